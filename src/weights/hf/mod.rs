//! Hugging Face checkpoint directories (`LlamaForCausalLM`): `config.json`
//! plus `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`.
//!
//! Tensors are renamed to Meta's names (`model.layers.3.self_attn.q_proj.weight`
//! -> `layers.3.attention.wq.weight`, see [`hf_to_meta_name`]), so the
//! builder's graph is the same whatever the format.
//!
//! # Q/K rows
//!
//! Hugging Face's conversion of Meta's weights (`permute` in
//! `convert_llama_weights_to_hf.py`) reorders the rows of `wq` and `wk` within
//! each head so that RoPE can rotate halves (`rotate_half`: pairs `(j, j +
//! D/2)`) instead of Meta's adjacent pairs `(2j, 2j + 1)`: Meta row `h·D + 2j +
//! s` (`s` = 0 or 1) is HF row `h·D + s·D/2 + j`. The loader undoes that once
//! ([`hf_to_meta_rows`], the same permutation as llama.cpp's
//! `LlamaModel.permute`), so RoPE is Meta's for every format. Those two
//! matrices per layer are therefore copies (owned, permuted at load); every
//! other tensor is a view of the memory map.

pub mod config;

pub use config::{ConfigError, HfConfig};

use super::safetensors::{SafetensorsError, SafetensorsFile};
use super::{TensorBytes, WeightStore, WeightTensor};
use crate::model::Family;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum HfError {
    #[error("{path}: {message}")]
    Path { path: String, message: String },
    #[error("{path}: {source}")]
    Config {
        path: String,
        #[source]
        source: ConfigError,
    },
    #[error("{path}: {source}")]
    Safetensors {
        path: String,
        #[source]
        source: SafetensorsError,
    },
    #[error("{index}: {message}")]
    Index { index: String, message: String },
    #[error("tensor `{0}` appears in two shards")]
    DuplicateTensor(String),
    #[error("tensor `{tensor}`: {message}")]
    Tensor { tensor: String, message: String },
}

impl From<HfError> for crate::Error {
    fn from(e: HfError) -> Self {
        crate::Error::Msg(e.to_string())
    }
}

