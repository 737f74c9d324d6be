//! Tokenizers: Llama 3 tiktoken files, SentencePiece `.model` files (Llama 2
//! style BPE) and the tokenizers embedded in GGUF files (byte-level BPE with
//! merges, or SentencePiece-style scores).
//!
//! All of them are a [`Tokenizer`]: [`Tokenizer::encode`] text to ids,
//! [`Tokenizer::decode`] ids to text (lossy), [`Tokenizer::token_bytes`] for
//! the raw bytes of one token, and a [`StreamDecoder`] that turns a stream of
//! ids into text without splitting multi-byte characters.
//!
//! Special tokens: with [`EncodeOptions::parse_special`] off, text that spells
//! a special token (`<|eot_id|>`) is encoded as ordinary text; with it on, it
//! becomes the special id. User-defined tokens of GGUF vocabularies are always
//! matched whole (as llama.cpp does); SentencePiece user-defined symbols are
//! always kept whole (as sentencepiece does).
use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use rustc_hash::FxHashMap;
use thiserror::Error;

mod bpe;
pub mod gguf;
pub mod hf;
mod pretok;
pub mod sentencepiece;
pub mod stream;
pub mod tiktoken;

pub use gguf::GgufTokenizerParts;
pub use hf::HfTokenizerConfig;
pub use stream::StreamDecoder;

/// Errors from loading a tokenizer. Messages name the line, offset or token
/// that was wrong.
#[derive(Debug, Error)]
pub enum TokenizerError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("tiktoken file, line {line}: {msg}")]
    Tiktoken { line: usize, msg: String },
    #[error("tiktoken file: {0}")]
    TiktokenFile(String),
    #[error("sentencepiece model: {0}")]
    SentencePiece(String),
    #[error("GGUF tokenizer: {0}")]
    Gguf(String),
    #[error("tokenizer.json: {0}")]
    HfJson(String),
}

impl From<TokenizerError> for crate::Error {
    fn from(e: TokenizerError) -> Self {
        crate::Error::msg(e.to_string())
    }
}

/// Options for [`Tokenizer::encode`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Prepend the BOS token (if the vocabulary has one).
    pub add_bos: bool,
    /// Turn text that spells a special (control) token into that token.
    pub parse_special: bool,
}

/// Which algorithm a [`Tokenizer`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// tiktoken-style byte BPE by rank (Llama 3 `tokenizer.model`).
    Tiktoken,
    /// SentencePiece BPE by score (Llama 2 `tokenizer.model`, GGUF `llama`).
    SentencePiece,
    /// Byte-level BPE with merges (GPT-2 style, GGUF `gpt2`, Llama 3 and
    /// SmolLM2 `tokenizer.json`).
    Gpt2Bpe,
    /// SentencePiece-style BPE with merges by rank (Llama 2 / TinyLlama
    /// `tokenizer.json`).
    HfSentencePiece,
}

/// Token types, numbered as in sentencepiece and GGUF.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
}

