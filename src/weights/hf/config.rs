//! Hugging Face `config.json` of a `LlamaForCausalLM` model, resolved into
//! [`ModelArgs`].
//!
//! Both spellings of the RoPE settings are read: transformers 4 writes
//! `rope_theta` and `rope_scaling` (`{"rope_type" or "type": ...}`),
//! transformers 5 writes one `rope_parameters` object holding `rope_theta`
//! and the scaling keys. Supported rope types: `default` (none), `llama3`
//! (Llama 3.1/3.2) and `linear`. Anything the graph does not compute is
//! refused by name: another architecture, attention or MLP biases, an
//! activation other than SiLU, a `head_dim` other than
//! `hidden_size / num_attention_heads`, another rope type, quantized
//! checkpoints. `pretraining_tp` is ignored: transformers' slicing by it is
//! the same product computed in pieces.

use crate::ir::RopeScaling;
use crate::model::{Family, GateAct, ModelArgs, Variant};
use serde_json::{Map, Value};
use thiserror::Error;

/// Sizes beyond these are refused: they would only come from a corrupt or
/// hostile file (the same limits as params.json).
const MAX_DIM: u64 = 1 << 17;
const MAX_LAYERS: u64 = 1 << 12;
const MAX_HEADS: u64 = 1 << 12;
const MAX_VOCAB: u64 = 1 << 24;
const MAX_FFN: u64 = 1 << 20;
const MAX_CONTEXT: u64 = 1 << 24;

#[derive(Debug, Clone, PartialEq, Error)]
pub enum ConfigError {
    #[error("config.json is not valid JSON: {0}")]
    NotJson(String),
    #[error("config.json must be a JSON object")]
    NotObject,
    #[error("config.json: field `{field}` {message}")]
    Field { field: String, message: String },
    #[error("config.json: {0}")]
    Unsupported(String),
}

fn ferr(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field: field.to_string(),
        message: message.into(),
    }
}

/// What `config.json` says, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct HfConfig {
    pub args: ModelArgs,
    /// `bos_token_id`, where given.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id`: one id or a list (Llama 3.1 Instruct lists three).
    pub eos_token_ids: Vec<u32>,
}

fn uint(obj: &Map<String, Value>, field: &str, max: u64) -> Result<Option<u64>, ConfigError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            let n = v
                .as_u64()
                .ok_or_else(|| ferr(field, format!("must be a non-negative integer, got {v}")))?;
            if n == 0 {
                return Err(ferr(field, "must be positive"));
            }
            if n > max {
                return Err(ferr(
                    field,
                    format!("is {n}, larger than the supported {max}"),
                ));
            }
            Ok(Some(n))
        }
    }
}

fn req_uint(obj: &Map<String, Value>, field: &str, max: u64) -> Result<usize, ConfigError> {
    uint(obj, field, max)?
        .map(|n| n as usize)
        .ok_or_else(|| ferr(field, "is missing"))
}

fn float(obj: &Map<String, Value>, field: &str) -> Result<Option<f64>, ConfigError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            let x = v
                .as_f64()
                .ok_or_else(|| ferr(field, format!("must be a number, got {v}")))?;
            if !(x.is_finite() && x > 0.0) {
                return Err(ferr(field, format!("must be a positive number, got {x}")));
            }
            Ok(Some(x))
        }
    }
}

fn boolean(obj: &Map<String, Value>, field: &str) -> Result<Option<bool>, ConfigError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ferr(field, format!("must be true or false, got {v}"))),
    }
}

/// A token id or a list of them.
fn ids(obj: &Map<String, Value>, field: &str) -> Result<Vec<u32>, ConfigError> {
    let one = |v: &Value| -> Result<u32, ConfigError> {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| ferr(field, format!("holds {v}, not a token id")))
    };
    match obj.get(field) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

/// The architectures read, by `architectures` entry and `model_type`.
const FAMILIES: &[(&str, &str, Family)] = &[
    ("LlamaForCausalLM", "llama", Family::Llama),
    ("MistralForCausalLM", "mistral", Family::Mistral),
    ("Qwen2ForCausalLM", "qwen2", Family::Qwen2),
    ("Qwen3ForCausalLM", "qwen3", Family::Qwen3),
    ("Gemma3ForCausalLM", "gemma3_text", Family::Gemma3),
    ("Phi3ForCausalLM", "phi3", Family::Phi3),
];

