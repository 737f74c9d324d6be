//! Single-token (`s == 1`, decode) matrix-vector products over plain
//! F32/F16/BF16 weights: memory-bound, so each weight row is streamed once
//! with four independent FMA accumulators (the dependent-FMA latency would
//! otherwise cap one row at ~8 elements per 4-5 cycles). Exact: f32
//! activations, f32 accumulation (only the summation order differs from
//! [`super::matmul`](super::matmul())).
//!
//! The kernel has to convert weights to f32 faster than memory delivers
//! them, or decode runs below the machine's bandwidth. BF16 is the common
//! checkpoint dtype, and widening it element by element (zero-extend, then
//! shift) costs as much as the multiply-add. So the bf16 kernels never
//! widen: they load 32-bit lanes, each holding an adjacent pair of bf16
//! values, and a shift left by 16 gives the even element as f32 while a
//! mask of the high half gives the odd one. `x` is rearranged once per call
//! to match (`split_even_odd`): per block of lanes, its even-indexed
//! elements, then its odd-indexed ones. On the development machine (Zen 4,
//! 2 threads, `examples/gemv_seq.rs`) this took the bf16 kernel's
//! L2-resident rate from ~25 to ~45 GB/s per core, and a decode step's
//! stream of 1B-shaped weights from 0.7-0.9 to 0.9-0.95 of a plain read of
//! the same bytes.

use super::Epilogue;
use crate::ir::DType;
use crate::kernels::{check_linear, Isa, KernelError, WeightRef};
use crate::pool::{SyncPtr, ThreadPool};
use std::cell::RefCell;

/// Weight rows per work chunk.
const ROWS_PER_CHUNK: usize = 16;

/// The kernel set a GEMV runs at a given [`Isa`] level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    /// Portable Rust.
    Scalar,
    /// AVX2 + FMA + F16C, 8 f32 lanes.
    Avx2,
    /// AVX-512F (and the AVX2 set): 16-lane kernels for F16; F32 and BF16
    /// run the AVX2 kernels (see the `avx512` module).
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

    /// Elements per block of the even/odd split of `x` the bf16 kernel of
    /// this level reads, or `None` when its kernels read `x` as it is.
    fn split_width(self, dtype: DType) -> Option<usize> {
        match (self, dtype) {
            (Level::Avx2 | Level::Avx512, DType::BF16) => Some(16),
            _ => None,
        }
    }
}

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
            DType::F16 => crate::kernels::f16_to_f32(u16::from_le_bytes([c[0], c[1]])),
            DType::BF16 => crate::kernels::bf16_to_f32(u16::from_le_bytes([c[0], c[1]])),
            _ => unreachable!("checked by supports()"),
        };
        sum += w * v;
    }
    sum
}

/// Writes the whole blocks of `width` elements of `x` to `out`, each as its
/// even-indexed elements followed by its odd-indexed ones (the order in
/// which the bf16 kernels produce weights); the tail past the last whole
/// block is left out (the kernels read it from `x`).
fn split_even_odd(x: &[f32], width: usize, out: &mut Vec<f32>) {
    out.clear();
    for b in x.chunks_exact(width) {
        out.extend(b.iter().step_by(2));
        out.extend(b.iter().skip(1).step_by(2));
    }
}

thread_local! {
    /// The caller thread's [`split_even_odd`] buffer, reused across calls.
    static X_SPLIT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The row kernels of one level and dtype.
#[derive(Clone, Copy)]
struct Kernels<'a> {
    level: Level,
    dtype: DType,
    x: &'a [f32],
    /// `x` split for the bf16 kernels (empty when unused).
    xs: &'a [f32],
}

