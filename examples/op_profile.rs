//! Where a decode step goes: `cargo run --release --example op_profile -- MODEL [steps] [threads]`.
//! Prints time per op kind, and the executor's own overhead per op (wall
//! time of the step minus the time inside the kernels, per kernel call).
use llama_graph::generate::sampler::argmax;
use llama_graph::ir::LogitRows;
use llama_graph::session::{Model, Session, SessionOptions};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .expect("usage: op_profile MODEL [steps] [threads]");
    let steps: usize = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(100);
    let threads: usize = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(1);
    let model = Model::open(std::path::Path::new(path)).unwrap();
    let opts = SessionOptions {
        context: Some(1024),
        batch: 16,
        threads,
        logit_rows: LogitRows::Last,
        ..SessionOptions::default()
    };
    let mut s = Session::new(&model, &opts).unwrap();
    let mut tok = argmax(s.feed(&[1, 2, 3, 4]).unwrap()) as u32;
    s.exec.set_profiling(true);
    let t0 = std::time::Instant::now();
    for _ in 0..steps {
        tok = argmax(s.feed(&[tok]).unwrap()) as u32;
    }
    let wall = t0.elapsed().as_secs_f64() / steps as f64;
    let prof = s.exec.profile().unwrap();
    let mut by_op: std::collections::BTreeMap<&str, f64> = Default::default();
    for p in prof {
        *by_op.entry(p.op).or_default() += p.total.as_secs_f64() / steps as f64;
    }
    let total: f64 = by_op.values().sum();
    println!(
        "{:.1} us per step wall, {:.1} us inside ops, {} ops: executor overhead {:.3} us per op",
        wall * 1e6,
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
