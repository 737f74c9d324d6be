//! GGUF reader (format versions 2 and 3, little-endian).
//!
//! Layout of a GGUF file (all integers little-endian):
//!
//! ```text
//! u32 magic = "GGUF"   u32 version   u64 n_tensors   u64 n_kv
//! n_kv x { string key; u32 value_type; value }
//! n_tensors x { string name; u32 n_dims; u64 ne[n_dims]; u32 ggml_type; u64 offset }
//! padding to `general.alignment` (default 32)
//! tensor data; each tensor at data_start + offset (offset a multiple of the alignment)
//! ```
//!
//! A string is `u64 len` + `len` UTF-8 bytes; an array is `u32 elem_type; u64 count` + elements.
//! `ne[0]` is the fastest-varying dimension, so the PyTorch shape is `ne` reversed.
//!
//! Every count and length read from the file is checked against the bytes that remain
//! before anything is allocated, so a hostile file can neither panic the reader nor make
//! it allocate more than a small multiple of the file size.
//!
//! The header parser (cursor, values, tensor table) is in `parse.rs`.

pub mod llama;
pub mod writer;

use crate::ir::DType;
use crate::weights::{TensorBytes, WeightStore, WeightTensor};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use thiserror::Error;

pub use llama::{
    file_type_name, gguf_to_meta_name, LlamaGguf, LlamaGgufMeta, RopeScaling, TokenizerParts,
};

mod parse;
use parse::{parse_header, wrong};

/// `"GGUF"` as the first four bytes of the file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment used when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Arrays nested deeper than this are rejected.
pub const MAX_ARRAY_DEPTH: usize = 8;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: u32 = 4;

/// GGUF value type ids (`gguf_type` in ggml).
pub mod value_type {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// ggml tensor type ids (`ggml_type` in ggml.h) that this reader accepts.
pub mod ggml_type {
    pub const F32: u32 = 0;
    pub const F16: u32 = 1;
    pub const Q4_0: u32 = 2;
    pub const Q4_1: u32 = 3;
    pub const Q5_0: u32 = 6;
    pub const Q5_1: u32 = 7;
    pub const Q8_0: u32 = 8;
    pub const Q2_K: u32 = 10;
    pub const Q3_K: u32 = 11;
    pub const Q4_K: u32 = 12;
    pub const Q5_K: u32 = 13;
    pub const Q6_K: u32 = 14;
    pub const IQ4_NL: u32 = 20;
    pub const IQ4_XS: u32 = 23;
    pub const I32: u32 = 26;
    pub const BF16: u32 = 30;
}

/// The tensor types this reader accepts, as named in messages and `--help`.
pub const SUPPORTED_TYPE_NAMES: &str =
    "f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs";

/// Maps a ggml type id to our [`DType`]; `None` for types we cannot compute with.
pub fn dtype_from_ggml(id: u32) -> Option<DType> {
    Some(match id {
        ggml_type::F32 => DType::F32,
        ggml_type::F16 => DType::F16,
        ggml_type::Q4_0 => DType::Q4_0,
        ggml_type::Q4_1 => DType::Q4_1,
        ggml_type::Q5_0 => DType::Q5_0,
        ggml_type::Q5_1 => DType::Q5_1,
        ggml_type::Q8_0 => DType::Q8_0,
        ggml_type::Q2_K => DType::Q2_K,
        ggml_type::Q3_K => DType::Q3_K,
        ggml_type::Q4_K => DType::Q4_K,
        ggml_type::Q5_K => DType::Q5_K,
        ggml_type::Q6_K => DType::Q6_K,
        ggml_type::IQ4_NL => DType::IQ4_NL,
        ggml_type::IQ4_XS => DType::IQ4_XS,
        ggml_type::I32 => DType::I32,
        ggml_type::BF16 => DType::BF16,
        _ => return None,
    })
}

/// The ggml type id of one of our [`DType`]s (`None` for BF16Z, which only
/// exists in a session's weight arena).
pub fn ggml_from_dtype(dtype: DType) -> Option<u32> {
    Some(match dtype {
        DType::F32 => ggml_type::F32,
        DType::F16 => ggml_type::F16,
        DType::Q4_0 => ggml_type::Q4_0,
        DType::Q4_1 => ggml_type::Q4_1,
        DType::Q5_0 => ggml_type::Q5_0,
        DType::Q5_1 => ggml_type::Q5_1,
        DType::Q8_0 => ggml_type::Q8_0,
        DType::Q2_K => ggml_type::Q2_K,
        DType::Q3_K => ggml_type::Q3_K,
        DType::Q4_K => ggml_type::Q4_K,
        DType::Q5_K => ggml_type::Q5_K,
        DType::Q6_K => ggml_type::Q6_K,
        DType::IQ4_NL => ggml_type::IQ4_NL,
        DType::IQ4_XS => ggml_type::IQ4_XS,
        DType::I32 => ggml_type::I32,
        DType::BF16 => ggml_type::BF16,
        DType::BF16Z => return None,
    })
}

/// ggml's name for a type id (also for the ones we do not support), for messages.
pub fn ggml_type_name(id: u32) -> &'static str {
    match id {
        0 => "f32",
        1 => "f16",
        2 => "q4_0",
        3 => "q4_1",
        4 | 5 => "removed (q4_2/q4_3)",
        6 => "q5_0",
        7 => "q5_1",
        8 => "q8_0",
        9 => "q8_1",
        10 => "q2_K",
        11 => "q3_K",
        12 => "q4_K",
        13 => "q5_K",
        14 => "q6_K",
        15 => "q8_K",
        16 => "iq2_xxs",
        17 => "iq2_xs",
        18 => "iq3_xxs",
        19 => "iq1_s",
        20 => "iq4_nl",
        21 => "iq3_s",
        22 => "iq2_s",
        23 => "iq4_xs",
        24 => "i8",
        25 => "i16",
        26 => "i32",
        27 => "i64",
        28 => "f64",
        29 => "iq1_m",
        30 => "bf16",
        34 => "tq1_0",
        35 => "tq2_0",
        39 => "mxfp4",
        _ => "unknown",
    }
}