impl Kernels<'_> {
    /// Whether [`Self::dot4`] is worth using for rows of `k` elements.
    /// Rows of more than 4096 elements: x (f32) no longer stays in L1 next
    /// to the weight stream, so four rows share each load of x. Shorter
    /// rows stream one at a time, which keeps the weights one sequential
    /// stream per thread (four interleaved row streams measured slower).
    fn four_rows(&self, k: usize) -> bool {
        self.level > Level::Scalar && k > 4096
    }

    #[inline]
    fn dot(&self, row: &[u8]) -> f32 {
        // SAFETY (all arms): the level was checked available when `self`
        // was made; `row` holds x.len() elements (checked by the caller)
        // and `xs` is `x` split at the level's width.
        #[cfg(target_arch = "x86_64")]
        match (self.level, self.dtype) {
            (Level::Scalar, _) => {}
            (Level::Avx512, DType::F16) => return unsafe { avx512::dot_f16(row, self.x) },
            (_, DType::BF16) => return unsafe { avx2::dot_bf16(row, self.xs, self.x) },
            (_, d) => return unsafe { avx2::dot(d, row, self.x) },
        }
        dot_scalar(self.dtype, row, self.x)
    }

    /// Four rows' dot products with `x` in one pass (only when
    /// [`Self::four_rows`]).
    #[inline]
    fn dot4(&self, rows: [&[u8]; 4]) -> [f32; 4] {
        // SAFETY: as in `dot`.
        #[cfg(target_arch = "x86_64")]
        match (self.level, self.dtype) {
            (Level::Scalar, _) => {}
            (Level::Avx512, DType::F16) => return unsafe { avx512::dot4_f16(rows, self.x) },
            (_, DType::BF16) => return unsafe { avx2::dot4_bf16(rows, self.xs, self.x) },
            (_, d) => return unsafe { avx2::dot4(d, rows, self.x) },
        }
        rows.map(|r| dot_scalar(self.dtype, r, self.x))
    }
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
    let Some(width) = level.split_width(w.dtype) else {
        let kern = Kernels {
            level,
            dtype: w.dtype,
            x,
            xs: &[],
        };
        run(pool, kern, k, w.bytes, row_bytes, n_out, epilogue, y);
        return Ok(());
    };
    X_SPLIT.with(|cell| {
        let mut xs = cell.borrow_mut();
        split_even_odd(x, width, &mut xs);
        let kern = Kernels {
            level,
            dtype: w.dtype,
            x,
            xs: &xs,
        };
        run(pool, kern, k, w.bytes, row_bytes, n_out, epilogue, y);
    });
    Ok(())
}

/// The row loop over the pool (arguments checked by the caller).
#[allow(clippy::too_many_arguments)]
fn run(
    pool: &ThreadPool,
    kern: Kernels<'_>,
    k: usize,
    w: &[u8],
    row_bytes: usize,
    n_out: usize,
    epilogue: Epilogue<'_>,
    y: &mut [f32],
) {
    let row = |j: usize| &w[j * row_bytes..(j + 1) * row_bytes];
    let four = kern.four_rows(k);
    let dot4 = |j: usize| kern.dot4([row(j), row(j + 1), row(j + 2), row(j + 3)]);
    run_rows(
        pool,
        n_out,
        epilogue,
        y,
        &|j| kern.dot(row(j)),
        four.then_some(&dot4 as &(dyn Fn(usize) -> [f32; 4] + Sync)),
    );
}

