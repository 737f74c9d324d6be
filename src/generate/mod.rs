//! Generation: sampling, stop strings, and the prefill/decode loop.
#![warn(missing_docs)]
pub mod chat;
pub mod constraint;
pub mod perplexity;
pub mod run;
pub mod sampler;
pub mod spec;
pub mod stop;

pub use run::{
    generate, generate_constrained, generate_shifting, generate_with, ContextShift, GenError,
    GenOptions, GenStats, Speculation, StopReason,
};
pub use sampler::{Sampler, SamplerConfig};
pub use spec::{Drafter, SpecConfig, SpecStats};
pub use stop::{StopMatcher, StopStatus};
