//! Llama-specific views of a GGUF file: hyper-parameters, tokenizer arrays, and the
//! mapping of GGUF tensor names to Meta checkpoint names.
//!
//! # Q/K row order
//!
//! Meta's reference Llama applies RoPE to *adjacent* pairs `(x[2i], x[2i+1])` of each head
//! (complex multiplication on `view_as_complex`). Hugging Face's conversion script
//! (`convert_llama_weights_to_hf.py`, `permute(w) = w.view(n_heads, dim1 // n_heads // 2, 2,
//! dim2).transpose(1, 2)`) reorders the rows of `wq`/`wk` so that HF can use the
//! "rotate-half" form (pairs `(x[i], x[i + d/2])`). llama.cpp's `convert_hf_to_gguf.py`
//! (`LlamaModel.permute`: `reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)`,
//! applied to `q_proj` with `n_head` and to `k_proj` with `n_head_kv`) is exactly the inverse
//! of that, so `attn_q`/`attn_k` in a llama GGUF are back in Meta's interleaved order, and
//! llama.cpp evaluates `LLM_ARCH_LLAMA` with `LLAMA_ROPE_TYPE_NORM` ("a normal RoPE, operating
//! on pairs of consecutive head values"). Hence the mapping below does **not** permute any
//! rows: GGUF `blk.N.attn_q.weight` is Meta `layers.N.attention.wq.weight` as is.

use super::{GgufArray, GgufError, GgufFile, GgufValue};
use crate::weights::WeightStore;

/// Hyper-parameters from the `<arch>.*` metadata keys (`llama.*`,
/// `qwen2.*`, ...); the fields name the `llama.*` spelling.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaGgufMeta {
    /// `general.architecture`: `llama`, `qwen2`, `qwen3`, `gemma3` or `phi3`.
    pub architecture: String,
    /// The family that architecture is.
    pub family: crate::model::Family,
    /// `<arch>.attention.sliding_window`, where present and not 0.
    pub sliding_window: Option<usize>,
    /// `<arch>.attention.sliding_window_pattern` (an integer `n`: every
    /// `n`th layer global), where present.
    pub swa_pattern: Option<usize>,
    /// `<arch>.rope.freq_base_swa`: the windowed layers' RoPE base, where
    /// present.
    pub rope_freq_base_swa: Option<f32>,
    /// `general.name`, if present.
    pub name: Option<String>,
    /// `general.file_type` (llama.cpp's `llama_ftype`: the file's main
    /// quantization), if present; see [`file_type_name`].
    pub file_type: Option<u32>,
    /// `llama.embedding_length`.
    pub dim: usize,
    /// `llama.block_count`.
    pub n_layers: usize,
    /// `llama.attention.head_count`.
    pub n_heads: usize,
    /// `llama.attention.head_count_kv` (defaults to `n_heads`).
    pub n_kv_heads: usize,
    /// `llama.feed_forward_length` (hidden size of the SwiGLU MLP).
    pub ffn_dim: usize,
    /// `llama.attention.key_length` if present, else `dim / n_heads`.
    pub head_dim: usize,
    /// `llama.rope.freq_base` (default 10000).
    pub rope_theta: f32,
    /// `llama.rope.dimension_count` (defaults to `head_dim`).
    pub rope_dim: usize,
    /// `llama.attention.layer_norm_rms_epsilon`.
    pub norm_eps: f32,
    /// `llama.context_length`.
    pub context_length: usize,
    /// `llama.vocab_size`, or the length of `tokenizer.ggml.tokens`.
    pub vocab_size: usize,
    /// Rope scaling keys, if `llama.rope.scaling.type` is present and not `"none"`.
    pub rope_scaling: Option<RopeScaling>,
    /// True when the file has a `rope_freqs.weight` tensor: llama.cpp's way of storing
    /// Llama-3.1-style per-frequency rope factors (divide each frequency by the factor).
    pub has_rope_freqs: bool,
}

