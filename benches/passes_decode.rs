//! Decode speed with `--passes all` against `--passes none`, and with the
//! pipeline minus `pack_weights` (fusion and dead work; of the weights only
//! the fused `wqkv` and `w13` are then in the arena, and compressed) to show
//! what each part contributes.
//!
//! Uses a random bf16 checkpoint shaped like Llama 3.2 1B
//! (`graphs/llama-3.2-1b/params.json`), generated once (2.5 GB, a few
//! minutes) into the directory named by `LLAMA_GRAPH_1B_DIR`, outside the
//! repository:
//!
//! ```text
//! LLAMA_GRAPH_1B_DIR=/work/tmp-1b cargo bench --bench passes_decode
//! ```
//!
//! The sessions are prepared once; then rounds alternate (all, fusion,
//! none, all, ...) so load from other processes on the machine affects both
//! alike, and the medians are reported. Each round resets the cache, feeds a
//! short prompt and times greedy decoding of `DECODE` tokens.
//! Environment: `BENCH_THREADS` (default 2), `BENCH_ROUNDS` (default 5),
//! `BENCH_DECODE` (default 32).

use llama_graph::ir::{DType, LogitRows};
use llama_graph::kernels::argmax;
use llama_graph::passes::PassList;
use llama_graph::session::{Model, Session, SessionOptions};
use llama_graph::weights::pth::{generate_random_checkpoint, MetaParams};
use std::path::PathBuf;
use std::time::Instant;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Greedy decode of `n` tokens after `prompt`; returns tokens per second.
fn decode(sess: &mut Session, prompt: &[u32], n: usize) -> (f64, Vec<u32>) {
    sess.reset();
    let mut next = argmax(sess.feed(prompt).expect("prefill")).expect("logits") as u32;
    let mut out = Vec::with_capacity(n);
    let t0 = Instant::now();
    for _ in 0..n {
        out.push(next);
        next = argmax(sess.feed(&[next]).expect("decode")).expect("logits") as u32;
    }
    (n as f64 / t0.elapsed().as_secs_f64(), out)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let Some(dir) = std::env::var_os("LLAMA_GRAPH_1B_DIR").map(PathBuf::from) else {
        eprintln!("passes_decode: set LLAMA_GRAPH_1B_DIR to a directory for the generated 1B-shaped checkpoint; skipping");
        return;
    };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if !dir.join("consolidated.00.pth").exists() {
        let text = std::fs::read_to_string(root.join("graphs/llama-3.2-1b/params.json"))
            .expect("graphs/llama-3.2-1b/params.json");
        let params = MetaParams::from_json(&text).expect("params");
        eprintln!(
            "generating the random checkpoint into {} ...",
            dir.display()
        );
        let t0 = Instant::now();
        generate_random_checkpoint(&dir, &params, 1, DType::BF16).expect("generate");
        eprintln!("generated in {:.0} s", t0.elapsed().as_secs_f64());
    }
    if std::env::args().any(|a| a == "--generate-only") {
        return;
    }
    let threads = env_usize("BENCH_THREADS", 2);
    let rounds = env_usize("BENCH_ROUNDS", 5);
    let n_decode = env_usize("BENCH_DECODE", 32);
    let model = Model::open_meta_dir(&dir).expect("open checkpoint");
    let opts = |passes: PassList| SessionOptions {
        context: Some(256),
        batch: 64,
        parallel: 1,
        threads,
        logit_rows: LogitRows::Last,
        passes,
        // The CLI default. For bf16 weights both modes are exact f32
        // arithmetic; the default one runs single tokens on the GEMV kernel.
        exact: false,
        ..SessionOptions::default()
    };
    // The pipeline, the pipeline without copying the unfused weights into
    // the arena (`wo`, `w2` and the head stay bf16 in the file mapping), and
    // the builder's graph.
    let configs = [
        ("all", PassList::all()),
        ("fusion", PassList::all().without("pack_weights")),
        ("none", PassList::none()),
    ];
    let mut sessions = Vec::new();
    for (label, passes) in &configs {
        let t0 = Instant::now();
        let s = Session::new(&model, &opts(passes.clone())).expect("session");
        println!(
            "session `{label}` prepared in {:.1} s (incl. packing weights)",
            t0.elapsed().as_secs_f64()
        );
        sessions.push(s);
    }
    let per_layer = |s: &Session| s.graph().nodes_per_layer().into_iter().max().unwrap_or(0);
    for ((label, _), s) in configs.iter().zip(&sessions) {
        println!(
            "{label:>6}: {} nodes per layer, {} nodes, {} kernel calls per step",
            per_layer(s),
            s.graph().node_count(),
            s.exec().n_steps()
        );
    }
    let prompt: Vec<u32> = (0..8u32).map(|i| 1000 + 37 * i).collect();
    // Warm-up (page in the weights) and check all give the same tokens.
    let mut first = None;
    for ((label, _), s) in configs.iter().zip(sessions.iter_mut()) {
        let (_, toks) = decode(s, &prompt, 4);
        println!("warm-up tokens ({label}): {toks:?}");
        assert!(
            first.get_or_insert(toks.clone()) == &toks,
            "greedy tokens differ"
        );
    }
    let mut speeds = vec![Vec::new(); configs.len()];
    for r in 0..rounds {
        let mut line = format!("round {r}:");
        for (i, s) in sessions.iter_mut().enumerate() {
            let (x, _) = decode(s, &prompt, n_decode);
            line += &format!(" {} {x:.2} tok/s", configs[i].0);
            speeds[i].push(x);
        }
        println!("{line}");
    }
    if std::env::var_os("BENCH_PROFILE").is_some() {
        for ((label, _), sess) in configs.iter().zip(sessions.iter_mut()) {
            sess.exec_mut().set_profiling(true);
            decode(sess, &prompt, n_decode);
            let mut by: std::collections::BTreeMap<&str, (u64, f64)> = Default::default();
            for p in sess.exec().profile().unwrap_or(&[]) {
                let e = by.entry(p.op).or_default();
                e.0 += p.calls;
                e.1 += p.total.as_secs_f64();
            }
            println!("profile ({label}), includes the prompt:");
            for (op, (calls, t)) in by {
                println!("  {op:<14} {calls:>7} calls {:>9.1} ms", t * 1e3);
            }
            sess.exec_mut().set_profiling(false);
        }
    }
    let ratios = |i: usize, speeds: &[Vec<f64>]| -> Vec<f64> {
        speeds[i]
            .iter()
            .zip(&speeds[2])
            .map(|(a, b)| a / b)
            .collect()
    };
    let (mut r_all, mut r_fusion) = (ratios(0, &speeds), ratios(1, &speeds));
    let med: Vec<f64> = speeds.iter_mut().map(|v| median(v)).collect();
    println!(
        "median decode ({threads} threads, {n_decode} tokens, {rounds} rounds): all {:.2} tok/s, fusion only {:.2}, none {:.2}; speed-up over none: all {:.2}x (median of per-round ratios {:.2}x), fusion only {:.2}x ({:.2}x)",
        med[0],
        med[1],
        med[2],
        med[0] / med[2],
        median(&mut r_all),
        med[1] / med[2],
        median(&mut r_fusion)
    );
}
