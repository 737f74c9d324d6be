//! Parsing a GGUF header: the bounded cursor over the file's bytes, the
//! metadata values and arrays, and the tensor table.

use super::{
    dtype_from_ggml, ggml_type_name, value_type, GgufArray, GgufError, GgufTensorInfo, GgufValue,
    DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS,
};
use std::collections::BTreeMap;

pub(super) fn wrong(key: &str, expected: &'static str, v: &GgufValue) -> GgufError {
    GgufError::WrongType {
        key: key.to_string(),
        expected,
        found: v.type_name(),
    }
}

pub(super) struct Header {
    pub(super) version: u32,
    pub(super) alignment: u64,
    pub(super) metadata: BTreeMap<String, GgufValue>,
    pub(super) key_order: Vec<String>,
    pub(super) tensors: BTreeMap<String, GgufTensorInfo>,
    pub(super) tensor_order: Vec<String>,
    pub(super) data_offset: usize,
}

/// A bounds-checked little-endian cursor.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                offset: self.pos as u64,
                what: what(),
                need: n as u64,
                available: self.remaining() as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Checks that `count` items of at least `min_each` bytes fit in what remains;
    /// returns the count as usize.
    fn check_count(
        &self,
        count: u64,
        min_each: u64,
        what: &dyn Fn() -> String,
    ) -> Result<usize, GgufError> {
        let fits = count
            .checked_mul(min_each)
            .is_some_and(|total| total <= self.remaining() as u64);
        match usize::try_from(count) {
            Ok(c) if fits => Ok(c),
            _ => Err(GgufError::CountTooLarge {
                what: what(),
                count,
                offset: self.pos as u64,
                available: self.remaining() as u64,
                min_each,
            }),
        }
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let start = self.pos as u64;
        let len = self.u64(&|| format!("length of {}", what()))?;
        let len = self.check_count(len, 1, &|| format!("string length of {}", what()))?;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::BadUtf8 {
                what: what(),
                offset: start,
            }),
        }
    }
}

/// Minimum encoded size of one value of a type (for count checks).
fn min_value_size(type_id: u32) -> u64 {
    use value_type as t;
    match type_id {
        t::U8 | t::I8 | t::BOOL => 1,
        t::U16 | t::I16 => 2,
        t::U32 | t::I32 | t::F32 => 4,
        t::U64 | t::I64 | t::F64 | t::STRING => 8,
        t::ARRAY => 12,
        _ => 1,
    }
}

fn read_value(c: &mut Cursor<'_>, key: &str, type_id: u32) -> Result<GgufValue, GgufError> {
    use value_type as t;
    let what = || format!("value of metadata key {key:?}");
    Ok(match type_id {
        t::U8 => GgufValue::U8(c.array::<1>(&what)?[0]),
        t::I8 => GgufValue::I8(i8::from_le_bytes(c.array(&what)?)),
        t::U16 => GgufValue::U16(u16::from_le_bytes(c.array(&what)?)),
        t::I16 => GgufValue::I16(i16::from_le_bytes(c.array(&what)?)),
        t::U32 => GgufValue::U32(u32::from_le_bytes(c.array(&what)?)),
        t::I32 => GgufValue::I32(i32::from_le_bytes(c.array(&what)?)),
        t::F32 => GgufValue::F32(f32::from_le_bytes(c.array(&what)?)),
        t::BOOL => GgufValue::Bool(read_bool(c, key)?),
        t::STRING => GgufValue::String(c.string(&what)?),
        t::ARRAY => GgufValue::Array(read_array(c, key, 1)?),
        t::U64 => GgufValue::U64(u64::from_le_bytes(c.array(&what)?)),
        t::I64 => GgufValue::I64(i64::from_le_bytes(c.array(&what)?)),
        t::F64 => GgufValue::F64(f64::from_le_bytes(c.array(&what)?)),
        other => {
            return Err(GgufError::UnknownValueType {
                key: key.to_string(),
                type_id: other,
            })
        }
    })
}

