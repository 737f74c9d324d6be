//! SentencePiece BPE models (Llama 2 style `tokenizer.model`).
//!
//! The `ModelProto` protobuf is parsed by hand (only the fields needed):
//!
//! * `pieces` (1): `piece` (1, string), `score` (2, float), `type` (3, enum)
//! * `trainer_spec` (2): `model_type` (3), `treat_whitespace_as_suffix` (24),
//!   `byte_fallback` (35), `unk_id` (40), `bos_id` (41), `eos_id` (42),
//!   `pad_id` (43), `unk_surface` (44)
//! * `normalizer_spec` (3): `name` (1), `precompiled_charsmap` (2),
//!   `add_dummy_prefix` (3), `remove_extra_whitespaces` (4),
//!   `escape_whitespaces` (5)
//!
//! Every length is checked against the bytes that remain, so hostile input
//! gives an error naming the offset, never a panic or a huge allocation.
//!
//! Encoding follows sentencepiece's `bpe::Model::SampleEncode` (with no
//! dropout): the normalized text is split into characters (user-defined
//! symbols kept whole and frozen), then the adjacent pair whose concatenation
//! is a piece with the highest score is merged (ties: leftmost) until none
//! is left; pieces of type UNUSED are split back; characters that are not
//! pieces become `<0xNN>` byte pieces when `byte_fallback` is on, else the
//! unknown piece.
//!
//! Only the identity normalizer is supported (as in Llama 2); a model with
//! a precompiled normalization charsmap (e.g. `nmt_nfkc`) is rejected.
use std::path::Path;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, Anchored, Input, MatchKind, StartKind};
use rustc_hash::FxHashMap;

use super::{bpe, Common, Model, TokenType, Tokenizer, TokenizerError, TokenizerKind};

/// One entry of `ModelProto.pieces`.
#[derive(Clone, Debug, PartialEq)]
pub struct SpmPiece {
    pub piece: String,
    pub score: f32,
    pub kind: TokenType,
}

/// The parts of a sentencepiece `ModelProto` this crate uses.
#[derive(Clone, Debug, PartialEq)]
pub struct SpmModelProto {
    pub pieces: Vec<SpmPiece>,
    /// `TrainerSpec.model_type`: 1 UNIGRAM, 2 BPE, 3 WORD, 4 CHAR.
    pub model_type: i32,
    pub byte_fallback: bool,
    pub treat_whitespace_as_suffix: bool,
    pub unk_id: i32,
    pub bos_id: i32,
    pub eos_id: i32,
    pub pad_id: i32,
    pub unk_surface: String,
    pub normalizer_name: String,
    pub precompiled_charsmap_len: usize,
    pub add_dummy_prefix: bool,
    pub remove_extra_whitespaces: bool,
    pub escape_whitespaces: bool,
}

impl Default for SpmModelProto {
    /// The protobuf defaults.
    fn default() -> Self {
        SpmModelProto {
            pieces: Vec::new(),
            model_type: 1,
            byte_fallback: false,
            treat_whitespace_as_suffix: false,
            unk_id: 0,
            bos_id: 1,
            eos_id: 2,
            pad_id: -1,
            unk_surface: " \u{2047} ".to_string(),
            normalizer_name: String::new(),
            precompiled_charsmap_len: 0,
            add_dummy_prefix: true,
            remove_extra_whitespaces: true,
            escape_whitespaces: true,
        }
    }
}

/// Protobuf wire-format reader over a bounded slice.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Offset of `buf[0]` in the whole file, for error messages.
    base: usize,
    what: &'static str,
}

enum Value<'a> {
    Varint(u64),
    Fixed64,
    Bytes(&'a [u8], usize),
    Fixed32(u32),
}

