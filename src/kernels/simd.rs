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
    /// `exp` for lanes `<= ~0` (one formula for every width); lanes below
    /// -87 give 0.
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
    /// The AVX2 instantiation of [`exp`], for tests.
    #[cfg(test)]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp_ps(x: __m256) -> __m256 {
        // SAFETY: AVX2 and FMA are enabled here.
        unsafe { x.exp() }
    }

    /// exp(x) lane-wise for x <= ~0, written once for every width
    /// (Cephes-style range reduction and degree-6 polynomial, ~1 ulp);
    /// lanes below -87 (incl. -inf) give exactly 0 (see
    /// [`Width::mul_zero_below`] for NaN lanes).
    #[inline(always)]
    unsafe fn exp<V: Width>(x0: V) -> V {
        // SAFETY (whole body): the width's features are enabled (trait
        // contract).
        unsafe {
            let lo = V::splat(-87.0);
            let x = x0.max(lo).min(V::splat(88.0));
            let n = x.mul(V::splat(std::f32::consts::LOG2_E)).round();
            let r = n.neg_mul_add(V::splat(0.693_359_4), x);
            let r = n.neg_mul_add(V::splat(-2.121_944_4e-4), r);
            let mut p = V::splat(1.987_569_1e-4);
            p = p.mul_add(r, V::splat(1.398_2e-3));
            p = p.mul_add(r, V::splat(8.333_452e-3));
            p = p.mul_add(r, V::splat(4.166_579_6e-2));
            p = p.mul_add(r, V::splat(0.166_666_65));
            p = p.mul_add(r, V::splat(0.5));
            let r2 = r.mul(r);
            let y = p.mul_add(r2, r).add(V::splat(1.0));
            y.mul_zero_below(n.pow2(), x0, lo)
        }
    }

    /// What [`exp`] needs beyond [`F32Vec`], one width's intrinsics each.
    trait Width: F32Vec {
        /// Lane-wise minimum.
        unsafe fn min(self, b: Self) -> Self;
        /// `c - self * b`, one rounding.
        unsafe fn neg_mul_add(self, b: Self, c: Self) -> Self;
        /// Rounded to the nearest integer (ties to even).
        unsafe fn round(self) -> Self;
        /// `2^self` for integral lanes in the normal exponent range.
        unsafe fn pow2(self) -> Self;
        /// `self * b`, with 0 in the lanes where `x < lo`. NaN lanes of `x`
        /// keep the product at AVX2 and give 0 at AVX-512, as the kernels
        /// of each width always did.
        unsafe fn mul_zero_below(self, b: Self, x: Self, lo: Self) -> Self;
    }

    impl Width for __m256 {
        #[inline(always)]
        unsafe fn min(self, b: Self) -> Self {
            // SAFETY: the width's features are enabled (trait contract).
            unsafe { _mm256_min_ps(self, b) }
        }
        #[inline(always)]
        unsafe fn neg_mul_add(self, b: Self, c: Self) -> Self {
            // SAFETY: as above.
            unsafe { _mm256_fnmadd_ps(self, b, c) }
        }
        #[inline(always)]
        unsafe fn round(self) -> Self {
            // SAFETY: as above.
            unsafe { _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self) }
        }
        #[inline(always)]
        unsafe fn pow2(self) -> Self {
            // SAFETY: as above.
            unsafe {
                let e = _mm256_add_epi32(_mm256_cvtps_epi32(self), _mm256_set1_epi32(127));
                _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e))
            }
        }
        #[inline(always)]
        unsafe fn mul_zero_below(self, b: Self, x: Self, lo: Self) -> Self {
            // SAFETY: as above.
            unsafe { _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(x, lo), _mm256_mul_ps(self, b)) }
        }
    }

    impl Width for __m512 {
        #[inline(always)]
        unsafe fn min(self, b: Self) -> Self {
            // SAFETY: the width's features are enabled (trait contract).
            unsafe { _mm512_min_ps(self, b) }
        }
        #[inline(always)]
        unsafe fn neg_mul_add(self, b: Self, c: Self) -> Self {
            // SAFETY: as above.
            unsafe { _mm512_fnmadd_ps(self, b, c) }
        }
        #[inline(always)]
        unsafe fn round(self) -> Self {
            // SAFETY: as above.
            unsafe {
                _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self)
            }
        }
        #[inline(always)]
        unsafe fn pow2(self) -> Self {
            // SAFETY: as above.
            unsafe {
                let e = _mm512_add_epi32(_mm512_cvtps_epi32(self), _mm512_set1_epi32(127));
                _mm512_castsi512_ps(_mm512_slli_epi32::<23>(e))
            }
        }
        #[inline(always)]
        unsafe fn mul_zero_below(self, b: Self, x: Self, lo: Self) -> Self {
            // SAFETY: as above.
            unsafe { _mm512_maskz_mul_ps(_mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, lo), self, b) }
        }
    }

    /// One width's wrappers: `$v` the vector type, then its intrinsics.
    macro_rules! f32_vec {
        ($v:ty, $lanes:expr, $zero:ident, $set1:ident, $load:ident, $store:ident,
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
                    unsafe { exp(self) }
                }
            }
        };
    }

    f32_vec!(
        __m256,
        8,
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
