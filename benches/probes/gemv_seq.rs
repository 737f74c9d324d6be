//! One decode step's weight GEMVs in sequence, over distinct weights laid out
//! as the weight arena lays them out (16 layers of Llama 3.2 1B shapes plus
//! the output head, bf16/f16/f32, one huge-page mapping), at each SIMD level
//! the CPU has, alternated with a plain read of the same bytes by the same
//! threads. The ratio says how close the
//! GEMV comes to the machine's streaming bandwidth when the op changes every
//! millisecond, as it does in decode; the plain read is the bound no kernel
//! over these bytes can beat.
//!
//! `cargo run --release --example gemv_seq -- [threads, default 2] [reps, default 10] [bf16|f16|f32]`

use llama_graph::ir::DType;
use llama_graph::kernels::{gemv, Isa, WeightRef};
use llama_graph::pool::ThreadPool;
use std::time::Instant;

#[path = "common/decode_step.rs"]
mod decode_step;
use decode_step::{median, n_out};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let reps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10);
    let dtype = match args.get(3).map(String::as_str).unwrap_or("bf16") {
        "f32" => DType::F32,
        "f16" => DType::F16,
        _ => DType::BF16,
    };
    let es = dtype.block_bytes();
    let pool = ThreadPool::new(threads);
    let ops = decode_step::ops();
    let total: usize = ops.iter().map(|&(n, k, _)| n * k * es).sum();
    let mut map = decode_step::huge(total);
    for (i, b) in map.iter_mut().enumerate() {
        *b = (i % 61) as u8 & 0x3f;
    }
    let x: Vec<f32> = (0..8192).map(|i| (i % 7) as f32 * 0.01).collect();
    let mut y = vec![0f32; 128256];
    let step = |level: Isa, y: &mut [f32]| {
        let mut off = 0;
        for &(n, k, ep) in &ops {
            let bytes = n * k * es;
            let w = WeightRef::new(dtype, &map[off..off + bytes]);
            off += bytes;
            let n_out = n_out(n, &ep);
            gemv::gemv_at(
                level,
                &pool,
                llama_graph::kernels::LinearArgs::new(&x[..k], 1, k, w, n, ep),
                &mut y[..n_out],
            )
            .expect("gemv");
        }
    };
    // The same bytes summed as u64 words, in 1 MiB chunks over the threads.
    let words = decode_step::words(&map);
    let read = || decode_step::read(&pool, words, 1 << 17);
    // The same read, one pool job per weight matrix, split into row ranges
    // as the GEMV splits it: what the op boundaries cost on their own.
    let read_ops = || {
        let mut off = 0;
        for &(n, k, _) in &ops {
            let (lo, len) = (off / 8, n * k * es / 8);
            off += n * k * es;
            let m = &words[lo..lo + len];
            decode_step::read(&pool, m, (len / (4 * threads)).max(1));
        }
    };
    let levels: Vec<Isa> = [Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|l| l.supported())
        .collect();
    for &l in &levels {
        step(l, &mut y);
    }
    read();
    let mut t_gemv = vec![Vec::new(); levels.len()];
    let mut t_read = Vec::new();
    let mut t_read_ops = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        read_ops();
        t_read_ops.push(t.elapsed().as_secs_f64());
        for (i, &l) in levels.iter().enumerate() {
            let t = Instant::now();
            step(l, &mut y);
            t_gemv[i].push(t.elapsed().as_secs_f64());
        }
        let t = Instant::now();
        read();
        t_read.push(t.elapsed().as_secs_f64());
    }
    let r = median(&mut t_read.clone());
    println!(
        "{threads} threads, {:.2} GB of {dtype} weights per step; plain read {:.1} GB/s, plain read per matrix {:.1} GB/s",
        total as f64 / 1e9,
        total as f64 / r / 1e9,
        total as f64 / median(&mut t_read_ops) / 1e9
    );
    for (l, t) in levels.iter().zip(&t_gemv) {
        let mut ratios: Vec<f64> = t_read.iter().zip(t).map(|(r, g)| r / g).collect();
        let g = median(&mut t.clone());
        println!(
            "  {l:?}: GEMV sequence {:.1} GB/s ({:.1} ms, {:.2} steps/s); GEMV / read: median of per-rep ratios {:.2}",
            total as f64 / g / 1e9,
            g * 1e3,
            1.0 / g,
            median(&mut ratios)
        );
    }
}
