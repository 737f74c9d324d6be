//! Model arguments from Meta's `params.json`, derived exactly as Meta's
//! reference (`llama_models/llama3/args.py`, `model.py`) derives them.

use crate::ir::RopeScaling;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use thiserror::Error;

/// Sizes beyond these are refused rather than planned for: they would only
/// come from a corrupt or hostile file.
const MAX_DIM: usize = 1 << 17;
const MAX_LAYERS: usize = 1 << 12;
const MAX_HEADS: usize = 1 << 12;
const MAX_VOCAB: usize = 1 << 24;
const MAX_FFN: usize = 1 << 20;

/// The context planned for when none is asked for.
pub const DEFAULT_CONTEXT: usize = 2048;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ParamsError {
    #[error("params.json is empty")]
    Empty,
    #[error("params.json is not valid JSON: {0}")]
    NotJson(String),
    #[error("params.json must be a JSON object, got {0}")]
    NotObject(&'static str),
    #[error("params.json: field `{field}` {message}")]
    Field {
        field: &'static str,
        message: String,
    },
}

fn field_err(field: &'static str, message: impl Into<String>) -> ParamsError {
    ParamsError::Field {
        field,
        message: message.into(),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The resolved arguments of a Llama-architecture model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelArgs {
    pub dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// `None` until known: Meta's Llama 2 files say -1, "take it from the
    /// tokenizer". A graph cannot be built until it is resolved.
    pub vocab_size: Option<usize>,
    pub multiple_of: usize,
    pub ffn_dim_multiplier: Option<f64>,
    /// Hidden size of the SwiGLU feed-forward block (derived, or given by the
    /// model file).
    pub ffn_hidden_dim: usize,
    pub norm_eps: f64,
    pub rope_theta: f64,
    /// Llama 3.1 frequency scaling (`use_scaled_rope`).
    pub rope_scaling: Option<RopeScaling>,
    /// The longest context the model supports, where the file says.
    pub max_context: Option<usize>,
    /// The output head shares the token embedding's weights.
    pub tied_embeddings: bool,
    /// What this family's layers do beyond Llama's (all off for Llama).
    #[serde(default)]
    pub variant: Variant,
}

/// The model families the builder knows. The family only names the
/// checkpoint layout and the defaults; the graph is built from the
/// [`Variant`] fields alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Family {
    #[default]
    Llama,
    /// Mistral 7B: Llama with a sliding attention window.
    Mistral,
    /// Qwen2 / Qwen2.5: biases on the Q/K/V projections.
    Qwen2,
    /// Qwen3: per-head RMSNorm on Q and K, an explicit head size.
    Qwen3,
    /// Gemma 3: embedding scale, `(1 + w)` norms (stored as `1 + w`), norms
    /// after attention and after the MLP, Q/K norm, GELU-tanh gate, local
    /// (windowed) and global layers with their own RoPE bases.
    Gemma3,
    /// Phi-3: fused QKV and gate/up tensors (split at load), a window.
    Phi3,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3",
            Family::Phi3 => "phi3",
        }
    }

    /// The Hugging Face class of the family (`config.json` `architectures`).
    pub fn hf_class(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Gemma3 => "Gemma3ForCausalLM",
            Family::Phi3 => "Phi3ForCausalLM",
        }
    }

    /// Whether a GGUF of this `general.architecture` stores Q/K rows in
    /// Hugging Face's rotate-half order (llama.cpp's NEOX RoPE), which the
    /// loader puts back in Meta's order.
    pub fn gguf_neox_rows(self) -> bool {
        !matches!(self, Family::Llama | Family::Mistral)
    }
}

/// The gate activation of the gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum GateAct {
    /// SwiGLU: `silu(gate) * up`.
    #[default]
    Silu,
    /// GeGLU with the tanh approximation: `gelu_tanh(gate) * up`.
    GeluTanh,
}

/// The per-family graph features, as data: the builder emits an op for each
/// one that is set.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Variant {
    pub family: Family,
    /// The head size when it is not `dim / n_heads` (Qwen3, Gemma 3).
    pub head_dim: Option<usize>,
    /// Biases on the Q, K and V projections (Qwen2).
    pub qkv_bias: bool,
    /// Per-head RMSNorm (weight `[head_dim]`) of q and k before RoPE.
    pub qk_norm: bool,
    /// RMSNorms on the attention output and the MLP output before their
    /// residual adds (Gemma 3's `post_attention_layernorm`,
    /// `post_feedforward_layernorm`).
    pub post_norms: bool,
    /// The token embedding is multiplied by `sqrt(dim)` (Gemma 3).
    pub embed_scale: bool,
    pub gate_act: GateAct,
    /// Positions a windowed layer's query attends, its own included
    /// (`q - k < window`).
    pub sliding_window: Option<usize>,
    /// With a window: `None`, every layer is windowed; `Some(n)`, layer `i`
    /// is global (no window) when `(i + 1) % n == 0` and windowed otherwise
    /// (Gemma 3: 6).
    pub global_every: Option<usize>,
    /// RoPE base of the windowed layers when it differs from `rope_theta`
    /// (Gemma 3's local layers: 10000, without the global layers' scaling).
    pub local_rope_theta: Option<f64>,
}