/// The row loop of a single-token product, shared by the weight formats:
/// `dot(j)` is weight row `j` · x, `dot4(j)` rows `j..j + 4` at once (used
/// when given). Rows are split over the pool in a few long contiguous ranges
/// per thread, and `epilogue` is applied to `y` (`n_out` outputs).
pub(crate) fn run_rows(
    pool: &ThreadPool,
    n_out: usize,
    epilogue: Epilogue<'_>,
    y: &mut [f32],
    dot: &(dyn Fn(usize) -> f32 + Sync),
    dot4: Option<&(dyn Fn(usize) -> [f32; 4] + Sync)>,
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
            // than alternating between rows n_out apart.
            Epilogue::SwiGlu => {
                dots(0, &mut |j, g| yr[j - j0] = g);
                dots(n_out, &mut |j, up| {
                    let o = &mut yr[j - j0];
                    *o = crate::kernels::elementwise::silu_f32(*o) * up;
                });
            }
            Epilogue::None => dots(0, &mut |j, v| yr[j - j0] = v),
            Epilogue::Accumulate => dots(0, &mut |j, v| yr[j - j0] += v),
            Epilogue::AddResidual(r) => dots(0, &mut |j, v| yr[j - j0] = v + r[j]),
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::ir::DType;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support avx2/fma/f16c; `row` holds `x.len()` elements
    /// of `dtype` (F32 or F16; BF16 has [`dot_bf16`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
        match dtype {
            DType::F32 => dot_t::<0>(row, x),
            DType::F16 => dot_t::<1>(row, x),
            _ => unreachable!("F32/F16 only"),
        }
    }

    /// # Safety
    /// As [`dot`], for four rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot4(dtype: DType, rows: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
        match dtype {
            DType::F32 => dot4_t::<0>(rows, x),
            DType::F16 => dot4_t::<1>(rows, x),
            _ => unreachable!("F32/F16 only"),
        }
    }

    /// Bytes per element of `D` (0 = F32, 1 = F16).
    const ES: [usize; 2] = [4, 2];

    /// Eight elements of dtype `D` widened to f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn ld<const D: u8>(b: &[u8]) -> __m256 {
        if D == 0 {
            let b = &b[..32];
            // SAFETY: 32 bytes; unaligned load.
            unsafe { _mm256_loadu_ps(b.as_ptr() as *const f32) }
        } else {
            let b = &b[..16];
            // SAFETY: 16 bytes; unaligned load.
            _mm256_cvtph_ps(unsafe { _mm_loadu_si128(b.as_ptr() as *const __m128i) })
        }
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
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
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
        let d = [DType::F32, DType::F16][D as usize];
        hsum(v) + super::dot_scalar(d, &row[i * es..], &x[i..])
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
        let d = [DType::F32, DType::F16][D as usize];
        let mut out = [0f32; 4];
        for r in 0..4 {
            let mut acc = _mm256_add_ps(a[r], b[r]);
            let mut j = i;
            while j + 8 <= n {
                acc = _mm256_fmadd_ps(ld::<D>(&rows[r][j * es..]), ld_x(&x[j..]), acc);
                j += 8;
            }
            out[r] = hsum(acc) + super::dot_scalar(d, &rows[r][j * es..], &x[j..]);
        }
        out
    }

    /// Sixteen bf16 weights (32 bytes) as f32: the even-indexed ones, then
    /// the odd-indexed ones (see the module documentation).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn bf16_split(b: &[u8]) -> (__m256, __m256) {
        let b = &b[..32];
        // SAFETY: 32 bytes.
        unsafe { bf16_split_at(b.as_ptr()) }
    }

    /// [`bf16_split`] of the 32 bytes at `p`.
    ///
    /// # Safety
    /// `p` points to 32 readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn bf16_split_at(p: *const u8) -> (__m256, __m256) {
        // SAFETY: as documented; unaligned load.
        let v = unsafe { _mm256_loadu_si256(p as *const __m256i) };
        let even = _mm256_slli_epi32::<16>(v);
        let odd = _mm256_and_si256(v, _mm256_set1_epi32(0xffff_0000_u32 as i32));
        (_mm256_castsi256_ps(even), _mm256_castsi256_ps(odd))
    }

    /// `row · x` for a bf16 row, `xs` being `x` split at width 16.
    ///
    /// # Safety
    /// The CPU must support avx2/fma/f16c; `row` holds `x.len()` bf16
    /// elements; `xs` is `split_even_odd(x, 16)`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_bf16(row: &[u8], xs: &[f32], x: &[f32]) -> f32 {
        let nb = xs.len() / 16;
        let (body, tail) = row.split_at(nb * 32);
        let mut acc = [_mm256_setzero_ps(); 4];
        for (w, xv) in body.chunks_exact(64).zip(xs.chunks_exact(32)) {
            let (e0, o0) = bf16_split(&w[..32]);
            let (e1, o1) = bf16_split(&w[32..]);
            acc[0] = _mm256_fmadd_ps(e0, ld_x(&xv[..8]), acc[0]);
            acc[1] = _mm256_fmadd_ps(o0, ld_x(&xv[8..16]), acc[1]);
            acc[2] = _mm256_fmadd_ps(e1, ld_x(&xv[16..24]), acc[2]);
            acc[3] = _mm256_fmadd_ps(o1, ld_x(&xv[24..]), acc[3]);
        }
        if nb % 2 == 1 {
            let (e, o) = bf16_split(&body[(nb - 1) * 32..]);
            let xv = &xs[(nb - 1) * 16..];
            acc[0] = _mm256_fmadd_ps(e, ld_x(&xv[..8]), acc[0]);
            acc[1] = _mm256_fmadd_ps(o, ld_x(&xv[8..16]), acc[1]);
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        hsum(v) + super::dot_scalar(DType::BF16, tail, &x[nb * 16..])
    }

    /// [`dot_bf16`] for four rows, sharing each load of `xs`.
    ///
    /// # Safety
    /// As [`dot_bf16`], for each row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot4_bf16(rows: [&[u8]; 4], xs: &[f32], x: &[f32]) -> [f32; 4] {
        let nb = xs.len() / 16;
        // One bounds check per row here instead of one per block below.
        let p = rows.map(|r| r[..nb * 32].as_ptr());
        let mut ev = [_mm256_setzero_ps(); 4];
        let mut od = [_mm256_setzero_ps(); 4];
        for (b, xv) in xs.chunks_exact(16).enumerate() {
            let (xe, xo) = (ld_x(&xv[..8]), ld_x(&xv[8..]));
            for r in 0..4 {
                // SAFETY: block b < nb of a row checked to hold nb blocks.
                let (e, o) = unsafe { bf16_split_at(p[r].add(b * 32)) };
                ev[r] = _mm256_fmadd_ps(e, xe, ev[r]);
                od[r] = _mm256_fmadd_ps(o, xo, od[r]);
            }
        }
        let mut out = [0f32; 4];
        for r in 0..4 {
            out[r] = hsum(_mm256_add_ps(ev[r], od[r]))
                + super::dot_scalar(DType::BF16, &rows[r][nb * 32..], &x[nb * 16..]);
        }
        out
    }
}

