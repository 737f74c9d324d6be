//! Opening a GGUF file: its metadata to model arguments (with the graph
//! variant of its architecture), its tensors and its tokenizer.

use super::{LoadError, Model, ModelFormat};
use crate::model::ModelArgs;
use crate::tokenizer::gguf::GgufTokenizerParts;
use crate::tokenizer::Tokenizer;
use crate::weights::gguf::LlamaGguf;
use std::path::Path;

/// The graph variant of a GGUF's architecture (llama.cpp's `llm_build_*` for
/// it): Qwen2's Q/K/V biases, the Q/K norm of Qwen3 and Gemma 3, Gemma 3's
/// embedding scale, post-norms, GELU-tanh gate and local layers (a window on
/// five of every six layers, RoPE base 10000 there: llama.cpp's
/// `set_swa_pattern(6)` and `rope_freq_base_train_swa`), and the sliding
/// window the file states.
fn gguf_variant(
    m: &crate::weights::gguf::LlamaGgufMeta,
    has_qkv_bias: bool,
    has_qk_norm: bool,
) -> crate::model::Variant {
    use crate::model::{Family, GateAct, Variant};
    let mut v = Variant {
        family: m.family,
        head_dim: (m.head_dim * m.n_heads != m.dim).then_some(m.head_dim),
        qkv_bias: has_qkv_bias,
        qk_norm: has_qk_norm,
        sliding_window: m.sliding_window,
        ..Variant::default()
    };
    if m.family == Family::Llama && m.sliding_window.is_some() {
        v.family = Family::Mistral;
    }
    if m.family == Family::Gemma3 {
        v.post_norms = true;
        v.embed_scale = true;
        v.gate_act = GateAct::GeluTanh;
        if m.sliding_window.is_some() {
            v.global_every = Some(m.swa_pattern.unwrap_or(6));
            v.local_rope_theta = Some(shortest_f64(m.rope_freq_base_swa.unwrap_or(10000.0)));
        }
    }
    v
}

impl Model {
    /// Opens a GGUF file (llama architecture).
    pub fn open_gguf(path: &Path) -> Result<Model, LoadError> {
        Model::open_gguf_file(path)
    }

    fn open_gguf_file(path: &Path) -> Result<Model, LoadError> {
        let gerr = |source| LoadError::Gguf {
            path: path.display().to_string(),
            source,
        };
        let g = LlamaGguf::open(path).map_err(gerr)?;
        let m = &g.meta;
        let perr = |message: String| LoadError::Path {
            path: path.display().to_string(),
            message,
        };
        if m.rope_dim != m.head_dim {
            return Err(perr(format!(
                "partial rotary embeddings (RoPE over {} of {} dims) are not supported",
                m.rope_dim, m.head_dim
            )));
        }
        if m.head_dim * m.n_heads != m.dim && m.family == crate::model::Family::Llama {
            return Err(perr(format!(
                "unsupported geometry: head_dim {} x {} heads != dim {}",
                m.head_dim, m.n_heads, m.dim
            )));
        }
        let has = |suffix: &str| g.store.tensors.contains_key(&format!("layers.0.{suffix}"));
        if g.store
            .tensors
            .keys()
            .any(|k| k.starts_with("rope_factors"))
        {
            return Err(perr(
                "per-frequency RoPE factors (rope_factors_long/short: Phi-3 LongRoPE) are not supported"
                    .into(),
            ));
        }
        let rope_scaling = match (&m.rope_scaling, m.has_rope_freqs) {
            (None, false) => None,
            // llama.cpp stores Llama 3.1's per-frequency factors in
            // `rope_freqs.weight`; they come from the same formula.
            (None, true) => {
                let factors = g
                    .store
                    .tensors
                    .get("rope_freqs.weight")
                    .filter(|t| t.dtype == crate::ir::DType::F32)
                    .map(|t| {
                        t.data
                            .as_bytes()
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            .collect::<Vec<f32>>()
                    })
                    .unwrap_or_default();
                let s = crate::weights::gguf::llama::llama3_scaling_from_rope_freqs(
                    &factors,
                    m.head_dim,
                    m.rope_theta,
                )
                .ok_or_else(|| {
                    perr(
                        "rope_freqs.weight holds per-frequency RoPE factors that are not \
                         Llama 3.x scaling (low 1, high 4, original context 8192); not supported"
                            .into(),
                    )
                })?;
                Some(s)
            }
            (Some(s), false) if s.kind == "linear" => match s.factor {
                Some(f) if f.is_finite() && f > 0.0 => Some(crate::ir::RopeScaling::Linear {
                    factor: f64::from(f),
                }),
                _ => {
                    return Err(perr(
                        "RoPE scaling type `linear` needs a positive llama.rope.scaling.factor"
                            .into(),
                    ))
                }
            },
            (Some(s), _) => {
                return Err(perr(format!(
                    "RoPE scaling type `{}` is not supported",
                    s.kind
                )))
            }
        };
        let args = ModelArgs {
            dim: m.dim,
            n_layers: m.n_layers,
            n_heads: m.n_heads,
            n_kv_heads: m.n_kv_heads,
            vocab_size: Some(m.vocab_size),
            multiple_of: 1,
            ffn_dim_multiplier: None,
            ffn_hidden_dim: m.ffn_dim,
            // The f32 in the file, as its shortest decimal (1e-5, not
            // 9.99999974738e-6): the same f32 value, and the same graph as
            // the checkpoint the file was converted from.
            norm_eps: shortest_f64(m.norm_eps),
            rope_theta: shortest_f64(m.rope_theta),
            rope_scaling,
            max_context: Some(m.context_length).filter(|&c| c > 0),
            tied_embeddings: g.tied_output,
            variant: gguf_variant(m, has("attention.wq.bias"), has("attention.q_norm.weight")),
        };
        args.validate().map_err(|e| perr(e.to_string()))?;
        let t = &g.tokenizer;
        let tokenizer = if t.tokens.is_empty() {
            None
        } else {
            let parts = GgufTokenizerParts::from(t);
            Some(
                Tokenizer::from_gguf_parts(parts).map_err(|source| LoadError::Tokenizer {
                    path: path.display().to_string(),
                    source,
                })?,
            )
        };
        // The metadata (vocabulary, merges, template) now lives in owned
        // values; its file pages need not stay resident.
        g.file.release_header_pages();
        Ok(Model {
            path: path.to_path_buf(),
            format: ModelFormat::Gguf,
            args,
            chat_template: g.tokenizer.chat_template.clone(),
            name: g.meta.name.clone(),
            file_type: g.meta.file_type.map(|t| {
                format!(
                    "{} (general.file_type {t})",
                    crate::weights::gguf::file_type_name(t)
                )
            }),
            weights: g.store,
            tokenizer,
        })
    }
}

/// An f32 read from a file as the f64 its shortest decimal spells.
fn shortest_f64(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}
