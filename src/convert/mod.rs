//! `llama-graph convert`: a Meta checkpoint, a Hugging Face directory or a
//! GGUF file into a GGUF file that llama.cpp loads, with llama.cpp's
//! metadata keys for the `llama` architecture, the tokenizer and the chat
//! template.
//!
//! Streaming: the header is written first (every tensor's type and size is
//! known from its shape), then each tensor is read from the source's memory
//! map, converted and written before the next one is touched, so the memory
//! needed is one tensor (plus its f32 copy while quantizing). Meta
//! checkpoints split over several `consolidated.*.pth` are the exception:
//! the shard merge happens at load.
//!
//! Types: `f32`, `f16`, `bf16`, `q8_0`, `q4_0` (blocks bit-identical to
//! `llama-quantize`'s: see [`crate::kernels::quantized::quantize`]). As
//! llama.cpp does, 1-D tensors (norms) stay F32, and a matrix whose rows are
//! not whole blocks falls back (to Q8_0, then F16). One difference: the
//! output head (or the tied embedding) of a `q4_0` file is Q8_0, where
//! llama-quantize writes Q6_K when the row length is a multiple of 256.

use crate::ir::{DType, RopeScaling};
use crate::kernels::quantized::{dequantize_row, quantize::quantize_row};
use crate::model::ModelArgs;
use crate::tokenizer::{HfTokenizerConfig, TokenizerError};
use crate::weights::gguf::writer::{GgufStreamWriter, StreamTensor};
use crate::weights::gguf::{ggml_from_dtype, GgufArray, GgufValue, LlamaGguf};
use crate::weights::hf::{open_hf_checkpoint, HfCheckpoint, HfError};
use crate::weights::pth::{load_meta_checkpoint, PthError};
use crate::weights::{WeightStore, WeightTensor};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The target type of `convert`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
}

impl OutType {
    pub const NAMES: &'static str = "f32, f16, bf16, q8_0, q4_0";

    pub fn parse(s: &str) -> Result<OutType, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => OutType::F32,
            "f16" => OutType::F16,
            "bf16" => OutType::BF16,
            "q8_0" => OutType::Q8_0,
            "q4_0" => OutType::Q4_0,
            "q4_k_m" => {
                return Err(
                    "q4_k_m is not implemented yet (no K-quant quantizer); supported: \
                            f32, f16, bf16, q8_0, q4_0"
                        .into(),
                )
            }
            other => {
                return Err(format!(
                    "unknown type `{other}`; supported: {}",
                    Self::NAMES
                ))
            }
        })
    }

    fn dtype(self) -> DType {
        match self {
            OutType::F32 => DType::F32,
            OutType::F16 => DType::F16,
            OutType::BF16 => DType::BF16,
            OutType::Q8_0 => DType::Q8_0,
            OutType::Q4_0 => DType::Q4_0,
        }
    }

    /// llama.cpp's `general.file_type` (`llama_ftype`).
    fn file_type(self) -> u32 {
        match self {
            OutType::F32 => 0,
            OutType::F16 => 1,
            OutType::Q4_0 => 2,
            OutType::Q8_0 => 7,
            OutType::BF16 => 32,
        }
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
    fn tensor(&self, name: &str) -> Result<Option<WeightTensor>, ConvertError> {
        match self {
            Source::Hf(ck) => Ok(ck.meta_tensor(name)?),
            Source::Store(s) => Ok(s.tensors.get(name).cloned()),
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
        "attention.wo.weight" => "attn_output.weight",
        "ffn_norm.weight" => "ffn_norm.weight",
        "feed_forward.w1.weight" => "ffn_gate.weight",
        "feed_forward.w2.weight" => "ffn_down.weight",
        "feed_forward.w3.weight" => "ffn_up.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}"))
}

/// The Meta names of a model's tensors in llama.cpp's file order.
fn tensor_names(a: &ModelArgs) -> Vec<String> {
    let mut v = vec!["tok_embeddings.weight".to_string()];
    for i in 0..a.n_layers {
        for s in [
            "attention_norm.weight",
            "feed_forward.w2.weight",
            "feed_forward.w1.weight",
            "feed_forward.w3.weight",
            "ffn_norm.weight",
            "attention.wk.weight",
            "attention.wo.weight",
            "attention.wq.weight",
            "attention.wv.weight",
        ] {
            v.push(format!("layers.{i}.{s}"));
        }
    }
    v.push("norm.weight".into());
    if !a.tied_embeddings {
        v.push("output.weight".into());
    }
    v
}