/// AVX-512 is used only where it streams faster: F16, whose 256-bit loads
/// convert to 16 lanes at once. Kernels with 512-bit weight loads (F32, or
/// BF16 32 elements at a time) stream slower on the development machine
/// than the AVX2 ones (`examples/gemv_seq.rs`), so those dtypes use AVX2 at
/// this level.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use crate::ir::DType;
    use std::arch::x86_64::*;

    /// Sixteen f16 weights (32 bytes) widened to f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn ld(b: &[u8]) -> __m512 {
        let b = &b[..32];
        // SAFETY: 32 bytes; unaligned load.
        _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) })
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn ld_x(x: &[f32]) -> __m512 {
        let x = &x[..16];
        // SAFETY: 16 f32; unaligned load.
        unsafe { _mm512_loadu_ps(x.as_ptr()) }
    }

    /// `row · x` for an f16 row.
    ///
    /// # Safety
    /// The CPU must support avx512f/avx2/fma/f16c; `row` holds `x.len()`
    /// f16 elements.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
        let n = x.len();
        let n64 = n / 64 * 64;
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i < n64 {
            for (u, a) in acc.iter_mut().enumerate() {
                let e = i + 16 * u;
                *a = _mm512_fmadd_ps(ld(&row[e * 2..]), ld_x(&x[e..]), *a);
            }
            i += 64;
        }
        while i + 16 <= n {
            acc[0] = _mm512_fmadd_ps(ld(&row[i * 2..]), ld_x(&x[i..]), acc[0]);
            i += 16;
        }
        let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        _mm512_reduce_add_ps(v) + super::dot_scalar(DType::F16, &row[i * 2..], &x[i..])
    }

    /// Four f16 rows, two accumulators each (32 elements per step), one
    /// load of x per 16 elements for all four rows.
    ///
    /// # Safety
    /// As [`dot_f16`], for each row.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn dot4_f16(rows: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
        let n = x.len();
        let n32 = n / 32 * 32;
        let mut a = [_mm512_setzero_ps(); 4];
        let mut b = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i < n32 {
            let (x0, x1) = (ld_x(&x[i..]), ld_x(&x[i + 16..]));
            for r in 0..4 {
                a[r] = _mm512_fmadd_ps(ld(&rows[r][i * 2..]), x0, a[r]);
                b[r] = _mm512_fmadd_ps(ld(&rows[r][(i + 16) * 2..]), x1, b[r]);
            }
            i += 32;
        }
        let mut out = [0f32; 4];
        for r in 0..4 {
            let mut acc = _mm512_add_ps(a[r], b[r]);
            let mut j = i;
            while j + 16 <= n {
                acc = _mm512_fmadd_ps(ld(&rows[r][j * 2..]), ld_x(&x[j..]), acc);
                j += 16;
            }
            out[r] = _mm512_reduce_add_ps(acc)
                + super::dot_scalar(DType::F16, &rows[r][j * 2..], &x[j..]);
        }
        out
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
