//! Reader for Hugging Face `safetensors` files.
//!
//! Layout: an 8-byte little-endian header length `N`, `N` bytes of JSON
//! `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
//! {string: string}}`, then the data; offsets are relative to the first byte
//! after the header and the tensors must cover the data exactly, without
//! holes or overlaps.
//!
//! Two layers of checks. Ours come first, because they can say precisely
//! what is wrong (which tensor, which bytes, which neighbour it overlaps) and
//! they add what the format's own library does not check: duplicate names
//! (JSON parsers keep the last one silently) and our dtype allow-list.
//! Then Hugging Face's `safetensors` crate validates the same header as the
//! final authority (`SafeTensors::read_metadata`); the fuzz target
//! `safetensors_header` checks that the two agree. Nothing is allocated from
//! a size in the file before it has been checked against the file's length:
//! the header must lie inside the file (and under 100 MB, the crate's cap),
//! and every tensor's bytes inside the data section.
//!
//! Tensors become zero-copy [`TensorBytes::Mapped`] views of the memory map.

use super::{TensorBytes, WeightStore, WeightTensor};
use crate::ir::DType;
use memmap2::Mmap;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::Value;
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use thiserror::Error;

/// The largest header accepted: the `safetensors` crate's own cap.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The dtypes we load, as named in messages.
pub const SUPPORTED_DTYPES: &str = "F32, F16, BF16";

/// Everything that can be wrong with a safetensors file. Messages name the
/// tensor and the numbers involved.
#[derive(Debug, Error)]
pub enum SafetensorsError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("not a safetensors file: {len} bytes, shorter than the 8-byte header length")]
    TooShort { len: usize },
    #[error(
        "header length {n} is larger than the {max}-byte limit (corrupt file, or not safetensors)"
    )]
    HeaderTooLarge { n: u64, max: u64 },
    #[error("header length {n} runs past the end of the file ({file_len} bytes): the file is truncated or not safetensors")]
    HeaderPastEnd { n: u64, file_len: usize },
    #[error("header is not valid UTF-8 (byte {at} of the header)")]
    HeaderUtf8 { at: usize },
    #[error("header is not valid JSON: {0}")]
    HeaderJson(String),
    #[error("`{0}` appears twice in the header")]
    DuplicateTensor(String),
    #[error("tensor `{tensor}`: {message}")]
    BadEntry { tensor: String, message: String },
    #[error("tensor `{tensor}` has dtype {dtype}; supported: {SUPPORTED_DTYPES}")]
    UnsupportedDtype { tensor: String, dtype: String },
    #[error("tensor `{tensor}`: dtype {dtype} x shape {shape:?} is {expected} bytes, but its data_offsets [{begin}, {end}) hold {actual}")]
    ByteCount {
        tensor: String,
        dtype: DType,
        shape: Vec<usize>,
        expected: u64,
        actual: u64,
        begin: u64,
        end: u64,
    },
    #[error("tensor `{tensor}`: shape {shape:?} overflows")]
    ShapeOverflow { tensor: String, shape: Vec<u64> },
    #[error("tensor `{tensor}`: data_offsets [{begin}, {end}) end before they begin")]
    Reversed {
        tensor: String,
        begin: u64,
        end: u64,
    },
    #[error("tensor `{tensor}`: data [{begin}, {end}) overlaps tensor `{other}` [{other_begin}, {other_end})")]
    Overlap {
        tensor: String,
        begin: u64,
        end: u64,
        other: String,
        other_begin: u64,
        other_end: u64,
    },
    #[error("data bytes [{begin}, {end}) belong to no tensor (safetensors files have no holes)")]
    Hole { begin: u64, end: u64 },
    #[error("tensor `{tensor}`: data [{begin}, {end}) runs past the end of the data section ({data_len} bytes after the header): the file is truncated")]
    PastEnd {
        tensor: String,
        begin: u64,
        end: u64,
        data_len: u64,
    },
    #[error("{extra} bytes after the last tensor's data (the tensors end at {end} of {data_len} data bytes)")]
    TrailingBytes { extra: u64, end: u64, data_len: u64 },
    #[error("__metadata__ must map strings to strings: {0}")]
    BadMetadata(String),
    /// Hugging Face's `safetensors` crate refused a header our own checks
    /// passed (they are meant to agree; the fuzz target checks it).
    #[error("rejected by the safetensors library: {0}")]
    Library(String),
}