/// The stored type of a tensor: 1-D stays F32; rows that are not whole
/// blocks fall back to Q8_0 and then F16.
fn target_type(ty: OutType, name: &str, shape: &[usize], tied: bool) -> DType {
    if shape.len() < 2 {
        return DType::F32;
    }
    let ne0 = shape[shape.len() - 1];
    let mut want = ty.dtype();
    let is_head = name == "output.weight" || (tied && name == "tok_embeddings.weight");
    if ty == OutType::Q4_0 && is_head {
        want = DType::Q8_0;
    }
    for d in [want, DType::Q8_0, DType::F16] {
        if ne0.is_multiple_of(d.block_elems()) {
            return d;
        }
    }
    DType::F32
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
    let u = |x: usize| GgufValue::U32(x as u32);
    let mut kv = vec![
        ("general.architecture".to_string(), s("llama")),
        ("general.type".into(), s("model")),
        ("general.name".into(), s(name)),
        ("llama.block_count".into(), u(a.n_layers)),
        (
            "llama.context_length".into(),
            u(a.max_context.unwrap_or(2048)),
        ),
        ("llama.embedding_length".into(), u(a.dim)),
        ("llama.feed_forward_length".into(), u(a.ffn_hidden_dim)),
        ("llama.attention.head_count".into(), u(a.n_heads)),
        ("llama.attention.head_count_kv".into(), u(a.n_kv_heads)),
        (
            "llama.rope.freq_base".into(),
            GgufValue::F32(a.rope_theta as f32),
        ),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            GgufValue::F32(a.norm_eps as f32),
        ),
        ("general.file_type".into(), GgufValue::U32(ty.file_type())),
        ("llama.vocab_size".into(), u(a.vocab_size.unwrap_or(0))),
        ("llama.rope.dimension_count".into(), u(a.head_dim())),
    ];
    if let Some(RopeScaling::Linear { factor }) = a.rope_scaling {
        kv.push(("llama.rope.scaling.type".into(), s("linear")));
        kv.push((
            "llama.rope.scaling.factor".into(),
            GgufValue::F32(factor as f32),
        ));
    }
    kv.push(("llama.attention.key_length".into(), u(a.head_dim())));
    kv.push(("llama.attention.value_length".into(), u(a.head_dim())));
    kv.push(("general.quantization_version".into(), GgufValue::U32(2)));
    kv
}

