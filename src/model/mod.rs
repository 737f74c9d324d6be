//! Model descriptions and the graph builder.
pub mod args;
pub mod llama;

pub use args::{ModelArgs, ParamsError};
pub use llama::{build_llama, BuildOptions};
