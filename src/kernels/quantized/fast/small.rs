//! The small-S (decode) kernel of both SIMD levels: [`SR`] weight rows
//! per call, every unit's integer products summed across the vector and
//! reduced into one lane per row, then the shared f32 step of `units.rs`
//! for the 4 rows at once (so every output is the same bits as the scalar
//! reference's). The levels differ only in how they form a unit's integer
//! products ([`UnitDot`]: AVX2 `vpmaddubsw`/`vpmaddwd` in `avx2.rs`,
//! AVX-512 VNNI 256-bit `vpdpbusd` in `avx512.rs`); the rest is written
//! once here, `#[inline(always)]`, and compiled into each level's
//! [`UnitDot::rows`] with that level's features.

use super::avx2::{with_fmt, Fmt};
use super::Q8Act;
use crate::ir::DType;
use std::arch::x86_64::*;

/// One level's integer products of a unit of [`SR`] weight rows with one
/// token's activations.
pub(super) trait UnitDot {
    /// True where the products of `F` are `Σ q·a` (the offset already
    /// off) rather than `Σ (q + OFF)·a`.
    fn signed<F: Fmt>() -> bool;
    /// What one row's unit `v` (the bytes `q + OFF`) brings to
    /// [`prod`](Self::prod).
    ///
    /// # Safety
    /// Inlined into [`rows`](Self::rows) only (the level's features).
    unsafe fn operands<F: Fmt>(v: __m256i) -> [__m256i; 2];
    /// `256·Σ w·qs + Σ w·qr` per 4 elements (8 `i32` lanes) of one row's
    /// [`operands`](Self::operands) `w` with one token's quants `av` and
    /// remainders `ar`.
    ///
    /// # Safety
    /// As [`operands`](Self::operands).
    unsafe fn prod<F: Fmt>(w: [__m256i; 2], av: __m256i, ar: __m256i) -> __m256i;
    /// [`rows`]`::<F, Self>`, compiled with the level's features.
    ///
    /// # Safety
    /// The CPU must support the level.
    unsafe fn rows<F: Fmt>(w: &[u8], row_bytes: usize, acts: &[&[Q8Act]], out: &mut [f32]);
}

/// `out[r * nt + t] = row_r · acts[t]` for the consecutive weight rows in
/// `w` (`row_bytes` each) and 1..=4 activation rows (`nt = acts.len()`).
///
/// # Safety
/// The CPU must support `D`'s level; `dtype` must be a fast-path format.
pub(super) unsafe fn dot_rows<D: UnitDot>(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &[&[Q8Act]],
    out: &mut [f32],
) {
    // SAFETY: as the caller's.
    unsafe { with_fmt!(dtype, level_rows::<_, D>(w, row_bytes, acts, out)) }
}

/// `D::rows::<F>` (a function `with_fmt!` can name).
#[inline(always)]
unsafe fn level_rows<F: Fmt, D: UnitDot>(
    w: &[u8],
    row_bytes: usize,
    acts: &[&[Q8Act]],
    out: &mut [f32],
) {
    // SAFETY: as the caller's.
    unsafe { D::rows::<F>(w, row_bytes, acts, out) }
}

/// The body of every level's [`UnitDot::rows`].
///
/// # Safety
/// Inlined into a function with `D`'s level's features only.
#[inline(always)]
pub(super) unsafe fn rows<F: Fmt, D: UnitDot>(
    w: &[u8],
    row_bytes: usize,
    acts: &[&[Q8Act]],
    out: &mut [f32],
) {
    // SAFETY: as the caller's.
    unsafe {
        match acts.len() {
            1 => rows_nt::<F, D, 1>(w, row_bytes, acts, out),
            2 => rows_nt::<F, D, 2>(w, row_bytes, acts, out),
            3 => rows_nt::<F, D, 3>(w, row_bytes, acts, out),
            4 => rows_nt::<F, D, 4>(w, row_bytes, acts, out),
            _ => unreachable!("tiles have 1..=4 tokens"),
        }
    }
}