/// Everything that can be wrong with a GGUF file. Messages name the offending key,
/// tensor, offset and the expected vs. actual values.
#[derive(Debug, Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\" (47 47 55 46)")]
    BadMagic { found: Vec<u8> },
    #[error("unsupported GGUF version {0}: only versions 2 and 3 are supported{hint}", hint = version_hint(*.0))]
    UnsupportedVersion(u32),
    #[error("GGUF file truncated at byte {offset} while reading {what}: need {need} bytes, {available} available")]
    Truncated {
        offset: u64,
        what: String,
        need: u64,
        available: u64,
    },
    #[error("GGUF {what} count {count} at byte {offset} cannot fit in the {available} bytes that remain (each needs at least {min_each} bytes)")]
    CountTooLarge {
        what: String,
        count: u64,
        offset: u64,
        available: u64,
        min_each: u64,
    },
    #[error("GGUF {what} at byte {offset} is not valid UTF-8")]
    BadUtf8 { what: String, offset: u64 },
    #[error("GGUF metadata key {key:?}: unknown value type {type_id}")]
    UnknownValueType { key: String, type_id: u32 },
    #[error("GGUF metadata key {key:?}: bool byte is {value}, expected 0 or 1")]
    BadBool { key: String, value: u8 },
    #[error("GGUF metadata key {key:?}: arrays nested deeper than {max}")]
    TooDeep { key: String, max: usize },
    #[error("GGUF metadata key {0:?} appears twice")]
    DuplicateKey(String),
    #[error("GGUF tensor {0:?} appears twice")]
    DuplicateTensor(String),
    #[error("GGUF general.alignment: {0}")]
    BadAlignment(String),
    #[error("GGUF tensor {name:?}: n_dims is {n_dims}, at most {max} are supported")]
    TooManyDims { name: String, n_dims: u32, max: u32 },
    #[error("GGUF tensor {name:?}: dimensions {ne:?} overflow")]
    DimsOverflow { name: String, ne: Vec<u64> },
    #[error("GGUF tensor {name:?}: tensor type {type_name} (ggml type {type_id}) is not supported; supported types: {supported}", supported = SUPPORTED_TYPE_NAMES)]
    UnsupportedTensorType {
        name: String,
        type_id: u32,
        type_name: &'static str,
    },
    #[error("GGUF tensor {name:?}: row length ne[0]={ne0} is not a multiple of the {dtype} block size {block}")]
    PartialBlock {
        name: String,
        ne0: u64,
        dtype: DType,
        block: usize,
    },
    #[error(
        "GGUF tensor {name:?}: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error("GGUF tensor {name:?}: data [{start}, {end}) (file offsets) extends past the end of the file ({file_len} bytes)")]
    TensorPastEof {
        name: String,
        start: u64,
        end: u64,
        file_len: u64,
    },
    #[error("GGUF metadata key {0:?} is missing")]
    MissingKey(String),
    #[error("GGUF metadata key {key:?}: expected {expected}, found {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("GGUF metadata key {key:?}: {msg}")]
    BadValue { key: String, msg: String },
    #[error("GGUF model is missing tensor {0:?}")]
    MissingTensor(String),
    #[error(
        "GGUF tensor {name:?} (Meta name {meta_name:?}): shape {actual:?}, expected {expected:?}"
    )]
    ShapeMismatch {
        name: String,
        meta_name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("GGUF general.architecture is {0:?}; supported: llama (also Mistral), qwen2, qwen3, gemma3, phi3")]
    UnsupportedArchitecture(String),
}