fn perr(msg: String) -> TokenizerError {
    TokenizerError::SentencePiece(msg)
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], base: usize, what: &'static str) -> Self {
        Reader {
            buf,
            pos: 0,
            base,
            what,
        }
    }
    fn at(&self) -> usize {
        self.base + self.pos
    }
    fn done(&self) -> bool {
        self.pos >= self.buf.len()
    }
    fn varint(&mut self) -> Result<u64, TokenizerError> {
        let start = self.at();
        let mut v: u64 = 0;
        for i in 0..10 {
            let Some(&b) = self.buf.get(self.pos) else {
                return Err(perr(format!(
                    "{}: truncated varint at offset {start}",
                    self.what
                )));
            };
            self.pos += 1;
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(perr(format!(
            "{}: varint longer than 10 bytes at offset {start}",
            self.what
        )))
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], TokenizerError> {
        let start = self.at();
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let Some(end) = end else {
            return Err(perr(format!(
                "{}: field of {n} bytes at offset {start} runs past the end ({} bytes left)",
                self.what,
                self.buf.len() - self.pos
            )));
        };
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    /// Next `(field number, value)`.
    fn field(&mut self) -> Result<(u64, Value<'a>), TokenizerError> {
        let at = self.at();
        let key = self.varint()?;
        let field = key >> 3;
        if field == 0 {
            return Err(perr(format!(
                "{}: field number 0 at offset {at}",
                self.what
            )));
        }
        let v = match key & 7 {
            0 => Value::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Value::Fixed64
            }
            2 => {
                let len = self.varint()?;
                let len = usize::try_from(len).map_err(|_| {
                    perr(format!(
                        "{}: length {len} at offset {at} too large",
                        self.what
                    ))
                })?;
                let off = self.at();
                Value::Bytes(self.take(len)?, off)
            }
            5 => {
                let b = self.take(4)?;
                let mut a = [0u8; 4];
                a.copy_from_slice(b);
                Value::Fixed32(u32::from_le_bytes(a))
            }
            w => {
                return Err(perr(format!(
                    "{}: unsupported wire type {w} (field {field}) at offset {at}",
                    self.what
                )))
            }
        };
        Ok((field, v))
    }
}

fn as_i32(v: &Value, what: &str, at: usize) -> Result<i32, TokenizerError> {
    match v {
        // int32 fields are sign-extended to 64 bits on the wire.
        Value::Varint(x) => Ok(*x as i64 as i32),
        _ => Err(perr(format!("{what} at offset {at}: expected a varint"))),
    }
}

fn as_bool(v: &Value, what: &str, at: usize) -> Result<bool, TokenizerError> {
    match v {
        Value::Varint(x) => Ok(*x != 0),
        _ => Err(perr(format!("{what} at offset {at}: expected a varint"))),
    }
}

fn as_str(v: &Value, what: &str, at: usize) -> Result<String, TokenizerError> {
    match v {
        Value::Bytes(b, off) => std::str::from_utf8(b)
            .map(|s| s.to_string())
            .map_err(|_| perr(format!("{what} at offset {off}: not valid UTF-8"))),
        _ => Err(perr(format!("{what} at offset {at}: expected a string"))),
    }
}

/// Parse a serialized sentencepiece `ModelProto`.
pub fn parse_model_proto(data: &[u8]) -> Result<SpmModelProto, TokenizerError> {
    let mut m = SpmModelProto::default();
    let mut r = Reader::new(data, 0, "ModelProto");
    while !r.done() {
        let at = r.at();
        let (f, v) = r.field()?;
        match (f, v) {
            (1, Value::Bytes(b, off)) => m.pieces.push(parse_piece(b, off, m.pieces.len())?),
            (2, Value::Bytes(b, off)) => parse_trainer(b, off, &mut m)?,
            (3, Value::Bytes(b, off)) => parse_normalizer(b, off, &mut m)?,
            (1..=3, _) => {
                return Err(perr(format!(
                    "ModelProto field {f} at offset {at}: expected a length-delimited message"
                )))
            }
            _ => {}
        }
    }
    Ok(m)
}