impl From<SafetensorsError> for crate::Error {
    fn from(e: SafetensorsError) -> Self {
        crate::Error::Msg(e.to_string())
    }
}

/// One tensor of a parsed header.
#[derive(Debug, Clone, PartialEq)]
pub struct SafetensorsEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Byte range relative to the start of the data section.
    pub begin: usize,
    pub end: usize,
}

/// A checked header: where the data starts and every tensor, in file order
/// of their data.
#[derive(Debug, Clone, PartialEq)]
pub struct SafetensorsHeader {
    /// Absolute offset of the data section (`8 + N`).
    pub data_start: usize,
    pub tensors: Vec<SafetensorsEntry>,
    /// `__metadata__`, in header order.
    pub metadata: Vec<(String, String)>,
}

/// The JSON object at the top of the header, with its keys in order and
/// duplicates kept (serde_json's own maps keep only the last).
struct Entries(Vec<(String, Value)>);

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some((k, val)) = map.next_entry::<String, Value>()? {
                    v.push((k, val));
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

fn dtype_of(name: &str) -> Option<DType> {
    Some(match name {
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        _ => return None,
    })
}

fn bad(tensor: &str, message: impl Into<String>) -> SafetensorsError {
    SafetensorsError::BadEntry {
        tensor: tensor.to_string(),
        message: message.into(),
    }
}

fn u64_array(tensor: &str, field: &str, v: Option<&Value>) -> Result<Vec<u64>, SafetensorsError> {
    let arr = match v {
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(bad(
                tensor,
                format!("`{field}` must be an array of integers"),
            ))
        }
        None => return Err(bad(tensor, format!("`{field}` is missing"))),
    };
    arr.iter()
        .map(|x| {
            x.as_u64().ok_or_else(|| {
                bad(
                    tensor,
                    format!("`{field}` holds {x}, not a non-negative integer"),
                )
            })
        })
        .collect()
}

