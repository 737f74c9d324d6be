//! Compute kernels, separate from scheduling.
