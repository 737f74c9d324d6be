//! Random Meta-layout checkpoints (params.json + consolidated.00.pth) for
//! tests and benchmarks, generated without torch and streamed to disk.
//!
//! Values are deterministic: tensor `name` uses a SplitMix64 stream seeded
//! with `splitmix64(seed ^ fnv1a64(name))`; each element takes one draw
//! `r`, splits it into four 16-bit uniforms u0..u3 and maps them to
//! `x = ((u0+u1+u2+u3) / 65536 - 2) * sqrt(3)` (approximately N(0,1)).
//! Weights are `0.02 * x`, norm weights `1 + 0.02 * x`, computed in f32 and
//! rounded to the target dtype (round-to-nearest-even).
//! tests/reference/check_rust_written.py re-implements this to check it.

use super::{io_err, PthError, PthWriter};
use crate::ir::DType;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The fields of Meta's `params.json` this crate uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetaParams {
    pub dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_kv_heads: Option<usize>,
    /// Meta's Llama 2 files say -1 here (vocab from the tokenizer).
    pub vocab_size: i64,
    #[serde(default = "default_multiple_of")]
    pub multiple_of: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ffn_dim_multiplier: Option<f64>,
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_scaled_rope: Option<bool>,
}

fn default_multiple_of() -> usize {
    256
}
fn default_norm_eps() -> f64 {
    1e-5
}

impl MetaParams {
    pub fn from_json(s: &str) -> Result<Self, PthError> {
        serde_json::from_str(s).map_err(|e| PthError::Params(e.to_string()))
    }
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }
    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads.max(1)
    }
    fn validate(&self) -> Result<usize, PthError> {
        let bad = |m: String| Err(PthError::Params(m));
        if self.dim == 0 || self.n_heads == 0 || self.n_layers == 0 || self.multiple_of == 0 {
            return bad("dim, n_layers, n_heads and multiple_of must be positive".into());
        }
        if !self.dim.is_multiple_of(self.n_heads) {
            return bad(format!(
                "dim {} is not a multiple of n_heads {}",
                self.dim, self.n_heads
            ));
        }
        let kv = self.n_kv_heads();
        if kv == 0 || !self.n_heads.is_multiple_of(kv) {
            return bad(format!(
                "n_heads {} is not a multiple of n_kv_heads {kv}",
                self.n_heads
            ));
        }
        match usize::try_from(self.vocab_size) {
            Ok(v) if v > 0 => Ok(v),
            _ => bad(format!(
                "vocab_size {} must be positive to generate weights",
                self.vocab_size
            )),
        }
    }
}

/// Meta's FFN hidden size: `4*dim`, two thirds, optional multiplier, rounded
/// up to `multiple_of`.
pub fn ffn_hidden_dim(p: &MetaParams) -> usize {
    let mut hidden = 4 * p.dim;
    hidden = 2 * hidden / 3;
    if let Some(m) = p.ffn_dim_multiplier {
        hidden = (m * hidden as f64) as usize;
    }
    let m = p.multiple_of.max(1);
    m * hidden.div_ceil(m)
}

