//! Loading a Meta checkpoint directory and merging model-parallel shards.

use super::{open_pth, PthError};
use crate::weights::{TensorBytes, WeightStore, WeightTensor};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How a tensor is distributed over model-parallel shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardSplit {
    /// Concatenate the shards along this dimension.
    Concat(usize),
    /// Every shard holds the full tensor (must be equal).
    Replicated,
}

impl ShardSplit {
    /// Meta's layout. Column-parallel (wq, wk, wv, w1, w3, output) split dim
    /// 0; row-parallel (wo, w2) split dim 1; norms and rope.freqs are
    /// replicated. `tok_embeddings` is dim 1 in Llama 1/2
    /// (`ParallelEmbedding`) but dim 0 in Llama 3 (`VocabParallelEmbedding`);
    /// `model_dim` (the length of `norm.weight`) decides: a shard whose
    /// second dimension already equals `model_dim` was split along vocab.
    pub fn for_tensor(
        name: &str,
        shard_shape: &[usize],
        model_dim: Option<usize>,
    ) -> Option<ShardSplit> {
        let base = name.strip_suffix(".weight").unwrap_or(name);
        let last = base.rsplit('.').next().unwrap_or(base);
        match last {
            "wq" | "wk" | "wv" | "w1" | "w3" | "output" => Some(ShardSplit::Concat(0)),
            "wo" | "w2" => Some(ShardSplit::Concat(1)),
            "tok_embeddings" => {
                if model_dim.is_some() && shard_shape.get(1).copied() == model_dim {
                    Some(ShardSplit::Concat(0))
                } else {
                    Some(ShardSplit::Concat(1))
                }
            }
            "attention_norm" | "ffn_norm" | "norm" | "freqs" => Some(ShardSplit::Replicated),
            _ => None,
        }
    }
}

/// The `consolidated.NN.pth` files of `dir`, ordered by NN. Errors when
/// there are none or when the numbers are not 0..n-1.
pub fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>, PthError> {
    let rd = std::fs::read_dir(dir).map_err(|e| super::io_err(dir, e))?;
    let mut shards: Vec<(usize, PathBuf)> = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| super::io_err(dir, e))?;
        let name = ent.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(num) = name
            .strip_prefix("consolidated.")
            .and_then(|s| s.strip_suffix(".pth"))
        else {
            continue;
        };
        if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(n) = num.parse::<usize>() else {
            continue;
        };
        shards.push((n, ent.path()));
    }
    if shards.is_empty() {
        return Err(PthError::NoShards(dir.display().to_string()));
    }
    shards.sort();
    for (i, (n, _)) in shards.iter().enumerate() {
        if *n != i {
            return Err(PthError::MissingShard {
                dir: dir.display().to_string(),
                index: i,
                found: shards.len(),
            });
        }
    }
    Ok(shards.into_iter().map(|(_, p)| p).collect())
}

/// Open every `consolidated.*.pth` in `dir`. One shard: zero-copy views.
/// Several: merged along Meta's model-parallel dims into owned tensors.
pub fn load_meta_checkpoint(dir: &Path) -> Result<WeightStore, PthError> {
    let paths = shard_paths(dir)?;
    let shards = paths
        .iter()
        .map(|p| open_pth(p))
        .collect::<Result<Vec<_>, _>>()?;
    merge_shards(shards)
}

fn merr(tensor: &str, msg: String) -> PthError {
    PthError::Merge {
        tensor: tensor.to_string(),
        msg,
    }
}

