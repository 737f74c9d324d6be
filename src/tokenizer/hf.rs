//! Hugging Face `tokenizer.json` (the `tokenizers` library's format), for
//! the configurations Llama-family checkpoints ship, mapped onto this
//! crate's own engines:
//!
//! * **Byte-level BPE** (Llama 3, SmolLM/SmolLM2, GPT-2 style): pre-tokenizer
//!   `ByteLevel` (GPT-2 split), `Sequence[Digits(individual), ByteLevel]`
//!   (SmolLM), or `Sequence[Split(Llama 3 regex, Isolated), ByteLevel(no
//!   regex)]` (Llama 3); merges by rank; `ignore_merges` (a piece that is
//!   itself a token is taken whole, as Llama 3's file asks).
//! * **SentencePiece-style BPE** (Llama 2, TinyLlama, CodeLlama): normalizer
//!   `Sequence[Prepend("▁"), Replace(" ", "▁")]` (older conversions) or
//!   pre-tokenizer `Metaspace` (newer ones), merges by rank, `byte_fallback`
//!   to `<0xNN>` tokens, `fuse_unk`.
//!
//! Added tokens are matched before the model, as `tokenizers` does: special
//! ones become control tokens (matched with `parse_special`, which is what
//! `tokenizers`' default `encode` does; without it they are text, as with
//! `encode_special_tokens = True`), non-special ones are always matched.
//! `TemplateProcessing` that starts with a special token gives the BOS.
//!
//! Anything else (another model type, normalizers such as NFKC, other
//! regexes, `lstrip`/`rstrip` added tokens, dropout, subword prefixes) is
//! refused with the component named, rather than tokenized differently.
//! Why not the `tokenizers` crate: it is a second tokenizer engine next to
//! the ones GGUF and Meta files already need (its default features also
//! build C code), while these configurations are a mapping onto those.

use rustc_hash::FxHashMap;
use serde_json::Value;

use super::gguf::{bytes_to_unicode, Gpt2Model, PreTok};
use super::sentencepiece::byte_piece_value;
use super::{bpe, Common, Model, TokenType, Tokenizer, TokenizerError, TokenizerKind};

/// Largest vocabulary accepted (as for GGUF and params.json).
const MAX_VOCAB: u64 = 1 << 24;

/// Llama 3's pre-tokenizer regex, as its `tokenizer.json` spells it.
pub const LLAMA3_SPLIT: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// Qwen2's pre-tokenizer regex (Qwen2, Qwen2.5, Qwen3), as its
/// `tokenizer.json` spells it: Llama 3's with `\p{N}` for `\p{N}{1,3}`.
pub const QWEN2_SPLIT: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

fn herr(msg: impl Into<String>) -> TokenizerError {
    TokenizerError::HfJson(msg.into())
}

/// How a SentencePiece-style segment gets its `▁`s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Spaces {
    /// Normalizer `Prepend("▁")` + `Replace(" ", "▁")`: every segment between
    /// added tokens gets a leading `▁`.
    PrependEvery,
    /// Pre-tokenizer `Metaspace` with `prepend_scheme`: spaces become `▁`,
    /// then a `▁` is prepended unless the segment already starts with one;
    /// `First` only for the segment at the start of the text.
    Metaspace { first_only: bool, prepend: bool },
    /// Normalizer `Replace(" ", "▁")` alone (Gemma): spaces become `▁`,
    /// nothing is prepended.
    ReplaceOnly,
}

/// SentencePiece-style BPE over characters, merges by rank.
pub(crate) struct HfSpmModel {
    spaces: Spaces,
    /// Split the segment at each `▁` (Metaspace `split: true`).
    split: bool,
    vocab: FxHashMap<String, u32>,
    merges: FxHashMap<(u32, u32), (u32, u32)>,
    /// `<0xNN>` ids when byte fallback is on.
    byte_ids: Option<[u32; 256]>,
    unk: Option<u32>,
    fuse_unk: bool,
}