fn path_err(path: &Path, message: impl Into<String>) -> HfError {
    HfError::Path {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// What a tensor name of a Llama checkpoint in Hugging Face's layout is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HfName {
    /// A weight the graph uses, under its Meta name.
    Meta(String),
    /// A buffer older transformers versions saved (`rotary_emb.inv_freq`):
    /// recomputed from the config, so not needed.
    Ignored,
    /// A bias (`q_proj.bias`, ...): Llama layers have none.
    Bias,
    /// Anything else.
    Unknown,
}

/// Maps a Hugging Face Llama tensor name to the Meta name our graph uses.
pub fn hf_to_meta_name(name: &str) -> HfName {
    hf_to_meta_name_for(name, Family::Llama)
}

/// Maps a tensor name of a family's Hugging Face checkpoint to the Meta
/// name our graph uses. Gemma 3's `post_attention_layernorm` is a norm of
/// the attention output (Llama's is the pre-MLP norm, which Gemma calls
/// `pre_feedforward_layernorm`); Phi-3's fused `qkv_proj` and
/// `gate_up_proj` map to names the loader splits.
pub fn hf_to_meta_name_for(name: &str, family: Family) -> HfName {
    if let Some(rest) = name.strip_prefix("model.layers.") {
        if let Some((layer, suffix)) = rest.split_once('.') {
            let ok =
                !layer.is_empty() && layer.bytes().all(|b| b.is_ascii_digit()) && layer.len() <= 6;
            let meta = match (family, suffix) {
                (Family::Qwen2, "self_attn.q_proj.bias") => Some("attention.wq.bias"),
                (Family::Qwen2, "self_attn.k_proj.bias") => Some("attention.wk.bias"),
                (Family::Qwen2, "self_attn.v_proj.bias") => Some("attention.wv.bias"),
                (Family::Qwen3 | Family::Gemma3, "self_attn.q_norm.weight") => {
                    Some("attention.q_norm.weight")
                }
                (Family::Qwen3 | Family::Gemma3, "self_attn.k_norm.weight") => {
                    Some("attention.k_norm.weight")
                }
                (Family::Gemma3, "post_attention_layernorm.weight") => {
                    Some("post_attention_norm.weight")
                }
                (Family::Gemma3, "pre_feedforward_layernorm.weight") => Some("ffn_norm.weight"),
                (Family::Gemma3, "post_feedforward_layernorm.weight") => {
                    Some("post_ffn_norm.weight")
                }
                (Family::Phi3, "self_attn.qkv_proj.weight") => Some(FUSED_QKV),
                (Family::Phi3, "mlp.gate_up_proj.weight") => Some(FUSED_GATE_UP),
                _ => None,
            };
            if let (true, Some(m)) = (ok, meta) {
                return HfName::Meta(format!("layers.{layer}.{m}"));
            }
        }
    }
    match name {
        "model.embed_tokens.weight" => return HfName::Meta("tok_embeddings.weight".into()),
        "model.norm.weight" => return HfName::Meta("norm.weight".into()),
        "lm_head.weight" => return HfName::Meta("output.weight".into()),
        _ => {}
    }
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return HfName::Unknown;
    };
    let Some((layer, suffix)) = rest.split_once('.') else {
        return HfName::Unknown;
    };
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) || layer.len() > 6 {
        return HfName::Unknown;
    }
    let meta = match suffix {
        "input_layernorm.weight" => "attention_norm.weight",
        "self_attn.q_proj.weight" => "attention.wq.weight",
        "self_attn.k_proj.weight" => "attention.wk.weight",
        "self_attn.v_proj.weight" => "attention.wv.weight",
        "self_attn.o_proj.weight" => "attention.wo.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "mlp.gate_proj.weight" => "feed_forward.w1.weight",
        "mlp.up_proj.weight" => "feed_forward.w3.weight",
        "mlp.down_proj.weight" => "feed_forward.w2.weight",
        "self_attn.rotary_emb.inv_freq" => return HfName::Ignored,
        s if s.ends_with(".bias") => return HfName::Bias,
        _ => return HfName::Unknown,
    };
    HfName::Meta(format!("layers.{layer}.{meta}"))
}

/// Phi-3's fused QKV matrix until the loader splits it.
const FUSED_QKV: &str = "attention.qkv_fused.weight";
/// Phi-3's fused gate/up matrix (gate rows first) until the loader splits it.
const FUSED_GATE_UP: &str = "feed_forward.gate_up_fused.weight";

