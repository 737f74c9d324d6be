//! `llama-graph convert`: a Meta checkpoint, a Hugging Face directory or a
//! GGUF file into a GGUF file that llama.cpp loads, with llama.cpp's
//! metadata keys for the model's architecture, the tokenizer and the chat
//! template.
//!
//! Families: each is written in the layout llama.cpp's `convert_hf_to_gguf.py`
//! gives it (see `tensor_layout`): `llama` for Llama and Mistral (whose
//! window llama.cpp's converter drops too), and `qwen2`, `qwen3`, `gemma3`,
//! `phi3` with their extra tensors (Q/K/V biases, Q/K norms, post-norms,
//! Phi-3's fused `attn_qkv` and gate/up `ffn_up`), Q/K rows in Hugging Face's
//! rotate-half order (llama.cpp runs these with NEOX RoPE) and Gemma's norms
//! as the stored `1 + w`.
//!
//! Streaming: the header is written first (every tensor's type and size is
//! known from its shape), then each tensor is read from the source's memory
//! map, converted and written before the next one is touched, so the memory
//! needed is one tensor (plus its f32 copy while quantizing). Meta
//! checkpoints split over several `consolidated.*.pth` are the exception:
//! the shard merge happens at load.
//!
//! Types: `f32`, `f16`, `bf16`, `q8_0`, `q4_0` and llama.cpp's mixes
//! `q4_k_m`, `q5_k_m`, `q6_k`: each tensor gets the type llama-quantize
//! gives it (see `target_type`) and blocks bit-identical to
//! llama-quantize's (see [`crate::kernels::quantized::quantize`]).
//!
//! The `tokenizer.*` keys the output carries are made in `tokenizer.rs`.

use crate::ir::{DType, RopeScaling};
use crate::kernels::quantized::{dequantize_row, quantize::quantize_row};
use crate::model::ModelArgs;
use crate::tokenizer::HfTokenizerConfig;
use crate::weights::gguf::writer::{GgufStreamWriter, StreamTensor};
use crate::weights::gguf::{ggml_from_dtype, GgufValue, LlamaGguf};
use crate::weights::hf::{open_hf_checkpoint, HfCheckpoint, HfError};
use crate::weights::pth::{load_meta_checkpoint, PthError};
use crate::weights::{WeightStore, WeightTensor};
use std::path::{Path, PathBuf};
use thiserror::Error;

mod tokenizer;
use tokenizer::{hf_json_tokenizer_kvs, spm_tokenizer_kvs, tiktoken_tokenizer_kvs};

/// The target type of `convert`: a plain type, or one of llama.cpp's
/// mixes (`Q4_K_M`: mostly Q4_K, more bits where llama-quantize puts them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum OutType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_K_M,
    Q5_K_M,
    Q6_K,
}

impl OutType {
    pub const NAMES: &'static str = "f32, f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m, q6_k";

    pub fn parse(s: &str) -> Result<OutType, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => OutType::F32,
            "f16" => OutType::F16,
            "bf16" => OutType::BF16,
            "q8_0" => OutType::Q8_0,
            "q4_0" => OutType::Q4_0,
            "q4_k_m" => OutType::Q4_K_M,
            "q5_k_m" => OutType::Q5_K_M,
            "q6_k" => OutType::Q6_K,
            other => {
                return Err(format!(
                    "unknown type `{other}`; supported: {}",
                    Self::NAMES
                ))
            }
        })
    }

    /// llama.cpp's default tensor type of the mix (`llama_ftype_get_default_type`).
    fn dtype(self) -> DType {
        match self {
            OutType::F32 => DType::F32,
            OutType::F16 => DType::F16,
            OutType::BF16 => DType::BF16,
            OutType::Q8_0 => DType::Q8_0,
            OutType::Q4_0 => DType::Q4_0,
            OutType::Q4_K_M => DType::Q4_K,
            OutType::Q5_K_M => DType::Q5_K,
            OutType::Q6_K => DType::Q6_K,
        }
    }

    /// llama.cpp's `general.file_type` (`llama_ftype`).
    fn file_type(self) -> u32 {
        match self {
            OutType::F32 => 0,
            OutType::F16 => 1,
            OutType::Q4_0 => 2,
            OutType::Q8_0 => 7,
            OutType::Q4_K_M => 15,
            OutType::Q5_K_M => 17,
            OutType::Q6_K => 18,
            OutType::BF16 => 32,
        }
    }

    fn quantized(self) -> bool {
        !matches!(self, OutType::F32 | OutType::F16 | OutType::BF16)
    }
}