impl HfSpmModel {
    pub(crate) fn encode_segment(&self, text: &str, at_start: bool, out: &mut Vec<u32>) {
        let mut s = String::with_capacity(text.len() + 3);
        match self.spaces {
            Spaces::PrependEvery => {
                if !text.is_empty() {
                    s.push('\u{2581}');
                }
                s.extend(text.chars().map(|c| if c == ' ' { '\u{2581}' } else { c }));
            }
            Spaces::Metaspace {
                first_only,
                prepend,
            } => {
                s.extend(text.chars().map(|c| if c == ' ' { '\u{2581}' } else { c }));
                if prepend && (!first_only || at_start) && !s.starts_with('\u{2581}') {
                    s.insert(0, '\u{2581}');
                }
            }
            Spaces::ReplaceOnly => {
                s.extend(text.chars().map(|c| if c == ' ' { '\u{2581}' } else { c }));
            }
        }
        if self.split {
            let mut start = 0;
            for (i, _) in s.match_indices('\u{2581}') {
                if i > start {
                    self.encode_word(&s[start..i], out);
                }
                start = i;
            }
            if start < s.len() {
                self.encode_word(&s[start..], out);
            }
        } else if !s.is_empty() {
            self.encode_word(&s, out);
        }
    }

    fn encode_word(&self, w: &str, out: &mut Vec<u32>) {
        let mut syms: Vec<u32> = Vec::with_capacity(w.len());
        let mut last_unk = false;
        let mut buf = [0u8; 4];
        for c in w.chars() {
            let cs = c.encode_utf8(&mut buf);
            if let Some(&id) = self.vocab.get(&*cs) {
                syms.push(id);
                last_unk = false;
            } else if let Some(bytes) = &self.byte_ids {
                syms.extend(cs.bytes().map(|b| bytes[b as usize]));
                last_unk = false;
            } else if let Some(u) = self.unk {
                if !(self.fuse_unk && last_unk) {
                    syms.push(u);
                }
                last_unk = true;
            }
            // Without an unknown token the character is dropped, as
            // `tokenizers` does.
        }
        out.extend(bpe::merge(syms, |l, r| self.merges.get(&(l, r)).copied()));
    }
}

/// `tokenizer_config.json`: what it adds to `tokenizer.json`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HfTokenizerConfig {
    /// `add_bos_token`, when given.
    pub add_bos_token: Option<bool>,
    /// `bos_token` / `eos_token` contents (string or `{"content": ...}`).
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// `chat_template`: a string, or the `default` entry of a list of
    /// `{name, template}`.
    pub chat_template: Option<String>,
}

fn token_content(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl HfTokenizerConfig {
    /// Parses `tokenizer_config.json`; unknown keys are ignored.
    pub fn parse(text: &str) -> Result<HfTokenizerConfig, TokenizerError> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| herr(format!("tokenizer_config.json is not valid JSON: {e}")))?;
        let Value::Object(o) = &v else {
            return Err(herr("tokenizer_config.json must be a JSON object"));
        };
        let add_bos_token = match o.get("add_bos_token") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(v) => {
                return Err(herr(format!(
                    "tokenizer_config.json: add_bos_token must be true or false, got {v}"
                )))
            }
        };
        let chat_template = match o.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => list
                .iter()
                .find(|e| e.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|e| e.get("template")?.as_str().map(str::to_string)),
            Some(v) => {
                return Err(herr(format!(
                    "tokenizer_config.json: chat_template must be a string or a list, got {v}"
                )))
            }
        };
        Ok(HfTokenizerConfig {
            add_bos_token,
            bos_token: o.get("bos_token").and_then(token_content),
            eos_token: o.get("eos_token").and_then(token_content),
            chat_template,
        })
    }
}

fn obj_type(v: &Value) -> Option<&str> {
    v.get("type").and_then(Value::as_str)
}

fn flag(v: &Value, key: &str) -> Option<bool> {
    v.get(key).and_then(Value::as_bool)
}

/// What the pre-tokenization part of the file asks for.
enum Front {
    /// Byte-level BPE: the split, and whether an NFC normalizer runs first.
    Bytes(PreTok, bool),
    Spm(Spaces, bool),
}

