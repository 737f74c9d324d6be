//! Weight loading. One reader per file format, all feeding one [`WeightStore`]:
//! named tensors whose bytes are, where possible, views into a memory-mapped
//! file (zero-copy).

pub mod gguf;

use crate::ir::DType;

pub mod pth;
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::sync::Arc;

/// The raw bytes of one tensor, in its stored (little-endian) layout.
#[derive(Clone)]
pub enum TensorBytes {
    /// A byte range of a memory-mapped file.
    Mapped {
        map: Arc<Mmap>,
        offset: usize,
        len: usize,
    },
    /// Bytes the loader had to materialise (merged shards, copies of
    /// non-contiguous tensors, packed weights prepared at load).
    Owned(Arc<Vec<u8>>),
}

impl TensorBytes {
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            TensorBytes::Mapped { map, offset, len } => &map[*offset..*offset + *len],
            TensorBytes::Owned(v) => v,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            TensorBytes::Mapped { len, .. } => *len,
            TensorBytes::Owned(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for TensorBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorBytes::Mapped { offset, len, .. } => write!(f, "Mapped({offset}+{len})"),
            TensorBytes::Owned(v) => write!(f, "Owned({})", v.len()),
        }
    }
}

/// One named weight tensor. `shape` is row-major, outermost first, exactly as
/// PyTorch reports it (GGUF's reversed `ne` order is converted by its reader).
#[derive(Clone, Debug)]
pub struct WeightTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: TensorBytes,
}

/// All tensors of a model, by checkpoint name.
#[derive(Clone, Debug, Default)]
pub struct WeightStore {
    pub tensors: BTreeMap<String, WeightTensor>,
}