fn parse_piece(b: &[u8], off: usize, index: usize) -> Result<SpmPiece, TokenizerError> {
    let mut r = Reader::new(b, off, "SentencePiece");
    let mut p = SpmPiece {
        piece: String::new(),
        score: 0.0,
        kind: TokenType::Normal,
    };
    while !r.done() {
        let at = r.at();
        let (f, v) = r.field()?;
        match f {
            1 => p.piece = as_str(&v, &format!("piece #{index}: text"), at)?,
            2 => match v {
                Value::Fixed32(x) => p.score = f32::from_bits(x),
                _ => {
                    return Err(perr(format!(
                        "piece #{index}: score at offset {at} is not a float"
                    )))
                }
            },
            3 => {
                let t = as_i32(&v, &format!("piece #{index}: type"), at)?;
                p.kind = TokenType::from_i32(t).ok_or_else(|| {
                    perr(format!(
                        "piece #{index} ({:?}): unknown type {t} at offset {at}",
                        p.piece
                    ))
                })?;
            }
            _ => {}
        }
    }
    Ok(p)
}

fn parse_trainer(b: &[u8], off: usize, m: &mut SpmModelProto) -> Result<(), TokenizerError> {
    let mut r = Reader::new(b, off, "TrainerSpec");
    while !r.done() {
        let at = r.at();
        let (f, v) = r.field()?;
        match f {
            3 => m.model_type = as_i32(&v, "trainer_spec.model_type", at)?,
            24 => m.treat_whitespace_as_suffix = as_bool(&v, "treat_whitespace_as_suffix", at)?,
            35 => m.byte_fallback = as_bool(&v, "byte_fallback", at)?,
            40 => m.unk_id = as_i32(&v, "unk_id", at)?,
            41 => m.bos_id = as_i32(&v, "bos_id", at)?,
            42 => m.eos_id = as_i32(&v, "eos_id", at)?,
            43 => m.pad_id = as_i32(&v, "pad_id", at)?,
            44 => m.unk_surface = as_str(&v, "unk_surface", at)?,
            _ => {}
        }
    }
    Ok(())
}

fn parse_normalizer(b: &[u8], off: usize, m: &mut SpmModelProto) -> Result<(), TokenizerError> {
    let mut r = Reader::new(b, off, "NormalizerSpec");
    while !r.done() {
        let at = r.at();
        let (f, v) = r.field()?;
        match f {
            1 => m.normalizer_name = as_str(&v, "normalizer_spec.name", at)?,
            2 => match v {
                Value::Bytes(b, _) => m.precompiled_charsmap_len = b.len(),
                _ => {
                    return Err(perr(format!(
                        "precompiled_charsmap at offset {at}: expected bytes"
                    )))
                }
            },
            3 => m.add_dummy_prefix = as_bool(&v, "add_dummy_prefix", at)?,
            4 => m.remove_extra_whitespaces = as_bool(&v, "remove_extra_whitespaces", at)?,
            5 => m.escape_whitespaces = as_bool(&v, "escape_whitespaces", at)?,
            _ => {}
        }
    }
    Ok(())
}

/// Map a score to a key where a higher score sorts first.
fn score_key(score: f32) -> u32 {
    let b = score.to_bits();
    let ordered = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    !ordered
}

/// Parse `<0xNN>`.
pub(crate) fn byte_piece_value(s: &[u8]) -> Option<u8> {
    if s.len() == 6 && s.starts_with(b"<0x") && s[5] == b'>' {
        let h = std::str::from_utf8(&s[3..5]).ok()?;
        u8::from_str_radix(h, 16).ok()
    } else {
        None
    }
}

/// Merged span -> the two spans it was made of (for UNUSED pieces).
type RevMerge = FxHashMap<(usize, usize), ((usize, usize), (usize, usize))>;

pub(crate) struct SpmModel {
    /// NORMAL, USER_DEFINED and UNUSED pieces: candidates for merging.
    pieces: FxHashMap<Vec<u8>, u32>,
    /// CONTROL, UNKNOWN and BYTE pieces.
    reserved: FxHashMap<Vec<u8>, u32>,
    types: Vec<TokenType>,
    scores: Vec<f32>,
    byte_ids: Option<Box<[u32; 256]>>,
    unk_id: Option<u32>,
    byte_fallback: bool,
    remove_extra_whitespaces: bool,
    escape_whitespaces: bool,
    /// Prefix matcher for user-defined symbols (sentencepiece files only).
    user_defined: Option<AhoCorasick>,
}