#[derive(Debug, Error)]
pub enum ConvertError {
    #[error("{path}: {message}")]
    Source { path: String, message: String },
    #[error(transparent)]
    Hf(#[from] HfError),
    #[error(transparent)]
    Pth(#[from] PthError),
    #[error("{0}")]
    Tokenizer(String),
    #[error("tensor `{tensor}`: {message}")]
    Tensor { tensor: String, message: String },
    #[error("{path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

fn src_err(path: &Path, message: impl Into<String>) -> ConvertError {
    ConvertError::Source {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// What was written.
#[derive(Debug, Clone, Default)]
pub struct ConvertSummary {
    pub tensors: usize,
    pub bytes: usize,
    /// (GGUF name, type) of every tensor, in file order.
    pub types: Vec<(String, DType)>,
}

enum Source {
    Hf(Box<HfCheckpoint>),
    Store(WeightStore),
}

impl Source {
    /// Tensor `name` in Meta's row order, or with `hf_heads`, a Q/K tensor
    /// (rows, bias or norm entries) in Hugging Face's rotate-half order of
    /// that many heads.
    fn tensor(
        &self,
        name: &str,
        hf_heads: Option<usize>,
    ) -> Result<Option<WeightTensor>, ConvertError> {
        match (self, hf_heads) {
            // Still in the order the checkpoint stores.
            (Source::Hf(ck), Some(_)) if ck.unpermuted.contains_key(name) => {
                Ok(ck.weights.tensors.get(name).cloned())
            }
            (Source::Hf(ck), _) => Ok(ck.meta_tensor(name)?),
            (Source::Store(s), None) => Ok(s.tensors.get(name).cloned()),
            (Source::Store(s), Some(h)) => s
                .tensors
                .get(name)
                .map(|t| crate::weights::hf::meta_to_hf_any(t, h))
                .transpose()
                .map_err(|message| ConvertError::Tensor {
                    tensor: name.to_string(),
                    message,
                }),
        }
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match self {
            Source::Hf(ck) => ck.weights.tensors.get(name).map(|t| t.shape.clone()),
            Source::Store(s) => s.tensors.get(name).map(|t| t.shape.clone()),
        }
    }
}

/// GGUF's name of a Meta tensor name.
pub fn meta_to_gguf_name(name: &str) -> Option<String> {
    match name {
        "tok_embeddings.weight" => return Some("token_embd.weight".into()),
        "norm.weight" => return Some("output_norm.weight".into()),
        "output.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let g = match suffix {
        "attention_norm.weight" => "attn_norm.weight",
        "attention.wq.weight" => "attn_q.weight",
        "attention.wk.weight" => "attn_k.weight",
        "attention.wv.weight" => "attn_v.weight",
        "attention.wq.bias" => "attn_q.bias",
        "attention.wk.bias" => "attn_k.bias",
        "attention.wv.bias" => "attn_v.bias",
        "attention.q_norm.weight" => "attn_q_norm.weight",
        "attention.k_norm.weight" => "attn_k_norm.weight",
        "post_attention_norm.weight" => "post_attention_norm.weight",
        "post_ffn_norm.weight" => "post_ffw_norm.weight",
        "attention.wo.weight" => "attn_output.weight",
        "ffn_norm.weight" => "ffn_norm.weight",
        "feed_forward.w1.weight" => "ffn_gate.weight",
        "feed_forward.w2.weight" => "ffn_down.weight",
        "feed_forward.w3.weight" => "ffn_up.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}"))
}

/// The tensors of the written file, in the order llama.cpp's converter
/// writes them: each GGUF name with the Meta tensors whose rows it holds
/// (one, or for Phi-3 the fused `attn_qkv` = wq, wk, wv and `ffn_up` =
/// gate rows then up rows, as llama.cpp's `phi3` reads them).
fn tensor_layout(a: &ModelArgs) -> Vec<(String, Vec<String>)> {
    let v = &a.variant;
    let phi3 = v.family == crate::model::Family::Phi3;
    let one = |m: String| {
        let g = meta_to_gguf_name(&m).expect("layout names map to GGUF");
        (g, vec![m])
    };
    let mut out = vec![one("tok_embeddings.weight".into())];
    for i in 0..a.n_layers {
        let m = |s: &str| format!("layers.{i}.{s}");
        let g = |s: &str| format!("blk.{i}.{s}");
        out.push(one(m("attention_norm.weight")));
        out.push(one(m("feed_forward.w2.weight")));
        if phi3 {
            out.push((
                g("ffn_up.weight"),
                vec![m("feed_forward.w1.weight"), m("feed_forward.w3.weight")],
            ));
        } else {
            out.push(one(m("feed_forward.w1.weight")));
            out.push(one(m("feed_forward.w3.weight")));
        }
        if v.post_norms {
            out.push(one(m("post_attention_norm.weight")));
            out.push(one(m("post_ffn_norm.weight")));
        }
        out.push(one(m("ffn_norm.weight")));
        if phi3 {
            out.push(one(m("attention.wo.weight")));
            out.push((
                g("attn_qkv.weight"),
                ["wq", "wk", "wv"]
                    .iter()
                    .map(|x| m(&format!("attention.{x}.weight")))
                    .collect(),
            ));
            continue;
        }
        let mut names = Vec::new();
        if v.qk_norm {
            names.push("attention.k_norm.weight");
        }
        if v.qkv_bias {
            names.push("attention.wk.bias");
        }
        names.extend(["attention.wk.weight", "attention.wo.weight"]);
        if v.qk_norm {
            names.push("attention.q_norm.weight");
        }
        if v.qkv_bias {
            names.push("attention.wq.bias");
        }
        names.push("attention.wq.weight");
        if v.qkv_bias {
            names.push("attention.wv.bias");
        }
        names.push("attention.wv.weight");
        out.extend(names.into_iter().map(|n| one(m(n))));
    }
    out.push(one("norm.weight".into()));
    if !a.tied_embeddings {
        out.push(one("output.weight".into()));
    }
    out
}

/// The head count a Q/K tensor's rows (or entries) are grouped by, for
/// putting them in Hugging Face's order: `n_heads` for wq and its bias,
/// `n_kv_heads` for wk and its bias, 1 for the per-head norm weights.
fn qk_heads(name: &str, a: &ModelArgs) -> Option<usize> {
    let s = name.split_once('.')?.1.split_once('.')?.1;
    match s {
        "attention.wq.weight" | "attention.wq.bias" => Some(a.n_heads),
        "attention.wk.weight" | "attention.wk.bias" => Some(a.n_kv_heads),
        "attention.q_norm.weight" | "attention.k_norm.weight" => Some(1),
        _ => None,
    }
}

/// llama.cpp's `general.architecture` for a family.
fn gguf_architecture(f: crate::model::Family) -> &'static str {
    use crate::model::Family;
    match f {
        Family::Llama | Family::Mistral => "llama",
        Family::Qwen2 => "qwen2",
        Family::Qwen3 => "qwen3",
        Family::Gemma3 => "gemma3",
        Family::Phi3 => "phi3",
    }
}

/// Refuses, naming it, what the written architecture cannot say: llama.cpp
/// derives the variant from `general.architecture` (Gemma 3's embedding
/// scale, post-norms and GELU gate; a local/global pattern of every sixth
/// layer global) and from the tensors present (biases, Q/K norms).
fn check_writable(a: &ModelArgs) -> Result<(), String> {
    use crate::model::{Family, GateAct};
    let v = &a.variant;
    let fam = v.family;
    let gemma = fam == Family::Gemma3;
    let arch = gguf_architecture(fam);
    let gemma_parts = [
        ("post-norms", v.post_norms),
        ("the embedding scale", v.embed_scale),
        ("the GELU-tanh gate", v.gate_act == GateAct::GeluTanh),
    ];
    for (what, on) in gemma_parts {
        if on != gemma {
            return Err(format!(
                "is a {} model {} {what}, which llama.cpp's `{arch}` architecture {}",
                fam.name(),
                if on { "with" } else { "without" },
                if on {
                    "does not have"
                } else {
                    "always applies"
                }
            ));
        }
    }
    if gemma && !v.qk_norm {
        return Err(
            "is a gemma3 model without Q/K norms, which llama.cpp's `gemma3` requires".into(),
        );
    }
    match (fam, v.sliding_window, v.global_every) {
        (Family::Gemma3, Some(_), Some(6)) | (_, _, None) => {}
        (_, _, Some(n)) => {
            return Err(format!(
                "has a global layer every {n} layers; llama.cpp's `{arch}` file can only say every 6th (Gemma 3's pattern)"
            ))
        }
    }
    if matches!(fam, Family::Qwen2 | Family::Qwen3) && v.sliding_window.is_some() {
        return Err(format!(
            "has a sliding window, which llama.cpp's `{arch}` does not read"
        ));
    }
    if v.local_rope_theta.is_some() && !gemma {
        return Err(format!(
            "has a RoPE base for local layers, which llama.cpp's `{arch}` does not read"
        ));
    }
    if arch != "llama" && matches!(a.rope_scaling, Some(RopeScaling::Llama3 { .. })) {
        return Err(format!(
            "has Llama 3 RoPE scaling, which llama.cpp's `{arch}` does not read"
        ));
    }
    Ok(())
}

/// What the type choice needs to know about the model.
#[derive(Debug, Clone, Copy)]
struct MixInfo {
    n_layers: usize,
    /// llama.cpp's `LLM_TYPE_70B` (80 layers with grouped-query attention):
    /// its attn_v gets more bits.
    is_70b: bool,
    tied: bool,
}

impl MixInfo {
    fn new(a: &ModelArgs) -> MixInfo {
        use crate::model::Family;
        // llama.cpp's model type by layer count: 80 `llama` layers with
        // grouped-query attention, or 80 `qwen2` layers, are its 70B.
        let is_70b = a.n_layers == 80
            && match a.variant.family {
                Family::Llama | Family::Mistral => a.n_heads != a.n_kv_heads,
                Family::Qwen2 => true,
                _ => false,
            };
        MixInfo {
            n_layers: a.n_layers,
            is_70b,
            tied: a.tied_embeddings,
        }
    }
}

/// The stored type of a tensor, chosen as llama-quantize chooses it
/// (`llama_tensor_get_type` in llama.cpp's `src/llama-quant.cpp`, for the
/// llama architecture, no importance matrix, no overrides):
///
/// * 1-D tensors (norms) stay F32; F32/F16/BF16 files are that type
///   throughout.
/// * The output head (the token embedding when it is tied) is Q6_K in
///   every quantized mix but Q8_0, or Q8_0 when its rows are not a
///   multiple of the mix's block.
/// * Q4_K_M / Q5_K_M: `attn_v` (and Phi-3's fused `attn_qkv`, which
///   llama-quantize counts as an `attn_v`) and `ffn_down` of the layers
///   `use_more_bits` picks (the first and last eighth, and every third in
///   between) are Q6_K; a 70B-shaped model's other `attn_v` are Q5_K.
/// * Rows that are not whole blocks of the chosen type fall back:
///   Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and to F16 when even
///   those do not fit.
///
/// `name` is the GGUF name, as llama-quantize matches it.
fn target_type(ty: OutType, name: &str, shape: &[usize], m: MixInfo) -> DType {
    if shape.len() < 2 || !ty.quantized() {
        return if shape.len() < 2 {
            DType::F32
        } else {
            ty.dtype()
        };
    }
    let ne0 = shape[shape.len() - 1];
    let mut t = ty.dtype();
    let is_head = name == "output.weight" || (m.tied && name == "token_embd.weight");
    // "blk.N." of llama-quantize is the layer index here: it walks the
    // tensors in layer order.
    let layer = name
        .strip_prefix("blk.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(i, _)| i.parse::<usize>().ok());
    let n = m.n_layers;
    let more_bits = |i: usize| i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64) % 3 == 2;
    let k_m = matches!(ty, OutType::Q4_K_M | OutType::Q5_K_M);
    if is_head {
        if !ne0.is_multiple_of(t.block_elems()) {
            t = DType::Q8_0;
        } else if t != DType::Q8_0 {
            t = DType::Q6_K;
        }
    } else if let Some(i) = layer {
        if name.ends_with("attn_v.weight") || name.ends_with("attn_qkv.weight") {
            if k_m && more_bits(i) {
                t = DType::Q6_K;
            }
            if m.is_70b && t == DType::Q4_K {
                t = DType::Q5_K;
            }
        } else if name.ends_with("ffn_down.weight") && k_m && more_bits(i) {
            t = DType::Q6_K;
        }
    }
    if !ne0.is_multiple_of(t.block_elems()) {
        t = match t {
            DType::Q4_K => DType::Q5_0,
            DType::Q5_K => DType::Q5_1,
            DType::Q6_K => DType::Q8_0,
            other => other,
        };
        if !ne0.is_multiple_of(t.block_elems()) {
            t = DType::F16;
        }
    }
    t
}

/// llama.cpp's `rope_freqs.weight` for Llama 3 scaling: the number each
/// frequency is divided by.
fn rope_freqs(a: &ModelArgs, s: RopeScaling) -> Vec<f32> {
    let k = crate::kernels::RopeScaling::from(s);
    (0..a.head_dim() / 2)
        .map(|i| {
            let f = crate::kernels::elementwise::rope::rope_freq(
                i,
                a.head_dim(),
                a.rope_theta as f32,
                None,
            );
            f / k.apply(f)
        })
        .collect()
}

fn s(v: &str) -> GgufValue {
    GgufValue::String(v.to_string())
}

fn hyper_kvs(a: &ModelArgs, name: &str, ty: OutType) -> Vec<(String, GgufValue)> {
    use crate::model::Family;
    let u = |x: usize| GgufValue::U32(x as u32);
    let arch = gguf_architecture(a.variant.family);
    let k = |key: &str| format!("{arch}.{key}");
    let mut kv = vec![
        ("general.architecture".to_string(), s(arch)),
        ("general.type".into(), s("model")),
        ("general.name".into(), s(name)),
        (k("block_count"), u(a.n_layers)),
        (k("context_length"), u(a.max_context.unwrap_or(2048))),
        (k("embedding_length"), u(a.dim)),
        (k("feed_forward_length"), u(a.ffn_hidden_dim)),
        (k("attention.head_count"), u(a.n_heads)),
        (k("attention.head_count_kv"), u(a.n_kv_heads)),
        (k("rope.freq_base"), GgufValue::F32(a.rope_theta as f32)),
        (
            k("attention.layer_norm_rms_epsilon"),
            GgufValue::F32(a.norm_eps as f32),
        ),
        ("general.file_type".into(), GgufValue::U32(ty.file_type())),
        (k("vocab_size"), u(a.vocab_size.unwrap_or(0))),
        (k("rope.dimension_count"), u(a.head_dim())),
    ];
    if let Some(RopeScaling::Linear { factor }) = a.rope_scaling {
        kv.push((k("rope.scaling.type"), s("linear")));
        kv.push((k("rope.scaling.factor"), GgufValue::F32(factor as f32)));
    }
    kv.push((k("attention.key_length"), u(a.head_dim())));
    kv.push((k("attention.value_length"), u(a.head_dim())));
    // Mistral is written as plain `llama`, without its window, as
    // llama.cpp's converter writes it (llama.cpp's `llama` does not read
    // one); Phi-3's window is written though llama.cpp runs Phi-3 without
    // it, as its converter does.
    let v = &a.variant;
    if matches!(v.family, Family::Gemma3 | Family::Phi3) {
        if let Some(w) = v.sliding_window {
            kv.push((k("attention.sliding_window"), u(w)));
        }
    }
    if let Some(t) = v.local_rope_theta {
        kv.push((k("rope.freq_base_swa"), GgufValue::F32(t as f32)));
    }
    kv.push(("general.quantization_version".into(), GgufValue::U32(2)));
    kv
}

fn read_opt(p: &Path) -> Result<Option<Vec<u8>>, ConvertError> {
    if !p.is_file() {
        return Ok(None);
    }
    std::fs::read(p)
        .map(Some)
        .map_err(|e| src_err(p, format!("cannot read: {e}")))
}

/// Converts `src` into the GGUF file `out`. `progress(done, total, name)`
/// is called before each tensor is written.
pub fn convert(
    src: &Path,
    out: &Path,
    ty: OutType,
    mut progress: impl FnMut(usize, usize, &str),
) -> Result<ConvertSummary, ConvertError> {
    let meta = std::fs::metadata(src).map_err(|e| src_err(src, format!("cannot open: {e}")))?;
    let mut dir_name = src
        .file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| "model".into());
    let mut kvs;
    let args;
    let source;
    let mut tok_kvs = Vec::new();
    let mut template = None;
    if meta.is_dir() && src.join("config.json").is_file() {
        let ck = open_hf_checkpoint(src)?;
        args = ck.config.args.clone();
        let cfg = match read_opt(&src.join("tokenizer_config.json"))? {
            Some(b) => Some(
                HfTokenizerConfig::parse(&String::from_utf8_lossy(&b))
                    .map_err(|e| ConvertError::Tokenizer(e.to_string()))?,
            ),
            None => None,
        };
        template = match read_opt(&src.join("chat_template.jinja"))? {
            Some(b) => Some(String::from_utf8_lossy(&b).into_owned()),
            None => cfg.as_ref().and_then(|c| c.chat_template.clone()),
        };
        if let Some(spm) =
            read_opt(&src.join("tokenizer.model"))?.filter(|d| d.first() == Some(&0x0a))
        {
            tok_kvs = spm_tokenizer_kvs(&spm)?;
        } else if let Some(json) = read_opt(&src.join("tokenizer.json"))? {
            tok_kvs = hf_json_tokenizer_kvs(&json, cfg.as_ref())?;
        }
        source = Source::Hf(Box::new(ck));
    } else if meta.is_dir() && src.join("params.json").is_file() {
        let text = std::fs::read_to_string(src.join("params.json"))
            .map_err(|e| src_err(src, format!("cannot read params.json: {e}")))?;
        let mut a = ModelArgs::from_params_json(&text).map_err(|e| src_err(src, e.to_string()))?;
        let store = load_meta_checkpoint(src)?;
        if a.vocab_size.is_none() {
            a.vocab_size = store
                .tensors
                .get("tok_embeddings.weight")
                .and_then(|t| t.shape.first().copied());
        }
        args = a;
        match read_opt(&src.join("tokenizer.model"))? {
            Some(d) if d.first() == Some(&0x0a) => tok_kvs = spm_tokenizer_kvs(&d)?,
            Some(d) => tok_kvs = tiktoken_tokenizer_kvs(&d)?,
            None => {}
        }
        source = Source::Store(store);
    } else {
        let g = LlamaGguf::open(src).map_err(|e| src_err(src, e.to_string()))?;
        let m = crate::weights::Model::open_gguf(src).map_err(|e| src_err(src, e.to_string()))?;
        args = m.args;
        if let Some(n) = m.name {
            dir_name = n;
        }
        for k in &g.file.key_order {
            if k.starts_with("tokenizer.") {
                let v = g.file.metadata[k].clone();
                if k == "tokenizer.chat_template" {
                    if let GgufValue::String(t) = &v {
                        template = Some(t.clone());
                    }
                    continue;
                }
                tok_kvs.push((k.clone(), v));
            }
        }
        source = Source::Store(m.weights);
    }
    if tok_kvs.is_empty() {
        return Err(ConvertError::Tokenizer(format!(
            "{}: no tokenizer (tokenizer.json or tokenizer.model) to put in the GGUF file; llama.cpp needs one",
            src.display()
        )));
    }
    check_writable(&args).map_err(|m| src_err(src, m))?;
    kvs = hyper_kvs(&args, &dir_name, ty);
    kvs.extend(tok_kvs);
    if let Some(t) = template {
        kvs.push(("tokenizer.chat_template".into(), GgufValue::String(t)));
    }

    // Every tensor's type and size, before any data.
    let neox = args.variant.family.gguf_neox_rows();
    let mut plan: Vec<Planned> = Vec::new();
    for (g, parts) in tensor_layout(&args) {
        let mut shape: Vec<usize> = Vec::new();
        for name in &parts {
            let sh = source.shape(name).ok_or_else(|| ConvertError::Tensor {
                tensor: name.clone(),
                message: "missing from the source".into(),
            })?;
            match shape.as_mut_slice() {
                [] => shape = sh,
                // Fused: the parts' rows one after the other.
                [rows, cols] if sh.len() == 2 && sh[1] == *cols => *rows += sh[0],
                _ => {
                    return Err(ConvertError::Tensor {
                        tensor: name.clone(),
                        message: format!("shape {sh:?} cannot be fused into {g} {shape:?}"),
                    })
                }
            }
        }
        let dt = target_type(ty, &g, &shape, MixInfo::new(&args));
        plan.push(Planned {
            gguf: g,
            parts,
            dt,
            shape,
        });
    }
    // A GGUF source keeps its own factors; otherwise they are computed as
    // llama.cpp's converter does.
    let stored_freqs = match &source {
        Source::Store(st) => st
            .tensors
            .get("rope_freqs.weight")
            .filter(|t| t.dtype == DType::F32)
            .map(|t| {
                t.data
                    .as_bytes()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect::<Vec<f32>>()
            }),
        Source::Hf(_) => None,
    };
    let freqs = match args.rope_scaling {
        Some(sc @ RopeScaling::Llama3 { .. }) => {
            stored_freqs.or_else(|| Some(rope_freqs(&args, sc)))
        }
        _ => None,
    };
    let mut decl: Vec<StreamTensor> = plan
        .iter()
        .map(|p| {
            let n: usize = p.shape.iter().product();
            StreamTensor {
                name: p.gguf.clone(),
                ne: p.shape.iter().rev().map(|&d| d as u64).collect(),
                ggml_type: ggml_from_dtype(p.dt).expect("written types have ggml ids"),
                n_bytes: p.dt.bytes_for(n).expect("checked shape"),
            }
        })
        .collect();
    if let Some(f) = &freqs {
        decl.push(StreamTensor {
            name: "rope_freqs.weight".into(),
            ne: vec![f.len() as u64],
            ggml_type: 0,
            n_bytes: 4 * f.len(),
        });
    }
    let total = decl.len();
    let werr = |source| ConvertError::Write {
        path: out.display().to_string(),
        source,
    };
    let part: PathBuf = out.with_extension("gguf.part");
    let mut w = GgufStreamWriter::create(&part, &kvs, decl).map_err(werr)?;
    let mut summary = ConvertSummary::default();
    for (i, p) in plan.iter().enumerate() {
        progress(i, total, &p.gguf);
        // Rows are converted independently, so a fused tensor is its
        // parts' converted rows one after the other.
        let mut bytes = Vec::new();
        for name in &p.parts {
            let heads = if neox { qk_heads(name, &args) } else { None };
            let t = source.tensor(name, heads)?.expect("planned tensors exist");
            let b = convert_tensor(&t, p.dt).map_err(|message| ConvertError::Tensor {
                tensor: name.clone(),
                message,
            })?;
            // The source's pages are clean; drop them as soon as they are used.
            t.data.release_pages();
            if bytes.is_empty() {
                bytes = b;
            } else {
                bytes.extend_from_slice(&b);
            }
        }
        w.write_tensor(&bytes).map_err(werr)?;
        summary.bytes += bytes.len();
        summary.types.push((p.gguf.clone(), p.dt));
    }
    if let Some(f) = &freqs {
        progress(total - 1, total, "rope_freqs.weight");
        let b: Vec<u8> = f.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.write_tensor(&b).map_err(werr)?;
        summary.types.push(("rope_freqs.weight".into(), DType::F32));
    }
    progress(total, total, "");
    w.finish().map_err(werr)?;
    std::fs::rename(&part, out).map_err(werr)?;
    summary.tensors = total;
    Ok(summary)
}

/// One tensor of the written file (see `tensor_layout`).
struct Planned {
    gguf: String,
    /// The Meta tensors whose rows it holds, in order.
    parts: Vec<String>,
    dt: DType,
    shape: Vec<usize>,
}

/// One tensor into `dt`: a copy when the types agree, else row by row
/// through f32.
fn convert_tensor(t: &WeightTensor, dt: DType) -> Result<Vec<u8>, String> {
    if t.dtype == dt {
        return Ok(t.data.as_bytes().to_vec());
    }
    let cols = *t.shape.last().ok_or("a tensor without dimensions")?;
    let rows: usize = t.shape[..t.shape.len() - 1].iter().product();
    let in_row = t
        .dtype
        .bytes_for(cols)
        .ok_or("row length is not whole blocks")?;
    let out_row = dt.bytes_for(cols).ok_or("row length is not whole blocks")?;
    let src = t.data.as_bytes();
    if src.len() != in_row * rows {
        return Err(format!("{} bytes for shape {:?}", src.len(), t.shape));
    }
    let mut out = vec![0u8; out_row * rows];
    // Rows are independent (and each is quantized alone, as llama-quantize
    // does), so they are spread over threads; the bytes do not depend on
    // how.
    use rayon::prelude::*;
    src.par_chunks_exact(in_row)
        .zip(out.par_chunks_exact_mut(out_row))
        .try_for_each_init(
            || vec![0f32; cols],
            |x, (r, o)| -> Result<(), String> {
                match t.dtype {
                    DType::BF16 => {
                        for (v, c) in x.iter_mut().zip(r.chunks_exact(2)) {
                            *v = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
                        }
                    }
                    DType::F16 => {
                        for (v, c) in x.iter_mut().zip(r.chunks_exact(2)) {
                            *v = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
                        }
                    }
                    other => dequantize_row(other, r, x).map_err(|e| format!("{other}: {e}"))?,
                }
                quantize_row(dt, x, o).ok_or_else(|| format!("cannot write {dt}"))
            },
        )?;
    Ok(out)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod writable_tests;
