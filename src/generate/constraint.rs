//! Structured output: a grammar the sampler obeys token by token.
//!
//! A [`Constraint`] holds one sequence's grammar state (an `llguidance`
//! [`Matcher`]). At every step it computes the set of tokens the grammar
//! allows next, hands the sampler a copy of the logits in which every other
//! token is minus infinity, and advances the grammar with the token the
//! sampler chose. End-of-sequence tokens are allowed exactly when the
//! grammar accepts what came so far, so a finished generation always parses
//! (a generation cut short by `max_tokens` may not be complete).
//!
//! What a request may ask for ([`GrammarSpec`]):
//! * a JSON object (`response_format: {"type": "json_object"}`), or a value
//!   valid against a JSON schema, compiled by `llguidance` (a schema
//!   keyword it does not implement is an error naming the keyword);
//! * a grammar in `llguidance`'s Lark-like syntax;
//! * a grammar in llama.cpp's GBNF, translated here to that syntax rule by
//!   rule (names, `::=`, literals with `\n \t \r \\ \" \xHH \uHHHH
//!   \UHHHHHHHH`, character classes and `.`, grouping, `| * + ?`, `{m,n}`,
//!   `#` comments; the start rule is `root`).
//!
//! JSON comes out in a fixed layout (`{"a": 1, "b": [1, 2]}`: `", "` and
//! `": "` between items, no other whitespace) unless the schema's own
//! `x-guidance` options say otherwise; a small model left free to add
//! whitespace may never close the object.
//!
//! The vocabulary is read once per model into a token trie ([`Grammars`]):
//! each token's bytes, special tokens marked so that a grammar can name
//! them (`<|im_end|>`) but free text never matches them.

use super::sampler::Sampler;
use crate::tokenizer::{TokenType, Tokenizer};
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use std::sync::Arc;
use thiserror::Error;
use toktrie::{ApproximateTokEnv, SimpleVob, TokRxInfo, TokTrie};

/// Why a grammar cannot be used, or stopped working.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ConstraintError {
    /// The grammar or schema cannot be compiled (the message says why,
    /// e.g. `Unimplemented keys: ["if"]`).
    #[error("{0}")]
    Compile(String),
    /// The GBNF text does not parse.
    #[error("GBNF: {0}")]
    Gbnf(String),
    /// Generation reached a state the grammar cannot continue from.
    #[error("the output grammar failed: {0}")]
    Runtime(String),
}

/// What the output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object.
    JsonObject,
    /// A JSON value valid against this schema.
    JsonSchema(Value),
    /// A grammar in llguidance's Lark-like syntax.
    Lark(String),
    /// A grammar in llama.cpp's GBNF.
    Gbnf(String),
}

/// The JSON layout every schema gets unless it has its own `x-guidance`.
fn json_layout() -> Value {
    serde_json::json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    })
}

impl GrammarSpec {
    /// A grammar's text as llama.cpp reads it: llguidance's Lark-like
    /// syntax when it starts with `%llguidance`, GBNF otherwise.
    pub fn from_grammar_text(text: &str) -> GrammarSpec {
        if text.trim_start().starts_with("%llguidance") {
            GrammarSpec::Lark(text.to_string())
        } else {
            GrammarSpec::Gbnf(text.to_string())
        }
    }

    /// The grammar as llguidance reads it.
    pub fn to_llguidance(&self) -> Result<TopLevelGrammar, ConstraintError> {
        Ok(match self {
            GrammarSpec::JsonObject => {
                GrammarSpec::JsonSchema(serde_json::json!({"type": "object"})).to_llguidance()?
            }
            GrammarSpec::JsonSchema(schema) => {
                let mut s = schema.clone();
                // `true` (anything) and `false` (nothing) are schemas too.
                if !s.is_boolean() {
                    let o = s.as_object_mut().ok_or_else(|| {
                        ConstraintError::Compile(
                            "a JSON schema is an object (or true/false)".into(),
                        )
                    })?;
                    o.entry("x-guidance").or_insert_with(json_layout);
                }
                TopLevelGrammar::from_json_schema(s)
            }
            GrammarSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
            GrammarSpec::Gbnf(text) => TopLevelGrammar::from_lark(gbnf_to_lark(text)?),
        })
    }
}