/// What [`SpmModel::new`] needs.
pub(crate) struct SpmSpec<'a> {
    pub texts: &'a [Vec<u8>],
    pub types: &'a [TokenType],
    pub scores: &'a [f32],
    pub unk_id: Option<u32>,
    pub byte_fallback: bool,
    pub remove_extra_whitespaces: bool,
    pub escape_whitespaces: bool,
    pub match_user_defined: bool,
}

impl SpmModel {
    pub(crate) fn new(s: SpmSpec) -> Result<SpmModel, String> {
        let mut pieces = FxHashMap::default();
        let mut reserved = FxHashMap::default();
        let mut byte_ids = [u32::MAX; 256];
        let mut user = Vec::new();
        for (i, (t, ty)) in s.texts.iter().zip(s.types).enumerate() {
            let id = i as u32;
            let normal = matches!(
                ty,
                TokenType::Normal | TokenType::UserDefined | TokenType::Unused
            );
            let map = if normal { &mut pieces } else { &mut reserved };
            if map.insert(t.clone(), id).is_some() {
                return Err(format!(
                    "piece #{i} {:?} is a duplicate",
                    String::from_utf8_lossy(t)
                ));
            }
            if *ty == TokenType::Byte {
                if let Some(b) = byte_piece_value(t) {
                    byte_ids[b as usize] = id;
                }
            }
            if *ty == TokenType::UserDefined && s.match_user_defined && !t.is_empty() {
                user.push(t.clone());
            }
        }
        let byte_ids = if byte_ids.iter().all(|&x| x != u32::MAX) {
            Some(Box::new(byte_ids))
        } else {
            None
        };
        if s.byte_fallback && byte_ids.is_none() {
            return Err(
                "byte_fallback is set but the 256 <0xNN> byte pieces are not all present".into(),
            );
        }
        let user_defined = if user.is_empty() {
            None
        } else {
            Some(
                AhoCorasickBuilder::new()
                    .match_kind(MatchKind::LeftmostLongest)
                    .start_kind(StartKind::Anchored)
                    .build(&user)
                    .map_err(|e| format!("building user-defined symbol matcher: {e}"))?,
            )
        };
        Ok(SpmModel {
            pieces,
            reserved,
            types: s.types.to_vec(),
            scores: s.scores.to_vec(),
            byte_ids,
            unk_id: s.unk_id,
            byte_fallback: s.byte_fallback,
            remove_extra_whitespaces: s.remove_extra_whitespaces,
            escape_whitespaces: s.escape_whitespaces,
            user_defined,
        })
    }

    fn normalize(&self, text: &str, add_prefix: bool) -> Vec<u8> {
        let mut t: String;
        let mut s = text;
        if self.remove_extra_whitespaces {
            s = s.trim_matches(' ');
            t = String::with_capacity(s.len());
            let mut prev_space = false;
            for c in s.chars() {
                if c == ' ' {
                    if !prev_space {
                        t.push(c);
                    }
                    prev_space = true;
                } else {
                    t.push(c);
                    prev_space = false;
                }
            }
        } else {
            t = s.to_string();
        }
        if t.is_empty() {
            return Vec::new();
        }
        if add_prefix {
            t.insert(0, ' ');
        }
        if self.escape_whitespaces {
            t = t.replace(' ', "\u{2581}");
        }
        t.into_bytes()
    }