/// The tensors of a Meta checkpoint, in Meta's order, with their shapes.
pub fn meta_tensor_shapes(p: &MetaParams) -> Result<Vec<(String, Vec<usize>)>, PthError> {
    let vocab = p.validate()?;
    let (dim, hd) = (p.dim, p.head_dim());
    let (nh, nkv) = (p.n_heads, p.n_kv_heads());
    let ffn = ffn_hidden_dim(p);
    let mut v = vec![("tok_embeddings.weight".to_string(), vec![vocab, dim])];
    for l in 0..p.n_layers {
        let a = format!("layers.{l}.attention");
        let f = format!("layers.{l}.feed_forward");
        v.push((format!("{a}.wq.weight"), vec![nh * hd, dim]));
        v.push((format!("{a}.wk.weight"), vec![nkv * hd, dim]));
        v.push((format!("{a}.wv.weight"), vec![nkv * hd, dim]));
        v.push((format!("{a}.wo.weight"), vec![dim, nh * hd]));
        v.push((format!("{f}.w1.weight"), vec![ffn, dim]));
        v.push((format!("{f}.w2.weight"), vec![dim, ffn]));
        v.push((format!("{f}.w3.weight"), vec![ffn, dim]));
        v.push((format!("layers.{l}.attention_norm.weight"), vec![dim]));
        v.push((format!("layers.{l}.ffn_norm.weight"), vec![dim]));
    }
    v.push(("norm.weight".to_string(), vec![dim]));
    v.push(("output.weight".to_string(), vec![vocab, dim]));
    Ok(v)
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn fnv1a64(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Deterministic value stream for one tensor (see the module docs).
pub(crate) struct TensorRng {
    state: u64,
    base: f32,
}

impl TensorRng {
    pub(crate) fn new(seed: u64, name: &str) -> Self {
        let mut s = seed ^ fnv1a64(name);
        let state = splitmix64(&mut s);
        let base = if name.ends_with("norm.weight") {
            1.0
        } else {
            0.0
        };
        TensorRng { state, base }
    }
    #[inline]
    pub(crate) fn next_f32(&mut self) -> f32 {
        let r = splitmix64(&mut self.state);
        let s = (r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48);
        let x = (s as f32 / 65536.0 - 2.0) * 1.732_050_8_f32;
        self.base + 0.02 * x
    }
}

fn encode(dtype: DType, x: f32, out: &mut Vec<u8>) {
    match dtype {
        DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes()),
        DType::F16 => out.extend_from_slice(&half::f16::from_f32(x).to_le_bytes()),
        _ => out.extend_from_slice(&x.to_le_bytes()),
    }
}

/// Write `dir/params.json` and `dir/consolidated.00.pth` with random
/// weights of `dtype` (BF16, F16 or F32). Memory use is bounded by a 1 MiB
/// chunk, whatever the model size.
pub fn generate_random_checkpoint(
    dir: &Path,
    params: &MetaParams,
    seed: u64,
    dtype: DType,
) -> Result<(), PthError> {
    if !matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
        return Err(PthError::Params(format!("cannot generate {dtype} weights")));
    }
    let shapes = meta_tensor_shapes(params)?;
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let pj = dir.join("params.json");
    let json = serde_json::to_string_pretty(params).map_err(|e| PthError::Params(e.to_string()))?;
    std::fs::write(&pj, json).map_err(|e| io_err(&pj, e))?;
    let mut w = PthWriter::create(&dir.join("consolidated.00.pth"))?;
    for (name, shape) in &shapes {
        let numel: usize = shape.iter().product();
        let mut rng = TensorRng::new(seed, name);
        w.add_tensor_with(name, dtype, shape, |out| {
            const CHUNK: usize = 1 << 18;
            let mut buf = Vec::with_capacity(CHUNK * 4);
            let mut left = numel;
            while left > 0 {
                let n = left.min(CHUNK);
                buf.clear();
                for _ in 0..n {
                    encode(dtype, rng.next_f32(), &mut buf);
                }
                out.write_all(&buf)?;
                left -= n;
            }
            Ok(())
        })?;
    }
    w.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(dim: usize, mult: Option<f64>, multiple_of: usize) -> MetaParams {
        MetaParams {
            dim,
            n_layers: 1,
            n_heads: 1,
            n_kv_heads: None,
            vocab_size: 10,
            multiple_of,
            ffn_dim_multiplier: mult,
            norm_eps: 1e-5,
            rope_theta: None,
            use_scaled_rope: None,
        }
    }

    #[test]
    fn ffn_dims_of_released_models() {
        // Published FFN sizes: Llama-2-7B 11008, Llama-3-8B 14336,
        // Llama-3.2-1B 8192, Llama-3.2-3B 8192, Llama-2-70B 28672.
        assert_eq!(ffn_hidden_dim(&p(4096, None, 256)), 11008);
        assert_eq!(ffn_hidden_dim(&p(4096, Some(1.3), 1024)), 14336);
        assert_eq!(ffn_hidden_dim(&p(2048, Some(1.5), 256)), 8192);
        assert_eq!(ffn_hidden_dim(&p(3072, Some(1.0), 256)), 8192);
        assert_eq!(ffn_hidden_dim(&p(8192, Some(1.3), 4096)), 28672);
    }
}