fn read_bool(c: &mut Cursor<'_>, key: &str) -> Result<bool, GgufError> {
    let b = c.array::<1>(&|| format!("value of metadata key {key:?}"))?[0];
    match b {
        0 => Ok(false),
        1 => Ok(true),
        value => Err(GgufError::BadBool {
            key: key.to_string(),
            value,
        }),
    }
}

fn read_array(c: &mut Cursor<'_>, key: &str, depth: usize) -> Result<GgufArray, GgufError> {
    use value_type as t;
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufError::TooDeep {
            key: key.to_string(),
            max: MAX_ARRAY_DEPTH,
        });
    }
    let what = || format!("array header of metadata key {key:?}");
    let elem = c.u32(&what)?;
    let count = c.u64(&what)?;
    if elem > t::F64 {
        return Err(GgufError::UnknownValueType {
            key: key.to_string(),
            type_id: elem,
        });
    }
    let n = c.check_count(count, min_value_size(elem), &|| {
        format!("array element (metadata key {key:?})")
    })?;
    let ew = || format!("array element of metadata key {key:?}");
    macro_rules! prim {
        ($variant:ident, $ty:ty, $size:expr) => {{
            let bytes = c.take(n * $size, &ew)?;
            GgufArray::$variant(
                bytes
                    .chunks_exact($size)
                    .map(|ch| {
                        let mut a = [0u8; $size];
                        a.copy_from_slice(ch);
                        <$ty>::from_le_bytes(a)
                    })
                    .collect(),
            )
        }};
    }
    Ok(match elem {
        t::U8 => GgufArray::U8(c.take(n, &ew)?.to_vec()),
        t::I8 => prim!(I8, i8, 1),
        t::U16 => prim!(U16, u16, 2),
        t::I16 => prim!(I16, i16, 2),
        t::U32 => prim!(U32, u32, 4),
        t::I32 => prim!(I32, i32, 4),
        t::F32 => prim!(F32, f32, 4),
        t::U64 => prim!(U64, u64, 8),
        t::I64 => prim!(I64, i64, 8),
        t::F64 => prim!(F64, f64, 8),
        t::BOOL => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(read_bool(c, key)?);
            }
            GgufArray::Bool(v)
        }
        t::STRING => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(c.string(&ew)?);
            }
            GgufArray::String(v)
        }
        _ => {
            // t::ARRAY (other ids were rejected above)
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(read_array(c, key, depth + 1)?);
            }
            GgufArray::Array(v)
        }
    })
}