    pub(crate) fn encode_ordinary(&self, text: &str, add_prefix: bool, out: &mut Vec<u32>) {
        let norm = self.normalize(text, add_prefix);
        if norm.is_empty() {
            return;
        }
        // Initial symbols: (start, end, frozen).
        let mut syms: Vec<(usize, usize, bool)> = Vec::with_capacity(norm.len());
        let mut i = 0;
        while i < norm.len() {
            if let Some(ac) = &self.user_defined {
                let inp = Input::new(&norm[i..]).anchored(Anchored::Yes);
                if let Some(m) = ac.find(inp) {
                    syms.push((i, i + m.end(), true));
                    i += m.end();
                    continue;
                }
            }
            let len = utf8_len(norm[i]).min(norm.len() - i);
            syms.push((i, i + len, false));
            i += len;
        }
        let mut rev_merge: RevMerge = FxHashMap::default();
        let merged = bpe::merge(syms, |l, r| {
            if l.2 || r.2 {
                return None;
            }
            let id = *self.pieces.get(&norm[l.0..r.1])?;
            if self.types[id as usize] == TokenType::Unused {
                rev_merge.insert((l.0, r.1), ((l.0, l.1), (r.0, r.1)));
            }
            Some((score_key(self.scores[id as usize]), (l.0, r.1, false)))
        });
        for (a, b, _) in merged {
            self.resegment(&norm, (a, b), &rev_merge, out);
        }
    }

    fn resegment(&self, norm: &[u8], w: (usize, usize), rev: &RevMerge, out: &mut Vec<u32>) {
        let piece = &norm[w.0..w.1];
        // A piece outside the vocabulary falls back to bytes (or the unknown
        // id) whatever type the unknown token has: GGUF files of Phi-3 and
        // Gemma 3 mark `<unk>` as a control token.
        let id = self
            .reserved
            .get(piece)
            .or_else(|| self.pieces.get(piece))
            .copied();
        match id {
            Some(id) if self.types[id as usize] == TokenType::Unused => {
                if let Some(&(l, r)) = rev.get(&w) {
                    self.resegment(norm, l, rev, out);
                    self.resegment(norm, r, rev, out);
                } else {
                    out.push(id);
                }
            }
            Some(id) if self.types[id as usize] == TokenType::Unknown => {
                self.unknown(piece, id, out)
            }
            Some(id) => out.push(id),
            None => self.unknown(piece, self.unk_id.unwrap_or(u32::MAX), out),
        }
    }

    fn unknown(&self, piece: &[u8], unk: u32, out: &mut Vec<u32>) {
        match (self.byte_fallback, &self.byte_ids) {
            (true, Some(ids)) => out.extend(piece.iter().map(|&b| ids[b as usize])),
            _ if unk != u32::MAX => out.push(unk),
            _ => {}
        }
    }
}

fn utf8_len(b: u8) -> usize {
    match b {
        0x00..=0x7f => 1,
        0xc0..=0xdf => 2,
        0xe0..=0xef => 3,
        0xf0..=0xf7 => 4,
        _ => 1,
    }
}

/// Bytes a sentencepiece piece contributes to decoded text.
pub(crate) fn spm_decode_bytes(text: &[u8], ty: TokenType, unk_surface: &str) -> Vec<u8> {
    match ty {
        TokenType::Control => Vec::new(),
        TokenType::Unknown => unk_surface.as_bytes().to_vec(),
        TokenType::Byte => match byte_piece_value(text) {
            Some(b) => vec![b],
            None => text.to_vec(),
        },
        _ => String::from_utf8_lossy(text)
            .replace('\u{2581}', " ")
            .into_bytes(),
    }
}

