//! A `torch.save`-compatible writer: a zip archive of stored entries,
//! each tensor's data aligned to 64 bytes, and a protocol-2 pickle built
//! from `_rebuild_tensor_v2` / `torch.<Type>Storage` like torch writes.
//! Tensor data is streamed: nothing but the pickle is held in memory.

use super::{io_err, PthError};
use crate::ir::DType;
use crate::weights::WeightTensor;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use zip::write::SimpleFileOptions;
use zip::CompressionMethod;

struct Pending {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    key: String,
    numel: u64,
}

/// Streaming `.pth` writer. Add tensors one by one, then [`finish`](Self::finish).
pub struct PthWriter {
    path: PathBuf,
    prefix: String,
    zip: zip::ZipWriter<BufWriter<File>>,
    tensors: Vec<Pending>,
}

fn storage_class(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::BF16 => Some("BFloat16Storage"),
        DType::F16 => Some("HalfStorage"),
        DType::F32 => Some("FloatStorage"),
        DType::I32 => Some("IntStorage"),
        _ => None,
    }
}

struct Counting<'a, W: Write> {
    inner: &'a mut W,
    n: u64,
}
impl<W: Write> Write for Counting<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl PthWriter {
    /// Create `path`. The archive prefix is the file stem, as torch uses
    /// (`consolidated.00.pth` -> `consolidated.00`; Meta's own files use
    /// `consolidated`, which readers do not care about).
    pub fn create(path: &Path) -> Result<Self, PthError> {
        let prefix = path
            .file_stem()
            .and_then(|s| s.to_str())
            .filter(|s| !s.is_empty() && !s.contains('/'))
            .unwrap_or("archive")
            .to_string();
        let f = File::create(path).map_err(|e| io_err(path, e))?;
        Ok(PthWriter {
            path: path.to_path_buf(),
            prefix,
            zip: zip::ZipWriter::new(BufWriter::with_capacity(1 << 20, f)),
            tensors: Vec::new(),
        })
    }

    fn zerr(&self, tensor: &str, e: impl std::fmt::Display) -> PthError {
        PthError::Write {
            tensor: tensor.to_string(),
            msg: format!("{}: {e}", self.path.display()),
        }
    }

    /// Add a tensor whose contiguous little-endian bytes are produced by
    /// `fill`, which must write exactly `numel * element size` bytes.
    pub fn add_tensor_with(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
    ) -> Result<(), PthError> {
        if storage_class(dtype).is_none() {
            return Err(self.zerr(name, format!("dtype {dtype} cannot be written to .pth")));
        }
        let numel = shape
            .iter()
            .try_fold(1usize, |a, &s| a.checked_mul(s))
            .ok_or_else(|| self.zerr(name, "shape overflows"))?;
        let nbytes = dtype
            .bytes_for(numel)
            .ok_or_else(|| self.zerr(name, "size overflows"))? as u64;
        let key = self.tensors.len().to_string();
        let opts = SimpleFileOptions::default()
            .compression_method(CompressionMethod::Stored)
            .with_alignment(64)
            .large_file(nbytes >= u32::MAX as u64);
        self.zip
            .start_file(format!("{}/data/{key}", self.prefix), opts)
            .map_err(|e| self.zerr(name, e))?;
        let mut c = Counting {
            inner: &mut self.zip,
            n: 0,
        };
        let r = fill(&mut c);
        let written = c.n;
        r.map_err(|e| self.zerr(name, e))?;
        if written != nbytes {
            return Err(self.zerr(name, format!("wrote {written} bytes, expected {nbytes}")));
        }
        self.tensors.push(Pending {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            key,
            numel: numel as u64,
        });
        Ok(())
    }

    /// Add a tensor from a [`WeightTensor`] (its bytes must be contiguous).
    pub fn add_tensor(&mut self, name: &str, t: &WeightTensor) -> Result<(), PthError> {
        let bytes = t.data.as_bytes();
        self.add_tensor_with(name, t.dtype, &t.shape, |w| w.write_all(bytes))
    }

