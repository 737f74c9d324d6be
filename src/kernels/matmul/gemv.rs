//! Single-token (`s == 1`, decode) matrix-vector products over plain
//! F32/F16/BF16 weights: memory-bound, so each weight row is streamed once.
//! The SIMD levels run the register tiles of `tiles` with one
//! token: four rows at a time, one accumulator each (four independent FMA
//! chains, one load of x for four rows), weights widened in registers. The
//! arithmetic per row is exactly that of the multi-token product
//! (`matmul` in this module's parent), so a token's outputs do not depend
//! on how many tokens share a step (batch invariance). Exact: f32
//! activations, f32 accumulation.

use super::tiles::{self, Tiles};
use super::Epilogue;
use crate::ir::DType;
use crate::kernels::{check_linear, Isa, KernelError, LinearArgs};
use crate::pool::{SyncPtr, ThreadPool};

/// Weight rows per work chunk.
const ROWS_PER_CHUNK: usize = 16;

/// The kernel set a GEMV runs at a given [`Isa`] level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    /// Portable Rust.
    Scalar,
    /// AVX2 + FMA + F16C, 8 f32 lanes.
    Avx2,
    /// AVX-512F/BW/VL: 16 f32 lanes (the tiles of the multi-token product
    /// at this level, so that both sum in the same order).
    Avx512,
}

impl Level {
    fn of(isa: Isa) -> Level {
        match isa.min(Isa::detect()) {
            Isa::Scalar => Level::Scalar,
            Isa::Avx2 => Level::Avx2,
            Isa::Avx512 | Isa::Avx512Vnni => Level::Avx512,
        }
    }
}

/// True for the dtypes this GEMV handles.
pub fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// Naive dot product of a stored row with `x`, element by element (a
/// reference for tests; the kernels use other orders).
pub fn dot_scalar(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    let es = dtype.block_bytes();
    let mut sum = 0f32;
    for (c, &v) in row.chunks_exact(es).zip(x) {
        let w = match dtype {
            DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            DType::F16 => crate::kernels::f16_to_f32(u16::from_le_bytes([c[0], c[1]])),
            DType::BF16 => crate::kernels::bf16_to_f32(u16::from_le_bytes([c[0], c[1]])),
            _ => unreachable!("checked by supports()"),
        };
        sum += w * v;
    }
    sum
}

/// `y = x·Wᵀ` with `epilogue` for one activation row (`x`: `[k]`) and a
/// plain-dtype `W` `[n, k]` with the kernels of `isa` (lowered to what the
/// CPU supports). Same contract as [`super::matmul_with`] with `s = 1`.
pub fn gemv_at(
    isa: Isa,
    pool: &ThreadPool,
    a: LinearArgs<'_>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "gemv";
    let (x, k, w, epilogue) = (a.x, a.k, a.w, a.epilogue);
    if !supports(w.dtype) {
        return Err(KernelError::DType {
            op: OP,
            dtype: w.dtype,
        });
    }
    if a.s != 1 {
        return Err(KernelError::Invalid {
            op: OP,
            what: "one activation row (s = 1)",
        });
    }
    let (row_bytes, n_out) = check_linear(OP, &a, y)?;
    let level = Level::of(isa);
    let dt = tiles::code(w.dtype);
    let row = |j: usize| w.bytes[j * row_bytes..(j + 1) * row_bytes].as_ptr();
    match level {
        Level::Scalar => run_rows(
            pool,
            n_out,
            BLOCK,
            epilogue,
            y,
            &|j| super::portable_dot_with(x, &mut |k0, buf| w.read_into(j * k + k0, buf)),
            None,
            swiglu_scalar,
        ),
        Level::Avx2 => run_tiles::<super::avx2::Avx2>(pool, dt, x, &row, n_out, epilogue, y),
        Level::Avx512 => run_tiles::<super::avx512::Avx512>(pool, dt, x, &row, n_out, epilogue, y),
    }
    Ok(())
}

/// The row loop with the tiles of `K`: four rows at a time, then one.
/// `row(j)` points to weight row `j` (`x.len()` elements of dtype `dt`).
fn run_tiles<K: Tiles>(
    pool: &ThreadPool,
    dt: u8,
    x: &[f32],
    row: &(dyn Fn(usize) -> *const u8 + Sync),
    n_out: usize,
    epilogue: Epilogue<'_>,
    y: &mut [f32],
) {
    let k = x.len();
    // SAFETY (both): the caller checked the level against the CPU and that
    // every row `row(j)` names (j < n, the weight's rows) holds k elements.
    let dot = |j: usize| unsafe { tiles::dot1::<K>(dt, row(j), x.as_ptr(), k) };
    let dot4 = |j: usize, q: usize| unsafe {
        tiles::dot4::<K>(
            dt,
            [row(j), row(j + q), row(j + 2 * q), row(j + 3 * q)],
            x.as_ptr(),
            k,
        )
    };
    run_rows(
        pool,
        n_out,
        TILE_BLOCK,
        epilogue,
        y,
        &dot,
        Some(&dot4),
        K::swiglu,
    );
}

