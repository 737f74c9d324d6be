//! Reader (and writer) for PyTorch `torch.save` checkpoints as Meta ships
//! them: `consolidated.00.pth` ... `consolidated.NN.pth`.
//!
//! A `.pth` file is a zip archive holding `<prefix>/data.pkl` (a pickle of
//! the state dict, see [`pickle`]) and one entry `<prefix>/data/<key>` per
//! tensor storage. Stored (uncompressed) storages become zero-copy
//! [`TensorBytes::Mapped`] views of the memory-mapped file; nothing in the
//! pickle is ever executed.

mod merge;
pub mod pickle;
mod random;
mod writer;

pub use merge::{load_meta_checkpoint, merge_shards, shard_paths, ShardSplit};
pub use random::{ffn_hidden_dim, generate_random_checkpoint, meta_tensor_shapes, MetaParams};
pub use writer::{write_pth, PthWriter};

use self::pickle::{PickleError, StorageType, TensorRef, Value};
use super::{TensorBytes, WeightStore, WeightTensor};
use crate::ir::DType;
use memmap2::Mmap;
use std::collections::HashMap;
use std::io::{Cursor, Read};
use std::path::Path;
use std::sync::Arc;
use thiserror::Error;

/// Everything that can go wrong reading, merging or writing `.pth` files.
#[derive(Debug, Error)]
pub enum PthError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("not a readable zip archive (torch.save format): {0}")]
    Zip(String),
    #[error("archive has no `<prefix>/data.pkl` entry")]
    NoDataPkl,
    #[error("archive has more than one data.pkl: {0:?}")]
    AmbiguousDataPkl(Vec<String>),
    #[error("archive byte order is `{0}`; only little-endian checkpoints are supported")]
    BigEndian(String),
    #[error("zip entry `{entry}`: {msg}")]
    Entry { entry: String, msg: String },
    #[error("data.pkl: {0}")]
    Pickle(#[from] PickleError),
    #[error("data.pkl does not hold a state dict: top-level object is a {0}")]
    NotAStateDict(String),
    #[error("state dict key is a {0}, not a string")]
    BadKey(String),
    #[error("tensor `{0}` appears twice")]
    DuplicateTensor(String),
    #[error("tensor `{tensor}`: storage type {storage_type} is not supported (bf16, f16, f32, i32 only)")]
    UnsupportedDtype {
        tensor: String,
        storage_type: String,
    },
    #[error("tensor `{tensor}`: storage entry `{entry}` is missing from the archive")]
    MissingStorage { tensor: String, entry: String },
    #[error("tensor `{tensor}`: storage `{entry}` declares {numel} elements ({need} bytes) but the entry has {have} bytes")]
    StorageSize {
        tensor: String,
        entry: String,
        numel: u64,
        need: String,
        have: u64,
    },
    #[error("tensor `{tensor}`: shape {shape:?} element count overflows")]
    ShapeOverflow { tensor: String, shape: Vec<u64> },
    #[error("tensor `{tensor}`: {detail}")]
    OutOfBounds { tensor: String, detail: String },
    #[error("tensor `{tensor}`: strides {stride:?} for shape {shape:?} overlap (broadcast/expanded tensors are not supported)")]
    OverlappingStrides {
        tensor: String,
        shape: Vec<u64>,
        stride: Vec<u64>,
    },
    #[error("no consolidated.*.pth shards in {0}")]
    NoShards(String),
    #[error("{dir}: shard consolidated.{index:02}.pth is missing (found {found} shards)")]
    MissingShard {
        dir: String,
        index: usize,
        found: usize,
    },
    #[error("merging tensor `{tensor}`: {msg}")]
    Merge { tensor: String, msg: String },
    #[error("params: {0}")]
    Params(String),
    #[error("writing tensor `{tensor}`: {msg}")]
    Write { tensor: String, msg: String },
}

impl From<PthError> for crate::Error {
    fn from(e: PthError) -> Self {
        match e {
            PthError::Io { path, source } => crate::Error::Io { path, source },
            e => crate::Error::Msg(e.to_string()),
        }
    }
}