    fn small(&mut self, name: &str, data: &[u8]) -> Result<(), PthError> {
        let opts = SimpleFileOptions::default()
            .compression_method(CompressionMethod::Stored)
            .with_alignment(64);
        self.zip
            .start_file(format!("{}/{name}", self.prefix), opts)
            .map_err(|e| self.zerr(name, e))?;
        self.zip.write_all(data).map_err(|e| self.zerr(name, e))
    }

    /// Write data.pkl and the bookkeeping entries, then the central directory.
    pub fn finish(mut self) -> Result<(), PthError> {
        let pkl = state_dict_pickle(&self.tensors);
        self.small("data.pkl", &pkl)?;
        self.small(".format_version", b"1")?;
        self.small(".storage_alignment", b"64")?;
        self.small("byteorder", b"little")?;
        self.small("version", b"3\n")?;
        let w = self.zip.finish().map_err(|e| PthError::Write {
            tensor: String::new(),
            msg: format!("{}: {e}", self.path.display()),
        })?;
        let f = w
            .into_inner()
            .map_err(|e| io_err(&self.path, e.into_error()))?;
        f.sync_all().ok();
        Ok(())
    }
}

/// Write `tensors` to `path` as a torch.save-compatible state dict.
pub fn write_pth(path: &Path, tensors: &[(&str, &WeightTensor)]) -> Result<(), PthError> {
    let mut w = PthWriter::create(path)?;
    for (name, t) in tensors {
        w.add_tensor(name, t)?;
    }
    w.finish()
}

fn p_int(out: &mut Vec<u8>, v: u64) {
    if v < 256 {
        out.extend_from_slice(&[b'K', v as u8]);
    } else if v < 65536 {
        out.push(b'M');
        out.extend_from_slice(&(v as u16).to_le_bytes());
    } else if v < (1 << 31) {
        out.push(b'J');
        out.extend_from_slice(&(v as u32).to_le_bytes());
    } else {
        // LONG1 with 8 (or 9, to keep the sign bit clear) bytes.
        let b = v.to_le_bytes();
        if v >> 63 == 0 {
            out.extend_from_slice(&[0x8a, 8]);
            out.extend_from_slice(&b);
        } else {
            out.extend_from_slice(&[0x8a, 9]);
            out.extend_from_slice(&b);
            out.push(0);
        }
    }
}

fn p_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'X');
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn p_tuple(out: &mut Vec<u8>, vals: impl Iterator<Item = u64> + Clone) {
    let n = vals.clone().count();
    match n {
        0 => out.push(b')'),
        1..=3 => {
            vals.for_each(|v| p_int(out, v));
            out.push(0x84 + n as u8);
        }
        _ => {
            out.push(b'(');
            vals.for_each(|v| p_int(out, v));
            out.push(b't');
        }
    }
}

fn state_dict_pickle(tensors: &[Pending]) -> Vec<u8> {
    let mut o = vec![0x80, 2, b'}', b'('];
    for t in tensors {
        p_str(&mut o, &t.name);
        o.extend_from_slice(b"ctorch._utils\n_rebuild_tensor_v2\n(");
        o.push(b'(');
        p_str(&mut o, "storage");
        // storage_class was checked when the tensor was added
        o.extend_from_slice(
            format!(
                "ctorch\n{}\n",
                storage_class(t.dtype).unwrap_or("FloatStorage")
            )
            .as_bytes(),
        );
        p_str(&mut o, &t.key);
        p_str(&mut o, "cpu");
        p_int(&mut o, t.numel);
        o.extend_from_slice(b"tQ");
        p_int(&mut o, 0);
        p_tuple(&mut o, t.shape.iter().map(|&s| s as u64));
        // Contiguous row-major strides.
        let mut strides = vec![0u64; t.shape.len()];
        let mut acc = 1u64;
        for (i, &s) in t.shape.iter().enumerate().rev() {
            strides[i] = acc;
            acc = acc.saturating_mul(s as u64);
        }
        p_tuple(&mut o, strides.iter().copied());
        o.push(0x89); // requires_grad = False
        o.extend_from_slice(b"ccollections\nOrderedDict\n)R");
        o.extend_from_slice(b"tR");
    }
    o.extend_from_slice(b"u.");
    o
}