/// `g[i] = silu(g[i]) * u[i]` with the scalar `silu_f32`.
pub(crate) fn swiglu_scalar(g: &mut [f32], u: &[f32]) {
    for (o, &up) in g.iter_mut().zip(u) {
        *o = crate::kernels::elementwise::silu_f32(*o) * up;
    }
}

/// Rows of one block of a chunk, read as four runs of a quarter of it, for
/// the formats without tiles (the portable level, bf16z). With two threads
/// on the 2-vCPU AMD EPYC family-23 VM (`SHAPES=smol
/// benches/probes/gemv_bench 2 f16`, medians of 3 interleaved rounds,
/// GB/s), blocks of 4 adjacent rows (the earlier order) streamed 17-19
/// from SmolLM2's 576-wide rows, blocks of 16 21-27, of 32 and 64 about the
/// same as 16 within this host's noise; F32 23-27 -> 26-31.
pub(crate) const BLOCK: usize = 16;

/// The block of the SIMD levels' tiles: four runs of 64 rows. On a 2-vCPU
/// AMD EPYC Zen 5 VM (family 26) blocks of 16 rows left the hardware
/// prefetcher restarting every 4.6 KB of a 576-wide F16 matrix:
/// `SHAPES=smol PAGES=huge gemv_bench 1 f16` streamed 18 GB/s where F32
/// rows, twice as long, streamed 35, and at AVX-512 blocks of 64, 128, 256
/// and 512 rows gave 25, 29, 31 and 32. Capped to AVX2
/// (`LLAMA_GRAPH_ISA=avx2`, with its four-rows-ahead prefetch), 16 -> 256
/// rows: 1 thread F16 17-22 -> 30-33 GB/s, F32 25-29 -> 33-34, BF16 ->
/// 33-35; 2 threads F16 31-37 -> 38-44, F32 37-52 -> 36-58. 256 rows were
/// not measured on the family-23 VM.
const TILE_BLOCK: usize = 256;