/// Meta's FFN sizing: `4*dim`, then `2/3`, then the optional multiplier,
/// then rounded up to a multiple of `multiple_of` (Python `int()` truncation).
pub fn ffn_hidden_dim(dim: usize, multiple_of: usize, ffn_dim_multiplier: Option<f64>) -> usize {
    let mut hidden = 4 * dim;
    hidden = ((2 * hidden) as f64 / 3.0) as usize;
    if let Some(m) = ffn_dim_multiplier {
        hidden = (m * hidden as f64) as usize;
    }
    multiple_of * hidden.div_ceil(multiple_of)
}

fn get_usize(
    obj: &Map<String, Value>,
    field: &'static str,
    max: usize,
) -> Result<Option<usize>, ParamsError> {
    match obj.get(field) {
        None => Ok(None),
        Some(v) => {
            let n = v
                .as_i64()
                .filter(|_| v.is_i64() || v.is_u64())
                .ok_or_else(|| {
                    field_err(field, format!("must be an integer, got {}", type_name(v)))
                })?;
            if n <= 0 {
                return Err(field_err(field, format!("must be positive, got {n}")));
            }
            let n = n as u64;
            if n > max as u64 {
                return Err(field_err(
                    field,
                    format!("is {n}, larger than the supported {max}"),
                ));
            }
            Ok(Some(n as usize))
        }
    }
}

fn require_usize(
    obj: &Map<String, Value>,
    field: &'static str,
    max: usize,
) -> Result<usize, ParamsError> {
    get_usize(obj, field, max)?.ok_or_else(|| field_err(field, "is missing"))
}

fn get_f64(obj: &Map<String, Value>, field: &'static str) -> Result<Option<f64>, ParamsError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            let x = v.as_f64().ok_or_else(|| {
                field_err(field, format!("must be a number, got {}", type_name(v)))
            })?;
            if !(x.is_finite() && x > 0.0) {
                return Err(field_err(
                    field,
                    format!("must be a positive number, got {x}"),
                ));
            }
            Ok(Some(x))
        }
    }
}

fn get_bool(obj: &Map<String, Value>, field: &'static str) -> Result<Option<bool>, ParamsError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(field_err(
            field,
            format!("must be true or false, got {}", type_name(v)),
        )),
    }
}

impl ModelArgs {
    /// Parses Meta's `params.json`. Unknown keys are ignored. Besides Meta's
    /// keys, `max_seq_len` (the model's context limit) and
    /// `tie_word_embeddings` (output head tied to the embedding, as
    /// SmolLM2) are understood.
    pub fn from_params_json(text: &str) -> Result<ModelArgs, ParamsError> {
        if text.trim().is_empty() {
            return Err(ParamsError::Empty);
        }
        let v: Value =
            serde_json::from_str(text).map_err(|e| ParamsError::NotJson(e.to_string()))?;
        let obj = match &v {
            Value::Object(o) => o,
            other => return Err(ParamsError::NotObject(type_name(other))),
        };
        let dim = require_usize(obj, "dim", MAX_DIM)?;
        let n_layers = require_usize(obj, "n_layers", MAX_LAYERS)?;
        let n_heads = require_usize(obj, "n_heads", MAX_HEADS)?;
        let n_kv_heads = match obj.get("n_kv_heads") {
            None | Some(Value::Null) => n_heads,
            Some(v) if v.as_i64() == Some(-1) => n_heads,
            Some(_) => require_usize(obj, "n_kv_heads", MAX_HEADS)?,
        };
        let vocab_size = match obj.get("vocab_size") {
            Some(v) if v.as_i64() == Some(-1) => None,
            None => {
                return Err(field_err(
                    "vocab_size",
                    "is missing (use -1 to take it from the tokenizer)",
                ))
            }
            Some(_) => Some(require_usize(obj, "vocab_size", MAX_VOCAB)?),
        };
        let multiple_of = get_usize(obj, "multiple_of", MAX_FFN)?.unwrap_or(256);
        let ffn_dim_multiplier = get_f64(obj, "ffn_dim_multiplier")?;
        let norm_eps =
            get_f64(obj, "norm_eps")?.ok_or_else(|| field_err("norm_eps", "is missing"))?;
        let rope_theta = get_f64(obj, "rope_theta")?.unwrap_or(10000.0);
        let use_scaled_rope = get_bool(obj, "use_scaled_rope")?.unwrap_or(false);
        let max_context = get_usize(obj, "max_seq_len", 1 << 24)?;
        let tied_embeddings = get_bool(obj, "tie_word_embeddings")?.unwrap_or(false);
        let ffn_hidden_dim = ffn_hidden_dim(dim, multiple_of, ffn_dim_multiplier);
        let args = ModelArgs {
            dim,
            n_layers,
            n_heads,
            n_kv_heads,
            vocab_size,
            multiple_of,
            ffn_dim_multiplier,
            ffn_hidden_dim,
            norm_eps,
            rope_theta,
            rope_scaling: use_scaled_rope.then_some(RopeScaling::LLAMA3_1),
            max_context,
            tied_embeddings,
            variant: Variant::default(),
        };
        args.validate()?;
        Ok(args)
    }

