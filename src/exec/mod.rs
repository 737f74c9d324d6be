//! Running compiled graphs: weight binding, the arena, the executor.
pub mod arena;
pub mod batch;
pub mod bind;
pub mod executor;

pub use batch::{Batch, KvPool};
pub use bind::{bind_weights, materialize_packed, store_dtypes, BindError, BoundWeights};
pub use executor::{ExecError, Executor, Logits, OpProfile};