/// The family of `architectures` (else `model_type`; Llama when neither is
/// given), refusing any other by name.
fn family_of(obj: &Map<String, Value>) -> Result<Family, ConfigError> {
    let supported = || FAMILIES.iter().map(|f| f.0).collect::<Vec<_>>().join(", ");
    let by_arch = match obj.get("architectures") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => {
            let names: Vec<&str> = a.iter().filter_map(Value::as_str).collect();
            match FAMILIES.iter().find(|f| names.contains(&f.0)) {
                Some(f) => Some(f),
                None => {
                    return Err(ConfigError::Unsupported(format!(
                        "architecture {names:?} is not supported; supported: {}",
                        supported()
                    )))
                }
            }
        }
        Some(v) => return Err(ferr("architectures", format!("must be a list, got {v}"))),
    };
    let by_type = match obj.get("model_type") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match FAMILIES.iter().find(|f| f.1 == s) {
            Some(f) => Some(f),
            None => {
                return Err(ConfigError::Unsupported(format!(
                    "model_type \"{s}\" is not supported; supported: {}",
                    FAMILIES.iter().map(|f| f.1).collect::<Vec<_>>().join(", ")
                )))
            }
        },
        Some(v) => return Err(ferr("model_type", format!("must be a string, got {v}"))),
    };
    match (by_arch, by_type) {
        (Some(a), Some(t)) if a.2 != t.2 => Err(ConfigError::Unsupported(format!(
            "architectures says {} but model_type says \"{}\"",
            a.0, t.1
        ))),
        (Some(f), _) | (None, Some(f)) => Ok(f.2),
        (None, None) => Ok(Family::Llama),
    }
}

/// Gemma 3's layer pattern: `layer_types` (transformers 5) must be
/// `sliding_attention` but for every `n`th layer, `full_attention`; else
/// `sliding_window_pattern` (default 6).
fn gemma_pattern(obj: &Map<String, Value>, n_layers: usize) -> Result<usize, ConfigError> {
    let Some(types) = obj.get("layer_types").filter(|v| !v.is_null()) else {
        return Ok(uint(obj, "sliding_window_pattern", MAX_LAYERS)?.unwrap_or(6) as usize);
    };
    let Value::Array(types) = types else {
        return Err(ferr("layer_types", "must be a list"));
    };
    if types.len() != n_layers {
        return Err(ferr(
            "layer_types",
            format!(
                "lists {} layers, not num_hidden_layers {n_layers}",
                types.len()
            ),
        ));
    }
    let full = |i: usize| types[i].as_str() == Some("full_attention");
    let n = (0..n_layers)
        .find(|&i| full(i))
        .map_or(n_layers + 1, |i| i + 1);
    for (i, t) in types.iter().enumerate() {
        let want = if (i + 1) % n == 0 {
            "full_attention"
        } else {
            "sliding_attention"
        };
        if t.as_str() != Some(want) {
            return Err(ConfigError::Unsupported(format!(
                "layer_types: layer {i} is {t}, not {want}; only a repeating pattern of sliding layers and one full layer is supported"
            )));
        }
    }
    Ok(n)
}

/// The rope theta and scaling (of the global layers), from either spelling,
/// and the local (sliding) layers' theta for Gemma 3: transformers 4's
/// `rope_local_base_freq`, or transformers 5's `rope_parameters` holding
/// one entry per layer type.
fn rope(
    obj: &Map<String, Value>,
    gemma: bool,
) -> Result<(f64, Option<RopeScaling>, f64), ConfigError> {
    if gemma {
        if let Some(Value::Object(p)) = obj.get("rope_parameters") {
            if let Some(full) = p.get("full_attention") {
                let mut g = obj.clone();
                g.insert("rope_parameters".into(), full.clone());
                let (theta, scaling) = rope_one(&g)?;
                let local = match p.get("sliding_attention") {
                    Some(l) => {
                        let mut g = obj.clone();
                        g.insert("rope_parameters".into(), l.clone());
                        let (t, s) = rope_one(&g)?;
                        if s.is_some() {
                            return Err(ConfigError::Unsupported(
                                "RoPE scaling on the sliding layers is not supported".into(),
                            ));
                        }
                        t
                    }
                    None => 10000.0,
                };
                return Ok((theta, scaling, local));
            }
        }
        let (theta, scaling) = rope_one(obj)?;
        let theta = if obj.get("rope_theta").is_none() && obj.get("rope_parameters").is_none() {
            1_000_000.0
        } else {
            theta
        };
        let local = float(obj, "rope_local_base_freq")?.unwrap_or(10000.0);
        return Ok((theta, scaling, local));
    }
    let (theta, scaling) = rope_one(obj)?;
    Ok((theta, scaling, theta))
}

