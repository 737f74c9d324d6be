//! Generation: sampling, stop strings, and the prefill/decode loop.
#![warn(missing_docs)]
pub mod chat;
pub mod run;
pub mod sampler;
pub mod stop;

pub use run::{generate, GenError, GenOptions, GenStats, StopReason};
pub use sampler::{Sampler, SamplerConfig};
pub use stop::{StopMatcher, StopStatus};
