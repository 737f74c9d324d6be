//! GGUF writers.
//!
//! [`GgufWriter`] builds a whole image in memory and writes exactly what it is given:
//! counts, offsets and alignment can be overridden so tests can produce malformed files.
//! [`GgufStreamWriter`] writes the header and then one tensor at a time (`convert`).

use super::{GgufArray, GgufValue, DEFAULT_ALIGNMENT};
use std::path::Path;

/// One tensor to write.
#[derive(Debug, Clone)]
pub struct WriterTensor {
    pub name: String,
    /// GGUF order (`ne[0]` fastest).
    pub ne: Vec<u64>,
    pub ggml_type: u32,
    pub data: Vec<u8>,
    /// Store this offset instead of the computed one.
    pub offset_override: Option<u64>,
}

/// Builder for a GGUF image.
#[derive(Debug, Clone)]
pub struct GgufWriter {
    pub version: u32,
    /// Alignment for padding; when `general.alignment` is a power-of-two u32 value it wins.
    pub alignment: u64,
    pub kvs: Vec<(String, GgufValue)>,
    pub tensors: Vec<WriterTensor>,
    /// Write this tensor count instead of the real one.
    pub n_tensors_override: Option<u64>,
    /// Write this key-value count instead of the real one.
    pub n_kv_override: Option<u64>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// Version 3, alignment 32, empty.
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            kvs: Vec::new(),
            tensors: Vec::new(),
            n_tensors_override: None,
            n_kv_override: None,
        }
    }

    pub fn kv(mut self, key: impl Into<String>, value: GgufValue) -> Self {
        self.kvs.push((key.into(), value));
        self
    }

    /// Adds a tensor. `ne` is in GGUF order (reverse of the PyTorch shape).
    pub fn tensor(
        mut self,
        name: impl Into<String>,
        ggml_type: u32,
        ne: &[u64],
        data: Vec<u8>,
    ) -> Self {
        self.tensors.push(WriterTensor {
            name: name.into(),
            ne: ne.to_vec(),
            ggml_type,
            data,
            offset_override: None,
        });
        self
    }

    fn effective_alignment(&self) -> u64 {
        for (k, v) in &self.kvs {
            if k == "general.alignment" {
                if let GgufValue::U32(a) = v {
                    if a.is_power_of_two() {
                        return u64::from(*a);
                    }
                }
            }
        }
        self.alignment.max(1)
    }

    /// Serialises the image.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.effective_alignment() as usize;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        let n_t = self.n_tensors_override.unwrap_or(self.tensors.len() as u64);
        let n_kv = self.n_kv_override.unwrap_or(self.kvs.len() as u64);
        out.extend_from_slice(&n_t.to_le_bytes());
        out.extend_from_slice(&n_kv.to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut out, k);
            out.extend_from_slice(&v.type_id().to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            offsets.push(offset);
            offset = pad(offset + t.data.len(), align);
        }
        for (t, &off) in self.tensors.iter().zip(&offsets) {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.to_le_bytes());
            let stored = t.offset_override.unwrap_or(off as u64);
            out.extend_from_slice(&stored.to_le_bytes());
        }
        if !self.tensors.is_empty() {
            out.resize(pad(out.len(), align), 0);
            let base = out.len();
            for (t, &off) in self.tensors.iter().zip(&offsets) {
                out.resize(base + off, 0);
                out.extend_from_slice(&t.data);
            }
            out.resize(pad(out.len(), align), 0);
        }
        out
    }

    pub fn write(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        std::fs::write(path, self.to_bytes())
    }
}