/// llama.cpp's name for a `general.file_type` value (`llama_ftype` in llama.h).
pub fn file_type_name(ftype: u32) -> &'static str {
    match ftype {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        19 => "IQ2_XXS",
        20 => "IQ2_XS",
        21 => "Q2_K_S",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        24 => "IQ1_S",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        28 => "IQ2_S",
        29 => "IQ2_M",
        30 => "IQ4_XS",
        31 => "IQ1_M",
        32 => "BF16",
        36 => "TQ1_0",
        37 => "TQ2_0",
        38 => "MXFP4_MOE",
        39 => "NVFP4",
        40 => "Q1_0",
        41 => "Q2_0",
        _ => "unknown",
    }
}

/// `llama.rope.scaling.*` keys.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeScaling {
    /// `llama.rope.scaling.type`: "linear", "yarn", ... .
    pub kind: String,
    /// `llama.rope.scaling.factor` (or 1/`llama.rope.scale_linear` in old files).
    pub factor: Option<f32>,
    /// `llama.rope.scaling.original_context_length`.
    pub original_context_length: Option<usize>,
    /// `llama.rope.scaling.attn_factor`.
    pub attn_factor: Option<f32>,
    /// `llama.rope.scaling.finetuned`.
    pub finetuned: Option<bool>,
}

/// The raw tokenizer arrays and ids of a GGUF file (`tokenizer.*` keys), type-checked.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TokenizerParts {
    /// `tokenizer.ggml.model`: "llama" (SentencePiece), "gpt2" (byte-level BPE), ...
    pub model: String,
    /// `tokenizer.ggml.pre`: pre-tokenizer name ("llama-bpe", "smollm", ...).
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// Same length as `tokens` when present.
    pub scores: Option<Vec<f32>>,
    /// Same length as `tokens` when present (llama.cpp token attributes: 1 normal,
    /// 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
    pub token_type: Option<Vec<i32>>,
    pub merges: Option<Vec<String>>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub eot_token_id: Option<u32>,
    pub unknown_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix` (SentencePiece-style vocabularies;
    /// false for Gemma).
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.chat_template` (Jinja source).
    pub chat_template: Option<String>,
}

fn bad(key: &str, msg: impl Into<String>) -> GgufError {
    GgufError::BadValue {
        key: key.to_string(),
        msg: msg.into(),
    }
}

/// The GGUF architectures this crate runs, and their families.
pub const ARCHITECTURES: &[(&str, crate::model::Family)] = &[
    ("llama", crate::model::Family::Llama),
    ("qwen2", crate::model::Family::Qwen2),
    ("qwen3", crate::model::Family::Qwen3),
    ("gemma3", crate::model::Family::Gemma3),
    ("phi3", crate::model::Family::Phi3),
];

/// Checks `general.architecture` is one of [`ARCHITECTURES`].
pub fn check_llama_architecture(f: &GgufFile) -> Result<String, GgufError> {
    let arch = f.get_str("general.architecture")?;
    if !ARCHITECTURES.iter().any(|(a, _)| *a == arch) {
        return Err(GgufError::UnsupportedArchitecture(arch.to_string()));
    }
    Ok(arch.to_string())
}

