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
use llama_graph::kernels::matmul::Epilogue;
use llama_graph::kernels::{gemv, WeightRef};
use llama_graph::pool::ThreadPool;
use std::hint::black_box;
use std::time::Instant;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

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
    // (n, k, epilogue) per weight GEMV of one decode step.
    let mut ops = Vec::new();
    for _ in 0..16 {
        ops.extend([
            (3072, 2048, Epilogue::None),
            (2048, 2048, Epilogue::Accumulate),
            (16384, 2048, Epilogue::SwiGlu),
            (2048, 8192, Epilogue::Accumulate),
        ]);
    }
    ops.push((128256, 2048, Epilogue::None));
    let total: usize = ops.iter().map(|&(n, k, _)| n * k * es).sum();
    let mut map = memmap2::MmapOptions::new()
        .len(total)
        .map_anon()
        .expect("map");
    let _ = map.advise(memmap2::Advice::HugePage);
    for (i, b) in map.iter_mut().enumerate() {
        *b = (i % 61) as u8 & 0x3f;
    }
    let x: Vec<f32> = (0..8192).map(|i| (i % 7) as f32 * 0.01).collect();
    let mut y = vec![0f32; 128256];
    let step = |level: gemv::Level, y: &mut [f32]| {
        let mut off = 0;
        for &(n, k, ep) in &ops {
            let bytes = n * k * es;
            let w = WeightRef::new(dtype, &map[off..off + bytes]);
            off += bytes;
            let n_out = if matches!(ep, Epilogue::SwiGlu) {
                n / 2
            } else {
                n
            };
            gemv::gemv_at(level, &pool, &x[..k], k, w, n, ep, &mut y[..n_out]).expect("gemv");
        }
    };
    // The same bytes summed as u64 words, in 1 MiB chunks over the threads.
    let words: &[u64] = bytemuck_words(&map);
    let read = || {
        const CHUNK: usize = 1 << 17;
        let sums: Vec<std::sync::atomic::AtomicU64> =
            (0..threads).map(|_| Default::default()).collect();
        pool.run_indexed(words.len().div_ceil(CHUNK), &|c, t| {
            let w = &words[c * CHUNK..((c + 1) * CHUNK).min(words.len())];
            let s = w.iter().fold(0u64, |a, &v| a.wrapping_add(v));
            sums[t].fetch_add(s, std::sync::atomic::Ordering::Relaxed);
        });
        black_box(sums);
    };
    // The same read, one pool job per weight matrix, split into row ranges
    // as the GEMV splits it: what the op boundaries cost on their own.
    let read_ops = || {
        let mut off = 0;
        for &(n, k, _) in &ops {
            let (lo, len) = (off / 8, n * k * es / 8);
            off += n * k * es;
            let m = &words[lo..lo + len];
            let chunk = (len / (4 * threads)).max(1);
            let sums: Vec<std::sync::atomic::AtomicU64> =
                (0..threads).map(|_| Default::default()).collect();
            pool.run_indexed(len.div_ceil(chunk), &|c, t| {
                let w = &m[c * chunk..((c + 1) * chunk).min(len)];
                let s = w.iter().fold(0u64, |a, &v| a.wrapping_add(v));
                sums[t].fetch_add(s, std::sync::atomic::Ordering::Relaxed);
            });
            black_box(sums);
        }
    };
    let levels: Vec<gemv::Level> = gemv::Level::ALL
        .into_iter()
        .filter(|l| *l > gemv::Level::Scalar && l.available())
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

/// The mapping as u64 words (it is page-aligned, and its length a multiple of 8).
fn bytemuck_words(b: &[u8]) -> &[u64] {
    assert!((b.as_ptr() as usize).is_multiple_of(8) && b.len().is_multiple_of(8));
    // SAFETY: aligned, in bounds, and every bit pattern is a valid u64.
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u64, b.len() / 8) }
}
