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

    /// Tells the OS that these bytes will not be needed soon (for weights
    /// that were copied, e.g. into a packed weight): their pages leave the
    /// resident set. A later read still sees the same bytes, re-read from
    /// the file. Owned bytes are left alone.
    pub fn release_pages(&self) {
        #[cfg(unix)]
        if let TensorBytes::Mapped { map, offset, len } = self {
            // Only whole pages inside the range, so neighbours keep theirs.
            const PAGE: usize = 4096;
            let start = offset.div_ceil(PAGE) * PAGE;
            let end = (offset + len) / PAGE * PAGE;
            if end > start {
                // SAFETY: the map is a read-only shared file mapping. For
                // such a mapping MADV_DONTNEED only drops clean page-cache
                // pages from this process; any later access faults the same
                // file contents back in, so every live slice stays valid and
                // unchanged. The range lies inside the map.
                let _ = unsafe {
                    map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        start,
                        end - start,
                    )
                };
            }
        }
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
