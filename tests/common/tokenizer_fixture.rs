//! What the tokenizer tests share: reading `tokenizers`' ids from a fixture
//! and the long-text check against `tokenizer_fixtures.py`'s `long_text()`.
#![allow(dead_code)]

use llama_graph::tokenizer::{EncodeOptions, Tokenizer};
use serde_json::Value;

/// A fixture's list of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The same text as `long_text()` in `tokenizer_fixtures.py`.
pub fn long_text() -> String {
    let p = super::root().join("tests/fixtures/tokenizer/corpus.json");
    let corpus: Vec<String> = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let base: String = corpus.concat();
    let reps = 1_000_000 / base.len() + 1;
    let mut s = base.repeat(reps);
    s.push_str(&" ".repeat(30_000));
    s.push_str(&"z".repeat(30_000));
    s.push_str(&"\n".repeat(10));
    s
}

/// `t` on the long text against the fixture's `long` entry (its length,
/// first 200 ids and id sum); returns how many ids it made.
pub fn check_long_text(t: &Tokenizer, long: &Value, name: &str) -> usize {
    let text = long_text();
    assert_eq!(
        text.chars().count() as u64,
        long["n_chars"].as_u64().unwrap()
    );
    let plain = EncodeOptions {
        add_bos: false,
        parse_special: false,
    };
    let got = t.encode(&text, plain);
    assert_eq!(
        got.len() as u64,
        long["ids"].as_u64().unwrap(),
        "{name}: long text"
    );
    assert_eq!(
        &got[..200],
        &ids(&long["first_ids"])[..],
        "{name}: long text"
    );
    assert_eq!(
        got.iter().map(|&x| x as u64).sum::<u64>(),
        long["sum"].as_u64().unwrap(),
        "{name}: long text"
    );
    got.len()
}
