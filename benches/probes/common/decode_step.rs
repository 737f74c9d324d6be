//! Pieces shared by the decode-step GEMV probes (`gemv_seq`,
//! `bf16z_seq`): the weight products of one Llama 3.2 1B decode step, a
//! huge-page mapping, a plain read of bytes over the pool, medians.

use llama_graph::kernels::matmul::Epilogue;
use llama_graph::pool::ThreadPool;
use std::hint::black_box;

/// `(n, k, epilogue)` of every weight product of one decode step: 16 layers
/// of `wqkv`, `wo`, `w13` (SwiGLU), `w2`, then the output head.
pub fn ops() -> Vec<(usize, usize, Epilogue<'static>)> {
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
    ops
}

/// Outputs of a product with `n` weight rows.
pub fn n_out(n: usize, ep: &Epilogue<'_>) -> usize {
    if matches!(ep, Epilogue::SwiGlu) {
        n / 2
    } else {
        n
    }
}

/// An anonymous mapping of `len` bytes advised for huge pages, as the
/// weight arena is.
pub fn huge(len: usize) -> memmap2::MmapMut {
    let map = memmap2::MmapOptions::new()
        .len(len)
        .map_anon()
        .expect("map");
    let _ = map.advise(memmap2::Advice::HugePage);
    map
}

/// The median (sorts `v`).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `b` as u64 words (it must be 8-aligned and a multiple of 8 long, as a
/// mapping is).
pub fn words(b: &[u8]) -> &[u64] {
    assert!((b.as_ptr() as usize).is_multiple_of(8) && b.len().is_multiple_of(8));
    // SAFETY: aligned, in bounds, and every bit pattern is a valid u64.
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u64, b.len() / 8) }
}

/// Sums `words` over the pool in chunks of `chunk` words: the plain read
/// that bounds any kernel over the same bytes.
pub fn read(pool: &ThreadPool, words: &[u64], chunk: usize) {
    let sums: Vec<std::sync::atomic::AtomicU64> =
        (0..pool.n_threads()).map(|_| Default::default()).collect();
    pool.run_indexed(words.len().div_ceil(chunk), &|c, t| {
        let w = &words[c * chunk..((c + 1) * chunk).min(words.len())];
        let s = w.iter().fold(0u64, |a, &v| a.wrapping_add(v));
        sums[t].fetch_add(s, std::sync::atomic::Ordering::Relaxed);
    });
    black_box(sums);
}
