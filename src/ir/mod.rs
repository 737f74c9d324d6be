//! The intermediate representation every stage speaks: a static graph of
//! typed ops with symbolic shapes.
#![warn(missing_docs)]
pub mod dot;
pub mod dtype;
pub mod graph;
pub mod infer;
pub mod op;
pub mod print;
pub mod shape;

pub use dtype::DType;
pub use graph::{Edge, Graph, GraphError, Node, NodeId, PackedWeight, TensorMeta, WeightLayout};
pub use op::{
    CacheKind, LogitRows, Op, Pooling, RopeParams, RopeScaling, StepInput, SEQ_TABLE_COLS,
};
pub use shape::{Bindings, Dim, Shape, Sym};