fn pad(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Appends the encoding of a value (without its type id).
pub fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(u8::from(*x)),
        GgufValue::String(s) => put_str(out, s),
        GgufValue::Array(a) => put_array(out, a),
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

fn put_array(out: &mut Vec<u8>, a: &GgufArray) {
    use super::value_type as t;
    let (ty, n) = match a {
        GgufArray::U8(v) => (t::U8, v.len()),
        GgufArray::I8(v) => (t::I8, v.len()),
        GgufArray::U16(v) => (t::U16, v.len()),
        GgufArray::I16(v) => (t::I16, v.len()),
        GgufArray::U32(v) => (t::U32, v.len()),
        GgufArray::I32(v) => (t::I32, v.len()),
        GgufArray::F32(v) => (t::F32, v.len()),
        GgufArray::Bool(v) => (t::BOOL, v.len()),
        GgufArray::String(v) => (t::STRING, v.len()),
        GgufArray::Array(v) => (t::ARRAY, v.len()),
        GgufArray::U64(v) => (t::U64, v.len()),
        GgufArray::I64(v) => (t::I64, v.len()),
        GgufArray::F64(v) => (t::F64, v.len()),
    };
    out.extend_from_slice(&ty.to_le_bytes());
    out.extend_from_slice(&(n as u64).to_le_bytes());
    match a {
        GgufArray::U8(v) => out.extend_from_slice(v),
        GgufArray::I8(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        GgufArray::U16(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        GgufArray::I16(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        GgufArray::U32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        GgufArray::I32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        GgufArray::F32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        GgufArray::Bool(v) => v.iter().for_each(|x| out.push(u8::from(*x))),
        GgufArray::String(v) => v.iter().for_each(|s| put_str(out, s)),
        GgufArray::Array(v) => v.iter().for_each(|x| put_array(out, x)),
        GgufArray::U64(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        GgufArray::I64(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        GgufArray::F64(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
    }
}

/// One tensor of a [`GgufStreamWriter`], declared before any data is written.
#[derive(Debug, Clone)]
pub struct StreamTensor {
    pub name: String,
    /// GGUF order (`ne[0]` fastest).
    pub ne: Vec<u64>,
    pub ggml_type: u32,
    /// Bytes of data the tensor will have.
    pub n_bytes: usize,
}

/// A GGUF file written tensor by tensor: the header (metadata, and every
/// tensor's name, shape, type and offset, all known in advance) first, then
/// each tensor's bytes as they are produced, so that only one tensor needs
/// to be in memory. Alignment 32 (`general.alignment` is not written).
pub struct GgufStreamWriter {
    out: std::io::BufWriter<std::fs::File>,
    tensors: Vec<StreamTensor>,
    next: usize,
    /// Bytes written since the start of the data section.
    data_pos: usize,
}

impl GgufStreamWriter {
    /// Creates `path` and writes the header.
    pub fn create(
        path: &Path,
        kvs: &[(String, GgufValue)],
        tensors: Vec<StreamTensor>,
    ) -> std::io::Result<GgufStreamWriter> {
        use std::io::Write;
        let align = DEFAULT_ALIGNMENT as usize;
        let mut head = Vec::new();
        head.extend_from_slice(b"GGUF");
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
        for (k, v) in kvs {
            put_str(&mut head, k);
            head.extend_from_slice(&v.type_id().to_le_bytes());
            put_value(&mut head, v);
        }
        let mut offset = 0usize;
        for t in &tensors {
            put_str(&mut head, &t.name);
            head.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.ggml_type.to_le_bytes());
            head.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = pad(offset + t.n_bytes, align);
        }
        head.resize(pad(head.len(), align), 0);
        let mut out = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path)?);
        out.write_all(&head)?;
        Ok(GgufStreamWriter {
            out,
            tensors,
            next: 0,
            data_pos: 0,
        })
    }

    /// Writes the data of the next declared tensor (they come in the
    /// declared order); `data` must have the declared size.
    pub fn write_tensor(&mut self, data: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        let Some(t) = self.tensors.get(self.next) else {
            return Err(std::io::Error::other("more tensors written than declared"));
        };
        if data.len() != t.n_bytes {
            return Err(std::io::Error::other(format!(
                "tensor {}: {} bytes written, {} declared",
                t.name,
                data.len(),
                t.n_bytes
            )));
        }
        self.out.write_all(data)?;
        let end = pad(self.data_pos + data.len(), DEFAULT_ALIGNMENT as usize);
        self.out
            .write_all(&vec![0u8; end - self.data_pos - data.len()])?;
        self.data_pos = end;
        self.next += 1;
        Ok(())
    }

    /// Flushes the file; every declared tensor must have been written.
    pub fn finish(mut self) -> std::io::Result<()> {
        use std::io::Write;
        if self.next != self.tensors.len() {
            return Err(std::io::Error::other(format!(
                "{} of {} tensors written",
                self.next,
                self.tensors.len()
            )));
        }
        self.out.flush()?;
        self.out.get_ref().sync_all()
    }
}
