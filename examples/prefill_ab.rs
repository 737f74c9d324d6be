//! End-to-end prefill A/B inside one process: the same session alternates
//! the streaming and the tiled attention kernel for S>1
//! (`Executor::set_tiled_attention`), so both see the same machine load.
//!
//! `cargo run --release --example prefill_ab -- MODEL [threads] [reps]`
//! (run it under `flock /tmp/llama-graph-bench.lock` on a shared machine).
//! Prints prompt tokens/s (median) for pp128 and pp512.
use llama_graph::session::{Model, Session, SessionOptions};
use std::time::Instant;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .expect("usage: prefill_ab MODEL [threads] [reps]");
    let threads: usize = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(2);
    let reps: usize = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(5);
    let model = Model::open(std::path::Path::new(path)).unwrap();
    let opts = SessionOptions {
        context: Some(1024),
        batch: 512,
        threads,
        ..SessionOptions::default()
    };
    let mut s = Session::new(&model, &opts).unwrap();
    let vocab = s.vocab() as u32;
    for n in [128usize, 512] {
        let toks: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 13) % vocab).collect();
        let (mut ta, mut tb) = (Vec::new(), Vec::new());
        for rep in 0..reps + 1 {
            for tiled in [false, true] {
                s.exec.set_tiled_attention(tiled);
                s.reset();
                let t = Instant::now();
                s.feed(&toks).unwrap();
                let dt = t.elapsed().as_secs_f64();
                if rep > 0 {
                    if tiled {
                        tb.push(dt)
                    } else {
                        ta.push(dt)
                    }
                }
            }
        }
        let (a, b) = (median(&mut ta), median(&mut tb));
        println!(
            "threads {threads} pp{n}: stream {:.1} t/s, tiled {:.1} t/s, {:.3}x",
            n as f64 / a,
            n as f64 / b,
            a / b
        );
    }
}