fn byte_level_ok(v: &Value, want_regex: bool) -> Result<(), TokenizerError> {
    if flag(v, "add_prefix_space") == Some(true) {
        return Err(herr("ByteLevel with add_prefix_space is not supported"));
    }
    let regex = flag(v, "use_regex").unwrap_or(true);
    if regex != want_regex {
        return Err(herr(format!(
            "ByteLevel with use_regex {regex} is not supported in this position"
        )));
    }
    Ok(())
}

fn front(normalizer: &Value, pre: &Value) -> Result<Front, TokenizerError> {
    let parts = match normalizer {
        Value::Null => vec![],
        n if obj_type(n) == Some("Sequence") => {
            n["normalizers"].as_array().cloned().unwrap_or_default()
        }
        n => vec![n.clone()],
    };
    let is_prepend =
        |p: &Value| obj_type(p) == Some("Prepend") && p["prepend"].as_str() == Some("\u{2581}");
    let is_replace = |p: &Value| {
        obj_type(p) == Some("Replace")
            && p["pattern"]["String"].as_str() == Some(" ")
            && p["content"].as_str() == Some("\u{2581}")
    };
    // Split(" ", MergedWithPrevious) after spaces became "▁" splits nothing
    // (Gemma's tokenizer.json).
    let is_space_split = |p: &Value| {
        obj_type(p) == Some("Split")
            && p["pattern"]["String"].as_str() == Some(" ")
            && flag(p, "invert") != Some(true)
    };
    let nfc = match &parts[..] {
        [] => false,
        [n] if obj_type(n) == Some("NFC") => true,
        [a, b] if is_prepend(a) && is_replace(b) => {
            if !pre.is_null() {
                return Err(herr(format!(
                    "pre-tokenizer {} after a Prepend/Replace normalizer is not supported",
                    short(pre)
                )));
            }
            return Ok(Front::Spm(Spaces::PrependEvery, false));
        }
        [r] if is_replace(r) => {
            if !pre.is_null() && !is_space_split(pre) {
                return Err(herr(format!(
                    "pre-tokenizer {} after a Replace normalizer is not supported",
                    short(pre)
                )));
            }
            return Ok(Front::Spm(Spaces::ReplaceOnly, false));
        }
        _ => {
            return Err(herr(format!(
                "normalizer {} is not supported (only NFC, Replace(\" \", \"\u{2581}\"), or Prepend(\"\u{2581}\") + Replace(\" \", \"\u{2581}\"))",
                short(normalizer)
            )))
        }
    };
    let byte_level = |pre: PreTok| Ok(Front::Bytes(pre, nfc));
    match obj_type(pre) {
        Some("Metaspace") if !nfc => {
            if pre["replacement"].as_str() != Some("\u{2581}") {
                return Err(herr("Metaspace with a replacement other than \u{2581}"));
            }
            let scheme = pre["prepend_scheme"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| {
                    // Older files: add_prefix_space true/false.
                    if flag(pre, "add_prefix_space") == Some(false) {
                        "never".into()
                    } else {
                        "always".into()
                    }
                });
            let (first_only, prepend) = match scheme.as_str() {
                "first" => (true, true),
                "always" => (false, true),
                "never" => (false, false),
                other => return Err(herr(format!("Metaspace prepend_scheme {other:?}"))),
            };
            Ok(Front::Spm(
                Spaces::Metaspace {
                    first_only,
                    prepend,
                },
                flag(pre, "split").unwrap_or(true),
            ))
        }
        Some("ByteLevel") => {
            byte_level_ok(pre, true)?;
            byte_level(PreTok::Gpt2)
        }
        Some("Sequence") => {
            let parts = pre["pretokenizers"].as_array().cloned().unwrap_or_default();
            match &parts[..] {
                [a, b] if obj_type(a) == Some("Digits") && obj_type(b) == Some("ByteLevel") => {
                    if flag(a, "individual_digits") != Some(true) {
                        return Err(herr("Digits without individual_digits is not supported"));
                    }
                    byte_level_ok(b, true)?;
                    byte_level(PreTok::DigitsGpt2)
                }
                [a, b] if obj_type(a) == Some("Split") && obj_type(b) == Some("ByteLevel") => {
                    let split = match a["pattern"]["Regex"].as_str().unwrap_or_default() {
                        LLAMA3_SPLIT => Some(PreTok::Llama3),
                        QWEN2_SPLIT => Some(PreTok::Qwen2),
                        _ => None,
                    };
                    let Some(split) = split.filter(|_| {
                        a["behavior"].as_str() == Some("Isolated")
                            && flag(a, "invert") != Some(true)
                    }) else {
                        return Err(herr(format!(
                            "Split pre-tokenizer {} is not supported (only Llama 3's or Qwen2's regex, Isolated)",
                            short(a)
                        )));
                    };
                    byte_level_ok(b, false)?;
                    byte_level(split)
                }
                _ => Err(herr(format!(
                    "pre-tokenizer {} is not supported",
                    short(pre)
                ))),
            }
        }
        _ => Err(herr(format!(
            "pre-tokenizer {} is not supported{}",
            short(pre),
            if nfc {
                " after an NFC normalizer"
            } else {
                " (with no normalizer)"
            }
        ))),
    }
}

