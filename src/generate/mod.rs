//! Generation: sampling, stop strings, and the prefill/decode loop.
pub mod chat;
pub mod constraint;
pub mod run;
pub mod sampler;
pub mod stop;

pub use run::{generate, generate_constrained, GenError, GenOptions, GenStats, StopReason};
pub use sampler::{Sampler, SamplerConfig};
pub use stop::{StopMatcher, StopStatus};
