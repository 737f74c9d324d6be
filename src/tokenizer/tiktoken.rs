//! Llama 3 tokenizer: a tiktoken BPE file plus Meta's 256 special tokens.
//!
//! File format (`tokenizer.model` of Llama 3): one token per line, `BASE64
//! RANK`, ranks `0..n`. Token ids are ranks; special tokens follow at
//! `n, n+1, ...` (128000.. for Llama 3) in the order
//! `llama_models/llama3/tokenizer.py` lists them.
//!
//! Encoding is what `llama_models.llama3.tokenizer.Tokenizer.encode` does:
//! the text is cut into 400 000-character chunks and runs of more than
//! 25 000 whitespace / non-whitespace characters are cut (Meta's workaround
//! for tiktoken's regex stack limits), each piece is split with the Llama 3
//! pattern (see `pretok.rs`) and each part is byte-pair merged by rank.
use std::path::Path;

use base64::Engine;
use rustc_hash::FxHashMap;

use super::{bpe, pretok, Common, Model, TokenType, Tokenizer, TokenizerError, TokenizerKind};

/// Number of special tokens Meta reserves after the base vocabulary.
pub const LLAMA3_NUM_SPECIAL_TOKENS: usize = 256;

/// Meta's Llama 3 special tokens, in id order (first id = number of base
/// tokens, 128000 for the real vocabulary).
pub fn llama3_special_tokens() -> Vec<String> {
    let mut v: Vec<String> = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
        "<|image|>",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let named = v.len();
    for i in 0..LLAMA3_NUM_SPECIAL_TOKENS - named {
        v.push(format!("<|reserved_special_token_{}|>", 2 + i));
    }
    v
}

/// Parse a tiktoken BPE file. Returns the token bytes indexed by rank.
///
/// Blank lines are skipped. Errors (naming the 1-based line): a line that is
/// not `TOKEN RANK`, bad base64, a rank that is not a number, a duplicate
/// rank or duplicate token, and ranks that are not exactly `0..n`.
pub fn parse_tiktoken_bpe(data: &[u8]) -> Result<Vec<Vec<u8>>, TokenizerError> {
    let text = std::str::from_utf8(data).map_err(|e| {
        TokenizerError::TiktokenFile(format!("not UTF-8 at byte offset {}", e.valid_up_to()))
    })?;
    let err = |line: usize, msg: String| TokenizerError::Tiktoken { line, msg };
    let mut entries: Vec<(Vec<u8>, u32, usize)> = Vec::new();
    let mut seen_tok: FxHashMap<Vec<u8>, usize> = FxHashMap::default();
    for (ln0, line) in text.lines().enumerate() {
        let ln = ln0 + 1;
        if line.trim().is_empty() {
            continue;
        }
        let mut parts = line.split_ascii_whitespace();
        let (Some(tok), Some(rank), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(err(
                ln,
                format!("expected `BASE64 RANK`, got {:?}", clip(line)),
            ));
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(tok)
            .map_err(|e| err(ln, format!("bad base64 {:?}: {e}", clip(tok))))?;
        let rank: u32 = rank.parse().map_err(|_| {
            err(
                ln,
                format!("rank {:?} is not a non-negative integer", clip(rank)),
            )
        })?;
        if let Some(prev) = seen_tok.insert(bytes.clone(), ln) {
            return Err(err(
                ln,
                format!("duplicate token {tok:?} (first on line {prev})"),
            ));
        }
        entries.push((bytes, rank, ln));
    }
    let n = entries.len();
    if n == 0 {
        return Err(TokenizerError::TiktokenFile("no tokens".into()));
    }
    let mut by_rank: Vec<Option<(Vec<u8>, usize)>> = vec![None; n];
    for (bytes, rank, ln) in entries {
        let r = rank as usize;
        if r >= n {
            return Err(err(
                ln,
                format!("rank {rank} out of range: {n} tokens need ranks 0..{n}"),
            ));
        }
        if let Some((_, prev)) = &by_rank[r] {
            return Err(err(
                ln,
                format!("duplicate rank {rank} (first on line {prev})"),
            ));
        }
        by_rank[r] = Some((bytes, ln));
    }
    // With n entries, no duplicates and all ranks < n, every slot is full.
    Ok(by_rank.into_iter().flatten().map(|(b, _)| b).collect())
}

/// The byte-pair merges under which a merge-list BPE (GGUF `gpt2`,
/// `tokenizer.json`) reproduces tiktoken's rank-driven merging, derived as
/// transformers' `TikTokenConverter` derives them: for every token of two or
/// more bytes, every split into two tokens `(left, right)`, ordered by the
/// token's rank, then by the ranks of `left` and `right`. (tiktoken merges
/// any adjacent pair whose concatenation is a token, so every split has to
/// be a merge; for Llama 3 that is 280 147 merges for 128 000 tokens.)
/// `tokens` is indexed by rank, as [`parse_tiktoken_bpe`] returns it.
pub fn merges_from_ranks(tokens: &[Vec<u8>]) -> Vec<(u32, u32)> {
    let rank: FxHashMap<&[u8], u32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_slice(), i as u32))
        .collect();
    let mut out = Vec::new();
    let mut local = Vec::new();
    for t in tokens {
        local.clear();
        for k in 1..t.len() {
            if let (Some(&l), Some(&r)) = (rank.get(&t[..k]), rank.get(&t[k..])) {
                local.push((l, r));
            }
        }
        local.sort_unstable();
        out.extend_from_slice(&local);
    }
    out
}

