//! Compute kernels, separate from scheduling.
pub mod quant;