/// Merge model-parallel shards (in rank order) into one store.
pub fn merge_shards(mut shards: Vec<WeightStore>) -> Result<WeightStore, PthError> {
    if shards.len() <= 1 {
        return Ok(shards.pop().unwrap_or_default());
    }
    let first = &shards[0];
    for (i, s) in shards.iter().enumerate().skip(1) {
        if s.tensors.len() != first.tensors.len() || !s.tensors.keys().eq(first.tensors.keys()) {
            let missing = first
                .tensors
                .keys()
                .find(|k| !s.tensors.contains_key(*k))
                .or_else(|| s.tensors.keys().find(|k| !first.tensors.contains_key(*k)));
            return Err(merr(
                missing.map_or("?", |s| s.as_str()),
                format!("shard {i} and shard 0 hold different tensor names"),
            ));
        }
    }
    let model_dim = first
        .tensors
        .get("norm.weight")
        .filter(|t| t.shape.len() == 1)
        .map(|t| t.shape[0]);
    let mut out = WeightStore::default();
    for (name, t0) in &first.tensors {
        let parts: Vec<&WeightTensor> = shards.iter().map(|s| &s.tensors[name]).collect();
        for (i, p) in parts.iter().enumerate() {
            if p.dtype != t0.dtype {
                return Err(merr(
                    name,
                    format!("shard {i} has dtype {}, shard 0 {}", p.dtype, t0.dtype),
                ));
            }
            if p.shape.len() != t0.shape.len() {
                return Err(merr(
                    name,
                    format!("shard {i} has shape {:?}, shard 0 {:?}", p.shape, t0.shape),
                ));
            }
        }
        let split = match ShardSplit::for_tensor(name, &t0.shape, model_dim) {
            Some(s) => s,
            // Unknown tensor: accept only if every shard holds the same data.
            None if parts
                .iter()
                .all(|p| p.shape == t0.shape && p.data.as_bytes() == t0.data.as_bytes()) =>
            {
                ShardSplit::Replicated
            }
            None => {
                return Err(merr(
                    name,
                    "unknown tensor differs between shards; no merge rule".into(),
                ))
            }
        };
        let merged = match split {
            ShardSplit::Replicated => {
                for (i, p) in parts.iter().enumerate().skip(1) {
                    if p.shape != t0.shape {
                        return Err(merr(
                            name,
                            format!(
                                "replicated tensor: shard {i} shape {:?} vs {:?}",
                                p.shape, t0.shape
                            ),
                        ));
                    }
                    if p.data.as_bytes() != t0.data.as_bytes() {
                        return Err(merr(
                            name,
                            format!("replicated tensor differs between shard 0 and {i}"),
                        ));
                    }
                }
                (*t0).clone()
            }
            ShardSplit::Concat(dim) => concat(name, &parts, dim)?,
        };
        out.tensors.insert(name.clone(), merged);
    }
    Ok(out)
}

fn concat(name: &str, parts: &[&WeightTensor], dim: usize) -> Result<WeightTensor, PthError> {
    let t0 = parts[0];
    if dim >= t0.shape.len() {
        return Err(merr(
            name,
            format!("cannot split {}-d tensor on dim {dim}", t0.shape.len()),
        ));
    }
    for (i, p) in parts.iter().enumerate() {
        for d in 0..t0.shape.len() {
            if d != dim && p.shape[d] != t0.shape[d] {
                return Err(merr(
                    name,
                    format!(
                        "shard {i} shape {:?} differs from shard 0 {:?} outside dim {dim}",
                        p.shape, t0.shape
                    ),
                ));
            }
        }
        let numel: usize = p.shape.iter().product();
        if p.dtype.bytes_for(numel) != Some(p.data.len()) {
            return Err(merr(
                name,
                format!(
                    "shard {i} byte length {} does not match its shape",
                    p.data.len()
                ),
            ));
        }
    }
    let esize = t0.dtype.block_bytes();
    let outer: usize = t0.shape[..dim].iter().product();
    let inner: usize = t0.shape[dim + 1..].iter().product::<usize>() * esize;
    let mut total_dim = 0usize;
    for p in parts {
        total_dim = total_dim
            .checked_add(p.shape[dim])
            .ok_or_else(|| merr(name, "merged shape overflows".into()))?;
    }
    let mut shape = t0.shape.clone();
    shape[dim] = total_dim;
    let total: usize = parts.iter().map(|p| p.data.len()).sum();
    let mut out = Vec::with_capacity(total);
    for o in 0..outer {
        for p in parts {
            let chunk = p.shape[dim] * inner;
            out.extend_from_slice(&p.data.as_bytes()[o * chunk..(o + 1) * chunk]);
        }
    }
    Ok(WeightTensor {
        dtype: t0.dtype,
        shape,
        data: TensorBytes::Owned(Arc::new(out)),
    })
}
