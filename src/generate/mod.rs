//! Generation: sampling, stop strings, and the prefill/decode loop.
pub mod chat;
pub mod perplexity;
pub mod run;
pub mod sampler;
pub mod stop;

pub use run::{
    generate, generate_shifting, ContextShift, GenError, GenOptions, GenStats, StopReason,
};
pub use sampler::{Sampler, SamplerConfig};
pub use stop::{StopMatcher, StopStatus};
