//! Binding the graph's weight nodes to loaded tensors.

use crate::ir::{DType, Graph, Op};
use crate::weights::{TensorBytes, WeightStore, WeightTensor};
use std::collections::BTreeMap;
use std::sync::Arc;
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
    #[error("packed weight `{packed}`: {message}")]
    Packed { packed: String, message: String },
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

/// Materialises the graph's packed weights (see
/// [`crate::ir::PackedWeight`]) once: each is the byte concatenation of its
/// parts' whole rows (axis 0), which is exact for every dtype, quantized
/// block formats included. Returns a store with the packed tensors added
/// (the parts stay available; other tensors are shared, not copied).
pub fn materialize_packed(graph: &Graph, store: &WeightStore) -> Result<WeightStore, BindError> {
    let mut out = store.clone();
    for p in graph.packed() {
        let err = |message: String| BindError::Packed {
            packed: p.name.clone(),
            message,
        };
        if p.axis != 0 {
            return Err(err(format!("only axis 0 is supported, got {}", p.axis)));
        }
        let mut rows = 0usize;
        let mut cols = None;
        let mut dtype = None;
        let mut total = 0usize;
        for part in &p.parts {
            let t = store.tensors.get(part).ok_or_else(|| BindError::Missing {
                tensor: part.clone(),
                expected: format!("a part of `{}`", p.name),
            })?;
            if t.shape.len() != 2 {
                return Err(err(format!(
                    "part `{part}` has shape {:?}, not 2-D",
                    t.shape
                )));
            }
            if cols.is_some_and(|c| c != t.shape[1]) || dtype.is_some_and(|d| d != t.dtype) {
                return Err(err(format!(
                    "part `{part}` is {}{:?}, unlike the first part",
                    t.dtype, t.shape
                )));
            }
            let want = t
                .shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .and_then(|n| t.dtype.bytes_for(n));
            if want != Some(t.data.len()) {
                return Err(BindError::Size {
                    tensor: part.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    expected: want.unwrap_or(usize::MAX),
                    actual: t.data.len(),
                });
            }
            cols = Some(t.shape[1]);
            dtype = Some(t.dtype);
            rows = rows
                .checked_add(t.shape[0])
                .ok_or_else(|| err("row count overflows".into()))?;
            total = total
                .checked_add(t.data.len())
                .ok_or_else(|| err("size overflows".into()))?;
        }
        let (Some(cols), Some(dtype)) = (cols, dtype) else {
            return Err(err("no parts".into()));
        };
        let mut bytes = Vec::with_capacity(total);
        for part in &p.parts {
            let data = &store.tensors[part].data;
            bytes.extend_from_slice(data.as_bytes());
            // The graph reads the packed copy from now on.
            data.release_pages();
        }
        out.tensors.insert(
            p.name.clone(),
            WeightTensor {
                dtype,
                shape: vec![rows, cols],
                data: TensorBytes::Owned(Arc::new(bytes)),
            },
        );
    }
    Ok(out)
}

/// The weight dtypes of a store, for building a graph that matches it.
pub fn store_dtypes(store: &WeightStore) -> BTreeMap<String, DType> {
    store
        .tensors
        .iter()
        .map(|(k, t)| (k.clone(), t.dtype))
        .collect()
}
