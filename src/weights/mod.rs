//! Weight loading. One reader per file format (`pth`, `gguf`, `safetensors`
//! with the `hf` directory layout), all feeding one [`WeightStore`]:
//! named tensors whose bytes are, where possible, views into a memory-mapped
//! file (zero-copy).
//!
//! [`open`] is the one entry point that turns a path into a [`Model`]: it
//! detects the layout ([`detect`]) and reads arguments, weights and
//! tokenizer (`open/`: one file per layout).

pub mod gguf;
pub mod hf;
pub mod safetensors;

mod open;
pub use open::{detect, open, open_only, LoadError, Model, ModelFormat, TensorSelector};

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
    /// A byte range of an anonymous mapping the runtime filled itself: the
    /// session's weight arena (packed weights, huge-page backed where the
    /// kernel allows). Never released: these bytes exist nowhere else.
    Arena {
        map: Arc<Mmap>,
        offset: usize,
        len: usize,
    },
}

impl TensorBytes {
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            TensorBytes::Mapped { map, offset, len } | TensorBytes::Arena { map, offset, len } => {
                &map[*offset..*offset + *len]
            }
            TensorBytes::Owned(v) => v,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            TensorBytes::Mapped { len, .. } | TensorBytes::Arena { len, .. } => *len,
            TensorBytes::Owned(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tells the OS that these bytes will not be needed soon (for weights
    /// that were copied, e.g. into a packed weight): their pages leave the
    /// resident set. A later read still sees the same bytes, re-read from
    /// the file. Owned and arena bytes are left alone.
    pub fn release_pages(&self) {
        self.release_range(0, self.len());
    }

    /// Releases every page of the file mapping these bytes are a view into
    /// (all its tensors, not only this one), for loaders that copy tensors
    /// one after another. Releasing only the copied tensor's range is not
    /// enough: the page cache may hold the file in large folios, and a
    /// fault maps a whole folio, so reading the next tensor maps again the
    /// pages of neighbours released before (with a cold page cache on a
    /// 6.18 kernel, 35 MiB of a 138 MiB GGUF stayed resident that way).
    /// Pages still in use come back on their next read. Owned and arena
    /// bytes are left alone.
    pub fn release_mapping(&self) {
        #[cfg(unix)]
        if let TensorBytes::Mapped { map, .. } = self {
            let whole = TensorBytes::Mapped {
                map: map.clone(),
                offset: 0,
                len: map.len(),
            };
            whole.release_range(0, map.len());
        }
    }

    /// [`Self::release_pages`] for the bytes `start..end` of this tensor
    /// (clamped to its length): only the pages that lie wholly inside the
    /// range are released, so neighbouring bytes keep theirs.
    pub fn release_range(&self, start: usize, end: usize) {
        #[cfg(unix)]
        if let TensorBytes::Mapped { map, offset, len } = self {
            const PAGE: usize = 4096;
            let (start, end) = (start.min(*len), end.min(*len));
            let first = (offset + start).div_ceil(PAGE) * PAGE;
            let last = (offset + end) / PAGE * PAGE;
            if last > first {
                // SAFETY: the map is a read-only shared file mapping. For
                // such a mapping MADV_DONTNEED only drops clean page-cache
                // pages from this process; any later access faults the same
                // file contents back in, so every live slice stays valid and
                // unchanged. The range lies inside the map.
                let _ = unsafe {
                    map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        first,
                        last - first,
                    )
                };
            }
        }
        #[cfg(not(unix))]
        let _ = (start, end);
    }
}

impl std::fmt::Debug for TensorBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorBytes::Mapped { offset, len, .. } => write!(f, "Mapped({offset}+{len})"),
            TensorBytes::Owned(v) => write!(f, "Owned({})", v.len()),
            TensorBytes::Arena { offset, len, .. } => write!(f, "Arena({offset}+{len})"),
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

impl WeightTensor {
    /// Rows `r0..r1` of a matrix (`[rows, cols]`, rows stored whole: any
    /// dtype whose rows are whole blocks): a view of the same map where the
    /// tensor is mapped, else a copy. Splits Phi-3's fused QKV and gate/up
    /// matrices.
    pub fn rows(&self, r0: usize, r1: usize) -> Result<WeightTensor, String> {
        let [rows, cols] = self.shape[..] else {
            return Err(format!("shape {:?} is not a matrix", self.shape));
        };
        let bytes = self.data.len();
        if r0 > r1 || r1 > rows || rows == 0 || !bytes.is_multiple_of(rows) {
            return Err(format!(
                "rows {r0}..{r1} of a {rows}-row matrix of {bytes} bytes"
            ));
        }
        let rb = bytes / rows;
        let data = match &self.data {
            TensorBytes::Mapped { map, offset, .. } => TensorBytes::Mapped {
                map: map.clone(),
                offset: offset + r0 * rb,
                len: (r1 - r0) * rb,
            },
            other => TensorBytes::Owned(Arc::new(other.as_bytes()[r0 * rb..r1 * rb].to_vec())),
        };
        Ok(WeightTensor {
            dtype: self.dtype,
            shape: vec![r1 - r0, cols],
            data,
        })
    }
}

/// All tensors of a model, by checkpoint name.
#[derive(Clone, Debug, Default)]
pub struct WeightStore {
    pub tensors: BTreeMap<String, WeightTensor>,
}