fn version_hint(v: u32) -> &'static str {
    match v {
        1 => " (GGUF v1 is obsolete; re-convert the model with a current llama.cpp)",
        0x0200_0000 | 0x0300_0000 => " (this looks like a big-endian GGUF file)",
        _ => "",
    }
}

impl From<GgufError> for crate::Error {
    fn from(e: GgufError) -> Self {
        crate::Error::Msg(e.to_string())
    }
}

/// A homogeneous GGUF array.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    /// Array of arrays (each inner array may have its own element type).
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufArray {
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// GGUF name of the element type.
    pub fn elem_type_name(&self) -> &'static str {
        match self {
            GgufArray::U8(_) => "u8",
            GgufArray::I8(_) => "i8",
            GgufArray::U16(_) => "u16",
            GgufArray::I16(_) => "i16",
            GgufArray::U32(_) => "u32",
            GgufArray::I32(_) => "i32",
            GgufArray::F32(_) => "f32",
            GgufArray::Bool(_) => "bool",
            GgufArray::String(_) => "string",
            GgufArray::Array(_) => "array",
            GgufArray::U64(_) => "u64",
            GgufArray::I64(_) => "i64",
            GgufArray::F64(_) => "f64",
        }
    }
}

/// One GGUF metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// GGUF name of the value's type, e.g. `"u32"` or `"array<string>"`.
    pub fn type_name(&self) -> String {
        match self {
            GgufValue::U8(_) => "u8".into(),
            GgufValue::I8(_) => "i8".into(),
            GgufValue::U16(_) => "u16".into(),
            GgufValue::I16(_) => "i16".into(),
            GgufValue::U32(_) => "u32".into(),
            GgufValue::I32(_) => "i32".into(),
            GgufValue::F32(_) => "f32".into(),
            GgufValue::Bool(_) => "bool".into(),
            GgufValue::String(_) => "string".into(),
            GgufValue::Array(a) => format!("array<{}>", a.elem_type_name()),
            GgufValue::U64(_) => "u64".into(),
            GgufValue::I64(_) => "i64".into(),
            GgufValue::F64(_) => "f64".into(),
        }
    }

    /// GGUF value type id of this value.
    pub fn type_id(&self) -> u32 {
        use value_type as t;
        match self {
            GgufValue::U8(_) => t::U8,
            GgufValue::I8(_) => t::I8,
            GgufValue::U16(_) => t::U16,
            GgufValue::I16(_) => t::I16,
            GgufValue::U32(_) => t::U32,
            GgufValue::I32(_) => t::I32,
            GgufValue::F32(_) => t::F32,
            GgufValue::Bool(_) => t::BOOL,
            GgufValue::String(_) => t::STRING,
            GgufValue::Array(_) => t::ARRAY,
            GgufValue::U64(_) => t::U64,
            GgufValue::I64(_) => t::I64,
            GgufValue::F64(_) => t::F64,
        }
    }

    /// The value as an integer if it is of any integer type.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }
}

impl fmt::Display for GgufValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufValue::String(s) => write!(f, "{s:?}"),
            GgufValue::Array(a) => write!(f, "[{} x {}]", a.len(), a.elem_type_name()),
            GgufValue::U8(v) => write!(f, "{v}"),
            GgufValue::I8(v) => write!(f, "{v}"),
            GgufValue::U16(v) => write!(f, "{v}"),
            GgufValue::I16(v) => write!(f, "{v}"),
            GgufValue::U32(v) => write!(f, "{v}"),
            GgufValue::I32(v) => write!(f, "{v}"),
            GgufValue::F32(v) => write!(f, "{v}"),
            GgufValue::Bool(v) => write!(f, "{v}"),
            GgufValue::U64(v) => write!(f, "{v}"),
            GgufValue::I64(v) => write!(f, "{v}"),
            GgufValue::F64(v) => write!(f, "{v}"),
        }
    }
}