fn clip(s: &str) -> String {
    s.chars().take(60).collect()
}

pub(crate) struct TiktokenModel {
    encoder: FxHashMap<Vec<u8>, u32>,
}

impl TiktokenModel {
    pub(crate) fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) {
        let mut pieces = Vec::new();
        pretok::split_llama3(text, &mut pieces);
        for (a, b) in pieces {
            let piece = &text.as_bytes()[a..b];
            self.encode_piece(piece, out);
        }
    }

    fn encode_piece(&self, piece: &[u8], out: &mut Vec<u32>) {
        if let Some(&id) = self.encoder.get(piece) {
            out.push(id);
            return;
        }
        let init: Vec<(usize, usize)> = (0..piece.len()).map(|i| (i, i + 1)).collect();
        let parts = bpe::merge(init, |l, r| {
            self.encoder
                .get(&piece[l.0..r.1])
                .map(|&rank| (rank, (l.0, r.1)))
        });
        for (a, b) in parts {
            // A vocabulary without some single byte has nothing sensible to
            // emit for it (tiktoken would panic): skip it.
            if let Some(&id) = self.encoder.get(&piece[a..b]) {
                out.push(id);
            }
        }
    }
}

/// Meta's chunking: 400 000-character chunks, then cuts so that no piece
/// has more than 25 000 consecutive whitespace or non-whitespace characters
/// (`str.isspace()` semantics).
pub(crate) fn meta_chunks(s: &str) -> Vec<&str> {
    const MAX_CHARS: usize = 400_000;
    const MAX_RUN: usize = 25_000;
    let mut out = Vec::new();
    let mut chunk_starts = Vec::new();
    for (k, (i, _)) in s.char_indices().enumerate() {
        if k % MAX_CHARS == 0 {
            chunk_starts.push(i);
        }
    }
    if chunk_starts.is_empty() {
        return vec![s];
    }
    chunk_starts.push(s.len());
    for w in chunk_starts.windows(2) {
        let chunk = &s[w[0]..w[1]];
        let mut cur_space = chunk.chars().next().is_some_and(pretok::is_py_space);
        let mut cur_len = 0usize;
        let mut start = 0usize;
        for (i, c) in chunk.char_indices() {
            let sp = pretok::is_py_space(c);
            if cur_space ^ sp {
                cur_len = 1;
                cur_space = sp;
            } else {
                cur_len += 1;
                if cur_len > MAX_RUN {
                    out.push(&chunk[start..i]);
                    start = i;
                    cur_len = 1;
                }
            }
        }
        out.push(&chunk[start..]);
    }
    out
}