impl Tokenizer {
    /// Load a sentencepiece `tokenizer.model` (BPE) from a file.
    pub fn from_sentencepiece_file(path: impl AsRef<Path>) -> Result<Tokenizer, TokenizerError> {
        let path = path.as_ref();
        let data = std::fs::read(path).map_err(|source| TokenizerError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_sentencepiece_bytes(&data)
    }

    /// Load a serialized sentencepiece `ModelProto` (BPE) from memory.
    pub fn from_sentencepiece_bytes(data: &[u8]) -> Result<Tokenizer, TokenizerError> {
        let m = parse_model_proto(data)?;
        Self::from_sentencepiece_proto(&m)
    }

    /// Build from an already parsed model.
    pub fn from_sentencepiece_proto(m: &SpmModelProto) -> Result<Tokenizer, TokenizerError> {
        if m.model_type != 2 {
            let name = match m.model_type {
                1 => "UNIGRAM",
                3 => "WORD",
                4 => "CHAR",
                _ => "unknown",
            };
            return Err(perr(format!(
                "model_type {} ({name}) is not supported, only BPE (2)",
                m.model_type
            )));
        }
        if m.pieces.is_empty() {
            return Err(perr("no pieces".into()));
        }
        if m.precompiled_charsmap_len > 0 {
            return Err(perr(format!(
                "normalizer {:?} uses a precompiled charsmap ({} bytes); only the identity normalizer is supported",
                m.normalizer_name, m.precompiled_charsmap_len
            )));
        }
        if m.treat_whitespace_as_suffix {
            return Err(perr("treat_whitespace_as_suffix is not supported".into()));
        }
        let n = m.pieces.len();
        u32::try_from(n).map_err(|_| perr(format!("{n} pieces do not fit in u32")))?;
        let texts: Vec<Vec<u8>> = m
            .pieces
            .iter()
            .map(|p| p.piece.as_bytes().to_vec())
            .collect();
        let types: Vec<TokenType> = m.pieces.iter().map(|p| p.kind).collect();
        let scores: Vec<f32> = m.pieces.iter().map(|p| p.score).collect();
        let unk_id = types
            .iter()
            .position(|&t| t == TokenType::Unknown)
            .map(|i| i as u32);
        let valid = |id: i32| {
            usize::try_from(id)
                .ok()
                .filter(|&i| i < n)
                .map(|i| i as u32)
        };
        let model = SpmModel::new(SpmSpec {
            texts: &texts,
            types: &types,
            scores: &scores,
            unk_id,
            byte_fallback: m.byte_fallback,
            remove_extra_whitespaces: m.remove_extra_whitespaces,
            escape_whitespaces: m.escape_whitespaces,
            match_user_defined: true,
        })
        .map_err(perr)?;
        let decode = texts
            .iter()
            .zip(&types)
            .map(|(t, &ty)| spm_decode_bytes(t, ty, &m.unk_surface))
            .collect();
        let eos = valid(m.eos_id);
        Tokenizer::build(Common {
            kind: TokenizerKind::SentencePiece,
            model: Model::SentencePiece(model),
            texts,
            decode,
            types,
            bos: valid(m.bos_id),
            eos,
            eot: None,
            stop: eos.into_iter().collect(),
            add_bos_default: true,
            add_space_prefix: m.add_dummy_prefix,
            strip_leading_space: m.add_dummy_prefix || m.remove_extra_whitespaces,
            split_user_defined: false,
        })
        .map_err(perr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn score_key_orders_descending() {
        let xs = [-1e9f32, -3.5, -0.0, 0.0, 1.0, 7.25, 1e9];
        for w in xs.windows(2) {
            assert!(score_key(w[0]) >= score_key(w[1]), "{w:?}");
        }
        assert!(score_key(-2.0) > score_key(-1.0));
    }

    #[test]
    fn varint_and_bounds() {
        // field 1, wire type 2, length 5 but only 2 bytes follow.
        let e = parse_model_proto(&[0x0a, 0x05, 0x0a, 0x00]).unwrap_err();
        assert!(e.to_string().contains("runs past the end"), "{e}");
        // 11-byte varint.
        let e = parse_model_proto(&[
            0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
        ])
        .unwrap_err();
        assert!(e.to_string().contains("longer than 10 bytes"), "{e}");
    }

    #[test]
    fn byte_piece_values() {
        assert_eq!(byte_piece_value(b"<0x0A>"), Some(10));
        assert_eq!(byte_piece_value(b"<0xff>"), Some(255));
        assert_eq!(byte_piece_value(b"<0xZZ>"), None);
        assert_eq!(byte_piece_value(b"<0x0A"), None);
    }
}