/// A component, shortened for a message.
fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 160 {
        format!(
            "{}...",
            &s[..s.char_indices().nth(150).map_or(s.len(), |(i, _)| i)]
        )
    } else {
        s
    }
}

/// The BOS token a `TemplateProcessing` post-processor puts first.
fn post_bos(post: &Value) -> Option<String> {
    let tp = match obj_type(post)? {
        "TemplateProcessing" => post,
        "Sequence" => post["processors"]
            .as_array()?
            .iter()
            .find(|p| obj_type(p) == Some("TemplateProcessing"))?,
        _ => return None,
    };
    let first = tp["single"].as_array()?.first()?;
    first["SpecialToken"]["id"].as_str().map(str::to_string)
}

fn merges_of(model: &Value) -> Result<Vec<(String, String)>, TokenizerError> {
    let Some(list) = model.get("merges").and_then(Value::as_array) else {
        return Err(herr("model.merges is missing"));
    };
    list.iter()
        .enumerate()
        .map(|(i, m)| match m {
            Value::String(s) => s
                .split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| herr(format!("merge #{i} {s:?} is not `left right`"))),
            Value::Array(p) => match &p[..] {
                [Value::String(a), Value::String(b)] => Ok((a.clone(), b.clone())),
                _ => Err(herr(format!("merge #{i} is not a pair of strings"))),
            },
            _ => Err(herr(format!("merge #{i} is neither a string nor a pair"))),
        })
        .collect()
}

