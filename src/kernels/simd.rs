//! Width-generic f32 vectors: the one convention for SIMD code whose
//! algorithm is the same at every width and differs only in lane count.
//!
//! A kernel step is written once, generic over [`F32Vec`], and instantiated
//! for AVX2 (`__m256`, 8 lanes) and AVX-512 (`__m512`, 16 lanes). The
//! methods are `#[inline(always)]` wrappers of one intrinsic each and carry
//! no `#[target_feature]` of their own: generic code built on them must be
//! `#[inline(always)]` too, all the way up to a per-width entry point that
//! enables the width's features (`#[target_feature(enable = "avx2,fma")]`
//! or `"avx512f"`), into which everything is inlined and compiled with
//! those features. Each operation is the single intrinsic it names, so an
//! instantiation performs exactly the operations the hand-written kernel of
//! that width did (same bits). Code whose algorithm differs between widths
//! (integer dot products, shuffles) stays in a per-width file.
//!
//! See docs/design/kernel-dispatch.md.

/// An f32 vector of one width.
///
/// # Safety
/// Every method may only run where the width's CPU features are enabled
/// (see the module docs); pointers must be valid for [`Self::LANES`] floats.
pub(crate) trait F32Vec: Copy {
    /// Lanes per vector.
    const LANES: usize;
    /// All lanes 0.
    unsafe fn zero() -> Self;
    /// All lanes `x`.
    unsafe fn splat(x: f32) -> Self;
    /// `LANES` floats from `p` (unaligned).
    unsafe fn load(p: *const f32) -> Self;
    /// Stores the lanes at `p` (unaligned).
    unsafe fn store(self, p: *mut f32);
    /// `self + b`.
    unsafe fn add(self, b: Self) -> Self;
    /// `self - b`.
    unsafe fn sub(self, b: Self) -> Self;
    /// `self * b`.
    unsafe fn mul(self, b: Self) -> Self;
    /// `self * b + c`, one rounding.
    unsafe fn mul_add(self, b: Self, c: Self) -> Self;
    /// Lane-wise maximum (`maxps`: the second operand when either is NaN).
    unsafe fn max(self, b: Self) -> Self;
    /// `exp` for lanes `<= ~0` (see [`exp_ps`]); lanes below -87 give 0.
    unsafe fn exp(self) -> Self;
}

#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) use x86::exp_ps;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::F32Vec;
    use std::arch::x86_64::*;

    /// exp(x) for x <= ~0 (Cephes-style range reduction and degree-6
    /// polynomial, ~1 ulp); lanes below -87 (incl. -inf) give exactly 0.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp_ps(x: __m256) -> __m256 {
        let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.0));
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
            _mm256_set1_ps(88.0),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.398_2e-3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.333_452e-3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166_579_6e-2));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.166_666_65));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
        let r2 = _mm256_mul_ps(r, r);
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
        let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2)))
    }

    /// exp(x) lane-wise for x <= ~0, the same operations as the AVX2
    /// [`exp_ps`] (so the same results); lanes below -87 (incl. -inf) give
    /// exactly 0.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn exp_ps512(x: __m512) -> __m512 {
        let lo = _mm512_set1_ps(-87.0);
        let ok = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, lo);
        let x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.987_569_1e-4);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.398_2e-3));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.333_452e-3));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166_579_6e-2));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.166_666_65));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5));
        let r2 = _mm512_mul_ps(r, r);
        let y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
        let pow2 = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        _mm512_maskz_mul_ps(ok, y, _mm512_castsi512_ps(pow2))
    }

    /// One width's wrappers: `$v` the vector type, `$p` the intrinsic
    /// prefix, `$exp` its exp.
    macro_rules! f32_vec {
        ($v:ty, $lanes:expr, $exp:ident, $zero:ident, $set1:ident, $load:ident, $store:ident,
         $add:ident, $sub:ident, $mul:ident, $fma:ident, $max:ident) => {
            impl F32Vec for $v {
                const LANES: usize = $lanes;
                #[inline(always)]
                unsafe fn zero() -> Self {
                    // SAFETY: the width's features are enabled (trait contract).
                    unsafe { $zero() }
                }
                #[inline(always)]
                unsafe fn splat(x: f32) -> Self {
                    // SAFETY: as above.
                    unsafe { $set1(x) }
                }
                #[inline(always)]
                unsafe fn load(p: *const f32) -> Self {
                    // SAFETY: as above; `p` valid for LANES floats (contract).
                    unsafe { $load(p) }
                }
                #[inline(always)]
                unsafe fn store(self, p: *mut f32) {
                    // SAFETY: as for `load`.
                    unsafe { $store(p, self) }
                }
                #[inline(always)]
                unsafe fn add(self, b: Self) -> Self {
                    // SAFETY: as for `zero`.
                    unsafe { $add(self, b) }
                }
                #[inline(always)]
                unsafe fn sub(self, b: Self) -> Self {
                    // SAFETY: as for `zero`.
                    unsafe { $sub(self, b) }
                }
                #[inline(always)]
                unsafe fn mul(self, b: Self) -> Self {
                    // SAFETY: as for `zero`.
                    unsafe { $mul(self, b) }
                }
                #[inline(always)]
                unsafe fn mul_add(self, b: Self, c: Self) -> Self {
                    // SAFETY: as for `zero`.
                    unsafe { $fma(self, b, c) }
                }
                #[inline(always)]
                unsafe fn max(self, b: Self) -> Self {
                    // SAFETY: as for `zero`.
                    unsafe { $max(self, b) }
                }
                #[inline(always)]
                unsafe fn exp(self) -> Self {
                    // SAFETY: as for `zero`.
                    unsafe { $exp(self) }
                }
            }
        };
    }

    f32_vec!(
        __m256,
        8,
        exp_ps,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_add_ps,
        _mm256_sub_ps,
        _mm256_mul_ps,
        _mm256_fmadd_ps,
        _mm256_max_ps
    );
    f32_vec!(
        __m512,
        16,
        exp_ps512,
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_add_ps,
        _mm512_sub_ps,
        _mm512_mul_ps,
        _mm512_fmadd_ps,
        _mm512_max_ps
    );
}