pub(crate) fn io_err(path: &Path, source: std::io::Error) -> PthError {
    PthError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Map a storage class to the element type.
pub fn storage_dtype(st: StorageType) -> Option<DType> {
    match st {
        StorageType::BFloat16 => Some(DType::BF16),
        StorageType::Half => Some(DType::F16),
        StorageType::Float => Some(DType::F32),
        StorageType::Int => Some(DType::I32),
        StorageType::Unsupported(_) => None,
    }
}

/// Open a `.pth` file by memory-mapping it. Contiguous tensors in stored
/// entries are zero-copy views; nothing is read from the tensor data.
pub fn open_pth(path: &Path) -> Result<WeightStore, PthError> {
    let file = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
    // SAFETY: the map is read-only. As with every mmap-based loader, the
    // file must not be truncated or modified by another process while the
    // store is alive; that would be undefined behaviour we cannot prevent.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| io_err(path, e))?;
    let map = Arc::new(map);
    let bytes: &[u8] = &map;
    parse(bytes, |offset, len| TensorBytes::Mapped {
        map: map.clone(),
        offset,
        len,
    })
}

/// Parse a `.pth` image held in memory. Tensor bytes are copied into
/// [`TensorBytes::Owned`] (used by tests and the fuzz target).
pub fn read_pth_bytes(bytes: &[u8]) -> Result<WeightStore, PthError> {
    parse(bytes, |offset, len| {
        TensorBytes::Owned(Arc::new(bytes[offset..offset + len].to_vec()))
    })
}

/// The upper bound of deflate's expansion ratio (about 1032:1), with slack.
const MAX_DEFLATE_RATIO: u64 = 1100;

struct Entry {
    name: String,
    index: usize,
    stored: bool,
    data_start: u64,
    compressed_size: u64,
    size: u64,
}

enum EntryData {
    /// Absolute byte range in the file.
    Slice(usize, usize),
    Owned(Vec<u8>),
}

struct Archive<'a> {
    bytes: &'a [u8],
    zip: zip::ZipArchive<Cursor<&'a [u8]>>,
    entries: HashMap<String, Entry>,
}

impl<'a> Archive<'a> {
    fn open(bytes: &'a [u8]) -> Result<Self, PthError> {
        let mut zip = zip::ZipArchive::new(Cursor::new(bytes)).map_err(|e| {
            // The pre-1.6 format starts with a pickled magic number.
            if bytes.starts_with(&[0x80, 0x02, 0x8a]) {
                PthError::Zip(
                    "legacy (torch < 1.6) non-zip serialization format is not supported; \
                         re-save it with a current torch"
                        .into(),
                )
            } else {
                PthError::Zip(e.to_string())
            }
        })?;
        let mut entries = HashMap::new();
        for index in 0..zip.len() {
            let f = zip
                .by_index_raw(index)
                .map_err(|e| PthError::Zip(format!("entry #{index}: {e}")))?;
            let name = f.name().to_string();
            let stored = match f.compression() {
                zip::CompressionMethod::Stored => true,
                zip::CompressionMethod::Deflated => false,
                m => {
                    return Err(PthError::Entry {
                        entry: name,
                        msg: format!("unsupported compression method {m:?}"),
                    })
                }
            };
            if f.encrypted() {
                return Err(PthError::Entry {
                    entry: name,
                    msg: "encrypted entries are not supported".into(),
                });
            }
            let e = Entry {
                name: name.clone(),
                index,
                stored,
                data_start: f.data_start(),
                compressed_size: f.compressed_size(),
                size: f.size(),
            };
            let end = e.data_start.checked_add(e.compressed_size);
            if end.is_none_or(|end| end > bytes.len() as u64) {
                return Err(PthError::Entry {
                    entry: name,
                    msg: format!(
                        "data at offset {} with {} bytes runs past the end of the file ({} bytes)",
                        e.data_start,
                        e.compressed_size,
                        bytes.len()
                    ),
                });
            }
            if e.stored && e.size != e.compressed_size {
                return Err(PthError::Entry {
                    entry: name,
                    msg: format!(
                        "stored entry declares size {} but compressed size {}",
                        e.size, e.compressed_size
                    ),
                });
            }
            entries.insert(name, e);
        }
        Ok(Archive {
            bytes,
            zip,
            entries,
        })
    }