impl TokenType {
    /// From the sentencepiece / GGUF number; unknown numbers are `None`.
    pub fn from_i32(v: i32) -> Option<TokenType> {
        Some(match v {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }
}

/// Leftmost-longest matcher over a set of token strings.
struct Matcher {
    ac: AhoCorasick,
    ids: Vec<u32>,
}

impl Matcher {
    fn new(pats: Vec<(Vec<u8>, u32)>) -> Result<Option<Matcher>, String> {
        let pats: Vec<(Vec<u8>, u32)> = pats.into_iter().filter(|(p, _)| !p.is_empty()).collect();
        if pats.is_empty() {
            return Ok(None);
        }
        let ac = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(pats.iter().map(|(p, _)| p.as_slice()))
            .map_err(|e| format!("building special-token matcher: {e}"))?;
        Ok(Some(Matcher {
            ac,
            ids: pats.into_iter().map(|(_, id)| id).collect(),
        }))
    }
}

enum Model {
    Tiktoken(tiktoken::TiktokenModel),
    SentencePiece(sentencepiece::SpmModel),
    Gpt2(Box<gguf::Gpt2Model>),
    HfSpm(Box<hf::HfSpmModel>),
}

/// A loaded tokenizer. Cheap to share (`&Tokenizer` is `Sync`).
pub struct Tokenizer {
    kind: TokenizerKind,
    model: Model,
    /// Bytes each id contributes to decoded text.
    decode: Vec<Vec<u8>>,
    types: Vec<TokenType>,
    /// Token strings exactly as the vocabulary stores them.
    text_to_id: FxHashMap<Vec<u8>, u32>,
    /// Tokens matched whole always (user-defined tokens of GGUF vocabularies).
    always: Option<Matcher>,
    /// Control and user-defined tokens together (used with `parse_special`).
    both: Option<Matcher>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    stop: Vec<u32>,
    add_bos_default: bool,
    /// Add a space before raw text at the start / after a special token.
    add_space_prefix: bool,
    /// Strip one leading space when decoding (sentencepiece's dummy prefix).
    strip_leading_space: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("n_vocab", &self.decode.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eot", &self.eot)
            .finish_non_exhaustive()
    }
}

/// Parts every constructor fills in; turned into a [`Tokenizer`] by `build`.
struct Common {
    kind: TokenizerKind,
    model: Model,
    /// Stored token strings (for `token_to_id`).
    texts: Vec<Vec<u8>>,
    decode: Vec<Vec<u8>>,
    types: Vec<TokenType>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    stop: Vec<u32>,
    add_bos_default: bool,
    add_space_prefix: bool,
    strip_leading_space: bool,
    /// Match user-defined tokens in front of the model (GGUF) instead of
    /// leaving them to the model (sentencepiece).
    split_user_defined: bool,
}

impl Tokenizer {
    fn build(c: Common) -> Result<Tokenizer, String> {
        let mut text_to_id = FxHashMap::default();
        for (i, t) in c.texts.iter().enumerate() {
            // First id wins for duplicated strings, like a lookup would.
            text_to_id.entry(t.clone()).or_insert(i as u32);
        }
        let mut special = Vec::new();
        let mut always = Vec::new();
        for (i, ty) in c.types.iter().enumerate() {
            let pat = (c.texts[i].clone(), i as u32);
            match ty {
                // As llama.cpp: control and unknown tokens need parse_special.
                TokenType::Control | TokenType::Unknown => special.push(pat),
                TokenType::UserDefined if c.split_user_defined => always.push(pat),
                _ => {}
            }
        }
        let both: Vec<_> = special.iter().chain(always.iter()).cloned().collect();
        Ok(Tokenizer {
            kind: c.kind,
            model: c.model,
            decode: c.decode,
            types: c.types,
            text_to_id,
            always: Matcher::new(always)?,
            both: Matcher::new(both)?,
            bos: c.bos,
            eos: c.eos,
            eot: c.eot,
            stop: c.stop,
            add_bos_default: c.add_bos_default,
            add_space_prefix: c.add_space_prefix,
            strip_leading_space: c.strip_leading_space,
        })
    }

    /// Which algorithm this tokenizer runs.
    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }

    /// For byte-level BPE: the `tokenizer.ggml.pre` name llama.cpp gives
    /// this tokenizer's split (`gpt-2`, `smollm`, `llama-bpe`, `qwen2`);
    /// `None` for the other kinds.
    pub fn llama_cpp_pre(&self) -> Option<&'static str> {
        match &self.model {
            Model::Gpt2(m) => Some(m.pre().llama_cpp_name()),
            _ => None,
        }
    }

    /// Number of token ids (base vocabulary plus special tokens).
    pub fn n_vocab(&self) -> usize {
        self.decode.len()
    }

    /// Beginning-of-sequence id.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence (end of text) id.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// End-of-turn id (`<|eot_id|>` for Llama 3, `<|im_end|>` for ChatML).
    pub fn eot_id(&self) -> Option<u32> {
        self.eot
    }