impl LlamaGgufMeta {
    pub fn from_file(f: &GgufFile) -> Result<LlamaGgufMeta, GgufError> {
        let architecture = check_llama_architecture(f)?;
        let family = ARCHITECTURES
            .iter()
            .find(|(a, _)| *a == architecture)
            .map(|&(_, fam)| fam)
            .unwrap_or_default();
        // Every hyper-parameter key is `<arch>.<name>`.
        let key = |name: &str| format!("{architecture}.{name}");
        for refused in ["final_logit_softcapping", "attn_logit_softcapping"] {
            if f.get(&key(refused)).is_some() {
                return Err(bad(&key(refused), "logit soft-capping is not supported"));
            }
        }
        if f.get(&key("expert_count")).is_some() {
            return Err(bad(
                &key("expert_count"),
                "mixture-of-experts models are not supported",
            ));
        }
        let positive = |key: &str| -> Result<usize, GgufError> {
            let v = f.get_usize(key)?;
            if v == 0 {
                return Err(bad(key, "must be positive"));
            }
            Ok(v)
        };
        let dim = positive(&key("embedding_length"))?;
        let n_layers = positive(&key("block_count"))?;
        let n_heads = positive(&key("attention.head_count"))?;
        let n_kv_heads = match f.opt(&key("attention.head_count_kv"), GgufFile::get_usize)? {
            Some(0) => return Err(bad(&key("attention.head_count_kv"), "must be positive")),
            Some(v) => v,
            None => n_heads,
        };
        if n_heads % n_kv_heads != 0 {
            return Err(bad(
                &key("attention.head_count_kv"),
                format!("{n_kv_heads} does not divide head_count {n_heads}"),
            ));
        }
        let ffn_dim = positive(&key("feed_forward_length"))?;
        let head_dim = match f.opt(&key("attention.key_length"), GgufFile::get_usize)? {
            Some(v) if v > 0 => v,
            Some(_) => return Err(bad(&key("attention.key_length"), "must be positive")),
            None => {
                if dim % n_heads != 0 {
                    return Err(bad(
                        &key("attention.head_count"),
                        format!("{n_heads} does not divide embedding_length {dim}"),
                    ));
                }
                dim / n_heads
            }
        };
        let rope_theta = f
            .opt(&key("rope.freq_base"), GgufFile::get_f32)?
            .unwrap_or(10000.0);
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return Err(bad(
                &key("rope.freq_base"),
                format!("{rope_theta} is not a positive number"),
            ));
        }
        let rope_dim = f
            .opt(&key("rope.dimension_count"), GgufFile::get_usize)?
            .unwrap_or(head_dim);
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(bad(
                &key("rope.dimension_count"),
                format!("{rope_dim} must be even and at most head_dim {head_dim}"),
            ));
        }
        let norm_eps = f.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        if !(norm_eps.is_finite() && norm_eps >= 0.0) {
            return Err(bad(
                &key("attention.layer_norm_rms_epsilon"),
                format!("{norm_eps} is invalid"),
            ));
        }
        let context_length = positive(&key("context_length"))?;
        let vocab_size = match f.opt(&key("vocab_size"), GgufFile::get_usize)? {
            Some(v) => v,
            None => match f.get("tokenizer.ggml.tokens") {
                Some(GgufValue::Array(a)) => a.len(),
                Some(v) => {
                    return Err(GgufError::WrongType {
                        key: "tokenizer.ggml.tokens".into(),
                        expected: "array<string>",
                        found: v.type_name(),
                    })
                }
                None => {
                    return Err(GgufError::MissingKey(format!(
                        "{} (or tokenizer.ggml.tokens)",
                        key("vocab_size")
                    )))
                }
            },
        };
        if vocab_size == 0 {
            return Err(bad(&key("vocab_size"), "vocabulary is empty"));
        }
        let rope_scaling = match f.opt(&key("rope.scaling.type"), GgufFile::get_str)? {
            None | Some("none") => {
                // Old files: llama.rope.scale_linear = factor.
                match f.opt(&key("rope.scale_linear"), GgufFile::get_f32)? {
                    Some(s) if s != 1.0 => Some(RopeScaling {
                        kind: "linear".into(),
                        factor: Some(s),
                        original_context_length: None,
                        attn_factor: None,
                        finetuned: None,
                    }),
                    _ => None,
                }
            }
            Some(kind) => Some(RopeScaling {
                kind: kind.to_string(),
                factor: f.opt(&key("rope.scaling.factor"), GgufFile::get_f32)?,
                original_context_length: f.opt(
                    &key("rope.scaling.original_context_length"),
                    GgufFile::get_usize,
                )?,
                attn_factor: f.opt(&key("rope.scaling.attn_factor"), GgufFile::get_f32)?,
                finetuned: f.opt(&key("rope.scaling.finetuned"), GgufFile::get_bool)?,
            }),
        };
        let sliding_window = f
            .opt(&key("attention.sliding_window"), GgufFile::get_usize)?
            .filter(|&w| w > 0);
        let swa_pattern = match f.get(&key("attention.sliding_window_pattern")) {
            None => None,
            Some(GgufValue::Array(_)) => {
                return Err(bad(
                    &key("attention.sliding_window_pattern"),
                    "a per-layer list is not supported (only an integer pattern)",
                ))
            }
            Some(_) => Some(f.get_usize(&key("attention.sliding_window_pattern"))?),
        };
        let rope_freq_base_swa = f.opt(&key("rope.freq_base_swa"), GgufFile::get_f32)?;
        Ok(LlamaGgufMeta {
            family,
            sliding_window,
            swa_pattern,
            rope_freq_base_swa,
            architecture,
            name: f
                .opt("general.name", GgufFile::get_str)?
                .map(str::to_string),
            file_type: f.opt("general.file_type", GgufFile::get_u32)?,
            dim,
            n_layers,
            n_heads,
            n_kv_heads,
            ffn_dim,
            head_dim,
            rope_theta,
            rope_dim,
            norm_eps,
            context_length,
            vocab_size,
            rope_scaling,
            has_rope_freqs: f.tensors.contains_key("rope_freqs.weight"),
        })
    }
}