    fn read(&mut self, name: &str) -> Result<EntryData, PthError> {
        let Some(e) = self.entries.get(name) else {
            return Err(PthError::Entry {
                entry: name.to_string(),
                msg: "missing".into(),
            });
        };
        if e.stored {
            // Bounds were checked in `open`, so these conversions fit.
            return Ok(EntryData::Slice(e.data_start as usize, e.size as usize));
        }
        let limit = e
            .compressed_size
            .saturating_mul(MAX_DEFLATE_RATIO)
            .saturating_add(1024);
        if e.size > limit {
            return Err(PthError::Entry {
                entry: e.name.clone(),
                msg: format!(
                    "declared size {} is implausible for {} compressed bytes",
                    e.size, e.compressed_size
                ),
            });
        }
        let (declared, index, ename) = (e.size, e.index, e.name.clone());
        let f = self.zip.by_index(index).map_err(|err| PthError::Entry {
            entry: ename.clone(),
            msg: err.to_string(),
        })?;
        let mut out = Vec::new();
        // Read one byte more than declared to detect oversized payloads;
        // the vector grows only with bytes actually produced.
        let mut r = f.take(declared.saturating_add(1));
        r.read_to_end(&mut out).map_err(|err| PthError::Entry {
            entry: ename.clone(),
            msg: format!("decompression failed: {err}"),
        })?;
        if out.len() as u64 != declared {
            return Err(PthError::Entry {
                entry: ename,
                msg: format!(
                    "decompressed to {}{} bytes but declares {declared}",
                    out.len(),
                    if out.len() as u64 > declared { "+" } else { "" }
                ),
            });
        }
        Ok(EntryData::Owned(out))
    }

    fn bytes_of<'b>(&self, d: &'b EntryData) -> &'b [u8]
    where
        'a: 'b,
    {
        match d {
            EntryData::Slice(o, l) => &self.bytes[*o..*o + *l],
            EntryData::Owned(v) => v,
        }
    }
}

/// Find the single `<prefix>/data.pkl` and return the prefix.
fn find_prefix(names: impl Iterator<Item = String>) -> Result<String, PthError> {
    let mut pkls: Vec<String> = names
        .filter(|n| {
            n.strip_suffix("/data.pkl")
                .is_some_and(|p| !p.is_empty() && !p.contains('/'))
                || n == "data.pkl"
        })
        .collect();
    pkls.sort();
    match pkls.len() {
        0 => Err(PthError::NoDataPkl),
        1 => Ok(pkls[0].strip_suffix("data.pkl").unwrap_or("").to_string()),
        _ => Err(PthError::AmbiguousDataPkl(pkls)),
    }
}