/// A model's vocabulary prepared for grammars; compiles [`Constraint`]s.
/// Cheap to clone and share between threads.
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
    vocab: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl Grammars {
    /// Builds the token trie of `tok` for a model whose logits have `vocab`
    /// entries (ids the tokenizer does not know are never allowed). The
    /// tokenizer's stop ids end a grammar.
    pub fn new(tok: &Tokenizer, vocab: usize) -> Result<Grammars, ConstraintError> {
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                let bytes = tok.token_bytes(id).unwrap_or(&[]);
                let special = tok.is_stop(id)
                    || matches!(
                        tok.token_type(id),
                        Some(TokenType::Control | TokenType::Unknown | TokenType::Unused)
                    );
                if bytes.is_empty() {
                    Vec::new()
                } else if special {
                    let mut w = Vec::with_capacity(bytes.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(bytes);
                    w
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let stops: Vec<u32> = tok
            .stop_ids()
            .iter()
            .copied()
            .filter(|&i| (i as usize) < vocab)
            .collect();
        let eos = stops.first().copied().or(tok.eos_id()).unwrap_or(0);
        let info = TokRxInfo::new(vocab as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        if !stops.is_empty() {
            trie = trie.with_eos_tokens(&stops);
        }
        let env: toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| ConstraintError::Compile(e.to_string()))?;
        factory.quiet();
        // Errors say what is wrong, without the parser's whole state.
        factory.limits_mut().verbose_errors = false;
        Ok(Grammars {
            factory: Arc::new(factory),
            vocab,
        })
    }

    /// A fresh constraint for one generation.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint, ConstraintError> {
        let grammar = spec.to_llguidance()?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| ConstraintError::Compile(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError::Compile(e));
        }
        Ok(Constraint {
            matcher,
            masked: Vec::with_capacity(self.vocab),
            eos: self.factory.tok_env().tok_trie().eos_tokens().to_vec(),
        })
    }
}

/// One generation's grammar state (see the module documentation).
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    /// The logits with disallowed tokens at minus infinity.
    masked: Vec<f32>,
    /// End-of-sequence ids (allowed once the output is complete).
    eos: Vec<u32>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// The tokens the grammar allows next (only end-of-sequence tokens once
    /// it is complete).
    pub fn allowed(&mut self) -> Result<SimpleVob, ConstraintError> {
        self.matcher
            .compute_mask_or_eos()
            .map_err(|e| ConstraintError::Runtime(e.to_string()))
    }

    /// Samples the next token among those the grammar allows, and advances
    /// the grammar with it.
    pub fn sample(
        &mut self,
        sampler: &mut Sampler,
        logits: &[f32],
    ) -> Result<u32, ConstraintError> {
        let mask = self.allowed()?;
        mask_logits(&mask, logits, &mut self.masked);
        if self.masked.iter().all(|&l| l == f32::NEG_INFINITY) {
            return Err(ConstraintError::Runtime(
                "no token of the vocabulary can continue the output".into(),
            ));
        }
        let tok = sampler.sample(&self.masked);
        // End-of-sequence ends the output (the grammar has nothing to
        // advance past it).
        if !self.eos.contains(&tok) {
            self.commit(tok)?;
        }
        Ok(tok)
    }

    /// Advances the grammar with a token chosen elsewhere.
    pub fn commit(&mut self, tok: u32) -> Result<(), ConstraintError> {
        self.matcher
            .consume_token(tok)
            .map_err(|e| ConstraintError::Runtime(e.to_string()))
    }

    /// Whether the output so far is complete (end-of-sequence allowed).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }
}

