//! Tokenizers described by GGUF metadata (`tokenizer.ggml.*`).
//!
//! The GGUF reader lives elsewhere; this module takes the plain arrays in a
//! [`GgufTokenizerParts`]:
//!
//! * `model == "gpt2"`: byte-level BPE. Tokens are strings in the GPT-2
//!   byte-to-unicode alphabet (`Ġ` for a space), `merges` are `"left right"`
//!   lines in priority order, and `pre` names the pre-tokenizer split. With
//!   Llama 3's pre-tokenizer (`llama-bpe`), a piece that is itself a token
//!   is taken whole (llama.cpp's `ignore_merges`).
//! * `model == "llama"`: SentencePiece-style BPE by score, with `<0xNN>` byte
//!   tokens for byte fallback (Llama 2 GGUFs).
//!
//! Special tokens: CONTROL tokens are matched whole only when
//! `parse_special` is set; USER_DEFINED tokens are always matched whole (as
//! llama.cpp's `tokenizer_st_partition` does).
use rustc_hash::FxHashMap;

use super::pretok;
use super::sentencepiece::{spm_decode_bytes, SpmModel, SpmSpec};
use super::{bpe, Common, Model, TokenType, Tokenizer, TokenizerError, TokenizerKind};

/// The `tokenizer.ggml.*` values of a GGUF file.
#[derive(Clone, Debug, Default)]
pub struct GgufTokenizerParts {
    /// `tokenizer.ggml.model`: `"gpt2"` or `"llama"`.
    pub model: String,
    /// `tokenizer.ggml.pre` (e.g. `"smollm"`, `"llama-bpe"`, `"gpt2"`).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens` as raw bytes.
    pub tokens: Vec<Vec<u8>>,
    /// `tokenizer.ggml.scores` (needed for `llama`).
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control,
    /// 4 user-defined, 5 unused, 6 byte). All normal when absent.
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges` (needed for `gpt2`).
    pub merges: Option<Vec<String>>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// `tokenizer.ggml.eot_token_id`; when absent it is guessed from the
    /// vocabulary as llama.cpp does (`<|eot_id|>`, `<|im_end|>`, ...).
    pub eot_id: Option<u32>,
    pub unk_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`. Default: true for `llama`, false
    /// for `gpt2`.
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix` (`llama` only). Default true.
    pub add_space_prefix: Option<bool>,
}

impl From<&crate::weights::gguf::TokenizerParts> for GgufTokenizerParts {
    /// The tokenizer keys a GGUF reader found.
    fn from(t: &crate::weights::gguf::TokenizerParts) -> Self {
        GgufTokenizerParts {
            model: t.model.clone(),
            pre: t.pre.clone(),
            tokens: t.tokens.iter().map(|s| s.as_bytes().to_vec()).collect(),
            scores: t.scores.clone(),
            token_types: t.token_type.clone(),
            merges: t.merges.clone(),
            bos_id: t.bos_token_id,
            eos_id: t.eos_token_id,
            eot_id: t.eot_token_id,
            unk_id: t.unknown_token_id,
            add_bos: t.add_bos_token,
            add_space_prefix: t.add_space_prefix,
        }
    }
}

/// Texts llama.cpp treats as end-of-generation tokens.
const EOG_TEXTS: [&str; 9] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
];

/// Pre-tokenizer splits for byte-level BPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PreTok {
    /// GPT-2 pattern.
    Gpt2,
    /// Each `\p{N}` alone, then the GPT-2 pattern (llama.cpp `smollm`,
    /// `starcoder`, ...).
    DigitsGpt2,
    /// Llama 3 pattern.
    Llama3,
    /// Qwen2 pattern (Llama 3's with single digits).
    Qwen2,
}

impl PreTok {
    /// The `tokenizer.ggml.pre` name llama.cpp gives this split (what
    /// `convert` writes; every one of them loads in llama.cpp).
    pub(crate) fn llama_cpp_name(self) -> &'static str {
        match self {
            PreTok::Gpt2 => "gpt-2",
            PreTok::DigitsGpt2 => "smollm",
            PreTok::Llama3 => "llama-bpe",
            PreTok::Qwen2 => "qwen2",
        }
    }
}

/// Map `tokenizer.ggml.pre` to a split. Only names whose llama.cpp regexes
/// are known to equal one of ours are accepted. A missing value falls back to
/// the plain GPT-2 pattern (llama.cpp's "default" differs slightly). `gpt2`
/// is not a name llama.cpp knows (its name is `gpt-2`), but files written by
/// earlier versions of `convert` carry it, so it is read as `gpt-2`.
fn pre_tok(name: Option<&str>) -> Result<PreTok, String> {
    Ok(match name {
        None | Some("gpt-2" | "phi-2" | "gpt2") => PreTok::Gpt2,
        Some(
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva",
        ) => PreTok::DigitsGpt2,
        Some("llama3" | "llama-v3" | "llama-bpe") => PreTok::Llama3,
        Some("qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2") => PreTok::Qwen2,
        Some(other) => return Err(format!("pre-tokenizer {other:?} is not supported")),
    })
}

/// GPT-2's byte <-> unicode alphabet.
pub fn bytes_to_unicode() -> [char; 256] {
    let mut t = ['\0'; 256];
    let mut n = 0u32;
    for (b, slot) in t.iter_mut().enumerate() {
        let printable =
            (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        *slot = if printable {
            char::from(b as u8)
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\0');
            n += 1;
            c
        };
    }
    t
}

pub(crate) struct Gpt2Model {
    pre: PreTok,
    /// Token id of each byte's alphabet character.
    byte_ids: [Option<u32>; 256],
    /// (left id, right id) -> (rank, merged id).
    merges: FxHashMap<(u32, u32), (u32, u32)>,
    /// With `ignore_merges` (Llama 3's tokenizer.json, llama.cpp's
    /// `llama-bpe`): the bytes of every normal token, so that a piece that is
    /// itself a token is taken whole instead of merged.
    whole: Option<FxHashMap<Vec<u8>, u32>>,
    /// Unicode NFC before splitting (a `tokenizer.json` `NFC` normalizer,
    /// as Qwen's files have; GGUF files never ask for it).
    nfc: bool,
}

impl Gpt2Model {
    pub(crate) fn new(
        pre: PreTok,
        byte_ids: [Option<u32>; 256],
        merges: FxHashMap<(u32, u32), (u32, u32)>,
        whole: Option<FxHashMap<Vec<u8>, u32>>,
    ) -> Self {
        Gpt2Model {
            pre,
            byte_ids,
            merges,
            whole,
            nfc: false,
        }
    }

    /// Normalize each segment to NFC first.
    pub(crate) fn with_nfc(mut self, nfc: bool) -> Self {
        self.nfc = nfc;
        self
    }

    /// The split this model runs.
    pub(crate) fn pre(&self) -> PreTok {
        self.pre
    }

    pub(crate) fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) {
        use unicode_normalization::{is_nfc_quick, IsNormalized, UnicodeNormalization};
        let normalized: String;
        let text = if self.nfc && is_nfc_quick(text.chars()) != IsNormalized::Yes {
            normalized = text.nfc().collect();
            normalized.as_str()
        } else {
            text
        };
        let mut pieces = Vec::new();
        match self.pre {
            PreTok::Gpt2 => pretok::split_gpt2(text, 0, &mut pieces),
            PreTok::DigitsGpt2 => pretok::split_digits_then_gpt2(text, &mut pieces),
            PreTok::Llama3 => pretok::split_llama3(text, &mut pieces),
            PreTok::Qwen2 => pretok::split_qwen2(text, &mut pieces),
        }
        for (a, b) in pieces {
            if let Some(&id) = self
                .whole
                .as_ref()
                .and_then(|w| w.get(&text.as_bytes()[a..b]))
            {
                out.push(id);
                continue;
            }
            // Bytes without a token are dropped, as Hugging Face's BPE does
            // when there is no unknown token.
            let init: Vec<u32> = text.as_bytes()[a..b]
                .iter()
                .filter_map(|&x| self.byte_ids[x as usize])
                .collect();
            let merged = bpe::merge(init, |l, r| self.merges.get(&(l, r)).copied());
            out.extend(merged);
        }
    }
}

fn gerr(s: String) -> TokenizerError {
    TokenizerError::Gguf(s)
}

impl Tokenizer {
    /// Build a tokenizer from the `tokenizer.ggml.*` values of a GGUF file.
    pub fn from_gguf_parts(p: GgufTokenizerParts) -> Result<Tokenizer, TokenizerError> {
        let n = p.tokens.len();
        if n == 0 {
            return Err(gerr("tokenizer.ggml.tokens is empty".into()));
        }
        u32::try_from(n).map_err(|_| gerr(format!("{n} tokens do not fit in u32")))?;
        let types: Vec<TokenType> = match &p.token_types {
            None => vec![TokenType::Normal; n],
            Some(t) => {
                if t.len() != n {
                    return Err(gerr(format!(
                        "tokenizer.ggml.token_type has {} entries, tokens has {n}",
                        t.len()
                    )));
                }
                t.iter()
                    .enumerate()
                    .map(|(i, &v)| {
                        TokenType::from_i32(v)
                            .ok_or_else(|| gerr(format!("token {i}: unknown token type {v}")))
                    })
                    .collect::<Result<_, _>>()?
            }
        };
        let check = |what: &str, id: Option<u32>| -> Result<Option<u32>, TokenizerError> {
            match id {
                Some(i) if i as usize >= n => {
                    Err(gerr(format!("{what} {i} out of range ({n} tokens)")))
                }
                _ => Ok(id),
            }
        };
        let bos = check("bos_token_id", p.bos_id)?;
        let eos = check("eos_token_id", p.eos_id)?;
        let unk = check("unknown_token_id", p.unk_id)?;
        let mut eot = check("eot_token_id", p.eot_id)?;
        // llama.cpp-style guess of eot and of all end-of-generation ids.
        let mut stop: Vec<u32> = eos.into_iter().collect();
        for want in EOG_TEXTS {
            if let Some(i) = p.tokens.iter().position(|t| t == want.as_bytes()) {
                if types[i] == TokenType::Control || types[i] == TokenType::UserDefined {
                    if eot.is_none()
                        && (want == "<|eot_id|>"
                            || want == "<|im_end|>"
                            || want == "<|end|>"
                            || want == "<end_of_turn>"
                            || want == "<EOT>"
                            || want == "_<EOT>")
                    {
                        eot = Some(i as u32);
                    }
                    stop.push(i as u32);
                }
            }
        }
        if let Some(e) = eot {
            stop.push(e);
        }
        stop.sort_unstable();
        stop.dedup();

        match p.model.as_str() {
            "gpt2" => {
                let pre = pre_tok(p.pre.as_deref()).map_err(gerr)?;
                let mut ids: FxHashMap<&[u8], u32> = FxHashMap::default();
                for (i, t) in p.tokens.iter().enumerate() {
                    ids.entry(t.as_slice()).or_insert(i as u32);
                }
                let alphabet = bytes_to_unicode();
                let mut byte_ids = [None; 256];
                let mut inverse: FxHashMap<char, u8> = FxHashMap::default();
                for (b, c) in alphabet.iter().enumerate() {
                    let mut buf = [0u8; 4];
                    byte_ids[b] = ids.get(c.encode_utf8(&mut buf).as_bytes()).copied();
                    inverse.insert(*c, b as u8);
                }
                let merges_in = p
                    .merges
                    .as_ref()
                    .ok_or_else(|| gerr("model gpt2 needs tokenizer.ggml.merges".into()))?;
                let mut merges = FxHashMap::default();
                for (rank, line) in merges_in.iter().enumerate() {
                    let Some((l, r)) = line.split_once(' ') else {
                        return Err(gerr(format!("merge #{rank} {line:?} is not `left right`")));
                    };
                    let (Some(&li), Some(&ri)) = (ids.get(l.as_bytes()), ids.get(r.as_bytes()))
                    else {
                        return Err(gerr(format!(
                            "merge #{rank} {line:?}: a side is not a token"
                        )));
                    };
                    let m = format!("{l}{r}");
                    let Some(&mi) = ids.get(m.as_bytes()) else {
                        return Err(gerr(format!(
                            "merge #{rank} {line:?}: result {m:?} is not a token"
                        )));
                    };
                    // Earlier merges win when a pair appears twice.
                    merges.entry((li, ri)).or_insert((rank as u32, mi));
                }
                // llama.cpp's `ignore_merges` for the Llama 3 pre-tokenizer: a
                // piece that is a token is that token, unmerged. The piece is
                // compared in the byte alphabet, so any token whose text is
                // all alphabet characters can match.
                let whole = if pre == PreTok::Llama3 {
                    let mut w: FxHashMap<Vec<u8>, u32> = FxHashMap::default();
                    for (i, t) in p.tokens.iter().enumerate() {
                        let Ok(s) = std::str::from_utf8(t) else {
                            continue;
                        };
                        let bytes: Option<Vec<u8>> =
                            s.chars().map(|c| inverse.get(&c).copied()).collect();
                        if let Some(b) = bytes.filter(|b| !b.is_empty()) {
                            w.entry(b).or_insert(i as u32);
                        }
                    }
                    Some(w)
                } else {
                    None
                };
                let mut decode = Vec::with_capacity(n);
                for (i, t) in p.tokens.iter().enumerate() {
                    let bytes = match types[i] {
                        TokenType::Normal | TokenType::Unused | TokenType::Unknown => {
                            match std::str::from_utf8(t) {
                                Ok(s) => {
                                    // Characters outside the alphabet are kept as UTF-8.
                                    let mut v = Vec::with_capacity(s.len());
                                    for c in s.chars() {
                                        match inverse.get(&c) {
                                            Some(&b) => v.push(b),
                                            None => {
                                                let mut buf = [0u8; 4];
                                                v.extend_from_slice(
                                                    c.encode_utf8(&mut buf).as_bytes(),
                                                );
                                            }
                                        }
                                    }
                                    v
                                }
                                Err(_) => t.clone(),
                            }
                        }
                        _ => t.clone(),
                    };
                    decode.push(bytes);
                }
                Tokenizer::build(Common {
                    kind: TokenizerKind::Gpt2Bpe,
                    model: Model::Gpt2(Box::new(Gpt2Model {
                        pre,
                        byte_ids,
                        merges,
                        whole,
                        nfc: false,
                    })),
                    texts: p.tokens.clone(),
                    decode,
                    types,
                    bos,
                    eos,
                    eot,
                    stop,
                    add_bos_default: p.add_bos.unwrap_or(false),
                    add_space_prefix: false,
                    strip_leading_space: false,
                    split_user_defined: true,
                })
                .map_err(gerr)
            }
            "llama" => {
                let scores = p
                    .scores
                    .as_ref()
                    .ok_or_else(|| gerr("model llama needs tokenizer.ggml.scores".into()))?;
                if scores.len() != n {
                    return Err(gerr(format!(
                        "tokenizer.ggml.scores has {} entries, tokens has {n}",
                        scores.len()
                    )));
                }
                let unk = unk.or_else(|| {
                    types
                        .iter()
                        .position(|&t| t == TokenType::Unknown)
                        .map(|i| i as u32)
                });
                let has_bytes = (0..=255u8).all(|b| {
                    let name = format!("<0x{b:02X}>");
                    p.tokens.iter().any(|t| t == name.as_bytes())
                });
                // Gemma's files store its whitespace-run tokens ("  ", ...)
                // as user-defined tokens spelled with real spaces. Its own
                // tokenizer (and transformers reading the GGUF) treats them
                // as the ordinary pieces "▁▁", ... that BPE reaches by
                // merging; matched whole in the raw text (as llama.cpp does)
                // they cut long space runs differently. So they are spelled
                // with "▁" and merged like any piece.
                let mut spm_texts = p.tokens.clone();
                let mut spm_types = types.clone();
                // Without a prefix space (Gemma), the stored scores do not
                // follow the merge order, the order of the vocabulary does
                // (what transformers assumes too when it reads such a GGUF).
                let by_position = p.add_space_prefix == Some(false);
                let mut spm_scores: Vec<f32> = if by_position {
                    (0..n).map(|i| -(i as f32)).collect()
                } else {
                    scores.clone()
                };
                {
                    let known: std::collections::HashSet<&[u8]> =
                        p.tokens.iter().map(|t| t.as_slice()).collect();
                    for (i, t) in p.tokens.iter().enumerate() {
                        let spaces = !t.is_empty() && t.iter().all(|&b| b == b' ');
                        if spaces && types[i] == TokenType::UserDefined {
                            let respelled = "\u{2581}".repeat(t.len()).into_bytes();
                            if !known.contains(respelled.as_slice()) {
                                spm_texts[i] = respelled;
                                spm_types[i] = TokenType::Normal;
                                // Their stored score (0) would merge them
                                // first; their place in the vocabulary is
                                // their merge rank, as for Gemma's other
                                // pieces.
                                spm_scores[i] = -(i as f32);
                            }
                        }
                    }
                }
                let model = SpmModel::new(SpmSpec {
                    texts: &spm_texts,
                    types: &spm_types,
                    scores: &spm_scores,
                    unk_id: unk,
                    byte_fallback: has_bytes,
                    remove_extra_whitespaces: false,
                    escape_whitespaces: true,
                    match_user_defined: false,
                })
                .map_err(gerr)?;
                let decode = p
                    .tokens
                    .iter()
                    .zip(&types)
                    .map(|(t, &ty)| spm_decode_bytes(t, ty, " \u{2047} "))
                    .collect();
                let add_space_prefix = p.add_space_prefix.unwrap_or(true);
                Tokenizer::build(Common {
                    kind: TokenizerKind::SentencePiece,
                    model: Model::SentencePiece(model),
                    texts: p.tokens.clone(),
                    decode,
                    types: spm_types,
                    bos,
                    eos,
                    eot,
                    stop,
                    add_bos_default: p.add_bos.unwrap_or(true),
                    add_space_prefix,
                    strip_leading_space: add_space_prefix,
                    split_user_defined: true,
                })
                .map_err(gerr)
            }
            other => Err(gerr(format!(
                "tokenizer.ggml.model {other:?} is not supported (expected \"gpt2\" or \"llama\")"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_a_bijection() {
        let t = bytes_to_unicode();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        let mut v: Vec<char> = t.to_vec();
        v.sort();
        v.dedup();
        assert_eq!(v.len(), 256);
    }

    #[test]
    fn tiny_gpt2_vocab() {
        let toks = ["a", "b", "Ġ", "ab", "Ġab", "<|x|>"];
        let parts = GgufTokenizerParts {
            model: "gpt2".into(),
            pre: Some("gpt2".into()),
            tokens: toks.iter().map(|s| s.as_bytes().to_vec()).collect(),
            token_types: Some(vec![1, 1, 1, 1, 1, 3]),
            merges: Some(vec!["a b".into(), "Ġ ab".into()]),
            eos_id: Some(5),
            ..Default::default()
        };
        let t = Tokenizer::from_gguf_parts(parts).unwrap();
        let o = super::super::EncodeOptions::default();
        assert_eq!(t.encode("ab ab", o), vec![3, 4]);
        assert_eq!(t.encode("ba<|x|>", o), vec![1, 0]);
        let os = super::super::EncodeOptions {
            parse_special: true,
            add_bos: false,
        };
        assert_eq!(t.encode("ba<|x|>", os), vec![1, 0, 5]);
        assert_eq!(t.decode(&[3, 4, 5]), "ab ab<|x|>");
        assert_eq!(t.token_to_id("Ġab"), Some(4));
    }
}