/// [`small`] over groups of [`SR`] rows (a short last group repeats its
/// last row in the spare lanes: every lane is computed on its own, and the
/// spare results are dropped).
#[inline(always)]
unsafe fn rows_nt<F: Fmt, D: UnitDot, const NT: usize>(
    w: &[u8],
    row_bytes: usize,
    acts: &[&[Q8Act]],
    out: &mut [f32],
) {
    let nblk = row_bytes / F::BYTES;
    assert!(nblk * F::BYTES == row_bytes && acts.len() == NT);
    let mut a: [&[Q8Act]; NT] = [&[]; NT];
    for t in 0..NT {
        a[t] = &acts[t][..nblk * F::UNITS];
    }
    let nr = w.len() / row_bytes;
    assert!(w.len() == nr * row_bytes && out.len() == nr * NT);
    let mut v = [[0f32; SR]; NT];
    for r0 in (0..nr).step_by(SR) {
        let nv = (nr - r0).min(SR);
        let mut rows: [&[u8]; SR] = [&[]; SR];
        for (i, row) in rows.iter_mut().enumerate() {
            let r = r0 + i.min(nv - 1);
            *row = &w[r * row_bytes..(r + 1) * row_bytes];
        }
        // SAFETY: as the caller's.
        unsafe { small::<F, D, NT>(&rows, nblk, &a, &mut v) };
        for i in 0..nv {
            for t in 0..NT {
                out[(r0 + i) * NT + t] = v[t][i];
            }
        }
    }
}

/// `out[t][i] = row_i · token_t` for [`SR`] rows with the shared
/// arithmetic: per unit, the level's products of each row with the
/// token's quants and remainders, each row's total reduced into its lane,
/// `OFF · isum` taken back off (unless the products are signed), then the
/// f32 step.
#[inline(always)]
unsafe fn small<F: Fmt, D: UnitDot, const NT: usize>(
    rows: &[&[u8]; SR],
    nblk: usize,
    a: &[&[Q8Act]; NT],
    out: &mut [[f32; SR]; NT],
) {
    for row in rows {
        assert!(row.len() == nblk * F::BYTES);
    }
    let signed = D::signed::<F>();
    // SAFETY (every intrinsic): the level's features are enabled where
    // this is inlined (the caller's contract).
    unsafe {
        let mut f = [_mm_setzero_ps(); NT];
        let mut d = [[_mm_setzero_ps(); 2]; 8];
        let mut m = [_mm_setzero_ps(); 8];
        for blk in 0..nblk {
            let at = blk * F::BYTES;
            scales4::<F>(rows, at, &mut d, &mut m);
            for u in 0..F::UNITS {
                let mut w = [[_mm256_setzero_si256(); 2]; SR];
                for i in 0..SR {
                    // The slice holds one block; u < UNITS.
                    w[i] = D::operands::<F>(F::load_u(&rows[i][at..at + F::BYTES], u));
                }
                for t in 0..NT {
                    let ab = &a[t][blk * F::UNITS + u];
                    // qs and qr have 32 bytes each; unaligned loads.
                    let av = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
                    let ar = _mm256_loadu_si256(ab.qr.as_ptr() as *const __m256i);
                    let mut p = [_mm256_setzero_si256(); SR];
                    for i in 0..SR {
                        p[i] = D::prod::<F>(w[i], av, ar);
                    }
                    let tot = if F::SPLIT {
                        reduce4_halves(&p)
                    } else {
                        (reduce4(&p), _mm_setzero_si128())
                    };
                    f[t] = if signed {
                        unit_step::<Signed<F>>(f[t], tot, ab, &d[u], m[u])
                    } else {
                        unit_step::<F>(f[t], tot, ab, &d[u], m[u])
                    };
                }
            }
        }
        for t in 0..NT {
            // out[t] holds SR = 4 f32; unaligned store.
            _mm_storeu_ps(out[t].as_mut_ptr(), f[t]);
        }
    }
}

/// Rows per small-S kernel call: one f32 lane each.
pub(super) const SR: usize = 4;