impl TokenizerParts {
    pub fn from_file(f: &GgufFile) -> Result<TokenizerParts, GgufError> {
        let model = f.get_str("tokenizer.ggml.model")?.to_string();
        let tokens = f.get_str_array("tokenizer.ggml.tokens")?.to_vec();
        let n = tokens.len();
        let scores = f
            .opt("tokenizer.ggml.scores", GgufFile::get_f32_array)?
            .map(<[f32]>::to_vec);
        if let Some(s) = &scores {
            if s.len() != n {
                return Err(bad(
                    "tokenizer.ggml.scores",
                    format!("{} scores for {n} tokens", s.len()),
                ));
            }
        }
        let token_type = match f.get("tokenizer.ggml.token_type") {
            None => None,
            Some(GgufValue::Array(GgufArray::I32(v))) => Some(v.clone()),
            Some(v) => {
                return Err(GgufError::WrongType {
                    key: "tokenizer.ggml.token_type".into(),
                    expected: "array<i32>",
                    found: v.type_name(),
                })
            }
        };
        if let Some(t) = &token_type {
            if t.len() != n {
                return Err(bad(
                    "tokenizer.ggml.token_type",
                    format!("{} types for {n} tokens", t.len()),
                ));
            }
        }
        let merges = f
            .opt("tokenizer.ggml.merges", GgufFile::get_str_array)?
            .map(<[String]>::to_vec);
        let id = |key: &str| -> Result<Option<u32>, GgufError> {
            let v = f.opt(key, GgufFile::get_u32)?;
            if let Some(id) = v {
                if id as usize >= n {
                    return Err(bad(
                        key,
                        format!("token id {id} is outside the vocabulary of {n} tokens"),
                    ));
                }
            }
            Ok(v)
        };
        Ok(TokenizerParts {
            model,
            pre: f
                .opt("tokenizer.ggml.pre", GgufFile::get_str)?
                .map(str::to_string),
            bos_token_id: id("tokenizer.ggml.bos_token_id")?,
            eos_token_id: id("tokenizer.ggml.eos_token_id")?,
            eot_token_id: id("tokenizer.ggml.eot_token_id")?,
            unknown_token_id: id("tokenizer.ggml.unknown_token_id")?,
            padding_token_id: id("tokenizer.ggml.padding_token_id")?,
            add_bos_token: f.opt("tokenizer.ggml.add_bos_token", GgufFile::get_bool)?,
            add_eos_token: f.opt("tokenizer.ggml.add_eos_token", GgufFile::get_bool)?,
            add_space_prefix: f.opt("tokenizer.ggml.add_space_prefix", GgufFile::get_bool)?,
            chat_template: f
                .opt("tokenizer.chat_template", GgufFile::get_str)?
                .map(str::to_string),
            tokens,
            scores,
            token_type,
            merges,
        })
    }
}