/// `out` = `logits` where `mask` allows the token, minus infinity elsewhere
/// (32 tokens per mask word; whole words copied or skipped at once).
pub fn mask_logits(mask: &SimpleVob, logits: &[f32], out: &mut Vec<f32>) {
    out.clear();
    out.resize(logits.len(), f32::NEG_INFINITY);
    for (w, &bits) in mask.as_slice().iter().enumerate() {
        if bits == 0 {
            continue;
        }
        let base = w * 32;
        if base >= logits.len() {
            break;
        }
        let end = (base + 32).min(logits.len());
        if bits == u32::MAX {
            out[base..end].copy_from_slice(&logits[base..end]);
            continue;
        }
        let mut b = bits;
        while b != 0 {
            let i = base + b.trailing_zeros() as usize;
            if i < end {
                out[i] = logits[i];
            }
            b &= b - 1;
        }
    }
}

/// Translates llama.cpp's GBNF into llguidance's Lark-like syntax, one rule
/// per line: `name ::= ...` becomes `g_name: ...` (upper-case letters of a
/// name become `_` and the lower-case letter, which GBNF names never
/// contain, so distinct names stay distinct), literals become JSON strings,
/// character classes and `.` become regexes of code points, and
/// `start: g_root` is added.
pub fn gbnf_to_lark(src: &str) -> Result<String, ConstraintError> {
    let toks = gbnf_tokens(src)?;
    let mut out = String::from("start: g_root\n");
    let mut i = 0;
    let mut have_root = false;
    while i < toks.len() {
        let Tok::Name(name) = &toks[i] else {
            return Err(ConstraintError::Gbnf(format!(
                "expected a rule name, found {}",
                toks[i].describe()
            )));
        };
        if toks.get(i + 1) != Some(&Tok::Define) {
            return Err(ConstraintError::Gbnf(format!(
                "expected `::=` after the rule name `{name}`"
            )));
        }
        have_root |= name == "root";
        out.push_str(&rule_name(name));
        out.push(':');
        i += 2;
        let start = i;
        let mut depth = 0i32;
        // The body runs to the next `name ::=` (or the end).
        while i < toks.len() {
            if matches!(toks[i], Tok::Name(_)) && toks.get(i + 1) == Some(&Tok::Define) {
                break;
            }
            out.push(' ');
            match &toks[i] {
                Tok::Name(n) => out.push_str(&rule_name(n)),
                Tok::Literal(s) => {
                    out.push_str(&serde_json::to_string(s).expect("a string serializes"))
                }
                Tok::Class(c) => out.push_str(c),
                Tok::Sym(c) => {
                    match c {
                        '(' => depth += 1,
                        ')' => depth -= 1,
                        _ => {}
                    }
                    if depth < 0 {
                        return Err(ConstraintError::Gbnf(format!(
                            "unbalanced `)` in rule `{name}`"
                        )));
                    }
                    out.push(*c)
                }
                Tok::Repeat(r) => {
                    // Binds to the item before it, without a space.
                    out.pop();
                    out.push_str(r)
                }
                Tok::Define => unreachable!("handled above"),
            }
            i += 1;
        }
        if depth != 0 {
            return Err(ConstraintError::Gbnf(format!(
                "unbalanced `(` in rule `{name}`"
            )));
        }
        if i == start {
            return Err(ConstraintError::Gbnf(format!("rule `{name}` is empty")));
        }
        out.push('\n');
    }
    if !have_root {
        return Err(ConstraintError::Gbnf(
            "no `root` rule (the start of a GBNF grammar)".into(),
        ));
    }
    Ok(out)
}

fn rule_name(name: &str) -> String {
    let mut s = String::from("g_");
    for c in name.chars() {
        if c.is_ascii_uppercase() {
            s.push('_');
            s.push(c.to_ascii_lowercase());
        } else {
            s.push(c);
        }
    }
    s
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Name(String),
    Define,
    Literal(String),
    /// A regex already in Lark form (`/[\x{61}-\x{7A}]/`).
    Class(String),
    /// `( ) |`
    Sym(char),
    /// `* + ?` or `{m,n}`.
    Repeat(String),
}

