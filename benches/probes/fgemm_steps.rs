//! The weight products of one SmolLM2-135M step of S tokens (30 layers of
//! `wqkv` 960×576, `wo` 576×576, `w13` 3072×576 SwiGLU, `w2` 576×1536, each
//! layer its own weights in one huge-page mapping as the weight arena lays
//! them out, so they stream from DRAM), for S = 1..=9 interleaved round by
//! round: the cost of a speculative verification step against a one-token
//! step. Prints the median step time per S and what each token past the
//! first costs (ms, and GFLOP/s of those extra tokens' arithmetic).
//!
//! `cargo run --release --example fgemm_steps -- [threads, default 1] [max s, default 9]`
//!
//! `DTYPES=f16,f32` (default both, also bf16), `ROUNDS` (default 15),
//! `HEAD=1` adds the 49152×576 output head for every token (the logits of
//! every verified position). `BY_OP=1` also prints, per S, the time of
//! each product shape summed over the layers (ms, and GFLOP/s of the whole
//! product: where a step's time goes).

use llama_graph::ir::DType;
use llama_graph::kernels::matmul::{matmul_with, Epilogue};
use llama_graph::kernels::{Kernels, LinearArgs, WeightRef};
use llama_graph::pool::ThreadPool;
use std::time::Instant;

// Only the mapping and the median are used here.
#[allow(dead_code)]
#[path = "common/decode_step.rs"]
mod decode_step;
use decode_step::{huge, median, n_out};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(1);
    let max_s: usize = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(9);
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15);
    let head = std::env::var("HEAD").is_ok_and(|v| v == "1");
    let by_op = std::env::var("BY_OP").is_ok_and(|v| v == "1");
    let dtypes = std::env::var("DTYPES").unwrap_or_else(|_| "f16,f32".into());
    let pool = ThreadPool::new(threads);
    let isa = Kernels::current().isa();
    let mut ops: Vec<(usize, usize, Epilogue<'static>)> = Vec::new();
    for _ in 0..30 {
        ops.extend([
            (960, 576, Epilogue::None),
            (576, 576, Epilogue::Accumulate),
            (3072, 576, Epilogue::SwiGlu),
            (576, 1536, Epilogue::Accumulate),
        ]);
    }
    if head {
        ops.push((49152, 576, Epilogue::None));
    }
    let params: usize = ops.iter().map(|&(n, k, _)| n * k).sum();
    println!("isa {isa:?}, threads {threads}, {params} weights, head {head}");
    let mut seed = 7u64;
    let mut rnd = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    };
    let x: Vec<f32> = (0..max_s * 1536).map(|_| rnd()).collect();
    for dn in dtypes.split(',') {
        let dtype = match dn {
            "f32" => DType::F32,
            "bf16" => DType::BF16,
            _ => DType::F16,
        };
        let es = dtype.block_bytes();
        let mut map = huge(params * es);
        // Small weights; every op gets its own bytes.
        let mut row: Vec<f32> = vec![0.0; 4096];
        let mut off = 0;
        for &(n, k, _) in &ops {
            for r in 0..n {
                row[..k].iter_mut().for_each(|v| *v = rnd() * 0.1);
                let b = llama_graph::kernels::plain_bytes(&row[..k], dtype).unwrap();
                map[off + r * k * es..off + (r + 1) * k * es].copy_from_slice(&b);
            }
            off += n * k * es;
        }
        let mut y = vec![0f32; max_s * 49152];
        // Seconds per op (by index) of the last step.
        let mut op_secs = vec![0f64; ops.len()];
        let mut step = |s: usize, op_secs: &mut [f64]| {
            let mut off = 0;
            for (o, &(n, k, ep)) in ops.iter().enumerate() {
                let t0 = Instant::now();
                let w = WeightRef::new(dtype, &map[off..off + n * k * es]);
                let m = s * n_out(n, &ep);
                matmul_with(
                    &pool,
                    isa,
                    LinearArgs::new(&x[..s * k], s, k, w, n, ep),
                    &mut y[..m],
                )
                .unwrap();
                op_secs[o] = t0.elapsed().as_secs_f64();
                off += n * k * es;
            }
        };
        let mut times = vec![Vec::new(); max_s + 1];
        // Per S, per shape (the first four ops, then the head): step times.
        let shapes = if head { 5 } else { 4 };
        let mut shape_times = vec![vec![Vec::new(); shapes]; max_s + 1];
        for _ in 0..rounds {
            for (s, t) in times.iter_mut().enumerate().skip(1) {
                let t0 = Instant::now();
                step(s, &mut op_secs);
                t.push(t0.elapsed().as_secs_f64());
                for (sh, v) in shape_times[s].iter_mut().enumerate() {
                    let sum: f64 = if sh == 4 {
                        op_secs[ops.len() - 1]
                    } else {
                        op_secs.iter().take(120).skip(sh).step_by(4).sum()
                    };
                    v.push(sum);
                }
            }
        }
        if by_op {
            let names = ["wqkv", "wo", "w13", "w2", "head"];
            for (s, per) in shape_times.iter_mut().enumerate().skip(1) {
                let mut line = format!("{dn}: S={s} by op:");
                for (sh, v) in per.iter_mut().enumerate() {
                    let (n, k, _) = ops[if sh == 4 { ops.len() - 1 } else { sh }];
                    let t = median(v);
                    let layers = if sh == 4 { 1.0 } else { 30.0 };
                    let gf = 2.0 * (n * k * s) as f64 * layers / t / 1e9;
                    line += &format!("  {} {:.2} ms {:.1} GF/s", names[sh], t * 1e3, gf);
                }
                println!("{line}");
            }
        }
        let t1 = median(&mut times[1]);
        println!("{dn}: S=1 {:.2} ms", t1 * 1e3);
        for (s, t) in times.iter_mut().enumerate().skip(2) {
            let ts = median(t);
            let extra = (ts - t1) / (s - 1) as f64;
            println!(
                "{dn}: S={s} {:7.2} ms  {:5.2}x S=1  extra token {:6.2} ms = {:6.1} GFLOP/s",
                ts * 1e3,
                ts / t1,
                extra * 1e3,
                2.0 * params as f64 / extra / 1e9
            );
        }
    }
}