/// The Llama 3 RoPE scaling whose per-frequency factors are `factors`, the
/// values of a `rope_freqs.weight` tensor: llama.cpp's converter writes, for
/// each frequency, the number it is divided by (`generate_extra_tensors` in
/// `convert_hf_to_gguf.py`). The file does not store the parameters, so the
/// ones every Llama 3.x release uses (low 1, high 4, original context 8192)
/// are assumed with the largest factor (8 for Llama 3.1, 32 for 3.2), and
/// accepted only if they reproduce every factor; `None` otherwise.
pub fn llama3_scaling_from_rope_freqs(
    factors: &[f32],
    head_dim: usize,
    theta: f32,
) -> Option<crate::ir::RopeScaling> {
    if factors.len() != head_dim / 2 || factors.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
        return None;
    }
    let max = factors.iter().copied().fold(1.0f32, f32::max);
    let ir = crate::ir::RopeScaling::Llama3 {
        factor: f64::from(max),
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 8192,
    };
    let k = crate::kernels::RopeScaling::from(ir);
    let ok = factors.iter().enumerate().all(|(i, &want)| {
        let f = crate::kernels::elementwise::rope::rope_freq(i, head_dim, theta, None);
        let got = f / k.apply(f);
        (got - want).abs() <= 1e-4 * want
    });
    ok.then_some(ir)
}

/// The name a fused QKV matrix (Phi-3's `attn_qkv`) has until the loader
/// splits it into `wq`, `wk`, `wv`.
pub const FUSED_QKV: &str = "attention.qkv_fused.weight";

/// Maps a GGUF (llama.cpp) tensor name to the Meta checkpoint name our graph uses.
/// Names it does not know are returned unchanged.
pub fn gguf_to_meta_name(name: &str) -> String {
    match name {
        "token_embd.weight" => return "tok_embeddings.weight".into(),
        "output_norm.weight" => return "norm.weight".into(),
        "output.weight" => return "output.weight".into(),
        _ => {}
    }
    if let Some(rest) = name.strip_prefix("blk.") {
        if let Some((layer, suffix)) = rest.split_once('.') {
            if !layer.is_empty() && layer.bytes().all(|b| b.is_ascii_digit()) {
                let meta = match suffix {
                    "attn_norm.weight" => Some("attention_norm.weight"),
                    "attn_q.bias" => Some("attention.wq.bias"),
                    "attn_k.bias" => Some("attention.wk.bias"),
                    "attn_v.bias" => Some("attention.wv.bias"),
                    "attn_q_norm.weight" => Some("attention.q_norm.weight"),
                    "attn_k_norm.weight" => Some("attention.k_norm.weight"),
                    "post_attention_norm.weight" => Some("post_attention_norm.weight"),
                    "post_ffw_norm.weight" => Some("post_ffn_norm.weight"),
                    // Phi-3's fused QKV, split at load (LlamaGguf::from_file).
                    "attn_qkv.weight" => Some(FUSED_QKV),
                    "attn_q.weight" => Some("attention.wq.weight"),
                    "attn_k.weight" => Some("attention.wk.weight"),
                    "attn_v.weight" => Some("attention.wv.weight"),
                    "attn_output.weight" => Some("attention.wo.weight"),
                    "ffn_norm.weight" => Some("ffn_norm.weight"),
                    "ffn_gate.weight" => Some("feed_forward.w1.weight"),
                    "ffn_down.weight" => Some("feed_forward.w2.weight"),
                    "ffn_up.weight" => Some("feed_forward.w3.weight"),
                    _ => None,
                };
                if let Some(m) = meta {
                    return format!("layers.{layer}.{m}");
                }
            }
        }
    }
    name.to_string()
}