fn parse(
    bytes: &[u8],
    mut view: impl FnMut(usize, usize) -> TensorBytes,
) -> Result<WeightStore, PthError> {
    let mut ar = Archive::open(bytes)?;
    let prefix = find_prefix(ar.entries.keys().cloned())?;
    if ar.entries.contains_key(&format!("{prefix}byteorder")) {
        let d = ar.read(&format!("{prefix}byteorder"))?;
        let b = ar.bytes_of(&d);
        if b != b"little" {
            return Err(PthError::BigEndian(String::from_utf8_lossy(b).into_owned()));
        }
    }
    let pkl = ar.read(&format!("{prefix}data.pkl"))?;
    let root = pickle::unpickle(ar.bytes_of(&pkl))?;
    drop(pkl);

    let mut found: Vec<(String, std::rc::Rc<TensorRef>)> = Vec::new();
    collect_tensors(&root, "", &mut found, 0)?;

    // Decompressed storages are cached by key so shared storages inflate once.
    let mut owned_storages: HashMap<String, Arc<Vec<u8>>> = HashMap::new();
    let mut store = WeightStore::default();
    for (name, t) in found {
        if store.tensors.contains_key(&name) {
            return Err(PthError::DuplicateTensor(name));
        }
        let dtype =
            storage_dtype(t.storage.storage_type).ok_or_else(|| PthError::UnsupportedDtype {
                tensor: name.clone(),
                storage_type: t.storage.storage_type.name().to_string(),
            })?;
        let entry_name = format!("{prefix}data/{}", t.storage.key);
        let Some(entry) = ar.entries.get(&entry_name) else {
            return Err(PthError::MissingStorage {
                tensor: name,
                entry: entry_name,
            });
        };
        let esize = dtype.block_bytes() as u64;
        let need = t.storage.numel.checked_mul(esize);
        if need.is_none_or(|n| n > entry.size) {
            return Err(PthError::StorageSize {
                tensor: name,
                entry: entry_name,
                numel: t.storage.numel,
                need: need.map_or("overflowing".into(), |n| n.to_string()),
                have: entry.size,
            });
        }
        let layout = check_layout(&name, &entry_name, &t)?;
        let shape: Vec<usize> = t.size.iter().map(|&s| s as usize).collect(); // checked in check_layout
        let data = if entry.stored {
            let base = entry.data_start as usize;
            match layout {
                Layout::Empty => TensorBytes::Owned(Arc::new(Vec::new())),
                Layout::Contiguous { start, len } => view(
                    base + start as usize * esize as usize,
                    len as usize * esize as usize,
                ),
                Layout::Strided => {
                    let src = &bytes[base..base + entry.size as usize];
                    TensorBytes::Owned(Arc::new(gather(src, &t, esize as usize)))
                }
            }
        } else {
            let storage = match owned_storages.get(&entry_name) {
                Some(s) => s.clone(),
                None => {
                    let d = match ar.read(&entry_name)? {
                        EntryData::Owned(v) => v,
                        other => ar.bytes_of(&other).to_vec(),
                    };
                    let d = Arc::new(d);
                    owned_storages.insert(entry_name.clone(), d.clone());
                    d
                }
            };
            match layout {
                Layout::Empty => TensorBytes::Owned(Arc::new(Vec::new())),
                Layout::Contiguous { start, len } => {
                    let s = start as usize * esize as usize;
                    if s == 0 && storage.len() == len as usize * esize as usize {
                        TensorBytes::Owned(storage)
                    } else {
                        TensorBytes::Owned(Arc::new(
                            storage[s..s + len as usize * esize as usize].to_vec(),
                        ))
                    }
                }
                Layout::Strided => {
                    TensorBytes::Owned(Arc::new(gather(&storage, &t, esize as usize)))
                }
            }
        };
        store
            .tensors
            .insert(name, WeightTensor { dtype, shape, data });
    }
    Ok(store)
}

fn collect_tensors(
    v: &Value,
    prefix: &str,
    out: &mut Vec<(String, std::rc::Rc<TensorRef>)>,
    depth: usize,
) -> Result<(), PthError> {
    let Value::Dict(items, _) = v else {
        return Err(PthError::NotAStateDict(
            format!("{v:?}").chars().take(40).collect(),
        ));
    };
    for (k, val) in items.iter() {
        let Value::Str(k) = k else {
            return Err(PthError::BadKey(
                format!("{k:?}").chars().take(40).collect(),
            ));
        };
        let name = format!("{prefix}{k}");
        match val {
            Value::Tensor(t) => out.push((name, t.clone())),
            // Nested state dicts (e.g. {"model": {...}}) are flattened with dots.
            Value::Dict(..) if depth < 8 => {
                collect_tensors(val, &format!("{name}."), out, depth + 1)?
            }
            // Non-tensor entries (ints, strings, optimizer state) are ignored.
            _ => {}
        }
    }
    Ok(())
}

