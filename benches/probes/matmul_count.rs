//! A fixed float matmul workload for instruction counts (`valgrind
//! --tool=callgrind`) or `perf record`: the linear layers of one SmolLM2-135M
//! step (30 layers: wqkv, wo + residual, w13 + SwiGLU, w2 + residual, and
//! the output head) over random weights, `s` tokens per step.
//!
//! `cargo run --release --example matmul_count -- ISA DTYPE S [STEPS] [THREADS]`
//! (ISA: scalar|avx2|avx512; DTYPE: f32|f16|bf16; `GEMV=1` sends single
//! tokens through `gemv::gemv_at`, the fast path's entry).

use llama_graph::ir::DType;
use llama_graph::kernels::matmul::{matmul_with, Epilogue};
use llama_graph::kernels::{Isa, WeightRef};
use llama_graph::pool::ThreadPool;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let isa = Isa::from_name(a.get(1).map_or("avx2", |s| s)).expect("isa");
    let dtype = match a.get(2).map_or("f16", |s| s) {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        _ => DType::F16,
    };
    let s: usize = a.get(3).and_then(|v| v.parse().ok()).unwrap_or(1);
    let steps: usize = a.get(4).and_then(|v| v.parse().ok()).unwrap_or(1);
    let threads: usize = a.get(5).and_then(|v| v.parse().ok()).unwrap_or(1);
    let pool = ThreadPool::new(threads);
    // GEMV=1: single tokens through `gemv::gemv_at` (the fast path's entry).
    let gemv = std::env::var("GEMV").is_ok_and(|v| v == "1");
    let es = if dtype == DType::F32 { 4 } else { 2 };
    // (n, k, epilogue): 0 none, 1 residual, 2 swiglu
    let layer = [(960, 576, 0), (576, 576, 1), (3072, 576, 2), (576, 1536, 1)];
    let mut mats = Vec::new();
    let mut seed = 1u32;
    for _ in 0..30 {
        for &(n, k, e) in &layer {
            let w: Vec<u8> = (0..n * k * es)
                .map(|i| {
                    seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
                    // Keep every element a normal number: high byte 0x3c..0x3f.
                    if (i % es) == es - 1 {
                        0x3c | (seed >> 30) as u8
                    } else {
                        (seed >> 24) as u8
                    }
                })
                .collect();
            mats.push((n, k, e, w));
        }
    }
    let x: Vec<f32> = (0..s * 1536)
        .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.05)
        .collect();
    let r: Vec<f32> = vec![0.5; s * 3072];
    let mut y = vec![0f32; s * 3072];
    let mut sum = 0f64;
    for _ in 0..steps {
        for (n, k, e, w) in &mats {
            let (n, k) = (*n, *k);
            let wr = WeightRef::new(dtype, w);
            let (ep, no) = match e {
                0 => (Epilogue::None, n),
                1 => (Epilogue::AddResidual(&r[..s * n]), n),
                _ => (Epilogue::SwiGlu, n / 2),
            };
            if s == 1 && gemv {
                llama_graph::kernels::gemv::gemv_at(
                    isa,
                    &pool,
                    llama_graph::kernels::LinearArgs::new(&x[..k], 1, k, wr, n, ep),
                    &mut y[..no],
                )
                .unwrap();
            } else {
                matmul_with(
                    &pool,
                    isa,
                    llama_graph::kernels::LinearArgs::new(&x[..s * k], s, k, wr, n, ep),
                    &mut y[..s * no],
                )
                .unwrap();
            }
            sum += y[0] as f64;
        }
    }
    println!("{sum}");
}
