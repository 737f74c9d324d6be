//! Single-token (`s == 1`, decode) matrix-vector products over plain
//! F32/F16/BF16 weights: memory-bound, so each weight row is streamed once
//! with four independent FMA accumulators (the dependent-FMA latency would
//! otherwise cap one row at ~8 elements per 4-5 cycles). Exact: f32
//! activations, f32 accumulation (only the summation order differs from
//! [`super::matmul`]).

use super::matmul::Epilogue;
use super::{check_linear, KernelError, WeightRef};
use crate::ir::DType;
use crate::pool::{SyncPtr, ThreadPool};

/// Weight rows per work chunk.
const ROWS_PER_CHUNK: usize = 16;

/// True for the dtypes [`gemv`] handles.
pub fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// Scalar reference dot product of a stored row with `x`.
pub fn dot_scalar(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    let es = dtype.block_bytes();
    let mut sum = 0f32;
    for (c, &v) in row.chunks_exact(es).zip(x) {
        let w = match dtype {
            DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            DType::F16 => super::f16_to_f32(u16::from_le_bytes([c[0], c[1]])),
            DType::BF16 => super::bf16_to_f32(u16::from_le_bytes([c[0], c[1]])),
            _ => unreachable!("checked by supports()"),
        };
        sum += w * v;
    }
    sum
}

#[inline]
fn dot(dtype: DType, row: &[u8], x: &[f32], simd: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if simd {
            // SAFETY: `simd` is only true when the CPU has avx2/fma/f16c;
            // `row` holds x.len() elements (checked by the caller).
            return unsafe { avx2::dot(dtype, row, x) };
        }
    }
    let _ = simd;
    dot_scalar(dtype, row, x)
}

/// Four rows' dot products with `x` in one pass (SIMD only).
#[inline]
fn dot4(dtype: DType, rows: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: only called when `simd` is true, i.e. the CPU has
        // avx2/fma/f16c; every row holds x.len() elements (checked by the caller).
        unsafe { avx2::dot4(dtype, rows, x) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    rows.map(|r| dot_scalar(dtype, r, x))
}

/// `y = x·Wᵀ` with `epilogue` for one activation row (`x`: `[k]`) and a
/// plain-dtype `W` `[n, k]`. Same contract as [`super::matmul`] with `s = 1`.
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
    gemv_impl(
        pool,
        x,
        k,
        w,
        n,
        epilogue,
        y,
        super::quant::simd_available(),
    )
}