/// The rope type, theta and scaling, from either spelling.
fn rope_one(obj: &Map<String, Value>) -> Result<(f64, Option<RopeScaling>), ConfigError> {
    // transformers 5: everything in `rope_parameters`.
    let (params, where_): (Option<&Map<String, Value>>, &str) = match obj.get("rope_parameters") {
        Some(Value::Object(p)) => (Some(p), "rope_parameters"),
        Some(Value::Null) | None => match obj.get("rope_scaling") {
            Some(Value::Object(p)) => (Some(p), "rope_scaling"),
            Some(Value::Null) | None => (None, "rope_scaling"),
            Some(v) => return Err(ferr("rope_scaling", format!("must be an object, got {v}"))),
        },
        Some(v) => {
            return Err(ferr(
                "rope_parameters",
                format!("must be an object, got {v}"),
            ))
        }
    };
    let theta = match params
        .map(|p| float(p, "rope_theta"))
        .transpose()?
        .flatten()
    {
        Some(t) => t,
        None => float(obj, "rope_theta")?.unwrap_or(10000.0),
    };
    let Some(p) = params else {
        return Ok((theta, None));
    };
    let kind = match (p.get("rope_type"), p.get("type")) {
        (Some(Value::String(s)), _) | (None, Some(Value::String(s))) => s.as_str(),
        (None, None) => "default",
        (Some(v), _) | (None, Some(v)) => {
            return Err(ferr(where_, format!("rope type must be a string, got {v}")))
        }
    };
    let field = |k: &str| format!("{where_}.{k}");
    let need = |k: &str| -> Result<f64, ConfigError> {
        float(p, k)
            .map_err(|e| match e {
                ConfigError::Field { message, .. } => ferr(&field(k), message),
                e => e,
            })?
            .ok_or_else(|| ferr(&field(k), "is missing"))
    };
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: need("factor")?,
        }),
        "llama3" => {
            let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
            if high <= low {
                return Err(ferr(
                    &field("high_freq_factor"),
                    format!("must be larger than low_freq_factor ({high} <= {low})"),
                ));
            }
            let orig = need("original_max_position_embeddings")?;
            if orig.fract() != 0.0 || orig > MAX_CONTEXT as f64 {
                return Err(ferr(
                    &field("original_max_position_embeddings"),
                    format!("must be an integer up to {MAX_CONTEXT}, got {orig}"),
                ));
            }
            Some(RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_context: orig as usize,
            })
        }
        other => {
            return Err(ConfigError::Unsupported(format!(
            "rope type `{other}` ({where_}) is not supported; supported: default, llama3, linear"
        )))
        }
    };
    Ok((theta, scaling))
}