/// The Hugging Face name of a Meta tensor name (the inverse of
/// [`hf_to_meta_name`] on the names the graph uses).
pub fn meta_to_hf_name(name: &str) -> Option<String> {
    match name {
        "tok_embeddings.weight" => return Some("model.embed_tokens.weight".into()),
        "norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let hf = match suffix {
        "attention_norm.weight" => "input_layernorm.weight",
        "attention.wq.weight" => "self_attn.q_proj.weight",
        "attention.wk.weight" => "self_attn.k_proj.weight",
        "attention.wv.weight" => "self_attn.v_proj.weight",
        "attention.wo.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "feed_forward.w1.weight" => "mlp.gate_proj.weight",
        "feed_forward.w3.weight" => "mlp.up_proj.weight",
        "feed_forward.w2.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Which Meta row each row of a permuted matrix comes from. `to_meta`:
/// the source row of Meta row `r` in an HF matrix; otherwise the source row
/// of HF row `r` in a Meta matrix.
fn row_source(r: usize, head_dim: usize, to_meta: bool) -> usize {
    let (h, i) = (r / head_dim, r % head_dim);
    let half = head_dim / 2;
    if to_meta {
        // Meta row h·D + 2j + s <- HF row h·D + s·D/2 + j.
        let (j, s) = (i / 2, i % 2);
        h * head_dim + s * half + j
    } else {
        // HF row h·D + s·D/2 + j <- Meta row h·D + 2j + s.
        let (s, j) = (i / half, i % half);
        h * head_dim + 2 * j + s
    }
}

fn permute_rows(t: &WeightTensor, n_heads: usize, to_meta: bool) -> Result<WeightTensor, String> {
    let [rows, _] = t.shape[..] else {
        return Err(format!("shape {:?} is not a matrix", t.shape));
    };
    if n_heads == 0 || !rows.is_multiple_of(n_heads) || !(rows / n_heads).is_multiple_of(2) {
        return Err(format!(
            "{rows} rows cannot be split into {n_heads} heads of an even size"
        ));
    }
    let head_dim = rows / n_heads;
    let bytes = t.data.as_bytes();
    if rows == 0 || !bytes.len().is_multiple_of(rows) {
        return Err(format!("{} bytes are not {rows} whole rows", bytes.len()));
    }
    let row_bytes = bytes.len() / rows;
    let mut out = Vec::with_capacity(bytes.len());
    for r in 0..rows {
        let src = row_source(r, head_dim, to_meta);
        out.extend_from_slice(&bytes[src * row_bytes..(src + 1) * row_bytes]);
    }
    Ok(WeightTensor {
        dtype: t.dtype,
        shape: t.shape.clone(),
        data: TensorBytes::Owned(Arc::new(out)),
    })
}

/// Undoes Hugging Face's rotate-half row order of a `q_proj` (`n_heads` =
/// attention heads) or `k_proj` (`n_heads` = KV heads) matrix: the result
/// is in Meta's order, as an owned copy. Rows are moved whole, so any dtype
/// whose rows are whole blocks works.
pub fn hf_to_meta_rows(t: &WeightTensor, n_heads: usize) -> Result<WeightTensor, String> {
    permute_rows(t, n_heads, true)
}

/// [`hf_to_meta_rows`] for a matrix, or for a vector (a bias or a per-head
/// norm weight) its entries.
pub fn hf_to_meta_any(t: &WeightTensor, n_heads: usize) -> Result<WeightTensor, String> {
    if t.shape.len() != 1 {
        return hf_to_meta_rows(t, n_heads);
    }
    let col = WeightTensor {
        shape: vec![t.shape[0], 1],
        ..t.clone()
    };
    let mut r = hf_to_meta_rows(&col, n_heads)?;
    r.shape = t.shape.clone();
    Ok(r)
}

/// `1 + w` in f32, for a vector of any float dtype.
fn plus_one(t: &WeightTensor) -> Result<WeightTensor, String> {
    if t.shape.len() != 1 {
        return Err(format!(
            "a norm weight of shape {:?}, not a vector",
            t.shape
        ));
    }
    let mut v = vec![0f32; t.shape[0]];
    crate::kernels::dequantize_row(t.dtype, t.data.as_bytes(), &mut v)
        .map_err(|e| e.to_string())?;
    let bytes: Vec<u8> = v.iter().flat_map(|x| (1.0 + x).to_le_bytes()).collect();
    Ok(WeightTensor {
        dtype: crate::ir::DType::F32,
        shape: t.shape.clone(),
        data: TensorBytes::Owned(Arc::new(bytes)),
    })
}

/// The inverse of [`hf_to_meta_rows`]: Meta's row order to Hugging Face's.
pub fn meta_to_hf_rows(t: &WeightTensor, n_heads: usize) -> Result<WeightTensor, String> {
    permute_rows(t, n_heads, false)
}

/// The inverse of [`hf_to_meta_any`]: a matrix's rows, or a vector's
/// entries, from Meta's order to Hugging Face's.
pub fn meta_to_hf_any(t: &WeightTensor, n_heads: usize) -> Result<WeightTensor, String> {
    if t.shape.len() != 1 {
        return meta_to_hf_rows(t, n_heads);
    }
    let col = WeightTensor {
        shape: vec![t.shape[0], 1],
        ..t.clone()
    };
    let mut r = meta_to_hf_rows(&col, n_heads)?;
    r.shape = t.shape.clone();
    Ok(r)
}

/// The safetensors files of a directory: the shards named by
/// `model.safetensors.index.json`, or `model.safetensors`.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, HfError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let ierr = |message: String| HfError::Index {
            index: index.display().to_string(),
            message,
        };
        let text =
            std::fs::read_to_string(&index).map_err(|e| ierr(format!("cannot read: {e}")))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ierr(format!("not valid JSON: {e}")))?;
        let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) else {
            return Err(ierr("has no `weight_map` object".into()));
        };
        let mut files = BTreeSet::new();
        for (tensor, file) in map {
            let Some(file) = file.as_str() else {
                return Err(ierr(format!(
                    "tensor `{tensor}` maps to {file}, not a file name"
                )));
            };
            // Shards are plain file names next to the index.
            let p = Path::new(file);
            let plain = p.components().count() == 1
                && matches!(p.components().next(), Some(std::path::Component::Normal(_)));
            if !plain {
                return Err(ierr(format!(
                    "tensor `{tensor}` maps to `{file}`, which is not a file name in the same directory"
                )));
            }
            files.insert(file.to_string());
        }
        if files.is_empty() {
            return Err(ierr("`weight_map` is empty".into()));
        }
        let mut out = Vec::new();
        for f in files {
            let p = dir.join(&f);
            if !p.is_file() {
                return Err(ierr(format!(
                    "shard `{f}` is missing from {}",
                    dir.display()
                )));
            }
            out.push(p);
        }
        return Ok(out);
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let hint = if dir.join("pytorch_model.bin").exists()
        || dir.join("pytorch_model.bin.index.json").exists()
    {
        " (pytorch_model.bin checkpoints are not read: they are pickles; re-save with safetensors)"
    } else {
        ""
    };
    Err(path_err(
        dir,
        format!(
            "has config.json but neither model.safetensors nor model.safetensors.index.json{hint}"
        ),
    ))
}