    /// Ids that end generation (eos, eot and friends such as `<|eom_id|>`).
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop
    }

    /// Is `id` one of [`Tokenizer::stop_ids`]?
    pub fn is_stop(&self, id: u32) -> bool {
        self.stop.contains(&id)
    }

    /// Whether the vocabulary asks for a BOS token by default (GGUF
    /// `tokenizer.ggml.add_bos_token`; true for Llama 2/3 files).
    pub fn add_bos_default(&self) -> bool {
        self.add_bos_default
    }

    /// Type of a token, `None` for ids out of range.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// Is `id` a control (special) token?
    pub fn is_special(&self, id: u32) -> bool {
        self.token_type(id) == Some(TokenType::Control)
    }

    /// The bytes token `id` contributes to decoded text, `None` if out of
    /// range. Special tokens give their text (tiktoken, GGUF byte-level) or
    /// nothing (sentencepiece control tokens), as the reference decoders do.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.decode.get(id as usize).map(|v| v.as_slice())
    }

    /// Id of the token whose vocabulary string is exactly `s` (the stored
    /// form: `"Ġthe"` for byte-level BPE, `"▁the"` for sentencepiece,
    /// `"<|eot_id|>"` for a special token).
    pub fn token_to_id(&self, s: &str) -> Option<u32> {
        self.text_to_id.get(s.as_bytes()).copied()
    }

    /// Encode `text` to token ids.
    pub fn encode(&self, text: &str, opts: EncodeOptions) -> Vec<u32> {
        let mut out = Vec::new();
        if opts.add_bos {
            if let Some(b) = self.bos {
                out.push(b);
            }
        }
        match &self.model {
            Model::Tiktoken(_) => {
                for chunk in tiktoken::meta_chunks(text) {
                    self.encode_fragments(chunk, opts.parse_special, &mut out);
                }
            }
            _ => self.encode_fragments(text, opts.parse_special, &mut out),
        }
        out
    }

    /// Split on special tokens, encode the raw text between them.
    fn encode_fragments(&self, text: &str, parse_special: bool, out: &mut Vec<u32>) {
        let matcher = if parse_special {
            self.both.as_ref()
        } else {
            self.always.as_ref()
        };
        let mut prev_special = true;
        let mut pos = 0;
        if let Some(m) = matcher {
            for mat in m.ac.find_iter(text) {
                let seg = &text[pos..mat.start()];
                if !seg.is_empty() {
                    self.encode_raw(seg, prev_special, pos == 0, out);
                }
                out.push(m.ids[mat.pattern().as_usize()]);
                prev_special = true;
                pos = mat.end();
            }
        }
        let seg = &text[pos..];
        if !seg.is_empty() {
            self.encode_raw(seg, prev_special, pos == 0, out);
        }
    }

    /// `at_start`: the segment starts the text (no special token before it).
    fn encode_raw(&self, text: &str, prev_special: bool, at_start: bool, out: &mut Vec<u32>) {
        match &self.model {
            Model::Tiktoken(m) => m.encode_ordinary(text, out),
            Model::Gpt2(m) => m.encode_ordinary(text, out),
            Model::SentencePiece(m) => {
                m.encode_ordinary(text, self.add_space_prefix && prev_special, out)
            }
            Model::HfSpm(m) => m.encode_segment(text, at_start, out),
        }
    }

    /// Sets the BOS and EOS ids and adds ids that end generation (a Hugging
    /// Face directory takes them from config.json, generation_config.json
    /// and tokenizer_config.json). Ids outside the vocabulary are ignored.
    pub fn set_special_ids(&mut self, bos: Option<u32>, eos: Option<u32>, stop: &[u32]) {
        let n = self.n_vocab() as u32;
        if let Some(b) = bos.filter(|&b| b < n) {
            self.bos = Some(b);
        }
        if let Some(e) = eos.filter(|&e| e < n) {
            self.eos = Some(e);
            self.stop.push(e);
        }
        self.stop.extend(stop.iter().copied().filter(|&s| s < n));
        self.stop.sort_unstable();
        self.stop.dedup();
    }

    /// Decode ids to text. Invalid UTF-8 and out-of-range ids become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        let mut at_start = true;
        for &id in ids {
            match self.decode.get(id as usize) {
                Some(b) => {
                    let ty = self.types[id as usize];
                    if self.strip_leading_space && at_start {
                        if ty == TokenType::Control {
                            continue;
                        }
                        at_start = false;
                        if ty != TokenType::Byte {
                            bytes.extend_from_slice(b.strip_prefix(b" ").unwrap_or(b));
                            continue;
                        }
                    }
                    bytes.extend_from_slice(b)
                }
                None => bytes.extend_from_slice("\u{FFFD}".as_bytes()),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_type_numbers() {
        assert_eq!(TokenType::from_i32(3), Some(TokenType::Control));
        assert_eq!(TokenType::from_i32(6), Some(TokenType::Byte));
        assert_eq!(TokenType::from_i32(0), None);
        assert_eq!(TokenType::from_i32(7), None);
    }
}