pub(super) fn parse_header(buf: &[u8]) -> Result<Header, GgufError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = match buf.get(..4) {
        Some(m) => [m[0], m[1], m[2], m[3]],
        None => {
            return Err(GgufError::BadMagic {
                found: buf.to_vec(),
            })
        }
    };
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic {
            found: magic.to_vec(),
        });
    }
    c.pos = 4;
    let version = c.u32(&|| "version".into())?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let n_tensors = c.u64(&|| "tensor count".into())?;
    let n_kv = c.u64(&|| "metadata count".into())?;
    // A key-value pair is at least: key length (8) + value type (4) + one byte of value.
    let n_kv = c.check_count(n_kv, 13, &|| "metadata key-value".into())?;

    let mut metadata = BTreeMap::new();
    let mut key_order = Vec::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata key #{i}"))?;
        let type_id = c.u32(&|| format!("value type of metadata key {key:?}"))?;
        let value = read_value(&mut c, &key, type_id)?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        key_order.push(key.clone());
        metadata.insert(key, value);
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(GgufValue::U32(a)) if a.is_power_of_two() => u64::from(*a),
        Some(GgufValue::U32(a)) => {
            return Err(GgufError::BadAlignment(format!(
                "{a} is not a power of two"
            )))
        }
        Some(v) => {
            return Err(GgufError::BadAlignment(format!(
                "must be a u32, found {}",
                v.type_name()
            )))
        }
    };

    // A tensor info is at least: name length (8) + n_dims (4) + type (4) + offset (8).
    let n_tensors = c.check_count(n_tensors, 24, &|| "tensor info".into())?;
    let mut infos = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = c.string(&|| format!("name of tensor #{i}"))?;
        let n_dims = c.u32(&|| format!("n_dims of tensor {name:?}"))?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                name,
                n_dims,
                max: MAX_DIMS,
            });
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            ne.push(c.u64(&|| format!("dimensions of tensor {name:?}"))?);
        }
        let type_id = c.u32(&|| format!("type of tensor {name:?}"))?;
        let offset = c.u64(&|| format!("data offset of tensor {name:?}"))?;
        infos.push((name, ne, type_id, offset));
    }
    let data_offset = align_up(c.pos as u64, alignment).ok_or_else(|| {
        GgufError::BadAlignment(format!(
            "data section start overflows with alignment {alignment}"
        ))
    })?;

    let file_len = buf.len() as u64;
    let mut tensors = BTreeMap::new();
    let mut tensor_order = Vec::with_capacity(infos.len());
    for (name, ne, type_id, offset) in infos {
        if tensors.contains_key(&name) {
            return Err(GgufError::DuplicateTensor(name));
        }
        let dtype = dtype_from_ggml(type_id).ok_or_else(|| GgufError::UnsupportedTensorType {
            name: name.clone(),
            type_id,
            type_name: ggml_type_name(type_id),
        })?;
        // ggml stores dims as int64_t.
        let overflow = || GgufError::DimsOverflow {
            name: name.clone(),
            ne: ne.clone(),
        };
        let mut n_elements: u64 = 1;
        // The product of the non-zero dims must fit too: a zero dim makes
        // the tensor empty, but the shape's product taken in any other
        // order (e.g. row-major) must not overflow on the way.
        let mut nonzero: u64 = 1;
        for &d in &ne {
            if d > i64::MAX as u64 {
                return Err(overflow());
            }
            n_elements = n_elements.checked_mul(d).ok_or_else(overflow)?;
            nonzero = nonzero.checked_mul(d.max(1)).ok_or_else(overflow)?;
        }
        if usize::try_from(nonzero).is_err() {
            return Err(overflow());
        }
        if n_elements > i64::MAX as u64 {
            return Err(overflow());
        }
        let n_elements = usize::try_from(n_elements).map_err(|_| overflow())?;
        let ne0 = ne.first().copied().unwrap_or(1);
        if ne0 % dtype.block_elems() as u64 != 0 {
            return Err(GgufError::PartialBlock {
                name,
                ne0,
                dtype,
                block: dtype.block_elems(),
            });
        }
        let n_bytes = dtype.bytes_for(n_elements).ok_or_else(overflow)?;
        if offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor {
                name,
                offset,
                alignment,
            });
        }
        let start = data_offset.checked_add(offset);
        let end = start.and_then(|s| s.checked_add(n_bytes as u64));
        let (start, end) = match (start, end) {
            (Some(s), Some(e)) if e <= file_len => (s, e),
            _ => {
                return Err(GgufError::TensorPastEof {
                    name,
                    start: start.unwrap_or(u64::MAX),
                    end: end.unwrap_or(u64::MAX),
                    file_len,
                })
            }
        };
        debug_assert!(end <= file_len);
        let shape: Vec<usize> = ne.iter().rev().map(|&d| d as usize).collect();
        tensor_order.push(name.clone());
        tensors.insert(
            name.clone(),
            GgufTensorInfo {
                name,
                ne,
                shape,
                ggml_type: type_id,
                dtype,
                offset,
                // start <= end <= file_len, which is a usize.
                file_offset: start as usize,
                n_elements,
                n_bytes,
            },
        );
    }

    Ok(Header {
        version,
        alignment,
        metadata,
        key_order,
        tensors,
        tensor_order,
        // If the data section starts past EOF there are no tensors that need it; clamp so
        // the value is a valid usize either way.
        data_offset: usize::try_from(data_offset.min(file_len)).unwrap_or(buf.len()),
    })
}

fn align_up(x: u64, a: u64) -> Option<u64> {
    let r = x % a;
    if r == 0 {
        Some(x)
    } else {
        x.checked_add(a - r)
    }
}
