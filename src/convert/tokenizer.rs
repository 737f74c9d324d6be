//! The `tokenizer.*` keys of the GGUF a conversion writes, from a
//! Hugging Face `tokenizer.json`, a SentencePiece `tokenizer.model` or a
//! tiktoken file.

use super::{s, ConvertError};
use crate::tokenizer::{HfTokenizerConfig, TokenizerError};
use crate::weights::gguf::{GgufArray, GgufValue};

/// The `tokenizer.ggml.*` keys of a GGUF, in the order they are put.
#[derive(Default)]
struct Kvs(Vec<(String, GgufValue)>);

impl Kvs {
    /// `tokenizer.ggml.<key> = v`.
    fn put(&mut self, key: &str, v: GgufValue) {
        self.0.push((format!("tokenizer.ggml.{key}"), v));
    }

    /// `tokenizer.ggml.<key> = id`, where there is an id.
    fn put_id(&mut self, key: &str, id: Option<u32>) {
        if let Some(id) = id {
            self.put(key, GgufValue::U32(id));
        }
    }
}

/// The `tokenizer.*` keys for a tokenizer.json (+ tokenizer_config.json).
pub(super) fn hf_json_tokenizer_kvs(
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
    let mut kv = Kvs::default();
    match tok.kind() {
        crate::tokenizer::TokenizerKind::Gpt2Bpe => {
            // llama.cpp's name for the split the tokenizer runs (`gpt-2`,
            // `smollm`, `llama-bpe`, `qwen2`): a name llama.cpp does not
            // know makes it refuse the file.
            let pre = tok
                .llama_cpp_pre()
                .expect("byte-level tokenizers have a split");
            kv.put("model", s("gpt2"));
            kv.put("pre", s(pre));
            let types: Vec<i32> = special
                .iter()
                .map(|&t| if t == 0 { 1 } else { t as i32 })
                .collect();
            kv.put("tokens", GgufValue::Array(GgufArray::String(tokens)));
            kv.put("token_type", GgufValue::Array(GgufArray::I32(types)));
            kv.put("merges", GgufValue::Array(GgufArray::String(merges)));
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
            kv.put("model", s("llama"));
            kv.put("pre", s("default"));
            kv.put("tokens", GgufValue::Array(GgufArray::String(tokens)));
            kv.put("scores", GgufValue::Array(GgufArray::F32(scores)));
            kv.put("token_type", GgufValue::Array(GgufArray::I32(types)));
            kv.put_id("unknown_token_id", unk);
        }
    }
    kv.put_id("bos_token_id", tok.bos_id());
    kv.put_id("eos_token_id", tok.eos_id());
    kv.put("add_bos_token", GgufValue::Bool(tok.add_bos_default()));
    kv.put("add_eos_token", GgufValue::Bool(false));
    Ok(kv.0)
}

/// The `tokenizer.*` keys for a SentencePiece `tokenizer.model`.
pub(super) fn spm_tokenizer_kvs(data: &[u8]) -> Result<Vec<(String, GgufValue)>, ConvertError> {
    let m = crate::tokenizer::sentencepiece::parse_model_proto(data)
        .map_err(|e| ConvertError::Tokenizer(e.to_string()))?;
    let tokens: Vec<String> = m.pieces.iter().map(|p| p.piece.clone()).collect();
    let scores: Vec<f32> = m.pieces.iter().map(|p| p.score).collect();
    let types: Vec<i32> = m.pieces.iter().map(|p| p.kind as i32).collect();
    let n = tokens.len();
    let id = |i: i32| (i >= 0 && (i as usize) < n).then_some(i as u32);
    let mut kv = Kvs::default();
    kv.put("model", s("llama"));
    kv.put("pre", s("default"));
    kv.put("tokens", GgufValue::Array(GgufArray::String(tokens)));
    kv.put("scores", GgufValue::Array(GgufArray::F32(scores)));
    kv.put("token_type", GgufValue::Array(GgufArray::I32(types)));
    kv.put_id("bos_token_id", id(m.bos_id));
    kv.put_id("eos_token_id", id(m.eos_id));
    kv.put_id("unknown_token_id", id(m.unk_id));
    kv.put("add_bos_token", GgufValue::Bool(true));
    kv.put("add_eos_token", GgufValue::Bool(false));
    Ok(kv.0)
}

/// The `tokenizer.*` keys for a Llama 3 tiktoken `tokenizer.model`: the
/// byte-level vocabulary llama.cpp's `gpt2` model reads (tokens in GPT-2's
/// byte alphabet, Meta's 256 special tokens as control tokens), the merges
/// recovered from the ranks ([`crate::tokenizer::tiktoken::merges_from_ranks`])
/// and Llama 3's pre-tokenizer (`llama-bpe`, with which llama.cpp also takes
/// a piece that is a token whole, as tiktoken does).
pub(super) fn tiktoken_tokenizer_kvs(
    data: &[u8],
) -> Result<Vec<(String, GgufValue)>, ConvertError> {
    use crate::tokenizer::tiktoken::{
        llama3_special_tokens, merges_from_ranks, parse_tiktoken_bpe,
    };
    let base = parse_tiktoken_bpe(data).map_err(|e| ConvertError::Tokenizer(e.to_string()))?;
    let alphabet = crate::tokenizer::gguf::bytes_to_unicode();
    let spell = |b: &[u8]| -> String { b.iter().map(|&x| alphabet[x as usize]).collect() };
    let mut tokens: Vec<String> = base.iter().map(|t| spell(t)).collect();
    let merges: Vec<String> = merges_from_ranks(&base)
        .into_iter()
        .map(|(l, r)| format!("{} {}", tokens[l as usize], tokens[r as usize]))
        .collect();
    let n_base = tokens.len();
    let mut types = vec![1i32; n_base];
    for t in llama3_special_tokens() {
        tokens.push(t);
        types.push(3);
    }
    let id = |name: &str| tokens.iter().position(|t| t == name).map(|i| i as u32);
    let (bos, eos) = (id("<|begin_of_text|>"), id("<|end_of_text|>"));
    let mut kv = Kvs::default();
    kv.put("model", s("gpt2"));
    kv.put("pre", s("llama-bpe"));
    kv.put_id("bos_token_id", bos);
    kv.put_id("eos_token_id", eos);
    kv.put("tokens", GgufValue::Array(GgufArray::String(tokens)));
    kv.put("token_type", GgufValue::Array(GgufArray::I32(types)));
    kv.put("merges", GgufValue::Array(GgufArray::String(merges)));
    kv.put("add_bos_token", GgufValue::Bool(true));
    kv.put("add_eos_token", GgufValue::Bool(false));
    Ok(kv.0)
}