/// A Hugging Face Llama checkpoint, renamed to Meta's names.
pub struct HfCheckpoint {
    pub config: HfConfig,
    pub weights: WeightStore,
    /// `lm_head.weight` was present but unused because the embeddings are
    /// tied (as transformers does).
    pub dropped_tied_head: bool,
    /// Tensors still in Hugging Face's Q/K row order, with the head count to
    /// undo it with ([`hf_to_meta_rows`]); empty once [`load_hf_checkpoint`]
    /// has done it.
    pub unpermuted: BTreeMap<String, usize>,
}

impl HfCheckpoint {
    /// Tensor `name` in Meta's row order (a permuted copy for `wq`/`wk`
    /// still in HF order, else the stored view).
    pub fn meta_tensor(&self, name: &str) -> Result<Option<WeightTensor>, HfError> {
        let Some(t) = self.weights.tensors.get(name) else {
            return Ok(None);
        };
        match self.unpermuted.get(name) {
            Some(&h) => hf_to_meta_any(t, h)
                .map(Some)
                .map_err(|message| HfError::Tensor {
                    tensor: name.to_string(),
                    message,
                }),
            None => Ok(Some(t.clone())),
        }
    }
}

/// Opens a Hugging Face checkpoint directory: reads `config.json`, maps
/// every safetensors file, renames the tensors and puts `wq`/`wk` back in
/// Meta's row order.
pub fn load_hf_checkpoint(dir: &Path) -> Result<HfCheckpoint, HfError> {
    let mut ck = open_hf_checkpoint(dir)?;
    for name in ck.unpermuted.keys() {
        let t = ck.meta_tensor(name)?.expect("listed tensors exist");
        ck.weights.tensors.insert(name.clone(), t);
    }
    ck.unpermuted.clear();
    Ok(ck)
}