enum Layout {
    Empty,
    /// Element range in the storage.
    Contiguous {
        start: u64,
        len: u64,
    },
    Strided,
}

/// Validate shape/stride/offset against the storage and classify.
fn check_layout(name: &str, entry: &str, t: &TensorRef) -> Result<Layout, PthError> {
    let mut numel: u64 = 1;
    for &s in &t.size {
        numel = numel
            .checked_mul(s)
            .ok_or_else(|| PthError::ShapeOverflow {
                tensor: name.to_string(),
                shape: t.size.clone(),
            })?;
    }
    // The byte size must be addressable too.
    if numel
        .checked_mul(4)
        .and_then(|b| usize::try_from(b).ok())
        .is_none()
    {
        return Err(PthError::ShapeOverflow {
            tensor: name.to_string(),
            shape: t.size.clone(),
        });
    }
    if numel == 0 {
        return Ok(Layout::Empty);
    }
    let oob = |end: String| {
        PthError::OutOfBounds {
        tensor: name.to_string(),
        detail: format!(
            "storage offset {} with shape {:?} stride {:?} reaches element {end} but storage `{entry}` has {} elements",
            t.storage_offset, t.size, t.stride, t.storage.numel
        ),
    }
    };
    // Last element index (exclusive end) = offset + sum((size-1)*stride) + 1.
    let mut end = Some(t.storage_offset);
    for (&s, &st) in t.size.iter().zip(&t.stride) {
        end = end.and_then(|e| (s - 1).checked_mul(st).and_then(|x| e.checked_add(x)));
    }
    let end = end
        .and_then(|e| e.checked_add(1))
        .ok_or_else(|| oob("overflow".into()))?;
    if end > t.storage.numel {
        return Err(oob(end.to_string()));
    }
    // Row-major contiguous? (dims of size 1 may carry any stride)
    let mut expect: u64 = 1;
    let mut contiguous = true;
    for (&s, &st) in t.size.iter().zip(&t.stride).rev() {
        if s != 1 && st != expect {
            contiguous = false;
        }
        expect = expect.saturating_mul(s);
    }
    if contiguous {
        return Ok(Layout::Contiguous {
            start: t.storage_offset,
            len: numel,
        });
    }
    // A strided copy is only allowed when no two indices alias the same
    // element: sort dims by stride and require each stride to exceed the
    // extent of all smaller ones. This also bounds the copy by the storage.
    let mut dims: Vec<(u64, u64)> = t
        .size
        .iter()
        .zip(&t.stride)
        .filter(|(&s, _)| s != 1)
        .map(|(&s, &st)| (st, s))
        .collect();
    dims.sort();
    let mut extent: u64 = 1;
    for (st, s) in dims {
        if st < extent {
            return Err(PthError::OverlappingStrides {
                tensor: name.to_string(),
                shape: t.size.clone(),
                stride: t.stride.clone(),
            });
        }
        extent = st.saturating_mul(s - 1).saturating_add(extent);
    }
    Ok(Layout::Strided)
}

/// Copy a strided tensor into a contiguous row-major buffer. Bounds were
/// validated by [`check_layout`].
fn gather(storage: &[u8], t: &TensorRef, esize: usize) -> Vec<u8> {
    let size: Vec<usize> = t.size.iter().map(|&s| s as usize).collect();
    let stride: Vec<usize> = t.stride.iter().map(|&s| s as usize).collect();
    let numel: usize = size.iter().product();
    let mut out = Vec::with_capacity(numel * esize);
    let nd = size.len();
    let mut idx = vec![0usize; nd];
    let off = t.storage_offset as usize;
    for _ in 0..numel {
        let mut e = off;
        for d in 0..nd {
            e += idx[d] * stride[d];
        }
        out.extend_from_slice(&storage[e * esize..(e + 1) * esize]);
        for d in (0..nd).rev() {
            idx[d] += 1;
            if idx[d] < size[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}
