//! Decode and prefill speed of a Llama-3.2-1B-shaped random bf16 checkpoint
//! (graphs/llama-3.2-1b/params.json), at 1 and 2 threads, interleaved.
//!
//! `cargo bench --bench decode` — the checkpoint (3 GB) is generated once
//! into `$LLAMA_GRAPH_BENCH_CKPT`, default `~/.cache/llama-graph/bench/llama-3.2-1b`.
//! Options (after `--`): `--runs N` (default 3), `--decode N` tokens
//! (default 32), `--prefill N` tokens (default 128), `--threads 1,2`.

use llama_graph::fetch::cache_dir;
use llama_graph::ir::{DType, LogitRows};
use llama_graph::session::{Model, Session, SessionOptions};
use llama_graph::weights::pth::{generate_random_checkpoint, MetaParams};
use std::path::PathBuf;
use std::time::Instant;

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let dir = std::env::var_os("LLAMA_GRAPH_BENCH_CKPT")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("bench/llama-3.2-1b"));
    if !dir.join("consolidated.00.pth").exists() {
        let params = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/graphs/llama-3.2-1b/params.json"
        ))
        .unwrap();
        eprintln!("generating {} (once)...", dir.display());
        generate_random_checkpoint(
            &dir,
            &MetaParams::from_json(&params).unwrap(),
            0,
            DType::BF16,
        )
        .unwrap();
    }
    let runs: usize = arg("--runs", "3").parse().unwrap();
    let n_decode: usize = arg("--decode", "32").parse().unwrap();
    let n_prefill: usize = arg("--prefill", "128").parse().unwrap();
    let threads: Vec<usize> = arg("--threads", "1,2")
        .split(',')
        .map(|t| t.parse().unwrap())
        .collect();
    let model = Model::open(&dir).unwrap();
    let weight_bytes: usize = model.weights.tensors.values().map(|t| t.data.len()).sum();
    let mut sessions: Vec<(usize, Session)> = threads
        .iter()
        .map(|&t| {
            let opts = SessionOptions {
                context: Some(1024),
                batch: n_prefill,
                threads: t,
                logit_rows: LogitRows::Last,
                ..SessionOptions::default()
            };
            (t, Session::new(&model, &opts).unwrap())
        })
        .collect();
    let prompt: Vec<u32> = (0..n_prefill as u32).map(|i| (i * 7919) % 128000).collect();
    let mut decode: Vec<Vec<f64>> = vec![Vec::new(); sessions.len()];
    let mut prefill: Vec<Vec<f64>> = vec![Vec::new(); sessions.len()];
    // Warm-up (page in the weights), then interleave the thread counts.
    for (_, s) in sessions.iter_mut() {
        s.reset();
        s.feed(&prompt[..16]).unwrap();
    }
    for _ in 0..runs {
        for (i, (_, s)) in sessions.iter_mut().enumerate() {
            s.reset();
            let t0 = Instant::now();
            s.feed(&prompt).unwrap();
            prefill[i].push(n_prefill as f64 / t0.elapsed().as_secs_f64());
            s.reset();
            s.feed(&prompt[..16]).unwrap();
            let t0 = Instant::now();
            let mut tok = 1u32;
            for _ in 0..n_decode {
                let l = s.feed(&[tok]).unwrap();
                tok = llama_graph::generate::sampler::argmax(l) as u32;
            }
            decode[i].push(n_decode as f64 / t0.elapsed().as_secs_f64());
        }
    }
    println!(
        "llama-3.2-1b-shaped bf16, {:.2} GB of weights, {} runs (medians)",
        weight_bytes as f64 / 1e9,
        runs
    );
    println!(
        "{:>8} {:>14} {:>14} {:>16}",
        "threads", "prefill tok/s", "decode tok/s", "decode GB/s eff."
    );
    let base = median(decode[0].clone());
    for (i, (t, _)) in sessions.iter().enumerate() {
        let d = median(decode[i].clone());
        println!(
            "{t:>8} {:>14.1} {:>14.2} {:>16.1}   (decode x{:.2} vs {} thread(s))",
            median(prefill[i].clone()),
            d,
            d * weight_bytes as f64 / 1e9,
            d / base,
            sessions[0].0
        );
    }
}