/// The `tokenizer.*` keys for a tokenizer.json (+ tokenizer_config.json).
fn hf_json_tokenizer_kvs(
    json: &[u8],
    cfg: Option<&HfTokenizerConfig>,
) -> Result<Vec<(String, GgufValue)>, ConvertError> {
    let terr = |m: String| ConvertError::Tokenizer(format!("tokenizer.json: {m}"));
    // Built once to validate the file and to resolve ids the same way the
    // runtime does.
    let tok = crate::tokenizer::Tokenizer::from_hf_json(json, cfg)
        .map_err(|e: TokenizerError| ConvertError::Tokenizer(e.to_string()))?;
    let v: serde_json::Value = serde_json::from_slice(json).map_err(|e| terr(e.to_string()))?;
    let model = &v["model"];
    let n = tok.n_vocab();
    let mut tokens = vec![String::new(); n];
    for (t, id) in model["vocab"].as_object().into_iter().flatten() {
        if let Some(i) = id.as_u64() {
            tokens[i as usize] = t.clone();
        }
    }
    let mut special = vec![0u8; n];
    for a in v["added_tokens"].as_array().into_iter().flatten() {
        if let (Some(i), Some(c)) = (a["id"].as_u64(), a["content"].as_str()) {
            tokens[i as usize] = c.to_string();
            special[i as usize] = if a["special"].as_bool() == Some(true) {
                3
            } else {
                4
            };
        }
    }
    let merges: Vec<String> = model["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| match m {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(p) => Some(format!("{} {}", p[0].as_str()?, p[1].as_str()?)),
            _ => None,
        })
        .collect();
    let mut kv = Vec::new();
    match tok.kind() {
        crate::tokenizer::TokenizerKind::Gpt2Bpe => {
            let pre = match v["pre_tokenizer"]["type"].as_str() {
                Some("ByteLevel") => "gpt2",
                _ => match v["pre_tokenizer"]["pretokenizers"][0]["type"].as_str() {
                    Some("Digits") => "smollm",
                    _ => "llama-bpe",
                },
            };
            kv.push(("tokenizer.ggml.model".into(), s("gpt2")));
            kv.push(("tokenizer.ggml.pre".into(), s(pre)));
            let types: Vec<i32> = special
                .iter()
                .map(|&t| if t == 0 { 1 } else { t as i32 })
                .collect();
            kv.push((
                "tokenizer.ggml.tokens".into(),
                GgufValue::Array(GgufArray::String(tokens)),
            ));
            kv.push((
                "tokenizer.ggml.token_type".into(),
                GgufValue::Array(GgufArray::I32(types)),
            ));
            kv.push((
                "tokenizer.ggml.merges".into(),
                GgufValue::Array(GgufArray::String(merges)),
            ));
        }
        _ => {
            // SentencePiece-style: llama.cpp's `llama` model merges the
            // adjacent pair whose concatenation scores highest, so the score
            // of a token made by merge #r is -r (earlier merges first).
            let mut scores = vec![0f32; n];
            let ids: std::collections::HashMap<&str, usize> = tokens
                .iter()
                .enumerate()
                .map(|(i, t)| (t.as_str(), i))
                .collect();
            for (r, m) in merges.iter().enumerate() {
                if let Some(&i) = ids.get(m.replacen(' ', "", 1).as_str()) {
                    if scores[i] == 0.0 {
                        scores[i] = -(r as f32) - 1.0;
                    }
                }
            }
            let unk = model["unk_token"]
                .as_str()
                .or(Some("<unk>"))
                .and_then(|u| tok.token_to_id(u));
            let types: Vec<i32> = (0..n)
                .map(|i| match special[i] {
                    _ if Some(i as u32) == unk => 2,
                    0 if tok.token_type(i as u32) == Some(crate::tokenizer::TokenType::Byte) => 6,
                    0 => 1,
                    t => t as i32,
                })
                .collect();
            kv.push(("tokenizer.ggml.model".into(), s("llama")));
            kv.push(("tokenizer.ggml.pre".into(), s("default")));
            kv.push((
                "tokenizer.ggml.tokens".into(),
                GgufValue::Array(GgufArray::String(tokens)),
            ));
            kv.push((
                "tokenizer.ggml.scores".into(),
                GgufValue::Array(GgufArray::F32(scores)),
            ));
            kv.push((
                "tokenizer.ggml.token_type".into(),
                GgufValue::Array(GgufArray::I32(types)),
            ));
            if let Some(u) = unk {
                kv.push(("tokenizer.ggml.unknown_token_id".into(), GgufValue::U32(u)));
            }
        }
    }
    if let Some(b) = tok.bos_id() {
        kv.push(("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(b)));
    }
    if let Some(e) = tok.eos_id() {
        kv.push(("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(e)));
    }
    kv.push((
        "tokenizer.ggml.add_bos_token".into(),
        GgufValue::Bool(tok.add_bos_default()),
    ));
    kv.push((
        "tokenizer.ggml.add_eos_token".into(),
        GgufValue::Bool(false),
    ));
    Ok(kv)
}

/// The `tokenizer.*` keys for a SentencePiece `tokenizer.model`.
fn spm_tokenizer_kvs(data: &[u8]) -> Result<Vec<(String, GgufValue)>, ConvertError> {
    let m = crate::tokenizer::sentencepiece::parse_model_proto(data)
        .map_err(|e| ConvertError::Tokenizer(e.to_string()))?;
    let tokens: Vec<String> = m.pieces.iter().map(|p| p.piece.clone()).collect();
    let scores: Vec<f32> = m.pieces.iter().map(|p| p.score).collect();
    let types: Vec<i32> = m.pieces.iter().map(|p| p.kind as i32).collect();
    let n = tokens.len();
    let id = |i: i32| (i >= 0 && (i as usize) < n).then_some(i as u32);
    let mut kv = vec![
        ("tokenizer.ggml.model".to_string(), s("llama")),
        ("tokenizer.ggml.pre".into(), s("default")),
        (
            "tokenizer.ggml.tokens".into(),
            GgufValue::Array(GgufArray::String(tokens)),
        ),
        (
            "tokenizer.ggml.scores".into(),
            GgufValue::Array(GgufArray::F32(scores)),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            GgufValue::Array(GgufArray::I32(types)),
        ),
    ];
    for (k, v) in [
        ("tokenizer.ggml.bos_token_id", id(m.bos_id)),
        ("tokenizer.ggml.eos_token_id", id(m.eos_id)),
        ("tokenizer.ggml.unknown_token_id", id(m.unk_id)),
    ] {
        if let Some(v) = v {
            kv.push((k.into(), GgufValue::U32(v)));
        }
    }
    kv.push(("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(true)));
    kv.push((
        "tokenizer.ggml.add_eos_token".into(),
        GgufValue::Bool(false),
    ));
    Ok(kv)
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
            Some(_) => {
                return Err(ConvertError::Tokenizer(
                    "converting a Meta Llama 3 (tiktoken) tokenizer.model is not supported yet; \
                     convert the Hugging Face layout of the model instead"
                        .into(),
                ))
            }
            None => {}
        }
        source = Source::Store(store);
    } else {
        let g = LlamaGguf::open(src).map_err(|e| src_err(src, e.to_string()))?;
        let m = crate::session::Model::open_gguf(src).map_err(|e| src_err(src, e.to_string()))?;
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
    kvs = hyper_kvs(&args, &dir_name, ty);
    kvs.extend(tok_kvs);
    if let Some(t) = template {
        kvs.push(("tokenizer.chat_template".into(), GgufValue::String(t)));
    }

    // Every tensor's type and size, before any data.
    let mut plan: Vec<(String, String, DType, Vec<usize>)> = Vec::new();
    for name in tensor_names(&args) {
        let shape = match &source {
            Source::Hf(ck) => ck.weights.tensors.get(&name).map(|t| t.shape.clone()),
            Source::Store(s) => s.tensors.get(&name).map(|t| t.shape.clone()),
        }
        .ok_or_else(|| ConvertError::Tensor {
            tensor: name.clone(),
            message: "missing from the source".into(),
        })?;
        let dt = target_type(ty, &name, &shape, args.tied_embeddings);
        let g = meta_to_gguf_name(&name).expect("graph names map to GGUF");
        plan.push((name, g, dt, shape));
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
        .map(|(_, g, dt, shape)| {
            let n: usize = shape.iter().product();
            StreamTensor {
                name: g.clone(),
                ne: shape.iter().rev().map(|&d| d as u64).collect(),
                ggml_type: ggml_from_dtype(*dt).expect("written types have ggml ids"),
                n_bytes: dt.bytes_for(n).expect("checked shape"),
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
    for (i, (name, g, dt, shape)) in plan.iter().enumerate() {
        progress(i, total, g);
        let t = source.tensor(name)?.expect("planned tensors exist");
        let bytes = convert_tensor(&t, *dt).map_err(|message| ConvertError::Tensor {
            tensor: name.clone(),
            message,
        })?;
        debug_assert_eq!(t.shape, *shape);
        // The source's pages are clean; drop them as soon as they are used.
        t.data.release_pages();
        w.write_tensor(&bytes).map_err(werr)?;
        summary.bytes += bytes.len();
        summary.types.push((g.clone(), *dt));
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
    let mut x = vec![0f32; cols];
    for (r, o) in src.chunks_exact(in_row).zip(out.chunks_exact_mut(out_row)) {
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
            other => dequantize_row(other, r, &mut x).map_err(|e| format!("{other}: {e}"))?,
        }
        quantize_row(dt, &x, o).ok_or_else(|| format!("cannot write {dt}"))?;
    }
    Ok(out)
}
