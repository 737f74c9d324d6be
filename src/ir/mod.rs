//! The intermediate representation every stage speaks.
pub mod dtype;
pub use dtype::DType;