/// A Llama GGUF model: hyper-parameters, tokenizer parts, and weights under Meta names.
/// Construction does not check tensor shapes; call [`LlamaGguf::validate`] for that.
#[derive(Debug, Clone)]
pub struct LlamaGguf {
    pub meta: LlamaGgufMeta,
    pub tokenizer: TokenizerParts,
    /// Tensors under Meta names (see [`gguf_to_meta_name`]); unknown names kept as-is.
    pub store: WeightStore,
    /// True when the file has no `output.weight`: the output projection is tied to
    /// `tok_embeddings.weight` (which is then *not* duplicated in `store`).
    pub tied_output: bool,
    /// GGUF version and the full metadata remain available here.
    pub file: GgufFile,
}

impl LlamaGguf {
    pub fn open(path: impl AsRef<std::path::Path>) -> Result<LlamaGguf, GgufError> {
        Self::from_file(GgufFile::open(path)?)
    }

    /// Checks that every tensor of the `n_layers` blocks, the embedding and the final norm
    /// are present with the shapes the hyper-parameters imply (PyTorch order);
    /// `output.weight` is optional (tied). Errors name the GGUF and the Meta tensor name.
    pub fn validate(&self) -> Result<(), GgufError> {
        check_shapes(&self.meta, &self.file)
    }

    pub fn from_file(file: GgufFile) -> Result<LlamaGguf, GgufError> {
        let meta = LlamaGgufMeta::from_file(&file)?;
        let tokenizer = TokenizerParts::from_file(&file)?;
        let mut store = WeightStore::default();
        for (name, t) in file.to_store().tensors {
            let meta_name = gguf_to_meta_name(&name);
            if store.tensors.insert(meta_name.clone(), t).is_some() {
                // Only possible if a file has both a GGUF name and the Meta name it maps to.
                return Err(GgufError::DuplicateTensor(meta_name));
            }
        }
        let tied_output = !file.tensors.contains_key("output.weight");
        family_layout(&meta, &mut store)?;
        Ok(LlamaGguf {
            meta,
            tokenizer,
            store,
            tied_output,
            file,
        })
    }
}

/// Puts a family's tensors in the layout the graph reads: Phi-3's fused
/// `attn_qkv` split into `wq`, `wk`, `wv` and its fused `ffn_up` (gate rows
/// first) into `w1`, `w3` (row ranges: views of the map); and for the
/// architectures llama.cpp runs with NEOX RoPE (rotate-half pairs), the Q/K
/// rows, Q/K biases and Q/K norm weights of each head back in Meta's
/// interleaved order (owned copies; see the module docs).
fn family_layout(m: &LlamaGgufMeta, store: &mut WeightStore) -> Result<(), GgufError> {
    use crate::model::Family;
    let terr = |name: &str, msg: String| bad(name, msg);
    let hd = m.head_dim;
    let (q, kv) = (m.n_heads * hd, m.n_kv_heads * hd);
    if m.family != Family::Phi3 && !m.family.gguf_neox_rows() {
        return Ok(());
    }
    for i in 0..m.n_layers {
        let p = format!("layers.{i}");
        // The layers the file has (`block_count` comes from the file: a
        // huge one must cost nothing; validation names the missing tensor).
        if !store
            .tensors
            .contains_key(&format!("{p}.attention_norm.weight"))
        {
            break;
        }
        if m.family == Family::Phi3 {
            let fused = format!("{p}.{FUSED_QKV}");
            if let Some(t) = store.tensors.remove(&fused) {
                for (name, r0, r1) in [("wq", 0, q), ("wk", q, q + kv), ("wv", q + kv, q + 2 * kv)]
                {
                    let part = t.rows(r0, r1).map_err(|e| terr(&fused, e))?;
                    store
                        .tensors
                        .insert(format!("{p}.attention.{name}.weight"), part);
                }
            }
            let gate = format!("{p}.feed_forward.w1.weight");
            let up = format!("{p}.feed_forward.w3.weight");
            if !store.tensors.contains_key(&gate) {
                if let Some(t) = store.tensors.remove(&up) {
                    let ff = m.ffn_dim;
                    store
                        .tensors
                        .insert(gate.clone(), t.rows(0, ff).map_err(|e| terr(&up, e))?);
                    store
                        .tensors
                        .insert(up.clone(), t.rows(ff, 2 * ff).map_err(|e| terr(&up, e))?);
                }
            }
        }
        if !m.family.gguf_neox_rows() {
            continue;
        }
        for (name, heads) in [
            ("attention.wq.weight", m.n_heads),
            ("attention.wk.weight", m.n_kv_heads),
            ("attention.wq.bias", m.n_heads),
            ("attention.wk.bias", m.n_kv_heads),
            ("attention.q_norm.weight", 1),
            ("attention.k_norm.weight", 1),
        ] {
            let name = format!("{p}.{name}");
            let Some(t) = store.tensors.get(&name) else {
                continue;
            };
            let permuted =
                crate::weights::hf::hf_to_meta_any(t, heads).map_err(|e| terr(&name, e))?;
            store.tensors.insert(name, permuted);
        }
    }
    Ok(())
}

