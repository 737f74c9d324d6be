//! Where a decode step goes:
//! `cargo run --release --example op_profile -- MODEL [steps] [threads] [seqs]`
//! (`DEPTH=N`: one sequence's steps after an N-token prompt).
//! Prints time per op kind, and the executor's own overhead per op (wall
//! time of the step minus the time inside the kernels, per kernel call).
//!
//! With `seqs` > 1 each step feeds one token of each of `seqs` sequences
//! (what `serve` runs with that many clients): every sequence is first fed
//! a 40-token prompt of its own, then the steps run on the shared KV pool.
//! `BATCHED=1` takes that path with one sequence too (what `serve` runs
//! with one client), in place of the single-sequence session; `CTX` and
//! `BATCH` set that session's context (default 4096) and step budget (512).
use llama_graph::exec::{Batch, KvPool};
use llama_graph::generate::sampler::argmax;
use llama_graph::ir::LogitRows;
use llama_graph::session::{Model, Session, SessionOptions};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .expect("usage: op_profile MODEL [steps] [threads] [seqs]");
    let steps: usize = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(100);
    let threads: usize = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(1);
    let seqs: usize = args.get(4).map(|s| s.parse().unwrap()).unwrap_or(1);
    let model = Model::open(std::path::Path::new(path)).unwrap();
    let prefill: Option<usize> = std::env::var("PREFILL").ok().map(|v| v.parse().unwrap());
    let (s, wall) = if let Some(n) = prefill {
        prompt(&model, steps, threads, n)
    } else if seqs <= 1 && std::env::var_os("BATCHED").is_none() {
        single(&model, steps, threads)
    } else {
        batched(&model, steps, threads, seqs)
    };
    let prof = s.exec().profile().unwrap();
    let mut by_op: std::collections::BTreeMap<&str, f64> = Default::default();
    for p in prof {
        *by_op.entry(p.op).or_default() += p.total.as_secs_f64() / steps as f64;
    }
    let total: f64 = by_op.values().sum();
    let tokens = prefill.unwrap_or(seqs.max(1));
    println!(
        "{:.1} us per step wall ({:.1} tokens/s), {:.1} us inside ops, {} ops: executor overhead {:.3} us per op",
        wall * 1e6,
        tokens as f64 / wall,
        total * 1e6,
        prof.len(),
        (wall - total) * 1e6 / prof.len() as f64
    );
    let mut v: Vec<_> = by_op.into_iter().collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    for (op, t) in v {
        println!(
            "  {op:<12} {:>9.1} us  {:>5.1}%",
            t * 1e6,
            100.0 * t / total
        );
    }
}

/// One sequence, one token per step; the session and seconds per step.
/// With `DEPTH=N` the steps run after an N-token prompt (fed in chunks of
/// 512), as `bench -d N` does.
fn single(model: &Model, steps: usize, threads: usize) -> (Session, f64) {
    let depth: usize = std::env::var("DEPTH").map_or(0, |v| v.parse().unwrap());
    let opts = SessionOptions {
        context: Some((depth + steps + 16).max(1024)),
        batch: if depth > 0 { 512 } else { 16 },
        threads,
        logit_rows: LogitRows::Last,
        ..SessionOptions::default()
    };
    let mut s = Session::new(model, &opts).unwrap();
    let prompt: Vec<u32> = (0..depth.max(4) as u32)
        .map(|i| 1 + (7 * i) % 1000)
        .collect();
    let mut tok = argmax(s.feed(&prompt).unwrap()) as u32;
    s.exec_mut().set_profiling(true);
    let t0 = std::time::Instant::now();
    for _ in 0..steps {
        tok = argmax(s.feed(&[tok]).unwrap()) as u32;
    }
    (s, t0.elapsed().as_secs_f64() / steps as f64)
}

/// One `n`-token prompt per step, each on a reset session.
fn prompt(model: &Model, steps: usize, threads: usize, n: usize) -> (Session, f64) {
    let opts = SessionOptions {
        context: Some(n.max(16)),
        batch: 512,
        threads,
        logit_rows: LogitRows::Last,
        ..SessionOptions::default()
    };
    let mut s = Session::new(model, &opts).unwrap();
    let toks: Vec<u32> = (0..n as u32).map(|i| 100 + 7 * i).collect();
    s.feed(&toks).unwrap();
    s.exec_mut().set_profiling(true);
    let t0 = std::time::Instant::now();
    for _ in 0..steps {
        s.reset();
        s.feed(&toks).unwrap();
    }
    (s, t0.elapsed().as_secs_f64() / steps as f64)
}

/// `seqs` sequences, one token of each per step.
fn batched(model: &Model, steps: usize, threads: usize, seqs: usize) -> (Session, f64) {
    let env = |v: &str, d: usize| std::env::var(v).ok().map_or(d, |x| x.parse().unwrap());
    let opts = SessionOptions {
        context: Some(env("CTX", 4096)),
        batch: env("BATCH", 512),
        parallel: seqs,
        threads,
        ..SessionOptions::default()
    };
    let mut s = Session::new(model, &opts).unwrap();
    let geom = s.exec().kv_geom();
    let mut pool = KvPool::new(geom.n_blocks, geom.block);
    let prompt = 40;
    let mut blocks: Vec<Vec<u32>> = vec![Vec::new(); seqs];
    for b in &mut blocks {
        assert!(
            pool.reserve(b, prompt + steps + 3),
            "the KV pool is too small for {seqs} sequences of {} positions",
            prompt + steps + 3
        );
    }
    let mut batch = Batch::with_capacity(s.exec().max_chunk(), seqs, geom.n_blocks);
    let mut next = vec![0u32; seqs];
    for (j, b) in blocks.iter().enumerate() {
        let toks: Vec<u32> = (0..prompt as u32)
            .map(|i| 100 + 7 * i + 13 * j as u32)
            .collect();
        batch.clear();
        batch.push(&toks, 0, b);
        next[j] = argmax(s.step(&batch).unwrap().row(0)) as u32;
    }
    let mut run = |s: &mut Session, from: usize, n: usize| {
        for i in 0..n {
            batch.clear();
            for (j, b) in blocks.iter().enumerate() {
                batch.push(&[next[j]], prompt + from + i, b);
            }
            let l = s.step(&batch).unwrap();
            for (j, n) in next.iter_mut().enumerate() {
                *n = argmax(l.row(j)) as u32;
            }
        }
    };
    // Two warm-up steps, then the measured ones.
    run(&mut s, 0, 2);
    s.exec_mut().set_profiling(true);
    let t0 = std::time::Instant::now();
    run(&mut s, 2, steps);
    (s, t0.elapsed().as_secs_f64() / steps as f64)
}