impl Tokenizer {
    /// Load Meta's Llama 3 `tokenizer.model` (tiktoken format) from a file.
    pub fn from_tiktoken_file(path: impl AsRef<Path>) -> Result<Tokenizer, TokenizerError> {
        let path = path.as_ref();
        let data = std::fs::read(path).map_err(|source| TokenizerError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_tiktoken_bytes(&data)
    }

    /// Load a Llama 3 tiktoken vocabulary from memory, adding Meta's 256
    /// special tokens after the base tokens.
    pub fn from_tiktoken_bytes(data: &[u8]) -> Result<Tokenizer, TokenizerError> {
        let base = parse_tiktoken_bpe(data)?;
        let n_base = base.len();
        let specials = llama3_special_tokens();
        let mut encoder = FxHashMap::default();
        encoder.reserve(n_base);
        for (i, b) in base.iter().enumerate() {
            encoder.insert(b.clone(), i as u32);
        }
        let total = n_base + specials.len();
        u32::try_from(total).map_err(|_| {
            TokenizerError::TiktokenFile(format!("{total} tokens do not fit in u32"))
        })?;
        let mut texts = base;
        let mut types = vec![TokenType::Normal; n_base];
        for s in &specials {
            texts.push(s.as_bytes().to_vec());
            types.push(TokenType::Control);
        }
        let id = |name: &str| {
            specials
                .iter()
                .position(|s| s == name)
                .map(|p| (n_base + p) as u32)
        };
        let (bos, eos, eot, eom) = (
            id("<|begin_of_text|>"),
            id("<|end_of_text|>"),
            id("<|eot_id|>"),
            id("<|eom_id|>"),
        );
        let stop = [eos, eom, eot].into_iter().flatten().collect();
        Tokenizer::build(Common {
            kind: TokenizerKind::Tiktoken,
            model: Model::Tiktoken(TiktokenModel { encoder }),
            decode: texts.clone(),
            texts,
            types,
            bos,
            eos,
            eot,
            stop,
            add_bos_default: true,
            add_space_prefix: false,
            strip_leading_space: false,
            split_user_defined: false,
        })
        .map_err(TokenizerError::TiktokenFile)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_token_list_matches_meta() {
        let v = llama3_special_tokens();
        assert_eq!(v.len(), 256);
        assert_eq!(v[0], "<|begin_of_text|>");
        assert_eq!(v[9], "<|eot_id|>");
        assert_eq!(v[11], "<|image|>");
        assert_eq!(v[12], "<|reserved_special_token_2|>");
        assert_eq!(v[255], "<|reserved_special_token_245|>");
    }

    #[test]
    fn merges_are_every_split_in_rank_order() {
        let toks: Vec<Vec<u8>> = ["a", "b", "c", "ab", "bc", "abc", "ca"]
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect();
        // ab = a+b; bc = b+c; abc = a+bc (ranks 0, 4) and ab+c (3, 2),
        // sorted by the left rank; ca = c+a.
        assert_eq!(
            merges_from_ranks(&toks),
            vec![(0, 1), (1, 2), (0, 4), (3, 2), (2, 0)]
        );
    }

    #[test]
    fn meta_chunks_cut_long_runs() {
        let s = format!("{}{}", "a".repeat(60_000), " ".repeat(3));
        let c = meta_chunks(&s);
        let lens: Vec<usize> = c.iter().map(|x| x.len()).collect();
        assert_eq!(lens, vec![25_000, 25_000, 10_003]);
        assert_eq!(meta_chunks(""), vec![""]);
    }
}
