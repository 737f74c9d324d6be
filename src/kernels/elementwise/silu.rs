//! The vector SwiGLU, `silu(g) · u` with `silu(v) = v / (1 + e^-v)`, for
//! the SIMD levels of the quantized fast path.
//!
//! `e^x` is Cephes' `expf` polynomial on `x - n ln 2`, scaled by `2^n`:
//! within a few ulp of libm's `expf`. The AVX2 version here computes every
//! lane with the same operations, in the same order, as the AVX-512 one
//! (`quantized::fast::avx512`), so both levels give the same bits: its
//! `2^n` scaling is two exact power-of-two multiplies where AVX-512 has
//! one `vscalefps`, which rounds the same single product (checked by a test
//! on CPUs with both).

#[cfg(target_arch = "x86_64")]
pub use x86::*;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `2^n` for integral `n` in `[-75, 64]` (a normal f32), as bits.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn pow2(n: __m256i) -> __m256 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            n,
            _mm256_set1_epi32(127),
        )))
    }

    /// `e^x` for 8 lanes (the formula of the AVX-512 `exp16`).
    ///
    /// # Safety
    /// The CPU must support avx2 and fma.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp8(x: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-104.0)),
            _mm256_set1_ps(88.72),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let e = _mm256_fmadd_ps(
            _mm256_mul_ps(p, r),
            r,
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        // e · 2^n with n in [-150, 128]: e · 2^h is exact (e is about 1 and
        // h = n >> 1 keeps it normal), so the second product rounds the
        // exact e · 2^n once, as vscalefps does.
        let ni = _mm256_cvtps_epi32(n);
        let h = _mm256_srai_epi32::<1>(ni);
        _mm256_mul_ps(_mm256_mul_ps(e, pow2(h)), pow2(_mm256_sub_epi32(ni, h)))
    }

    /// `silu(g) · u` lane-wise.
    ///
    /// # Safety
    /// The CPU must support avx2 and fma.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn swiglu8(gv: __m256, uv: __m256) -> __m256 {
        // SAFETY: as the caller's.
        let e = unsafe { exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)) };
        let sv = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0), e));
        _mm256_mul_ps(sv, uv)
    }

    /// `g[i] = silu(g[i]) · u[i]` for slices of any length.
    ///
    /// # Safety
    /// The CPU must support avx2 and fma.
    ///
    /// # Panics
    /// If the lengths differ.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn swiglu_slice_avx2(g: &mut [f32], u: &[f32]) {
        assert_eq!(g.len(), u.len(), "swiglu: length mismatch");
        let mut gc = g.chunks_exact_mut(8);
        let mut uc = u.chunks_exact(8);
        for (gs, us) in (&mut gc).zip(&mut uc) {
            // SAFETY: 8 f32 each; unaligned loads and stores.
            unsafe {
                let v = swiglu8(_mm256_loadu_ps(gs.as_ptr()), _mm256_loadu_ps(us.as_ptr()));
                _mm256_storeu_ps(gs.as_mut_ptr(), v);
            }
        }
        let (gt, ut) = (gc.into_remainder(), uc.remainder());
        if !gt.is_empty() {
            let (mut gb, mut ub) = ([0f32; 8], [0f32; 8]);
            gb[..gt.len()].copy_from_slice(gt);
            ub[..ut.len()].copy_from_slice(ut);
            // SAFETY: 8 f32 each.
            unsafe {
                let v = swiglu8(_mm256_loadu_ps(gb.as_ptr()), _mm256_loadu_ps(ub.as_ptr()));
                _mm256_storeu_ps(gb.as_mut_ptr(), v);
            }
            let n = gt.len();
            gt.copy_from_slice(&gb[..n]);
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::kernels::elementwise::silu_f32;

    /// Against `silu_f32` (libm `expf`) over a wide range, saturation at
    /// both ends included (below -88 libm gives -0, this a tiny negative
    /// number), on every length's tail.
    #[test]
    fn swiglu_avx2_matches_libm() {
        if !crate::kernels::Isa::detect().avx2() {
            return;
        }
        let mut worst = 0f32;
        for len in [1usize, 7, 8, 9, 1277] {
            let mut v = -120.0f32;
            while v < 100.0 {
                let g0: Vec<f32> = (0..len).map(|i| v + i as f32 * 1.37e-3).collect();
                let u: Vec<f32> = (0..len).map(|i| 1.0 - 0.01 * (i % 50) as f32).collect();
                let mut g = g0.clone();
                // SAFETY: avx2 (and fma, which the level implies) detected above.
                unsafe { swiglu_slice_avx2(&mut g, &u) };
                for i in 0..len {
                    let want = silu_f32(g0[i]) * u[i];
                    let err = (g[i] - want).abs();
                    assert!(
                        err <= 4e-7 * want.abs() || err < 1e-30,
                        "{}: {} vs {want}",
                        g0[i],
                        g[i]
                    );
                    if want.abs() > 1e-30 {
                        worst = worst.max(err / want.abs());
                    }
                }
                v += 0.173 * len.min(8) as f32;
            }
        }
        eprintln!("swiglu (avx2) worst relative error {worst:e}");
    }
}