/// Description of one tensor in a GGUF file.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions in GGUF order (`ne[0]` fastest-varying).
    pub ne: Vec<u64>,
    /// Row-major PyTorch shape, outermost first: `ne` reversed.
    pub shape: Vec<usize>,
    /// The ggml type id as stored.
    pub ggml_type: u32,
    pub dtype: DType,
    /// Offset relative to the start of the data section (as stored).
    pub offset: u64,
    /// Absolute file offset of the first byte.
    pub file_offset: usize,
    pub n_elements: usize,
    pub n_bytes: usize,
}

#[derive(Clone)]
enum Source {
    Mapped(Arc<Mmap>),
    Owned(Arc<Vec<u8>>),
}

impl Source {
    fn bytes(&self) -> &[u8] {
        match self {
            Source::Mapped(m) => m,
            Source::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file. The tensor data stays in the mapped (or owned) buffer.
#[derive(Clone)]
pub struct GgufFile {
    pub version: u32,
    /// Effective alignment (from `general.alignment`, default 32).
    pub alignment: u64,
    pub metadata: BTreeMap<String, GgufValue>,
    /// Metadata keys in file order.
    pub key_order: Vec<String>,
    pub tensors: BTreeMap<String, GgufTensorInfo>,
    /// Tensor names in file order.
    pub tensor_order: Vec<String>,
    /// Absolute file offset of the data section.
    pub data_offset: usize,
    source: Source,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`. Tensor data is not copied.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only. As with every mmap-based loader, the file must not be
        // truncated or modified by another process while the map is alive; all offsets into
        // it are validated against its length at parse time.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(Source::Mapped(Arc::new(map)))
    }

    /// Parses an in-memory GGUF image (tests, fuzzing, embedded files).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        Self::parse(Source::Owned(Arc::new(bytes)))
    }

    fn parse(source: Source) -> Result<GgufFile, GgufError> {
        let header = parse_header(source.bytes())?;
        Ok(GgufFile {
            version: header.version,
            alignment: header.alignment,
            metadata: header.metadata,
            key_order: header.key_order,
            tensors: header.tensors,
            tensor_order: header.tensor_order,
            data_offset: header.data_offset,
            source,
        })
    }

    /// Releases the resident pages of the header (metadata and tensor
    /// table, `0..data_offset`) once everything needed from it has been
    /// parsed into owned values: for a model with a large vocabulary that is
    /// a few MiB of clean file pages. Reading the header again stays valid
    /// (the pages fault back in from the file). Owned images are left alone.
    pub fn release_header_pages(&self) {
        if let Source::Mapped(map) = &self.source {
            crate::weights::TensorBytes::Mapped {
                map: map.clone(),
                offset: 0,
                len: self.data_offset.min(map.len()),
            }
            .release_pages();
        }
    }

    /// Size of the whole file in bytes.
    pub fn file_len(&self) -> usize {
        self.source.bytes().len()
    }

    /// The raw bytes of one tensor.
    pub fn tensor_data(&self, name: &str) -> Option<&[u8]> {
        let t = self.tensors.get(name)?;
        self.source
            .bytes()
            .get(t.file_offset..t.file_offset + t.n_bytes)
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    fn need(&self, key: &str) -> Result<&GgufValue, GgufError> {
        self.metadata
            .get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    fn int_in_range<T: TryFrom<i128>>(
        &self,
        key: &str,
        expected: &'static str,
    ) -> Result<T, GgufError> {
        let v = self.need(key)?;
        let i = v.as_i128().ok_or_else(|| GgufError::WrongType {
            key: key.to_string(),
            expected,
            found: v.type_name(),
        })?;
        T::try_from(i).map_err(|_| GgufError::BadValue {
            key: key.to_string(),
            msg: format!("value {i} does not fit in {expected}"),
        })
    }

    /// An integer value of any GGUF integer type that fits in `u32`.
    /// Errors if the key is missing, not an integer, or out of range.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.int_in_range(key, "u32")
    }
    /// Like [`get_u32`](Self::get_u32) for `u64`.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.int_in_range(key, "u64")
    }
    /// Like [`get_u32`](Self::get_u32) for `i64`.
    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        self.int_in_range(key, "i64")
    }
    /// Like [`get_u32`](Self::get_u32) for `usize`.
    pub fn get_usize(&self, key: &str) -> Result<usize, GgufError> {
        self.int_in_range(key, "usize")
    }
    /// An `f32` value (an `f64` value is accepted and rounded).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        match self.need(key)? {
            GgufValue::F32(v) => Ok(*v),
            GgufValue::F64(v) => Ok(*v as f32),
            v => Err(wrong(key, "f32", v)),
        }
    }
    /// An `f64` or `f32` value.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        match self.need(key)? {
            GgufValue::F32(v) => Ok(f64::from(*v)),
            GgufValue::F64(v) => Ok(*v),
            v => Err(wrong(key, "f64", v)),
        }
    }
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        match self.need(key)? {
            GgufValue::Bool(v) => Ok(*v),
            v => Err(wrong(key, "bool", v)),
        }
    }
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.need(key)? {
            GgufValue::String(v) => Ok(v),
            v => Err(wrong(key, "string", v)),
        }
    }
    pub fn get_array(&self, key: &str) -> Result<&GgufArray, GgufError> {
        match self.need(key)? {
            GgufValue::Array(v) => Ok(v),
            v => Err(wrong(key, "array", v)),
        }
    }
    pub fn get_str_array(&self, key: &str) -> Result<&[String], GgufError> {
        match self.need(key)? {
            GgufValue::Array(GgufArray::String(v)) => Ok(v),
            v => Err(wrong(key, "array<string>", v)),
        }
    }
    pub fn get_f32_array(&self, key: &str) -> Result<&[f32], GgufError> {
        match self.need(key)? {
            GgufValue::Array(GgufArray::F32(v)) => Ok(v),
            v => Err(wrong(key, "array<f32>", v)),
        }
    }
    /// An integer array of any integer element type, converted to `i64` (u64 values
    /// above `i64::MAX` are an error).
    pub fn get_int_array(&self, key: &str) -> Result<Vec<i64>, GgufError> {
        fn conv<T: Copy>(key: &str, v: &[T]) -> Result<Vec<i64>, GgufError>
        where
            i64: TryFrom<T>,
        {
            v.iter()
                .map(|&x| {
                    i64::try_from(x).map_err(|_| GgufError::BadValue {
                        key: key.to_string(),
                        msg: "array element does not fit in i64".into(),
                    })
                })
                .collect()
        }
        match self.need(key)? {
            GgufValue::Array(a) => match a {
                GgufArray::U8(v) => conv(key, v),
                GgufArray::I8(v) => conv(key, v),
                GgufArray::U16(v) => conv(key, v),
                GgufArray::I16(v) => conv(key, v),
                GgufArray::U32(v) => conv(key, v),
                GgufArray::I32(v) => conv(key, v),
                GgufArray::U64(v) => conv(key, v),
                GgufArray::I64(v) => conv(key, v),
                _ => Err(wrong(
                    key,
                    "array of integers",
                    &GgufValue::Array(a.clone()),
                )),
            },
            v => Err(wrong(key, "array of integers", v)),
        }
    }

    /// Optional variants: `Ok(None)` when the key is absent, an error when it is present
    /// with the wrong type.
    pub fn opt<'a, T>(
        &'a self,
        key: &str,
        getter: impl FnOnce(&'a Self, &str) -> Result<T, GgufError>,
    ) -> Result<Option<T>, GgufError> {
        if self.metadata.contains_key(key) {
            getter(self, key).map(Some)
        } else {
            Ok(None)
        }
    }

    /// All tensors as [`WeightTensor`]s under their GGUF names, sharing the file's buffer.
    pub fn to_store(&self) -> WeightStore {
        let mut store = WeightStore::default();
        for (name, t) in &self.tensors {
            let data = match &self.source {
                Source::Mapped(map) => TensorBytes::Mapped {
                    map: Arc::clone(map),
                    offset: t.file_offset,
                    len: t.n_bytes,
                },
                Source::Owned(v) => TensorBytes::Owned(Arc::new(
                    v[t.file_offset..t.file_offset + t.n_bytes].to_vec(),
                )),
            };
            store.tensors.insert(
                name.clone(),
                WeightTensor {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data,
                },
            );
        }
        store
    }

    /// Consumes the file, returning all tensors under their GGUF names.
    pub fn into_store(self) -> WeightStore {
        self.to_store()
    }
}