/// Checks that every tensor a Llama graph needs is present with the shape the
/// hyper-parameters imply (PyTorch order). `output.weight` is optional (tied embeddings).
fn check_shapes(m: &LlamaGgufMeta, f: &GgufFile) -> Result<(), GgufError> {
    // Checked one by one (no list sized by `n_layers`, which comes from the file): the first
    // missing tensor ends the check, so a huge `block_count` costs nothing.
    let check = |name: &str, expected: &[usize], required: bool| -> Result<(), GgufError> {
        match f.tensors.get(name) {
            None if required => Err(GgufError::MissingTensor(name.to_string())),
            Some(t) if t.shape != expected => Err(GgufError::ShapeMismatch {
                name: name.to_string(),
                meta_name: gguf_to_meta_name(name),
                expected: expected.to_vec(),
                actual: t.shape.clone(),
            }),
            _ => Ok(()),
        }
    };
    use crate::model::Family;
    let (d, hd, ff, v) = (m.dim, m.head_dim, m.ffn_dim, m.vocab_size);
    let q = m.n_heads.saturating_mul(hd);
    let kv = m.n_kv_heads.saturating_mul(hd);
    check("token_embd.weight", &[v, d], true)?;
    check("output_norm.weight", &[d], true)?;
    check("output.weight", &[v, d], false)?;
    let fam = m.family;
    for i in 0..m.n_layers {
        let mut want: Vec<(&str, Vec<usize>)> = vec![
            ("attn_norm.weight", vec![d]),
            ("attn_output.weight", vec![d, q]),
            ("ffn_norm.weight", vec![d]),
            ("ffn_down.weight", vec![d, ff]),
        ];
        if fam == Family::Phi3 {
            want.push(("attn_qkv.weight", vec![q + 2 * kv, d]));
            want.push(("ffn_up.weight", vec![2 * ff, d]));
        } else {
            want.extend([
                ("attn_q.weight", vec![q, d]),
                ("attn_k.weight", vec![kv, d]),
                ("attn_v.weight", vec![kv, d]),
                ("ffn_gate.weight", vec![ff, d]),
                ("ffn_up.weight", vec![ff, d]),
            ]);
        }
        if fam == Family::Qwen2 {
            want.extend([
                ("attn_q.bias", vec![q]),
                ("attn_k.bias", vec![kv]),
                ("attn_v.bias", vec![kv]),
            ]);
        }
        if matches!(fam, Family::Qwen3 | Family::Gemma3) {
            want.extend([
                ("attn_q_norm.weight", vec![hd]),
                ("attn_k_norm.weight", vec![hd]),
            ]);
        }
        if fam == Family::Gemma3 {
            want.extend([
                ("post_attention_norm.weight", vec![d]),
                ("post_ffw_norm.weight", vec![d]),
            ]);
        }
        for (n, shape) in want {
            check(&format!("blk.{i}.{n}"), &shape, true)?;
        }
    }
    Ok(())
}
