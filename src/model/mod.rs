//! Model descriptions and the graph builder.
pub mod args;
pub mod llama;

pub use args::{Family, GateAct, ModelArgs, ParamsError, Variant};
pub use llama::{build_llama, BuildOptions};
