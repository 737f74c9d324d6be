//! Generation: sampling, stop strings, and the prefill/decode loop.
pub mod sampler;
pub mod stop;

pub use sampler::{Sampler, SamplerConfig};
pub use stop::{StopMatcher, StopStatus};
