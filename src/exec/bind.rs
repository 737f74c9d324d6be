//! Binding the graph's weight nodes to loaded tensors.

use crate::ir::{DType, Graph, Op};
use crate::weights::{WeightStore, WeightTensor};
use std::collections::BTreeMap;
use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BindError {
    #[error("missing tensor `{tensor}` (the graph expects {expected})")]
    Missing { tensor: String, expected: String },
    #[error("tensor `{tensor}` has shape {actual:?}, expected {expected:?}")]
    Shape {
        tensor: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("tensor `{tensor}` has dtype {actual}, expected {expected}")]
    DType {
        tensor: String,
        expected: DType,
        actual: DType,
    },
    #[error("tensor `{tensor}` holds {actual} bytes, but {dtype}{shape:?} needs {expected}")]
    Size {
        tensor: String,
        dtype: DType,
        shape: Vec<usize>,
        expected: usize,
        actual: usize,
    },
}

/// The weights a graph reads, by checkpoint name, plus the names of the
/// tensors in the store that it does not read.
#[derive(Debug, Clone)]
pub struct BoundWeights {
    pub tensors: BTreeMap<String, WeightTensor>,
    pub unused: Vec<String>,
}

/// Finds every weight node's tensor by name and checks its shape, dtype and
/// byte size. Every failure names the tensor, what was expected and what
/// was found.
pub fn bind_weights(graph: &Graph, store: &WeightStore) -> Result<BoundWeights, BindError> {
    let mut tensors = BTreeMap::new();
    for id in graph.topo_order().expect("a verified graph is acyclic") {
        let node = graph.node(id);
        let Op::Weight { tensor } = &node.op else {
            continue;
        };
        let expected: Vec<usize> = node
            .meta
            .shape
            .dims()
            .iter()
            .map(|d| d.as_const().unwrap_or(0))
            .collect();
        let t = store
            .tensors
            .get(tensor)
            .ok_or_else(|| BindError::Missing {
                tensor: tensor.clone(),
                expected: format!("{}", node.meta),
            })?;
        if t.shape != expected {
            return Err(BindError::Shape {
                tensor: tensor.clone(),
                expected,
                actual: t.shape.clone(),
            });
        }
        if t.dtype != node.meta.dtype {
            return Err(BindError::DType {
                tensor: tensor.clone(),
                expected: node.meta.dtype,
                actual: t.dtype,
            });
        }
        let numel: usize = expected.iter().product();
        let want = t.dtype.bytes_for(numel);
        if want != Some(t.data.len()) {
            return Err(BindError::Size {
                tensor: tensor.clone(),
                dtype: t.dtype,
                shape: expected,
                expected: want.unwrap_or(usize::MAX),
                actual: t.data.len(),
            });
        }
        tensors.insert(tensor.clone(), t.clone());
    }
    let unused = store
        .tensors
        .keys()
        .filter(|k| !tensors.contains_key(*k))
        .cloned()
        .collect();
    Ok(BoundWeights { tensors, unused })
}

/// The weight dtypes of a store, for building a graph that matches it.
pub fn store_dtypes(store: &WeightStore) -> BTreeMap<String, DType> {
    store
        .tensors
        .iter()
        .map(|(k, t)| (k.clone(), t.dtype))
        .collect()
}