    /// Checks the relations between sizes; every failure names the field.
    pub fn validate(&self) -> Result<(), ParamsError> {
        if self.dim == 0 {
            return Err(field_err("dim", "must be positive"));
        }
        if self.n_heads == 0
            || (self.variant.head_dim.is_none() && !self.dim.is_multiple_of(self.n_heads))
        {
            return Err(field_err(
                "n_heads",
                format!(
                    "must divide dim ({} is not divisible by {})",
                    self.dim, self.n_heads
                ),
            ));
        }
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(field_err(
                "n_kv_heads",
                format!(
                    "must divide n_heads ({} is not divisible by {})",
                    self.n_heads, self.n_kv_heads
                ),
            ));
        }
        if let Some(hd) = self.variant.head_dim {
            if hd == 0 || hd > MAX_DIM {
                return Err(field_err(
                    "head_dim",
                    format!("must be in 1..={MAX_DIM}, got {hd}"),
                ));
            }
        }
        if self.variant.sliding_window == Some(0) {
            return Err(field_err("sliding_window", "must be positive"));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(field_err(
                "n_heads",
                format!(
                    "gives an odd head_dim {} (RoPE rotates pairs)",
                    self.head_dim()
                ),
            ));
        }
        if self.ffn_hidden_dim == 0 || self.ffn_hidden_dim > MAX_FFN {
            return Err(field_err(
                "ffn_dim_multiplier",
                format!("gives an FFN hidden size of {}", self.ffn_hidden_dim),
            ));
        }
        if self.n_layers == 0 {
            return Err(field_err("n_layers", "must be positive"));
        }
        if let Some(0) = self.vocab_size {
            return Err(field_err("vocab_size", "must be positive"));
        }
        Ok(())
    }

    pub fn head_dim(&self) -> usize {
        self.variant.head_dim.unwrap_or(self.dim / self.n_heads)
    }

    /// The attention window of layer `i`, if it has one.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        let w = self.variant.sliding_window?;
        match self.variant.global_every {
            Some(n) if n > 0 && (i + 1).is_multiple_of(n) => None,
            _ => Some(w),
        }
    }

    /// The RoPE base and scaling of layer `i`: a windowed layer of a model
    /// with a local base uses that base, unscaled.
    pub fn layer_rope(&self, i: usize) -> (f64, Option<RopeScaling>) {
        match (self.layer_window(i), self.variant.local_rope_theta) {
            (Some(_), Some(t)) => (t, None),
            _ => (self.rope_theta, self.rope_scaling),
        }
    }

    /// Query heads per KV head.
    pub fn n_rep(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// The context to plan for: the request (default 2048), capped by the
    /// model's own limit where it has one.
    pub fn plan_context(&self, requested: Option<usize>) -> usize {
        let want = requested.unwrap_or(DEFAULT_CONTEXT);
        match self.max_context {
            Some(limit) => want.min(limit),
            None => want,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_ffn_sizes() {
        // Llama 3.1 8B: dim 4096, multiple_of 1024, multiplier 1.3.
        assert_eq!(ffn_hidden_dim(4096, 1024, Some(1.3)), 14336);
        // Llama 2 7B: dim 4096, multiple_of 256, no multiplier.
        assert_eq!(ffn_hidden_dim(4096, 256, None), 11008);
        // Llama 3.2 1B: dim 2048, multiple_of 256, multiplier 1.5.
        assert_eq!(ffn_hidden_dim(2048, 256, Some(1.5)), 8192);
    }

    #[test]
    fn defaults() {
        let a = ModelArgs::from_params_json(
            r#"{"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": -1, "norm_eps": 1e-5, "extra": [1]}"#,
        )
        .unwrap();
        assert_eq!(a.n_kv_heads, 4);
        assert_eq!(a.vocab_size, None);
        assert_eq!(a.rope_theta, 10000.0);
        assert_eq!(a.rope_scaling, None);
        assert_eq!(a.plan_context(None), 2048);
    }
}
