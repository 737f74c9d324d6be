//! Bandwidth of the single-token GEMV over bf16/f16/f32 weights held in
//! huge-page memory (as the weight arena holds them) or in 4 KiB pages.
//!
//! `cargo run --release --example gemv_bench -- [threads] [dtype] [reps]`
//! prints GB/s of weight bytes for the decode shapes of Llama 3.2 1B
//! (wqkv, wo, w13 with SwiGLU, w2, the output head).

use llama_graph::ir::DType;
use llama_graph::kernels::matmul::Epilogue;
use llama_graph::kernels::{gemv, WeightRef};
use llama_graph::pool::ThreadPool;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1);
    let dtype = match args.get(2).map(String::as_str).unwrap_or("bf16") {
        "f32" => DType::F32,
        "f16" => DType::F16,
        _ => DType::BF16,
    };
    let reps: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(20);
    let pool = ThreadPool::new(threads);
    let es = dtype.block_bytes();
    // (name, n, k, swiglu)
    let shapes = [
        ("wqkv", 3072, 2048, false),
        ("wo", 2048, 2048, false),
        ("w13", 16384, 2048, true),
        ("w2", 2048, 8192, false),
        ("head", 128256, 2048, false),
    ];
    for huge in [true, false] {
        for &(name, n, k, swiglu) in &shapes {
            let bytes = n * k * es;
            let mut map = memmap2::MmapOptions::new().len(bytes).map_anon().unwrap();
            if huge {
                let _ = map.advise(memmap2::Advice::HugePage);
            } else {
                let _ = map.advise(memmap2::Advice::NoHugePage);
            }
            for (i, b) in map.iter_mut().enumerate() {
                *b = (i % 61) as u8 & 0x3f;
            }
            let x: Vec<f32> = (0..k).map(|i| (i % 7) as f32 * 0.01).collect();
            let n_out = if swiglu { n / 2 } else { n };
            let mut y = vec![0f32; n_out];
            let w = WeightRef::new(dtype, &map);
            let ep = if swiglu {
                Epilogue::SwiGlu
            } else {
                Epilogue::None
            };
            gemv::gemv(&pool, &x, k, w, n, ep, &mut y).unwrap();
            let mut best = f64::MAX;
            for _ in 0..reps {
                let t = Instant::now();
                gemv::gemv(&pool, &x, k, w, n, ep, &mut y).unwrap();
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "{} {name:>5} [{n} x {k}] {dtype} {threads} thr: {:.1} GB/s ({:.2} ms)",
                if huge { "huge" } else { "4k  " },
                bytes as f64 / best / 1e9,
                best * 1e3
            );
        }
    }
}