/// The row loop of a single-token product, shared by the weight formats:
/// `dot(j)` is weight row `j` · x, `dot4(j, q)` rows `j, j + q, j + 2q,
/// j + 3q` at once (used when given). Rows are split over the pool in a few
/// long contiguous ranges per thread, and `epilogue` is applied to `y`
/// (`n_out` outputs), the SwiGLU by `swiglu` (the one the level's
/// several-token products apply). Products are gathered four blocks at a
/// time before the epilogue is applied to them (for the SwiGLU, a vector
/// function: about 6 ns an element on slices of 6, under 1 on slices of
/// 64).
///
/// Within a range, each block of `m` rows (`block`, a multiple of 4 up to
/// the tiles' block, or fewer at the range's end) is read as four runs of
/// `m / 4` consecutive rows, one row of each run at a time (then the rows
/// left over one by one): four streams that each go on for several rows, where
/// four adjacent rows at a time restarted all four streams every row (a
/// short row, 1152 bytes of F16 in SmolLM2, is a few cache lines) and the
/// hardware prefetcher did not keep up.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_rows(
    pool: &ThreadPool,
    n_out: usize,
    block: usize,
    epilogue: Epilogue<'_>,
    y: &mut [f32],
    dot: &(dyn Fn(usize) -> f32 + Sync),
    dot4: Option<&(dyn Fn(usize, usize) -> [f32; 4] + Sync)>,
    swiglu: fn(&mut [f32], &[f32]),
) {
    assert!(block.is_multiple_of(4) && (4..=TILE_BLOCK).contains(&block));
    let batch = 4 * block;
    let yp = SyncPtr::new(y);
    // One long contiguous row range per thread (short chunks taken
    // alternately by two threads break the prefetcher's streams, and each
    // chunk restarts them: `kernels::DECODE_CHUNKS_PER_THREAD`).
    let per_thread = crate::kernels::DECODE_CHUNKS_PER_THREAD;
    let rows = ROWS_PER_CHUNK.max(n_out.div_ceil(per_thread * pool.n_threads()));
    pool.run(n_out.div_ceil(rows), &|c| {
        let (j0, j1) = (c * rows, ((c + 1) * rows).min(n_out));
        // SAFETY: chunk c alone owns y[j0..j1].
        let yr = unsafe { yp.slice(j0, j1 - j0) };
        // out[i] = row(base + b0 + i) · x, block by block.
        let rows_dot = |base: usize, b0: usize, out: &mut [f32]| {
            for (n, out) in out.chunks_mut(block).enumerate() {
                let b0 = base + b0 + n * block;
                let mut i = 0;
                if let Some(dot4) = dot4 {
                    let q = out.len() / 4;
                    while i < q {
                        let v = dot4(b0 + i, q);
                        for (u, v) in v.into_iter().enumerate() {
                            out[i + u * q] = v;
                        }
                        i += 1;
                    }
                    i = 4 * q;
                }
                for (i, o) in out.iter_mut().enumerate().skip(i) {
                    *o = dot(b0 + i);
                }
            }
        };
        let mut buf = [0f32; 4 * TILE_BLOCK];
        let mut b0 = j0;
        if let Epilogue::SwiGlu = epilogue {
            // Gate rows first, then up rows: two sequential streams rather
            // than alternating between rows n_out apart.
            rows_dot(0, j0, yr);
        }
        while b0 < j1 {
            let b1 = (b0 + batch).min(j1);
            let vals = &mut buf[..b1 - b0];
            let yb = &mut yr[b0 - j0..b1 - j0];
            match epilogue {
                Epilogue::SwiGlu => {
                    rows_dot(n_out, b0, vals);
                    swiglu(yb, vals);
                }
                Epilogue::None => rows_dot(0, b0, yb),
                Epilogue::Accumulate => {
                    rows_dot(0, b0, vals);
                    for (o, v) in yb.iter_mut().zip(vals.iter()) {
                        *o += v;
                    }
                }
                Epilogue::AddResidual(r) => {
                    rows_dot(0, b0, vals);
                    for ((o, v), r) in yb.iter_mut().zip(vals.iter()).zip(&r[b0..b1]) {
                        *o = v + r;
                    }
                }
            }
            b0 = b1;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{encode, Rng};
    use crate::kernels::WeightRef;

    #[test]
    fn matches_naive_for_every_dtype_and_epilogue() {
        let pool = ThreadPool::new(2);
        let mut rng = Rng::new(5);
        // k = 13: no whole SIMD block. k = 83: a main loop, a single step
        // and a scalar tail; an odd number of 16-element bf16 blocks.
        // k = 101: the 16-lane f16 kernel's main loop, two single steps and
        // a tail. k = 4107: the
        // four-row kernel (k > 4096) with its tails, and rows left over
        // after the groups of four (n = 22: chunks of 16 and 6 rows, the
        // second one run of four rows and two left over). n = 90: the
        // SwiGLU's 45 outputs in chunks of 16, 16 and 13 rows, the last four
        // runs of three rows and one left over.
        for (k, n) in [
            (13, 6),
            (83, 38),
            (101, 10),
            (300, 90),
            (576, 20),
            (4107, 22),
        ] {
            let x = rng.vec(k);
            let wf = rng.vec(n * k);
            let r = rng.vec(n);
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let wb = encode(&wf, dtype);
                let wr = WeightRef::new(dtype, &wb);
                let wd: Vec<f32> = wb
                    .chunks_exact(n * k / n * dtype.block_bytes())
                    .flat_map(|row| {
                        row.chunks_exact(dtype.block_bytes())
                            .map(|c| dot_scalar(dtype, c, &[1.0]))
                            .collect::<Vec<_>>()
                    })
                    .collect();
                let naive =
                    |j: usize| -> f64 { (0..k).map(|i| wd[j * k + i] as f64 * x[i] as f64).sum() };
                for level in Isa::supported_levels() {
                    let mut y = vec![0f32; n];
                    gemv_at(
                        level,
                        &pool,
                        LinearArgs::new(&x, 1, k, wr, n, Epilogue::AddResidual(&r)),
                        &mut y,
                    )
                    .unwrap();
                    for j in 0..n {
                        let want = naive(j) + r[j] as f64;
                        assert!(
                            (y[j] as f64 - want).abs() < 1e-4,
                            "{dtype} {level:?} k={k} j={j}: {} vs {want}",
                            y[j]
                        );
                    }
                    let mut g = vec![0f32; n / 2];
                    gemv_at(
                        level,
                        &pool,
                        LinearArgs::new(&x, 1, k, wr, n, Epilogue::SwiGlu),
                        &mut g,
                    )
                    .unwrap();
                    for (j, &got) in g.iter().enumerate() {
                        let (a, b) = (naive(j) as f32, naive(j + n / 2) as f32);
                        let want = crate::kernels::elementwise::silu_f32(a) * b;
                        assert!(
                            (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                            "{dtype} {level:?}"
                        );
                    }
                }
            }
        }
    }
}