/// The unit scales and additive terms of [`SR`] rows' blocks at byte `at`,
/// rearranged per unit as 4-lane vectors (`d[u][h]`, `m[u]`; lane = row).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales4<F: Fmt>(rows: &[&[u8]; SR], at: usize, d: &mut [[__m128; 2]; 8], m: &mut [__m128; 8]) {
    let mut dlo = [[0f32; 8]; SR];
    let mut dhi = [[0f32; 8]; SR];
    let mut mr = [[0f32; 8]; SR];
    for i in 0..SR {
        // SAFETY: the slice holds one block; the features are enabled here.
        unsafe {
            F::scales(
                &rows[i][at..at + F::BYTES],
                &mut dlo[i],
                &mut dhi[i],
                &mut mr[i],
            )
        };
    }
    for u in 0..F::UNITS {
        d[u][0] = _mm_setr_ps(dlo[0][u], dlo[1][u], dlo[2][u], dlo[3][u]);
        d[u][1] = if F::SPLIT {
            _mm_setr_ps(dhi[0][u], dhi[1][u], dhi[2][u], dhi[3][u])
        } else {
            d[u][0]
        };
        if F::HAS_MIN {
            m[u] = _mm_setr_ps(mr[0][u], mr[1][u], mr[2][u], mr[3][u]);
        }
    }
}

/// Row totals of 4 vectors of 8 `i32` lanes: lane `i` of the result is the
/// sum of `p[i]`'s lanes (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce4(p: &[__m256i; SR]) -> __m128i {
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
}

/// As [`reduce4`] over each 128-bit half (elements 0..16 and 16..32 of a
/// unit) separately.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce4_halves(p: &[__m256i; SR]) -> (__m128i, __m128i) {
    let lo = [
        _mm256_castsi256_si128(p[0]),
        _mm256_castsi256_si128(p[1]),
        _mm256_castsi256_si128(p[2]),
        _mm256_castsi256_si128(p[3]),
    ];
    let hi = [
        _mm256_extracti128_si256::<1>(p[0]),
        _mm256_extracti128_si256::<1>(p[1]),
        _mm256_extracti128_si256::<1>(p[2]),
        _mm256_extracti128_si256::<1>(p[3]),
    ];
    (
        _mm_hadd_epi32(_mm_hadd_epi32(lo[0], lo[1]), _mm_hadd_epi32(lo[2], lo[3])),
        _mm_hadd_epi32(_mm_hadd_epi32(hi[0], hi[1]), _mm_hadd_epi32(hi[2], hi[3])),
    )
}

/// The f32 step of the shared arithmetic for 4 rows (lanes) and one token:
/// `isum` the unit's (or halves') exact totals of `Σ (q + OFF)·a` per row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unit_step<F: Fmt>(
    f: __m128,
    tot: (__m128i, __m128i),
    a: &Q8Act,
    d: &[__m128; 2],
    m: __m128,
) -> __m128 {
    let da = _mm_set1_ps(a.d);
    let mut f = f;
    if F::SPLIT {
        let (mut lo, mut hi) = tot;
        if F::OFF != 0 {
            lo = _mm_sub_epi32(lo, _mm_set1_epi32(F::OFF * a.isum[0]));
            hi = _mm_sub_epi32(hi, _mm_set1_epi32(F::OFF * a.isum[1]));
        }
        f = _mm_fmadd_ps(_mm_cvtepi32_ps(lo), _mm_mul_ps(da, d[0]), f);
        f = _mm_fmadd_ps(_mm_cvtepi32_ps(hi), _mm_mul_ps(da, d[1]), f);
    } else {
        let mut t = tot.0;
        if F::OFF != 0 {
            t = _mm_sub_epi32(t, _mm_set1_epi32(F::OFF * (a.isum[0] + a.isum[1])));
        }
        f = _mm_fmadd_ps(_mm_cvtepi32_ps(t), _mm_mul_ps(da, d[0]), f);
    }
    if F::HAS_MIN {
        f = _mm_fmadd_ps(m, _mm_set1_ps(a.s), f);
    }
    f
}

/// `F` with its offset already taken off (for the sign-trick products).
struct Signed<F>(std::marker::PhantomData<F>);

impl<F: Fmt> Fmt for Signed<F> {
    const D: DType = F::D;
    const OFF: i32 = 0;
    unsafe fn load_u(b: &[u8], u: usize) -> __m256i {
        // SAFETY: as F::load_u.
        unsafe { F::load_u(b, u) }
    }
}
