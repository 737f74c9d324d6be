//! Bandwidth of the single-token GEMV over bf16/f16/f32 weights held in
//! huge-page memory (as the weight arena holds them) or in 4 KiB pages.
//!
//! `cargo run --release --example gemv_bench -- [threads] [dtype] [reps]`
//! prints GB/s of weight bytes for the decode shapes of Llama 3.2 1B
//! (wqkv, wo, w13 with SwiGLU, w2, the output head), or of SmolLM2-135M
//! with `SHAPES=smol`, or 8 MiB of F32 (4 of F16) at row lengths from 256
//! to 8192 with `SHAPES=sweep`. Each shape is copied until the copies fill 256 MiB
//! (well past the last-level cache) and the product runs over the copies in
//! turn, as decode streams one layer's matrix after another: the figure is
//! what a step sees from memory, not from cache. `PAGES=huge` or `PAGES=4k`
//! measures one kind of page only.

use llama_graph::ir::DType;
use llama_graph::kernels::matmul::Epilogue;
use llama_graph::kernels::{gemv, WeightRef};
use llama_graph::pool::ThreadPool;
use std::time::Instant;

/// Bytes of weight copies per shape: more than any last-level cache here.
const STREAM_BYTES: usize = 256 << 20;

fn main() {
    let isa = llama_graph::kernels::Kernels::current().isa();
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1);
    let dtype = match args.get(2).map(String::as_str).unwrap_or("bf16") {
        "f32" => DType::F32,
        "f16" => DType::F16,
        _ => DType::BF16,
    };
    let reps: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5);
    let pool = ThreadPool::new(threads);
    let es = dtype.block_bytes();
    // (name, n, k, swiglu)
    let shapes: &[(&str, usize, usize, bool)] = match std::env::var("SHAPES").as_deref() {
        Ok("smol") => &[
            ("wqkv", 960, 576, false),
            ("wo", 576, 576, false),
            ("w13", 3072, 576, true),
            ("w2", 576, 1536, false),
            ("head", 49152, 576, false),
        ],
        Ok("sweep") => &[
            ("k256", 8192, 256, false),
            ("k576", 4096, 576, false),
            ("k1024", 2048, 1024, false),
            ("k1536", 1536, 1536, false),
            ("k2048", 1024, 2048, false),
            ("k4096", 512, 4096, false),
            ("k8192", 256, 8192, false),
        ],
        _ => &[
            ("wqkv", 3072, 2048, false),
            ("wo", 2048, 2048, false),
            ("w13", 16384, 2048, true),
            ("w2", 2048, 8192, false),
            ("head", 128256, 2048, false),
        ],
    };
    let pages: &[bool] = match std::env::var("PAGES").as_deref() {
        Ok("huge") => &[true],
        Ok("4k") => &[false],
        _ => &[true, false],
    };
    for &huge in pages {
        for &(name, n, k, swiglu) in shapes {
            let bytes = n * k * es;
            let copies = STREAM_BYTES.div_ceil(bytes);
            let mut map = memmap2::MmapOptions::new()
                .len(bytes * copies)
                .map_anon()
                .unwrap();
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
            let ep = if swiglu {
                Epilogue::SwiGlu
            } else {
                Epilogue::None
            };
            let pass = |y: &mut [f32]| {
                for c in 0..copies {
                    let w = WeightRef::new(dtype, &map[c * bytes..(c + 1) * bytes]);
                    gemv::gemv_at(
                        isa,
                        &pool,
                        llama_graph::kernels::LinearArgs::new(&x, 1, k, w, n, ep),
                        y,
                    )
                    .unwrap();
                }
            };
            pass(&mut y);
            let mut best = f64::MAX;
            for _ in 0..reps {
                let t = Instant::now();
                pass(&mut y);
                best = best.min(t.elapsed().as_secs_f64() / copies as f64);
            }
            println!(
                "{} {name:>5} [{n} x {k}] {dtype} {threads} thr: {:.1} GB/s ({:.3} ms per product, {copies} copies)",
                if huge { "huge" } else { "4k  " },
                bytes as f64 / best / 1e9,
                best * 1e3
            );
        }
    }
}