impl HfConfig {
    /// Parses `config.json`. Unknown keys are ignored.
    pub fn parse(text: &str) -> Result<HfConfig, ConfigError> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| ConfigError::NotJson(e.to_string()))?;
        let Value::Object(obj) = &v else {
            return Err(ConfigError::NotObject);
        };
        let family = family_of(obj)?;
        if obj.get("quantization_config").is_some_and(|q| !q.is_null()) {
            return Err(ConfigError::Unsupported(
                "quantized checkpoints (quantization_config) are not supported; use F32, F16 or BF16 weights".into(),
            ));
        }
        // Qwen2's Q/K/V projections always have biases (its attention
        // module says `bias=True`); any other bias is refused.
        if boolean(obj, "attention_bias")? == Some(true) {
            return Err(ConfigError::Unsupported(format!(
                "`attention_bias: true` is not supported for {}: its layers have no attention biases",
                family.name()
            )));
        }
        if boolean(obj, "mlp_bias")? == Some(true) {
            return Err(ConfigError::Unsupported(
                "`mlp_bias: true` is not supported: the MLP has no biases".into(),
            ));
        }
        for refused in [
            "final_logit_softcapping",
            "attn_logit_softcapping",
            "num_experts",
            "num_local_experts",
        ] {
            if obj.get(refused).is_some_and(|v| !v.is_null()) {
                return Err(ConfigError::Unsupported(format!(
                    "`{refused}` is not supported (logit soft-capping and mixture-of-experts are not computed)"
                )));
            }
        }
        if let Some(f) = float(obj, "partial_rotary_factor")? {
            if f != 1.0 {
                return Err(ConfigError::Unsupported(format!(
                    "partial_rotary_factor {f} (partial rotary embeddings) is not supported"
                )));
            }
        }
        if boolean(obj, "use_sliding_window")? == Some(true) {
            return Err(ConfigError::Unsupported(
                "`use_sliding_window: true` (Qwen's windowed layers) is not supported".into(),
            ));
        }
        if boolean(obj, "use_bidirectional_attention")? == Some(true) {
            return Err(ConfigError::Unsupported(
                "`use_bidirectional_attention: true` is not supported: attention is causal".into(),
            ));
        }
        let gemma = family == Family::Gemma3;
        let act_field = if gemma {
            "hidden_activation"
        } else {
            "hidden_act"
        };
        let gate_act = match obj.get(act_field).or_else(|| obj.get("hidden_act")) {
            None | Some(Value::Null) if gemma => GateAct::GeluTanh,
            None | Some(Value::Null) => GateAct::Silu,
            Some(Value::String(s)) if s == "silu" => GateAct::Silu,
            Some(Value::String(s)) if s == "gelu_pytorch_tanh" => GateAct::GeluTanh,
            Some(v) => {
                return Err(ConfigError::Unsupported(format!(
                    "{act_field} {v} is not supported; \"silu\" (SwiGLU) and \"gelu_pytorch_tanh\" (GeGLU) are"
                )))
            }
        };
        let dim = req_uint(obj, "hidden_size", MAX_DIM)?;
        let ffn = req_uint(obj, "intermediate_size", MAX_FFN)?;
        let n_layers = req_uint(obj, "num_hidden_layers", MAX_LAYERS)?;
        let n_heads = req_uint(obj, "num_attention_heads", MAX_HEADS)?;
        let n_kv_heads = uint(obj, "num_key_value_heads", MAX_HEADS)?
            .map(|n| n as usize)
            .unwrap_or(n_heads);
        let vocab = req_uint(obj, "vocab_size", MAX_VOCAB)?;
        // Gemma3TextConfig's default head_dim is 256; the others derive it.
        let head_dim = match uint(obj, "head_dim", MAX_DIM)? {
            Some(hd) => hd as usize,
            None if gemma => 256,
            None => {
                if !dim.is_multiple_of(n_heads) {
                    return Err(ConfigError::Unsupported(format!(
                        "num_attention_heads {n_heads} does not divide hidden_size {dim}"
                    )));
                }
                dim / n_heads
            }
        };
        if gemma {
            let scalar = float(obj, "query_pre_attn_scalar")?.unwrap_or(256.0);
            if scalar != head_dim as f64 {
                return Err(ConfigError::Unsupported(format!(
                    "query_pre_attn_scalar {scalar} differs from head_dim {head_dim}; only the 1/sqrt(head_dim) attention scale is supported"
                )));
            }
        }
        // LlamaConfig's defaults (Gemma 3: 1e-6 too).
        let norm_eps = float(obj, "rms_norm_eps")?.unwrap_or(1e-6);
        let (rope_theta, rope_scaling, local_theta) = rope(obj, gemma)?;
        let max_context = uint(obj, "max_position_embeddings", MAX_CONTEXT)?
            .map(|n| n as usize)
            .unwrap_or(if gemma { 131072 } else { 2048 });
        let tied = boolean(obj, "tie_word_embeddings")?.unwrap_or(gemma);
        // The window, for the families whose transformers model applies it.
        let sliding_window = match family {
            Family::Mistral | Family::Phi3 => uint(obj, "sliding_window", MAX_CONTEXT)?,
            Family::Gemma3 => Some(uint(obj, "sliding_window", MAX_CONTEXT)?.unwrap_or(4096)),
            _ => None,
        }
        .map(|w| w as usize);
        let global_every = if gemma {
            Some(gemma_pattern(obj, n_layers)?)
        } else {
            None
        };
        let variant = Variant {
            family,
            head_dim: (head_dim * n_heads != dim).then_some(head_dim),
            qkv_bias: family == Family::Qwen2,
            qk_norm: matches!(family, Family::Qwen3 | Family::Gemma3),
            post_norms: gemma,
            embed_scale: gemma,
            gate_act,
            sliding_window,
            global_every,
            local_rope_theta: if gemma { Some(local_theta) } else { None },
        };
        let args = ModelArgs {
            dim,
            n_layers,
            n_heads,
            n_kv_heads,
            vocab_size: Some(vocab),
            multiple_of: 1,
            ffn_dim_multiplier: None,
            ffn_hidden_dim: ffn,
            norm_eps,
            rope_theta,
            rope_scaling,
            max_context: Some(max_context),
            tied_embeddings: tied,
            variant,
        };
        args.validate().map_err(|e| {
            // ModelArgs names Meta's fields; say the config.json ones.
            let msg = e.to_string();
            ConfigError::Unsupported(
                msg.replace("params.json: field `n_heads`", "num_attention_heads")
                    .replace("params.json: field `n_kv_heads`", "num_key_value_heads")
                    .replace("params.json: field ", ""),
            )
        })?;
        let bos = ids(obj, "bos_token_id")?;
        if bos.len() > 1 {
            return Err(ferr("bos_token_id", "must be a single id"));
        }
        let eos = ids(obj, "eos_token_id")?;
        for &id in bos.iter().chain(&eos) {
            if id as usize >= vocab {
                return Err(ConfigError::Unsupported(format!(
                    "token id {id} (bos/eos_token_id) is outside the vocabulary of {vocab}"
                )));
            }
        }
        Ok(HfConfig {
            args,
            bos_token_id: bos.first().copied(),
            eos_token_ids: eos,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#""architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 320"#;

    fn parse(extra: &str) -> Result<HfConfig, ConfigError> {
        HfConfig::parse(&format!("{{{BASE}{extra}}}"))
    }

    #[test]
    fn defaults_and_both_rope_spellings() {
        let c = parse("").unwrap();
        assert_eq!(c.args.rope_theta, 10000.0);
        assert_eq!(c.args.norm_eps, 1e-6);
        assert_eq!(c.args.max_context, Some(2048));
        assert_eq!(c.args.ffn_hidden_dim, 192);
        assert!(!c.args.tied_embeddings);
        let v4 = parse(r#", "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#).unwrap();
        let v5 = parse(r#", "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#).unwrap();
        assert_eq!(v4.args, v5.args);
        assert_eq!(
            v4.args.rope_scaling,
            Some(RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_context: 8192
            })
        );
        let lin = parse(r#", "rope_scaling": {"type": "linear", "factor": 4.0}"#).unwrap();
        assert_eq!(
            lin.args.rope_scaling,
            Some(RopeScaling::Linear { factor: 4.0 })
        );
        let eos = parse(r#", "eos_token_id": [2, 3], "bos_token_id": 1"#).unwrap();
        assert_eq!(eos.eos_token_ids, vec![2, 3]);
        assert_eq!(eos.bos_token_id, Some(1));
    }

    #[test]
    fn refusals_name_the_problem() {
        let cases = [
            (r#", "attention_bias": true"#, "attention_bias"),
            (r#", "mlp_bias": true"#, "mlp_bias"),
            (r#", "hidden_act": "gelu""#, "hidden_act"),
            (
                r#", "final_logit_softcapping": 30.0"#,
                "final_logit_softcapping",
            ),
            (r#", "num_local_experts": 8"#, "num_local_experts"),
            (r#", "partial_rotary_factor": 0.5"#, "partial_rotary_factor"),
            (
                r#", "rope_scaling": {"type": "yarn", "factor": 4.0}"#,
                "rope type `yarn`",
            ),
            (
                r#", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}"#,
                "`dynamic`",
            ),
            (
                r#", "rope_scaling": {"rope_type": "linear"}"#,
                "rope_scaling.factor",
            ),
            (
                r#", "quantization_config": {"quant_method": "gptq"}"#,
                "quantized",
            ),
            (r#", "eos_token_id": 999"#, "outside the vocabulary"),
        ];
        for (extra, want) in cases {
            let e = parse(extra).unwrap_err().to_string();
            assert!(e.contains(want), "{extra}: {e}");
        }
        let e = HfConfig::parse(r#"{"architectures": ["MixtralForCausalLM"]}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("MixtralForCausalLM"), "{e}");
        let e = HfConfig::parse(r#"{"architectures": ["LlamaForCausalLM"]}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("hidden_size` is missing"), "{e}");
        let e = parse(r#", "num_key_value_heads": 3"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
    }
}