impl Tokenizer {
    /// Builds a tokenizer from the bytes of a `tokenizer.json`, with the
    /// settings of `tokenizer_config.json` where given.
    pub fn from_hf_json(
        json: &[u8],
        config: Option<&HfTokenizerConfig>,
    ) -> Result<Tokenizer, TokenizerError> {
        let v: Value = serde_json::from_slice(json)
            .map_err(|e| herr(format!("tokenizer.json is not valid JSON: {e}")))?;
        let model = &v["model"];
        match obj_type(model) {
            Some("BPE") => {}
            Some(other) => {
                return Err(herr(format!(
                    "model type {other} is not supported (only BPE)"
                )))
            }
            None => return Err(herr("model.type is missing")),
        }
        if model.get("dropout").is_some_and(|d| !d.is_null()) {
            return Err(herr("BPE dropout is not supported"));
        }
        for k in ["continuing_subword_prefix", "end_of_word_suffix"] {
            if model
                .get(k)
                .and_then(Value::as_str)
                .is_some_and(|s| !s.is_empty())
            {
                return Err(herr(format!("BPE {k} is not supported")));
            }
        }
        let front = front(&v["normalizer"], &v["pre_tokenizer"])?;

        // Vocabulary: model.vocab plus added tokens, ids dense from 0.
        let Some(vocab_obj) = model.get("vocab").and_then(Value::as_object) else {
            return Err(herr("model.vocab is missing"));
        };
        let mut by_id: Vec<Option<String>> = Vec::new();
        let mut put = |id: u64, s: &str, what: &str| -> Result<(), TokenizerError> {
            if id >= MAX_VOCAB {
                return Err(herr(format!(
                    "{what} {s:?} has id {id}, above the {MAX_VOCAB} limit"
                )));
            }
            let id = id as usize;
            if by_id.len() <= id {
                by_id.resize(id + 1, None);
            }
            match &by_id[id] {
                Some(old) if old != s => Err(herr(format!("id {id} is both {old:?} and {s:?}"))),
                _ => {
                    by_id[id] = Some(s.to_string());
                    Ok(())
                }
            }
        };
        for (s, id) in vocab_obj {
            let id = id
                .as_u64()
                .ok_or_else(|| herr(format!("vocab entry {s:?} has id {id}")))?;
            put(id, s, "token")?;
        }
        let mut added: Vec<(u32, String, bool)> = Vec::new();
        if let Some(list) = v.get("added_tokens").and_then(Value::as_array) {
            for a in list {
                let (Some(id), Some(content)) = (a["id"].as_u64(), a["content"].as_str()) else {
                    return Err(herr(format!(
                        "added token {} lacks id or content",
                        short(a)
                    )));
                };
                for k in ["lstrip", "rstrip", "single_word"] {
                    if flag(a, k) == Some(true) {
                        return Err(herr(format!(
                            "added token {content:?} with {k} is not supported"
                        )));
                    }
                }
                put(id, content, "added token")?;
                added.push((
                    id as u32,
                    content.to_string(),
                    flag(a, "special") == Some(true),
                ));
            }
        }
        let n = by_id.len();
        if n == 0 {
            return Err(herr("the vocabulary is empty"));
        }
        if let Some(i) = by_id.iter().position(Option::is_none) {
            return Err(herr(format!(
                "token id {i} is missing (ids must be 0..{n})"
            )));
        }
        let texts: Vec<String> = by_id.into_iter().map(Option::unwrap_or_default).collect();
        let mut ids: FxHashMap<&str, u32> = FxHashMap::default();
        for (i, t) in texts.iter().enumerate() {
            ids.entry(t.as_str()).or_insert(i as u32);
        }
        let mut merges = FxHashMap::default();
        for (rank, (l, r)) in merges_of(model)?.into_iter().enumerate() {
            let (Some(&li), Some(&ri)) = (ids.get(l.as_str()), ids.get(r.as_str())) else {
                return Err(herr(format!(
                    "merge #{rank} ({l:?}, {r:?}): a side is not a token"
                )));
            };
            let m = format!("{l}{r}");
            let Some(&mi) = ids.get(m.as_str()) else {
                return Err(herr(format!("merge #{rank}: {m:?} is not a token")));
            };
            merges.entry((li, ri)).or_insert((rank as u32, mi));
        }
        let mut types = vec![TokenType::Normal; n];
        for (id, _, special) in &added {
            types[*id as usize] = if *special {
                TokenType::Control
            } else {
                TokenType::UserDefined
            };
        }
        let unk = match model.get("unk_token") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(
                *ids.get(s.as_str())
                    .ok_or_else(|| herr(format!("unk_token {s:?} is not a token")))?,
            ),
            Some(v) => return Err(herr(format!("unk_token {v} is not a string"))),
        };
        let lookup = |s: &Option<String>| s.as_deref().and_then(|s| ids.get(s).copied());
        let bos = lookup(&config.and_then(|c| c.bos_token.clone()))
            .or_else(|| lookup(&post_bos(&v["post_processor"])));
        let post_adds_bos = post_bos(&v["post_processor"]).is_some();
        let eos = lookup(&config.and_then(|c| c.eos_token.clone()));
        let add_bos_default = config
            .and_then(|c| c.add_bos_token)
            .unwrap_or(post_adds_bos);
        let ignore_merges = flag(model, "ignore_merges") == Some(true);

