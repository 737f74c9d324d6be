//! Single-token (`s == 1`, decode) matrix-vector products over plain
//! F32/F16/BF16 weights: memory-bound, so each weight row is streamed once.
//! The SIMD levels run the register tiles of [`super::tiles`] with one
//! token: four rows at a time, one accumulator each (four independent FMA
//! chains, one load of x for four rows), weights widened in registers. The
//! arithmetic per row is exactly that of the multi-token product
//! ([`super::matmul`](super::matmul())), so a token's outputs do not depend
//! on how many tokens share a step (batch invariance). Exact: f32
//! activations, f32 accumulation.

use super::tiles::{self, Tiles};
use super::Epilogue;
use crate::ir::DType;
use crate::kernels::{check_linear, Isa, KernelError, WeightRef};
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

/// True for the dtypes [`gemv`] handles.
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
/// plain-dtype `W` `[n, k]`. Same contract as [`super::matmul`](super::matmul()) with `s = 1`.
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    pool: &ThreadPool,
    x: &[f32],
    k: usize,
    w: WeightRef<'_>,
    n: usize,
    epilogue: Epilogue<'_>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    gemv_at(Isa::current(), pool, x, k, w, n, epilogue, y)
}

/// [`gemv`] at a chosen level (lowered to what the CPU supports), for
/// tests and benchmarks.
#[allow(clippy::too_many_arguments)]
pub fn gemv_at(
    isa: Isa,
    pool: &ThreadPool,
    x: &[f32],
    k: usize,
    w: WeightRef<'_>,
    n: usize,
    epilogue: Epilogue<'_>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "gemv";
    if !supports(w.dtype) {
        return Err(KernelError::DType {
            op: OP,
            dtype: w.dtype,
        });
    }
    let (row_bytes, n_out) = check_linear(OP, x, 1, k, &w, n, &epilogue, y)?;
    let level = Level::of(isa);
    let dt = tiles::code(w.dtype);
    let row = |j: usize| w.bytes[j * row_bytes..(j + 1) * row_bytes].as_ptr();
    match level {
        Level::Scalar => run_rows(
            pool,
            n_out,
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
    let dot4 = |j: usize| unsafe {
        tiles::dot4::<K>(
            dt,
            [row(j), row(j + 1), row(j + 2), row(j + 3)],
            x.as_ptr(),
            k,
        )
    };
    run_rows(pool, n_out, epilogue, y, &dot, Some(&dot4), K::swiglu);
}

/// `g[i] = silu(g[i]) * u[i]` with the scalar `silu_f32`.
pub(crate) fn swiglu_scalar(g: &mut [f32], u: &[f32]) {
    for (o, &up) in g.iter_mut().zip(u) {
        *o = crate::kernels::elementwise::silu_f32(*o) * up;
    }
}

/// Up-row products [`run_rows`] gathers before applying the SwiGLU.
const SWIGLU_BATCH: usize = 64;

/// The row loop of a single-token product, shared by the weight formats:
/// `dot(j)` is weight row `j` · x, `dot4(j)` rows `j..j + 4` at once (used
/// when given). Rows are split over the pool in a few long contiguous ranges
/// per thread, and `epilogue` is applied to `y` (`n_out` outputs), the
/// SwiGLU by `swiglu` (the one the level's several-token products apply).
pub(crate) fn run_rows(
    pool: &ThreadPool,
    n_out: usize,
    epilogue: Epilogue<'_>,
    y: &mut [f32],
    dot: &(dyn Fn(usize) -> f32 + Sync),
    dot4: Option<&(dyn Fn(usize) -> [f32; 4] + Sync)>,
    swiglu: fn(&mut [f32], &[f32]),
) {
    let yp = SyncPtr::new(y);
    // A few long contiguous row ranges per thread (see qfast: short chunks
    // taken alternately by two threads break the prefetcher's streams).
    let rows = ROWS_PER_CHUNK.max(n_out.div_ceil(4 * pool.n_threads()));
    pool.run(n_out.div_ceil(rows), &|c| {
        let (j0, j1) = (c * rows, ((c + 1) * rows).min(n_out));
        // SAFETY: chunk c alone owns y[j0..j1].
        let yr = unsafe { yp.slice(j0, j1 - j0) };
        // Calls f(j, row(base + j) · x) for j in j0..j1, in order.
        let dots = |base: usize, f: &mut dyn FnMut(usize, f32)| {
            let mut j = j0;
            if let Some(dot4) = dot4 {
                while j + 4 <= j1 {
                    for (u, v) in dot4(base + j).into_iter().enumerate() {
                        f(j + u, v);
                    }
                    j += 4;
                }
            }
            for j in j..j1 {
                f(j, dot(base + j));
            }
        };
        match epilogue {
            // Gate rows first, then up rows: two sequential streams rather
            // than alternating between rows n_out apart. The up products
            // come in order j0..j1; the SwiGLU is applied to batches of them.
            Epilogue::SwiGlu => {
                dots(0, &mut |j, g| yr[j - j0] = g);
                let mut ups = [0f32; SWIGLU_BATCH];
                let mut from = 0;
                dots(n_out, &mut |j, up| {
                    let i = j - j0;
                    ups[i - from] = up;
                    if i + 1 - from == SWIGLU_BATCH {
                        swiglu(&mut yr[from..=i], &ups);
                        from = i + 1;
                    }
                });
                let rest = j1 - j0 - from;
                swiglu(&mut yr[from..], &ups[..rest]);
            }
            Epilogue::None => dots(0, &mut |j, v| yr[j - j0] = v),
            Epilogue::Accumulate => dots(0, &mut |j, v| yr[j - j0] += v),
            Epilogue::AddResidual(r) => dots(0, &mut |j, v| yr[j - j0] = v + r[j]),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{encode, Rng};

    #[test]
    fn matches_naive_for_every_dtype_and_epilogue() {
        let pool = ThreadPool::new(2);
        let mut rng = Rng::new(5);
        // k = 13: no whole SIMD block. k = 83: a main loop, a single step
        // and a scalar tail; an odd number of 16-element bf16 blocks.
        // k = 101: the 16-lane f16 kernel's main loop, two single steps and
        // a tail. k = 4107: the
        // four-row kernel (k > 4096) with its tails, and rows left over
        // after the groups of four (n = 22: 5 + 2 per 11-row chunk).
        for (k, n) in [(13, 6), (83, 38), (101, 10), (576, 20), (4107, 22)] {
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
                        &x,
                        k,
                        wr,
                        n,
                        Epilogue::AddResidual(&r),
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
                    gemv_at(level, &pool, &x, k, wr, n, Epilogue::SwiGlu, &mut g).unwrap();
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