#[allow(clippy::too_many_arguments)]
fn gemv_impl(
    pool: &ThreadPool,
    x: &[f32],
    k: usize,
    w: WeightRef<'_>,
    n: usize,
    epilogue: Epilogue<'_>,
    y: &mut [f32],
    simd: bool,
) -> Result<(), KernelError> {
    const OP: &str = "gemv";
    if !supports(w.dtype) {
        return Err(KernelError::DType {
            op: OP,
            dtype: w.dtype,
        });
    }
    let (row_bytes, n_out) = check_linear(OP, x, 1, k, &w, n, &epilogue, y)?;
    let yp = SyncPtr::new(y);
    let row = |j: usize| &w.bytes[j * row_bytes..(j + 1) * row_bytes];
    // A few long contiguous row ranges per thread (see qfast: short chunks
    // taken alternately by two threads break the prefetcher's streams).
    let rows = ROWS_PER_CHUNK.max(n_out.div_ceil(4 * pool.n_threads()));
    // Rows of more than 4096 elements: x (f32) no longer stays in L1 next
    // to the weight stream, so four rows share each load of x. Shorter
    // rows stream one at a time, which keeps the weights one sequential
    // stream per thread (four interleaved row streams measured slower).
    let four_rows = simd && k > 4096;
    pool.run(n_out.div_ceil(rows), &|c| {
        let (j0, j1) = (c * rows, ((c + 1) * rows).min(n_out));
        // SAFETY: chunk c alone owns y[j0..j1].
        let yr = unsafe { yp.slice(j0, j1 - j0) };
        // Calls f(j, row(base + j) · x) for j in j0..j1, in order.
        let dots = |base: usize, f: &mut dyn FnMut(usize, f32)| {
            let mut j = j0;
            if four_rows {
                while j + 4 <= j1 {
                    let rs = [
                        row(base + j),
                        row(base + j + 1),
                        row(base + j + 2),
                        row(base + j + 3),
                    ];
                    for (u, v) in dot4(w.dtype, rs, x).into_iter().enumerate() {
                        f(j + u, v);
                    }
                    j += 4;
                }
            }
            for j in j..j1 {
                f(j, dot(w.dtype, row(base + j), x, simd));
            }
        };
        match epilogue {
            // Gate rows first, then up rows: two sequential streams rather
            // than alternating between rows n_out apart.
            Epilogue::SwiGlu => {
                dots(0, &mut |j, g| yr[j - j0] = g);
                dots(n_out, &mut |j, up| {
                    let o = &mut yr[j - j0];
                    *o = super::elementwise::silu_f32(*o) * up;
                });
            }
            Epilogue::None => dots(0, &mut |j, v| yr[j - j0] = v),
            Epilogue::Accumulate => dots(0, &mut |j, v| yr[j - j0] += v),
            Epilogue::AddResidual(r) => dots(0, &mut |j, v| yr[j - j0] = v + r[j]),
        }
    });
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::ir::DType;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support avx2/fma/f16c; `row` holds `x.len()` elements of `dtype`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
        match dtype {
            DType::F32 => dot_t::<0>(row, x),
            DType::F16 => dot_t::<1>(row, x),
            DType::BF16 => dot_t::<2>(row, x),
            _ => unreachable!("checked by supports()"),
        }
    }

    /// # Safety
    /// The CPU must support avx2/fma/f16c; each row holds `x.len()` elements of `dtype`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot4(dtype: DType, rows: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
        match dtype {
            DType::F32 => dot4_t::<0>(rows, x),
            DType::F16 => dot4_t::<1>(rows, x),
            DType::BF16 => dot4_t::<2>(rows, x),
            _ => unreachable!("checked by supports()"),
        }
    }

    /// Bytes per element of `D` (0 = F32, 1 = F16, 2 = BF16).
    const ES: [usize; 3] = [4, 2, 2];

    /// Eight elements of dtype `D` widened to f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn ld<const D: u8>(b: &[u8]) -> __m256 {
        match D {
            0 => ld_f32(b),
            1 => ld_f16(b),
            _ => ld_bf16(b),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Four rows, two accumulators each (16 elements per step), one load
    /// of x per 8 elements for all four rows.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot4_t<const D: u8>(rows: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
        let es = ES[D as usize];
        let n = x.len();
        let n16 = n / 16 * 16;
        let mut a = [_mm256_setzero_ps(); 4];
        let mut b = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i < n16 {
            let (x0, x1) = (ld_x(&x[i..]), ld_x(&x[i + 8..]));
            for r in 0..4 {
                a[r] = _mm256_fmadd_ps(ld::<D>(&rows[r][i * es..]), x0, a[r]);
                b[r] = _mm256_fmadd_ps(ld::<D>(&rows[r][(i + 8) * es..]), x1, b[r]);
            }
            i += 16;
        }
        let mut out = [0f32; 4];
        for r in 0..4 {
            let mut acc = _mm256_add_ps(a[r], b[r]);
            let mut j = i;
            while j + 8 <= n {
                acc = _mm256_fmadd_ps(ld::<D>(&rows[r][j * es..]), ld_x(&x[j..]), acc);
                j += 8;
            }
            out[r] = hsum(acc);
            if j < n {
                let d = [DType::F32, DType::F16, DType::BF16][D as usize];
                out[r] += super::dot_scalar(d, &rows[r][j * es..], &x[j..]);
            }
        }
        out
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn ld_f32(b: &[u8]) -> __m256 {
        let b = &b[..32];
        // SAFETY: 32 bytes; unaligned load.
        unsafe { _mm256_loadu_ps(b.as_ptr() as *const f32) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn ld_f16(b: &[u8]) -> __m256 {
        let b = &b[..16];
        // SAFETY: 16 bytes; unaligned load.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(b.as_ptr() as *const __m128i) })
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn ld_bf16(b: &[u8]) -> __m256 {
        let b = &b[..16];
        // SAFETY: 16 bytes; unaligned load.
        let v = unsafe { _mm_loadu_si128(b.as_ptr() as *const __m128i) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn ld_x(x: &[f32]) -> __m256 {
        let x = &x[..8];
        // SAFETY: 8 f32; unaligned load.
        unsafe { _mm256_loadu_ps(x.as_ptr()) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    /// `D`: 0 = F32, 1 = F16, 2 = BF16.
    fn dot_t<const D: u8>(row: &[u8], x: &[f32]) -> f32 {
        let es = ES[D as usize];
        let n = x.len();
        let n32 = n / 32 * 32;
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i < n32 {
            for (u, a) in acc.iter_mut().enumerate() {
                let e = i + 8 * u;
                *a = _mm256_fmadd_ps(ld::<D>(&row[e * es..]), ld_x(&x[e..]), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(ld::<D>(&row[i * es..]), ld_x(&x[i..]), acc[0]);
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut sum = hsum(v);
        if i < n {
            let d = [DType::F32, DType::F16, DType::BF16][D as usize];
            sum += super::dot_scalar(d, &row[i * es..], &x[i..]);
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{encode, Rng};

    #[test]
    fn matches_naive_for_every_dtype_and_epilogue() {
        let pool = ThreadPool::new(2);
        let mut rng = Rng::new(5);
        // k = 83: a 32-element main loop, an 8-element step and a scalar tail.
        // k = 4107: the four-row kernel (k > 4096) with both tails, and rows
        // left over after the groups of four (n = 22: 5 + 2 per 11-row chunk).
        for (k, n) in [(83, 38), (576, 20), (4107, 22)] {
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
                for simd in [false, true] {
                    if simd && !crate::kernels::quant::simd_available() {
                        continue;
                    }
                    let mut y = vec![0f32; n];
                    gemv_impl(&pool, &x, k, wr, n, Epilogue::AddResidual(&r), &mut y, simd)
                        .unwrap();
                    for j in 0..n {
                        let want = naive(j) + r[j] as f64;
                        assert!(
                            (y[j] as f64 - want).abs() < 1e-4,
                            "{dtype} simd={simd} k={k} j={j}: {} vs {want}",
                            y[j]
                        );
                    }
                    let mut g = vec![0f32; n / 2];
                    gemv_impl(&pool, &x, k, wr, n, Epilogue::SwiGlu, &mut g, simd).unwrap();
                    for (j, &got) in g.iter().enumerate() {
                        let (a, b) = (naive(j) as f32, naive(j + n / 2) as f32);
                        let want = crate::kernels::elementwise::silu_f32(a) * b;
                        assert!((got - want).abs() < 1e-4 * (1.0 + want.abs()), "{dtype}");
                    }
                }
            }
        }
    }
}
