//! Where a multi-sequence decode step goes (what `serve` runs with several
//! clients): `cargo run --release --example batch_profile -- MODEL [seqs] [steps] [threads]`.
//! Each of `seqs` sequences is fed a 40-token prompt, then every step feeds
//! one token of each sequence; prints the time per step and per op kind.
use llama_graph::exec::{Batch, KvPool};
use llama_graph::generate::sampler::argmax;
use llama_graph::session::{Model, Session, SessionOptions};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .expect("usage: batch_profile MODEL [seqs] [steps] [threads]");
    let seqs: usize = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(16);
    let steps: usize = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(32);
    let threads: usize = args.get(4).map(|s| s.parse().unwrap()).unwrap_or(2);
    let model = Model::open(std::path::Path::new(path)).unwrap();
    let opts = SessionOptions {
        context: Some(4096),
        parallel: seqs,
        threads,
        ..SessionOptions::default()
    };
    let mut s = Session::new(&model, &opts).unwrap();
    let geom = s.exec.kv_geom();
    let mut pool = KvPool::new(geom.n_blocks, geom.block);
    let prompt = 40;
    let mut blocks: Vec<Vec<u32>> = vec![Vec::new(); seqs];
    for b in &mut blocks {
        assert!(pool.reserve(b, prompt + steps + 1));
    }
    let mut batch = Batch::with_capacity(s.exec.max_chunk(), seqs, geom.n_blocks);
    let mut next = vec![0u32; seqs];
    for (j, b) in blocks.iter().enumerate() {
        let toks: Vec<u32> = (0..prompt as u32)
            .map(|i| 100 + 7 * i + 13 * j as u32)
            .collect();
        batch.clear();
        batch.push(&toks, 0, b);
        next[j] = argmax(s.step(&batch).unwrap().row(0)) as u32;
    }
    let mut run = |s: &mut Session, from: usize, n: usize, next: &mut Vec<u32>| {
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
    run(&mut s, 0, 2, &mut next);
    s.exec.set_profiling(true);
    let t0 = std::time::Instant::now();
    run(&mut s, 2, steps, &mut next);
    let wall = t0.elapsed().as_secs_f64() / steps as f64;
    let prof = s.exec.profile().unwrap();
    let mut by_op: std::collections::BTreeMap<&str, f64> = Default::default();
    for p in prof {
        *by_op.entry(p.op).or_default() += p.total.as_secs_f64() / steps as f64;
    }
    let total: f64 = by_op.values().sum();
    println!(
        "{seqs} sequences: {:.1} ms per step wall ({:.1} tokens/s), {:.1} ms inside ops",
        wall * 1e3,
        seqs as f64 / wall,
        total * 1e3
    );
    let mut v: Vec<_> = by_op.into_iter().collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    for (op, t) in v {
        println!(
            "  {op:<12} {:>9.2} ms  {:>5.1}%",
            t * 1e3,
            100.0 * t / total
        );
    }
}