/// Parses and checks the header of a safetensors image (`bytes` is the whole
/// file). See the module documentation for what is checked.
pub fn parse_header(bytes: &[u8]) -> Result<SafetensorsHeader, SafetensorsError> {
    let file_len = bytes.len();
    let Some(len_bytes) = bytes.get(..8) else {
        return Err(SafetensorsError::TooShort { len: file_len });
    };
    let n = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
    if n > MAX_HEADER_BYTES {
        return Err(SafetensorsError::HeaderTooLarge {
            n,
            max: MAX_HEADER_BYTES,
        });
    }
    // n <= 1e8, so 8 + n fits a usize on every supported platform.
    let data_start = 8 + n as usize;
    let Some(header) = bytes.get(8..data_start) else {
        return Err(SafetensorsError::HeaderPastEnd { n, file_len });
    };
    let text = std::str::from_utf8(header).map_err(|e| SafetensorsError::HeaderUtf8 {
        at: e.valid_up_to(),
    })?;
    let entries: Entries =
        serde_json::from_str(text).map_err(|e| SafetensorsError::HeaderJson(e.to_string()))?;
    let data_len = (file_len - data_start) as u64;

    let mut seen = std::collections::HashSet::new();
    let mut metadata = Vec::new();
    let mut raw = Vec::new();
    for (name, v) in entries.0 {
        if !seen.insert(name.clone()) {
            return Err(SafetensorsError::DuplicateTensor(name));
        }
        if name == "__metadata__" {
            let Value::Object(m) = v else {
                return Err(SafetensorsError::BadMetadata(format!(
                    "found {}",
                    json_kind(&v)
                )));
            };
            for (k, val) in m {
                match val {
                    Value::String(s) => metadata.push((k, s)),
                    other => {
                        return Err(SafetensorsError::BadMetadata(format!(
                            "key `{k}` holds {}",
                            json_kind(&other)
                        )))
                    }
                }
            }
            continue;
        }
        let Value::Object(obj) = &v else {
            return Err(bad(
                &name,
                format!("entry is {}, not an object", json_kind(&v)),
            ));
        };
        let dtype_name = match obj.get("dtype") {
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(bad(&name, "`dtype` must be a string")),
            None => return Err(bad(&name, "`dtype` is missing")),
        };
        let shape = u64_array(&name, "shape", obj.get("shape"))?;
        let offsets = u64_array(&name, "data_offsets", obj.get("data_offsets"))?;
        let [begin, end] = offsets[..] else {
            return Err(bad(
                &name,
                format!("`data_offsets` has {} values, expected 2", offsets.len()),
            ));
        };
        let dtype = dtype_of(&dtype_name).ok_or_else(|| SafetensorsError::UnsupportedDtype {
            tensor: name.clone(),
            dtype: dtype_name.clone(),
        })?;
        raw.push((name, dtype, shape, begin, end));
    }

    // Data order; ties (zero-size tensors may share an offset) by end.
    raw.sort_by_key(|&(_, _, _, b, e)| (b, e));
    let mut tensors = Vec::with_capacity(raw.len());
    let mut prev: Option<(String, u64, u64)> = None;
    let mut covered = 0u64;
    for (name, dtype, shape, begin, end) in raw {
        if end < begin {
            return Err(SafetensorsError::Reversed {
                tensor: name,
                begin,
                end,
            });
        }
        if end > data_len {
            return Err(SafetensorsError::PastEnd {
                tensor: name,
                begin,
                end,
                data_len,
            });
        }
        let overflow = || SafetensorsError::ShapeOverflow {
            tensor: name.clone(),
            shape: shape.clone(),
        };
        let numel = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(overflow)?;
        let shape_usize: Vec<usize> = shape
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<_, _>>()
            .map_err(|_| overflow())?;
        let expected = usize::try_from(numel)
            .ok()
            .and_then(|n| dtype.bytes_for(n))
            .ok_or_else(overflow)? as u64;
        if expected != end - begin {
            return Err(SafetensorsError::ByteCount {
                tensor: name,
                dtype,
                shape: shape_usize,
                expected,
                actual: end - begin,
                begin,
                end,
            });
        }
        if begin < covered {
            let (other, ob, oe) = prev.clone().expect("covered > 0 implies a previous tensor");
            return Err(SafetensorsError::Overlap {
                tensor: name,
                begin,
                end,
                other,
                other_begin: ob,
                other_end: oe,
            });
        }
        if begin > covered {
            return Err(SafetensorsError::Hole {
                begin: covered,
                end: begin,
            });
        }
        covered = end;
        prev = Some((name.clone(), begin, end));
        tensors.push(SafetensorsEntry {
            name,
            dtype,
            shape: shape_usize,
            // end <= data_len, a usize.
            begin: begin as usize,
            end: end as usize,
        });
    }
    if covered != data_len {
        return Err(SafetensorsError::TrailingBytes {
            extra: data_len - covered,
            end: covered,
            data_len,
        });
    }

    // The format's own library, as the final word.
    let (_, lib) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| SafetensorsError::Library(e.to_string()))?;
    if lib.tensors().len() != tensors.len() {
        return Err(SafetensorsError::Library(format!(
            "it sees {} tensors where we see {}",
            lib.tensors().len(),
            tensors.len()
        )));
    }
    Ok(SafetensorsHeader {
        data_start,
        tensors,
        metadata,
    })
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A memory-mapped, checked safetensors file.
pub struct SafetensorsFile {
    pub header: SafetensorsHeader,
    map: Arc<Mmap>,
}