        let (kind, m, decode, strip) = match front {
            Front::Bytes(pre, nfc) => {
                let alphabet = bytes_to_unicode();
                let mut byte_ids = [None; 256];
                let mut inverse: FxHashMap<char, u8> = FxHashMap::default();
                for (b, c) in alphabet.iter().enumerate() {
                    let mut buf = [0u8; 4];
                    byte_ids[b] = ids.get(&*c.encode_utf8(&mut buf)).copied();
                    inverse.insert(*c, b as u8);
                }
                let decode: Vec<Vec<u8>> = texts
                    .iter()
                    .zip(&types)
                    .map(|(t, ty)| match ty {
                        TokenType::Normal => t
                            .chars()
                            .flat_map(|c| match inverse.get(&c) {
                                Some(&b) => vec![b],
                                None => c.to_string().into_bytes(),
                            })
                            .collect(),
                        _ => t.as_bytes().to_vec(),
                    })
                    .collect();
                let whole = if ignore_merges {
                    let mut w = FxHashMap::default();
                    for (i, d) in decode.iter().enumerate() {
                        if types[i] == TokenType::Normal {
                            w.entry(d.clone()).or_insert(i as u32);
                        }
                    }
                    Some(w)
                } else {
                    None
                };
                let m = Gpt2Model::new(pre, byte_ids, merges, whole).with_nfc(nfc);
                (
                    TokenizerKind::Gpt2Bpe,
                    Model::Gpt2(Box::new(m)),
                    decode,
                    false,
                )
            }
            Front::Spm(spaces, split) => {
                if ignore_merges {
                    return Err(herr("ignore_merges with a SentencePiece-style model"));
                }
                let byte_fallback = flag(model, "byte_fallback") == Some(true);
                let byte_ids = if byte_fallback {
                    let mut b = [0u32; 256];
                    for (x, slot) in b.iter_mut().enumerate() {
                        *slot = *ids.get(format!("<0x{x:02X}>").as_str()).ok_or_else(|| {
                            herr(format!(
                                "byte_fallback is on but <0x{x:02X}> is not a token"
                            ))
                        })?;
                    }
                    for &id in b.iter() {
                        if types[id as usize] == TokenType::Normal {
                            types[id as usize] = TokenType::Byte;
                        }
                    }
                    Some(b)
                } else {
                    None
                };
                let decode: Vec<Vec<u8>> = texts
                    .iter()
                    .zip(&types)
                    .map(|(t, ty)| match ty {
                        TokenType::Byte => byte_piece_value(t.as_bytes())
                            .map(|b| vec![b])
                            .unwrap_or_else(|| t.as_bytes().to_vec()),
                        TokenType::Normal => t.replace('\u{2581}', " ").into_bytes(),
                        _ => t.as_bytes().to_vec(),
                    })
                    .collect();
                // The decoder's Strip takes back the `▁` the encoder put first.
                let strip = matches!(
                    spaces,
                    Spaces::PrependEvery | Spaces::Metaspace { prepend: true, .. }
                );
                let m = HfSpmModel {
                    spaces,
                    split,
                    vocab: ids.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
                    merges,
                    byte_ids,
                    unk,
                    fuse_unk: flag(model, "fuse_unk") == Some(true),
                };
                (
                    TokenizerKind::HfSentencePiece,
                    Model::HfSpm(Box::new(m)),
                    decode,
                    strip,
                )
            }
        };
        let mut stop: Vec<u32> = eos.into_iter().collect();
        stop.sort_unstable();
        Tokenizer::build(Common {
            kind,
            model: m,
            texts: texts.iter().map(|t| t.as_bytes().to_vec()).collect(),
            decode,
            types,
            bos,
            eos,
            eot: None,
            stop,
            add_bos_default,
            add_space_prefix: false,
            strip_leading_space: strip,
            split_user_defined: true,
        })
        .map_err(herr)
    }
}
