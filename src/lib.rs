//! llama-graph: a graph-compiled inference runtime for Llama-architecture
//! models on CPU.
//!
//! Layout: [`ir`] (the graph), [`model`] (arguments and the Llama builder),
//! [`weights`] (checkpoint readers), [`tokenizer`], [`kernels`].
pub mod convert;
pub mod dist;
pub mod error;
pub mod exec;
pub mod fetch;
pub mod generate;
pub mod ir;
pub mod kernels;
pub mod model;
pub mod passes;
pub mod plan;
pub mod pool;
pub mod server;
pub mod session;
pub mod tokenizer;
pub mod weights;

pub use error::{Error, Result};