impl Tok {
    fn describe(&self) -> String {
        match self {
            Tok::Name(n) => format!("`{n}`"),
            Tok::Define => "`::=`".into(),
            Tok::Literal(s) => format!("the literal {s:?}"),
            Tok::Class(_) => "a character class".into(),
            Tok::Sym(c) => format!("`{c}`"),
            Tok::Repeat(r) => format!("`{r}`"),
        }
    }
}

/// Reads one escape after `\` (the iterator is past the backslash).
fn gbnf_escape(it: &mut std::iter::Peekable<std::str::Chars<'_>>) -> Result<char, ConstraintError> {
    let c = it
        .next()
        .ok_or_else(|| ConstraintError::Gbnf("a `\\` at the end of the grammar".into()))?;
    let hex = |it: &mut std::iter::Peekable<std::str::Chars<'_>>, n: usize| {
        let mut v = 0u32;
        for _ in 0..n {
            let d = it.next().and_then(|d| d.to_digit(16)).ok_or_else(|| {
                ConstraintError::Gbnf(format!("`\\{c}` needs {n} hexadecimal digits"))
            })?;
            v = v * 16 + d;
        }
        char::from_u32(v).ok_or_else(|| {
            ConstraintError::Gbnf(format!("`\\{c}{v:X}` is not a Unicode scalar value"))
        })
    };
    Ok(match c {
        'n' => '\n',
        't' => '\t',
        'r' => '\r',
        'x' => hex(it, 2)?,
        'u' => hex(it, 4)?,
        'U' => hex(it, 8)?,
        '\\' | '"' | '[' | ']' | '-' | '^' | '/' | '.' | '\'' => c,
        other => return Err(ConstraintError::Gbnf(format!("unknown escape `\\{other}`"))),
    })
}

