//! Prefill attention, one layer of SmolLM2-135M (9 heads, 3 kv heads,
//! head_dim 64): the streaming kernel (before) against the tiled kernel
//! (after) at AVX2 and, if the CPU has it, AVX-512F, interleaved on the
//! same data, medians.
//!
//! `cargo run --release --example attention_bench -- [reps]`
//! (run it under `flock /tmp/llama-graph-bench.lock` on a shared machine).
use llama_graph::kernels::{
    attention_stream_scratch_len, attention_stream_with, attention_tiled_scratch_len,
    attention_tiled_with, AttnShape, Isa,
};
use llama_graph::pool::ThreadPool;
use std::time::Instant;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let reps: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("reps"))
        .unwrap_or(30);
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let has512 = Isa::Avx512.supported();
    println!("| threads | S | P | stream (us) | tiled AVX2 (us) | tiled AVX-512 (us) | best speed-up | best GFLOP/s |");
    println!("|---|---|---|---|---|---|---|---|");
    for threads in [1, 2] {
        let pool = ThreadPool::new(threads);
        for (s, pos) in [
            (128, 0),
            (512, 0),
            (64, 448),
            (16, 200),
            (4, 200),
            (1, 511),
            (1, 2047),
        ] {
            let shape = AttnShape {
                s,
                pos,
                n_heads: 9,
                n_kv_heads: 3,
                head_dim: 64,
            };
            let kv = (pos + s) * 3 * 64;
            let q: Vec<f32> = (0..s * 9 * 64).map(|_| rnd()).collect();
            let kc: Vec<f32> = (0..kv).map(|_| rnd()).collect();
            let vc: Vec<f32> = (0..kv).map(|_| rnd()).collect();
            let mut out = vec![0f32; q.len()];
            let mut scr_a = vec![0f32; attention_stream_scratch_len(&shape, threads)];
            let mut scr_b = vec![0f32; attention_tiled_scratch_len(&shape, threads)];
            let inner = (2_000_000 / (s * (pos + s)).max(1)).clamp(1, 200);
            let (mut ta, mut tb, mut tc) = (Vec::new(), Vec::new(), Vec::new());
            for rep in 0..reps + 2 {
                let t = Instant::now();
                for _ in 0..inner {
                    attention_stream_with(
                        &pool,
                        Isa::current(),
                        &q,
                        &kc,
                        &vc,
                        shape,
                        &mut out,
                        &mut scr_a,
                    )
                    .unwrap();
                }
                let a = t.elapsed().as_secs_f64() / inner as f64;
                let t = Instant::now();
                for _ in 0..inner {
                    let l = Isa::Avx2;
                    attention_tiled_with(&pool, l, &q, &kc, &vc, shape, &mut out, &mut scr_b)
                        .unwrap();
                }
                let b = t.elapsed().as_secs_f64() / inner as f64;
                let t = Instant::now();
                if has512 {
                    for _ in 0..inner {
                        let l = Isa::Avx512;
                        attention_tiled_with(&pool, l, &q, &kc, &vc, shape, &mut out, &mut scr_b)
                            .unwrap();
                    }
                }
                let c = t.elapsed().as_secs_f64() / inner as f64;
                if rep >= 2 {
                    ta.push(a);
                    tb.push(b);
                    tc.push(c);
                }
            }
            let (a, b, c) = (median(&mut ta), median(&mut tb), median(&mut tc));
            let best = if has512 { b.min(c) } else { b };
            // Causal multiply-adds of q·K and p·V (2 FLOP each).
            let pairs: usize = (0..s).map(|i| pos + i + 1).sum();
            let flop = 4.0 * (pairs * 9 * 64) as f64;
            println!(
                "| {threads} | {s} | {pos} | {:.1} | {:.1} | {} | {:.2}x | {:.1} |",
                a * 1e6,
                b * 1e6,
                if has512 {
                    format!("{:.1}", c * 1e6)
                } else {
                    "-".into()
                },
                a / best,
                flop / best * 1e-9
            );
        }
    }
}
