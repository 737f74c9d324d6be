//! Float-weight GEMM throughput (the prefill matmuls of F32/F16/BF16 files)
//! on Llama-3.2-1B-like shapes, GFLOP/s per call, medians of interleaved rounds.
//!
//! `cargo run --release --example fgemm_bench -- [threads, default 1] [s, default 128]`
//!
//! `DTYPES=f16,f32` picks the weight types, `SHAPES=qkv,ffn` the matrices by
//! a part of their names, `ROUNDS` (default 5) the rounds.

use llama_graph::ir::DType;
use llama_graph::kernels::matmul::{flops, matmul_with};
use llama_graph::kernels::{Epilogue, WeightRef};
use llama_graph::pool::ThreadPool;
use std::time::Instant;

fn encode(v: &[f32], dtype: DType) -> Vec<u8> {
    llama_graph::kernels::plain_bytes(v, dtype).expect("a plain dtype")
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(1);
    let s: usize = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(128);
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let pool = ThreadPool::new(threads);
    let pick = |var: &str, name: &str| {
        std::env::var(var).map_or(true, |f| {
            f.split(',')
                .any(|p| name == p || (var == "SHAPES" && name.contains(p)))
        })
    };
    let mut seed = 7u64;
    let mut rnd = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    };
    println!(
        "isa {:?}, threads {threads}, s {s}",
        llama_graph::kernels::Kernels::current().isa()
    );
    for (name, n, k, swiglu) in [
        ("tiny 64x256", 64, 256, false),
        // SmolLM2-135M's 30 gate+up matrices stacked, and its output head:
        // at S = 1 these stream from DRAM.
        ("smol-ffn 92160x576", 92160, 576, true),
        ("smol-head 49152x576", 49152, 576, false),
        ("l1 2048x256", 2048, 256, false),
        ("qkv 3072x2048", 3072, 2048, false),
        ("ffn-swiglu 16384x2048", 16384, 2048, true),
        ("down 2048x8192", 2048, 8192, false),
    ] {
        if !pick("SHAPES", name) {
            continue;
        }
        let x: Vec<f32> = (0..s * k).map(|_| rnd()).collect();
        let wf: Vec<f32> = (0..n * k).map(|_| rnd() * 0.1).collect();
        for (dn, dtype) in [
            ("f32", DType::F32),
            ("f16", DType::F16),
            ("bf16", DType::BF16),
        ] {
            if !pick("DTYPES", dn) {
                continue;
            }
            let bytes = encode(&wf, dtype);
            let w = WeightRef::new(dtype, &bytes);
            let n_out = if swiglu { n / 2 } else { n };
            let ep = || {
                if swiglu {
                    Epilogue::SwiGlu
                } else {
                    Epilogue::None
                }
            };
            let mut y = vec![0f32; s * n_out];
            let mut call = || {
                matmul_with(
                    &pool,
                    llama_graph::kernels::Kernels::current().isa(),
                    llama_graph::kernels::LinearArgs::new(&x, s, k, w, n, ep()),
                    &mut y,
                )
                .unwrap();
            };
            call();
            let mut v = Vec::new();
            for _ in 0..rounds {
                let t = Instant::now();
                let mut reps = 0;
                while t.elapsed().as_secs_f64() < 0.2 {
                    call();
                    reps += 1;
                }
                v.push(t.elapsed().as_secs_f64() / reps as f64);
            }
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let med = v[v.len() / 2];
            println!(
                "{name:>24} {dn:>4}: {:7.2} GFLOP/s  {:8.3} ms  weights {:6.2} GB/s",
                flops(s, n, k) / med / 1e9,
                med * 1e3,
                bytes.len() as f64 / med / 1e9
            );
        }
    }
}