fn gbnf_tokens(src: &str) -> Result<Vec<Tok>, ConstraintError> {
    let mut out = Vec::new();
    let mut it = src.chars().peekable();
    while let Some(&c) = it.peek() {
        match c {
            c if c.is_whitespace() => {
                it.next();
            }
            '#' => while it.next().is_some_and(|c| c != '\n') {},
            ':' => {
                let s: String = it.by_ref().take(3).collect();
                if s != "::=" {
                    return Err(ConstraintError::Gbnf(format!(
                        "expected `::=`, found `{s}`"
                    )));
                }
                out.push(Tok::Define);
            }
            '"' => {
                it.next();
                let mut s = String::new();
                loop {
                    match it.next() {
                        None => return Err(ConstraintError::Gbnf("an unterminated string".into())),
                        Some('"') => break,
                        Some('\\') => s.push(gbnf_escape(&mut it)?),
                        Some(ch) => s.push(ch),
                    }
                }
                out.push(Tok::Literal(s));
            }
            '[' => {
                it.next();
                let negated = it.peek() == Some(&'^');
                if negated {
                    it.next();
                }
                let mut ranges: Vec<(char, char)> = Vec::new();
                loop {
                    let lo = match it.next() {
                        None => {
                            return Err(ConstraintError::Gbnf(
                                "an unterminated character class".into(),
                            ))
                        }
                        Some(']') => break,
                        Some('\\') => gbnf_escape(&mut it)?,
                        Some(ch) => ch,
                    };
                    let mut hi = lo;
                    if it.peek() == Some(&'-') {
                        let mut look = it.clone();
                        look.next();
                        if look.peek().is_some_and(|&n| n != ']') {
                            it.next();
                            hi = match it.next() {
                                Some('\\') => gbnf_escape(&mut it)?,
                                Some(ch) => ch,
                                None => unreachable!("peeked above"),
                            };
                        }
                    }
                    if hi < lo {
                        return Err(ConstraintError::Gbnf(format!(
                            "the character range {lo:?}-{hi:?} is reversed"
                        )));
                    }
                    ranges.push((lo, hi));
                }
                let mut rx = String::from("/[");
                if negated {
                    rx.push('^');
                }
                for (lo, hi) in ranges {
                    rx.push_str(&format!("\\x{{{:X}}}", lo as u32));
                    if hi != lo {
                        rx.push_str(&format!("-\\x{{{:X}}}", hi as u32));
                    }
                }
                rx.push_str("]/");
                if rx == "/[]/" {
                    return Err(ConstraintError::Gbnf("an empty character class".into()));
                }
                out.push(Tok::Class(rx));
            }
            '.' => {
                it.next();
                out.push(Tok::Class("/(?s:.)/".into()));
            }
            '(' | ')' | '|' => {
                it.next();
                out.push(Tok::Sym(c));
            }
            '*' | '+' | '?' => {
                it.next();
                out.push(Tok::Repeat(c.to_string()));
            }
            '{' => {
                let mut s = String::new();
                for ch in it.by_ref() {
                    s.push(ch);
                    if ch == '}' {
                        break;
                    }
                }
                let inner = s
                    .strip_prefix('{')
                    .and_then(|r| r.strip_suffix('}'))
                    .unwrap_or("");
                let ok = !inner.is_empty()
                    && inner
                        .chars()
                        .all(|ch| ch.is_ascii_digit() || ch == ',' || ch == ' ')
                    && inner.matches(',').count() <= 1;
                if !ok {
                    return Err(ConstraintError::Gbnf(format!(
                        "a repetition is `{{m}}`, `{{m,}}` or `{{m,n}}`, found `{s}`"
                    )));
                }
                out.push(Tok::Repeat(s.replace(' ', "")));
            }
            c if c.is_ascii_alphanumeric() || c == '-' => {
                let mut s = String::new();
                while let Some(&ch) = it.peek() {
                    if ch.is_ascii_alphanumeric() || ch == '-' {
                        s.push(ch);
                        it.next();
                    } else {
                        break;
                    }
                }
                out.push(Tok::Name(s));
            }
            other => {
                return Err(ConstraintError::Gbnf(format!(
                    "unexpected character {other:?}"
                )))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gbnf_rules_become_lark_lines() {
        let g = "# answer\nroot ::= \"yes\" | \"no\" ws? item{2,3}\nitem ::= [a-zA-Z_] [^\\n\\x7F]* (\"-\" Item)+\nItem ::= .\nws ::= [ \\t]";
        let l = gbnf_to_lark(g).unwrap();
        assert_eq!(
            l,
            "start: g_root\n\
             g_root: \"yes\" | \"no\" g_ws? g_item{2,3}\n\
             g_item: /[\\x{61}-\\x{7A}\\x{41}-\\x{5A}\\x{5F}]/ /[^\\x{A}\\x{7F}]/* ( \"-\" g__item )+\n\
             g__item: /(?s:.)/\n\
             g_ws: /[\\x{20}\\x{9}]/\n"
        );
    }

    #[test]
    fn bad_gbnf_is_named() {
        for (g, want) in [
            ("item ::= \"a\"", "no `root` rule"),
            ("root ::= \"a", "unterminated string"),
            ("root ::= [a-", "unterminated character class"),
            ("root ::= (\"a\"", "unbalanced `(`"),
            ("root := \"a\"", "expected `::=`"),
            ("root = \"a\"", "unexpected character '='"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::= \"a\"{x}", "a repetition is"),
        ] {
            let e = gbnf_to_lark(g).unwrap_err().to_string();
            assert!(e.contains(want), "{g}: {e}");
        }
    }

    #[test]
    fn masking_keeps_exactly_the_allowed_logits() {
        let n = 100;
        let logits: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let mut mask = SimpleVob::alloc(n);
        for i in [0, 5, 31, 32, 63, 64, 65, 99] {
            mask.allow_token(i);
        }
        // A whole word allowed.
        for i in 64..96 {
            mask.allow_token(i);
        }
        let mut out = Vec::new();
        mask_logits(&mask, &logits, &mut out);
        for i in 0..n {
            let allowed = mask.is_allowed(i as u32);
            assert_eq!(out[i] == logits[i], allowed, "{i}");
            assert_eq!(out[i] == f32::NEG_INFINITY, !allowed, "{i}");
        }
    }
}