impl SafetensorsFile {
    /// Maps and checks `path`. Nothing is read from the tensor data.
    pub fn open(path: &Path) -> Result<SafetensorsFile, SafetensorsError> {
        let io = |source| SafetensorsError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only. As with every mmap-based loader, the
        // file must not be truncated or modified by another process while the
        // map is alive; every offset into it is checked against its length
        // by `parse_header`.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = parse_header(&map)?;
        Ok(SafetensorsFile {
            header,
            map: Arc::new(map),
        })
    }

    /// Every tensor as a zero-copy view of the map.
    pub fn to_store(&self) -> WeightStore {
        let mut store = WeightStore::default();
        for t in &self.header.tensors {
            store.tensors.insert(
                t.name.clone(),
                WeightTensor {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data: TensorBytes::Mapped {
                        map: self.map.clone(),
                        offset: self.header.data_start + t.begin,
                        len: t.end - t.begin,
                    },
                },
            );
        }
        store
    }
}

/// Parses a safetensors image held in memory; tensor bytes are copied into
/// [`TensorBytes::Owned`] (tests and the fuzz target).
pub fn read_safetensors_bytes(bytes: &[u8]) -> Result<WeightStore, SafetensorsError> {
    let header = parse_header(bytes)?;
    let mut store = WeightStore::default();
    for t in &header.tensors {
        let start = header.data_start + t.begin;
        store.tensors.insert(
            t.name.clone(),
            WeightTensor {
                dtype: t.dtype,
                shape: t.shape.clone(),
                data: TensorBytes::Owned(Arc::new(
                    bytes[start..header.data_start + t.end].to_vec(),
                )),
            },
        );
    }
    Ok(store)
}

/// Serialises tensors as a safetensors image, in the order given, with
/// the header padded to a multiple of 8 bytes as Hugging Face's writer does.
/// Used to make test fixtures; `tensors` holds (name, dtype, shape, bytes).
pub fn to_safetensors_bytes(
    tensors: &[(&str, DType, &[usize], &[u8])],
    metadata: &[(&str, &str)],
) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        let m: serde_json::Map<String, Value> = metadata
            .iter()
            .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
            .collect();
        header.insert("__metadata__".into(), Value::Object(m));
    }
    let mut offset = 0usize;
    for (name, dtype, shape, data) in tensors {
        let dt = match dtype {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            other => panic!("to_safetensors_bytes: {other} has no safetensors name here"),
        };
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [offset, offset + data.len()]}),
        );
        offset += data.len();
    }
    let mut text = serde_json::to_string(&Value::Object(header)).expect("JSON");
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = Vec::with_capacity(8 + text.len() + offset);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
    for (_, _, _, data) in tensors {
        out.extend_from_slice(data);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let a: Vec<u8> = (0..24).collect();
        let b: Vec<u8> = (0..8).collect();
        let img = to_safetensors_bytes(
            &[
                ("a", DType::F32, &[2, 3], &a),
                ("empty", DType::BF16, &[0, 4], &[]),
                ("b", DType::BF16, &[4], &b),
            ],
            &[("format", "pt")],
        );
        let h = parse_header(&img).unwrap();
        assert_eq!(h.metadata, vec![("format".to_string(), "pt".to_string())]);
        assert_eq!(h.tensors.len(), 3);
        let s = read_safetensors_bytes(&img).unwrap();
        assert_eq!(s.tensors["a"].data.as_bytes(), &a[..]);
        assert_eq!(s.tensors["b"].data.as_bytes(), &b[..]);
        assert_eq!(s.tensors["b"].shape, vec![4]);
        assert!(s.tensors["empty"].data.is_empty());
    }
}