/// [`load_hf_checkpoint`] without the Q/K permutation: every tensor stays a
/// view of the map, and [`HfCheckpoint::meta_tensor`] permutes `wq`/`wk` one
/// at a time (what `convert` needs to hold one tensor at a time).
pub fn open_hf_checkpoint(dir: &Path) -> Result<HfCheckpoint, HfError> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .map_err(|e| path_err(&cfg_path, format!("cannot read config.json: {e}")))?;
    let config = HfConfig::parse(&text).map_err(|source| HfError::Config {
        path: cfg_path.display().to_string(),
        source,
    })?;
    let files = safetensors_files(dir)?;
    let index: Option<BTreeMap<String, String>> = {
        let p = dir.join("model.safetensors.index.json");
        if p.exists() {
            let v: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(&p).map_err(|e| path_err(&p, e.to_string()))?,
            )
            .map_err(|e| path_err(&p, e.to_string()))?;
            Some(
                v["weight_map"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter_map(|(k, f)| Some((k.clone(), f.as_str()?.to_string())))
                    .collect(),
            )
        } else {
            None
        }
    };
    let args = &config.args;
    let mut raw = WeightStore::default();
    let mut origin: BTreeMap<String, String> = BTreeMap::new();
    for f in &files {
        let st = SafetensorsFile::open(f).map_err(|source| HfError::Safetensors {
            path: f.display().to_string(),
            source,
        })?;
        let fname = f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        for (name, t) in st.to_store().tensors {
            if let Some(idx) = &index {
                match idx.get(&name) {
                    Some(want) if *want == fname => {}
                    Some(want) => {
                        return Err(HfError::Tensor {
                            tensor: name,
                            message: format!("found in {fname}, but the index says {want}"),
                        })
                    }
                    None => {
                        return Err(HfError::Tensor {
                            tensor: name,
                            message: format!("found in {fname}, but the index does not list it"),
                        })
                    }
                }
            }
            if origin.insert(name.clone(), fname.clone()).is_some() {
                return Err(HfError::DuplicateTensor(name));
            }
            raw.tensors.insert(name, t);
        }
    }
    if let Some(idx) = &index {
        if let Some((name, file)) = idx.iter().find(|(n, _)| !origin.contains_key(*n)) {
            return Err(HfError::Tensor {
                tensor: name.clone(),
                message: format!("listed in the index for {file}, but not in that file"),
            });
        }
    }
    let mut weights = WeightStore::default();
    let mut dropped_tied_head = false;
    let mut unpermuted = BTreeMap::new();
    let family = args.variant.family;
    let hd = args.head_dim();
    for (name, t) in raw.tensors {
        let meta = match hf_to_meta_name_for(&name, family) {
            HfName::Meta(m) => m,
            HfName::Ignored => continue,
            HfName::Bias => {
                return Err(HfError::Tensor {
                    tensor: name,
                    message: format!("biases are not supported ({} has none here)", family.name()),
                })
            }
            HfName::Unknown => {
                return Err(HfError::Tensor {
                    tensor: name,
                    message: format!(
                        "not a tensor of {} (another architecture?)",
                        family.hf_class()
                    ),
                })
            }
        };
        // Gemma 3's norms compute `x̂ · (1 + w)`: stored as `1 + w` in f32
        // (transformers adds in f32; llama.cpp's converter stores the sum).
        let t = if family == Family::Gemma3 && meta.ends_with("norm.weight") {
            plus_one(&t).map_err(|message| HfError::Tensor {
                tensor: name.clone(),
                message,
            })?
        } else {
            t
        };
        // Phi-3's fused matrices, split into the graph's (row ranges).
        let split: Vec<(String, WeightTensor)> = if let Some(p) = meta.strip_suffix(FUSED_QKV) {
            let (q, kv) = (args.n_heads * hd, args.n_kv_heads * hd);
            let mut v = Vec::new();
            for (n, r0, r1) in [("wq", 0, q), ("wk", q, q + kv), ("wv", q + kv, q + 2 * kv)] {
                let part = t.rows(r0, r1).map_err(|message| HfError::Tensor {
                    tensor: name.clone(),
                    message,
                })?;
                v.push((format!("{p}attention.{n}.weight"), part));
            }
            v
        } else if let Some(p) = meta.strip_suffix(FUSED_GATE_UP) {
            let ff = args.ffn_hidden_dim;
            let mut v = Vec::new();
            for (n, r0, r1) in [("w1", 0, ff), ("w3", ff, 2 * ff)] {
                let part = t.rows(r0, r1).map_err(|message| HfError::Tensor {
                    tensor: name.clone(),
                    message,
                })?;
                v.push((format!("{p}feed_forward.{n}.weight"), part));
            }
            v
        } else {
            vec![(meta, t)]
        };
        for (meta, t) in split {
            if meta == "output.weight" && args.tied_embeddings {
                dropped_tied_head = true;
                continue;
            }
            // Rows (and bias entries, norm weights) of q and k heads in HF's
            // rotate-half order.
            let heads = if meta.ends_with("attention.wq.weight")
                || meta.ends_with("attention.wq.bias")
            {
                Some(args.n_heads)
            } else if meta.ends_with("attention.wk.weight") || meta.ends_with("attention.wk.bias") {
                Some(args.n_kv_heads)
            } else if meta.ends_with("attention.q_norm.weight")
                || meta.ends_with("attention.k_norm.weight")
            {
                Some(1)
            } else {
                None
            };
            if let Some(h) = heads {
                unpermuted.insert(meta.clone(), h);
            }
            if weights.tensors.insert(meta.clone(), t).is_some() {
                return Err(HfError::DuplicateTensor(meta));
            }
        }
    }
    if !args.tied_embeddings && !weights.tensors.contains_key("output.weight") {
        return Err(path_err(
            dir,
            "lm_head.weight is missing and config.json says tie_word_embeddings is false",
        ));
    }
    Ok(HfCheckpoint {
        config,
        weights,
        dropped_tied_head,
        unpermuted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;

    #[test]
    fn names_round_trip() {
        for n in [
            "tok_embeddings.weight",
            "norm.weight",
            "output.weight",
            "layers.12.attention.wq.weight",
            "layers.0.feed_forward.w3.weight",
            "layers.7.ffn_norm.weight",
        ] {
            let hf = meta_to_hf_name(n).unwrap();
            assert_eq!(hf_to_meta_name(&hf), HfName::Meta(n.to_string()), "{hf}");
        }
        assert_eq!(
            hf_to_meta_name("model.layers.0.self_attn.q_proj.bias"),
            HfName::Bias
        );
        assert_eq!(
            hf_to_meta_name("model.layers.3.self_attn.rotary_emb.inv_freq"),
            HfName::Ignored
        );
        assert_eq!(
            hf_to_meta_name("model.layers.x.mlp.up_proj.weight"),
            HfName::Unknown
        );
    }

    #[test]
    fn permutation_is_llama_cpp_s() {
        // llama.cpp's LlamaModel.permute, which turns HF rows into Meta rows:
        // w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)
        // Written out: Meta row h*D + 2*j + s = HF row h*D + s*(D/2) + j.
        let (heads, hd, cols) = (3, 8, 2);
        let rows = heads * hd;
        let hf: Vec<u8> = (0..rows * cols).map(|i| i as u8).collect();
        let t = WeightTensor {
            dtype: DType::F16,
            shape: vec![rows, 1],
            data: TensorBytes::Owned(Arc::new(hf.clone())),
        };
        let meta = hf_to_meta_rows(&t, heads).unwrap();
        let m = meta.data.as_bytes();
        for h in 0..heads {
            for s in 0..2 {
                for j in 0..hd / 2 {
                    let mr = h * hd + 2 * j + s;
                    let hr = h * hd + s * (hd / 2) + j;
                    assert_eq!(
                        &m[mr * cols..mr * cols + cols],
                        &hf[hr * cols..hr * cols + cols]
                    );
                }
            }
        }
        let back = meta_to_hf_rows(&meta, heads).unwrap();
        assert_eq!(back.data.as_bytes(), &hf[..]);
        assert!(hf_to_meta_rows(&t, 5).is_err());
    }
}
