//! AVX2 + FMA + F16C tile kernels for [`super::matmul`](super::matmul()).
//!
//! A tile computes `R` weight rows × `T` tokens of dot products with `R·T`
//! 8-lane accumulators. One token (GEMV, memory-bound): 8×1 / 4×1 / 1×1
//! tiles over the full K, weights widened from F16/BF16 in registers.
//! Several tokens: K blocks of [`x86::KB`] elements; per block the x rows
//! are packed contiguously and each 4-row weight tile is widened to f32 once
//! into a stack buffer, then 4×3 tiles (12 accumulators, 7 loads per 12
//! FMAs) run from L1, partial sums reduced with `hadd` into the output.

// Register tiles are indexed explicitly on purpose.
#![allow(clippy::needless_range_loop)]

use crate::ir::DType;
use crate::kernels::WeightRef;

/// Whether the SIMD kernels can run on this CPU.
pub(crate) fn available() -> bool {
    crate::kernels::Isa::detect().avx2()
}

/// `out[t * nr + r] = dot(x[t], W[row0 + r])`; requires [`available`].
pub(crate) fn block(
    x: &[f32],
    ns: usize,
    k: usize,
    w: WeightRef<'_>,
    row0: usize,
    nr: usize,
    out: &mut [f32],
) {
    assert!(x.len() >= ns * k && out.len() >= ns * nr);
    #[cfg(target_arch = "x86_64")]
    {
        let es = match w.dtype {
            DType::F32 => 4,
            _ => 2,
        };
        let end = (row0 + nr) * k * es;
        assert!(end <= w.bytes.len() && available());
        // SAFETY: CPU features checked above; all pointers stay inside
        // `x[..ns*k]`, `w.bytes[row0*k*es..end]` and `out[..ns*nr]` as the
        // tile loops index rows < nr, tokens < ns and elements < k.
        unsafe {
            let wp = w.bytes.as_ptr().add(row0 * k * es);
            match w.dtype {
                DType::F32 => x86::f32w::block(x.as_ptr(), ns, k, wp, nr, out.as_mut_ptr()),
                DType::F16 => x86::f16w::block(x.as_ptr(), ns, k, wp, nr, out.as_mut_ptr()),
                DType::BF16 if ns == 1 && k.is_multiple_of(16) && k <= x86::GEMV_PERM_MAX_K => {
                    x86::gemv_bf16_perm(x.as_ptr(), k, wp, nr, out.as_mut_ptr())
                }
                DType::BF16 => x86::bf16w::block(x.as_ptr(), ns, k, wp, nr, out.as_mut_ptr()),
                _ => unreachable!("dtype checked by matmul"),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (x, ns, k, w, row0, nr, out);
        unreachable!("available() is false on this architecture");
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn load_f32(p: *const u8) -> __m256 {
        // SAFETY: caller guarantees 32 readable bytes at p.
        unsafe { _mm256_loadu_ps(p.cast::<f32>()) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn load_f16(p: *const u8) -> __m256 {
        // SAFETY: caller guarantees 16 readable bytes at p.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>())) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn load_bf16(p: *const u8) -> __m256 {
        // SAFETY: caller guarantees 16 readable bytes at p.
        unsafe {
            let h = _mm_loadu_si128(p.cast::<__m128i>());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }
    #[inline]
    pub(super) unsafe fn one_f32(p: *const u8) -> f32 {
        // SAFETY: caller guarantees 4 readable bytes at p.
        unsafe { f32::from_le_bytes(p.cast::<[u8; 4]>().read_unaligned()) }
    }
    #[inline]
    pub(super) unsafe fn one_f16(p: *const u8) -> f32 {
        // SAFETY: caller guarantees 2 readable bytes at p.
        unsafe {
            crate::kernels::f16_to_f32(u16::from_le_bytes(p.cast::<[u8; 2]>().read_unaligned()))
        }
    }
    #[inline]
    pub(super) unsafe fn one_bf16(p: *const u8) -> f32 {
        // SAFETY: caller guarantees 2 readable bytes at p.
        unsafe {
            crate::kernels::bf16_to_f32(u16::from_le_bytes(p.cast::<[u8; 2]>().read_unaligned()))
        }
    }

    /// K-block of the multi-token path, in elements (x block and weight
    /// tile stay in L1).
    pub(super) const KB: usize = 256;
    /// Tokens packed per K block in the multi-token path.
    pub(super) const MAX_NS: usize = 24;

    /// out[t*os + i] += dot(x[t*xs..][..kl], w[i*ws..][..kl]) for i < R, t < T,
    /// all f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile_acc<const R: usize, const T: usize>(
        x: *const f32,
        xs: usize,
        w: *const f32,
        ws: usize,
        kl: usize,
        out: *mut f32,
        os: usize,
    ) {
        // SAFETY (whole body): x has T rows (stride xs) of kl floats, w has R
        // rows (stride ws) of kl floats, out has T rows of stride os >= R.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); T]; R];
            let k8 = kl & !7;
            let mut kk = 0;
            while kk < k8 {
                let mut xv = [_mm256_setzero_ps(); T];
                for (j, v) in xv.iter_mut().enumerate() {
                    *v = _mm256_loadu_ps(x.add(j * xs + kk));
                }
                for (i, a) in acc.iter_mut().enumerate() {
                    let wv = _mm256_loadu_ps(w.add(i * ws + kk));
                    for j in 0..T {
                        a[j] = _mm256_fmadd_ps(wv, xv[j], a[j]);
                    }
                }
                kk += 8;
            }
            if R == 4 {
                // Reduce the 4 rows of each token together (3 hadds).
                for j in 0..T {
                    let mut v = hsum4(acc[0][j], acc[1][j], acc[2][j], acc[3][j]);
                    if k8 < kl {
                        let mut tail = [0f32; 4];
                        for (i, t) in tail.iter_mut().enumerate() {
                            for e in k8..kl {
                                *t += *w.add(i * ws + e) * *x.add(j * xs + e);
                            }
                        }
                        v = _mm_add_ps(v, _mm_loadu_ps(tail.as_ptr()));
                    }
                    let o = out.add(j * os);
                    _mm_storeu_ps(o, _mm_add_ps(_mm_loadu_ps(o), v));
                }
                return;
            }
            for (i, a) in acc.iter().enumerate() {
                for j in 0..T {
                    let mut s = hsum(a[j]);
                    for e in k8..kl {
                        s += *w.add(i * ws + e) * *x.add(j * xs + e);
                    }
                    *out.add(j * os + i) += s;
                }
            }
        }
    }

    /// Horizontal sums of four vectors: `[sum(a), sum(b), sum(c), sum(d)]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn hsum4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
        let t0 = _mm256_hadd_ps(a, b);
        let t1 = _mm256_hadd_ps(c, d);
        let t2 = _mm256_hadd_ps(t0, t1);
        _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps::<1>(t2))
    }

    /// Token tiles of 3 (then 2 or 1) over `ns` tokens for one R-row weight
    /// tile and one K block.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tokens_acc<const R: usize>(
        x: *const f32,
        xs: usize,
        ns: usize,
        w: *const f32,
        ws: usize,
        kl: usize,
        out: *mut f32,
        os: usize,
    ) {
        // SAFETY: forwards the caller's bounds (ns rows of x and out).
        unsafe {
            let mut t = 0;
            while t + 3 <= ns {
                tile_acc::<R, 3>(x.add(t * xs), xs, w, ws, kl, out.add(t * os), os);
                t += 3;
            }
            match ns - t {
                2 => tile_acc::<R, 2>(x.add(t * xs), xs, w, ws, kl, out.add(t * os), os),
                1 => tile_acc::<R, 1>(x.add(t * xs), xs, w, ws, kl, out.add(t * os), os),
                _ => {}
            }
        }
    }

    macro_rules! tile_kernels {
        ($m:ident, $es:expr, $load:ident, $one:ident) => {
            pub(super) mod $m {
                use super::*;
                const ES: usize = $es;

                /// R rows × T tokens; out[t*os + i] = dot(x[t], w[i]).
                #[inline]
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn tile<const R: usize, const T: usize>(
                    x: *const f32,
                    k: usize,
                    w: *const u8,
                    out: *mut f32,
                    os: usize,
                ) {
                    // SAFETY (whole body): x has T rows of k floats, w has R
                    // rows of k elements, out has T rows of stride os >= R.
                    unsafe {
                        let wrb = k * ES;
                        let mut acc = [[_mm256_setzero_ps(); T]; R];
                        let k8 = k & !7;
                        let mut kk = 0;
                        while kk < k8 {
                            let mut xv = [_mm256_setzero_ps(); T];
                            for (j, v) in xv.iter_mut().enumerate() {
                                *v = _mm256_loadu_ps(x.add(j * k + kk));
                            }
                            for (i, a) in acc.iter_mut().enumerate() {
                                let wv = $load(w.add(i * wrb + kk * ES));
                                for j in 0..T {
                                    a[j] = _mm256_fmadd_ps(wv, xv[j], a[j]);
                                }
                            }
                            kk += 8;
                        }
                        for (i, a) in acc.iter().enumerate() {
                            for j in 0..T {
                                let mut s = hsum(a[j]);
                                for e in k8..k {
                                    s += $one(w.add(i * wrb + e * ES)) * *x.add(j * k + e);
                                }
                                *out.add(j * os + i) = s;
                            }
                        }
                    }
                }

                /// Several tokens, K-blocked: per K block, the x block (up to
                /// 12 tokens) is packed contiguously and each 4-row weight
                /// tile is widened/copied to f32 once, then reused for all
                /// tokens from L1 (packing also avoids the cache-set
                /// conflicts of power-of-two row strides).
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn block_multi(
                    x: *const f32,
                    ns: usize,
                    k: usize,
                    w: *const u8,
                    nr: usize,
                    out: *mut f32,
                ) {
                    // SAFETY: x: ns*k floats, w: nr rows of k elements, out: ns*nr.
                    unsafe {
                        for i in 0..ns * nr {
                            *out.add(i) = 0.0;
                        }
                        let wrb = k * ES;
                        let mut wbuf = [0f32; 4 * KB];
                        let mut xbuf = [0f32; MAX_NS * KB];
                        let mut t0 = 0;
                        while t0 < ns {
                            let nt = (ns - t0).min(MAX_NS);
                            let mut k0 = 0;
                            while k0 < k {
                                let kl = (k - k0).min(KB);
                                for t in 0..nt {
                                    std::ptr::copy_nonoverlapping(
                                        x.add((t0 + t) * k + k0),
                                        xbuf.as_mut_ptr().add(t * KB),
                                        kl,
                                    );
                                }
                                let mut r = 0;
                                while r < nr {
                                    let rt = if r + 4 <= nr { 4 } else { 1 };
                                    // F32 rows are used in place (copying
                                    // them cost ~20% of F32 prefill);
                                    // F16/BF16 rows are widened once per
                                    // token block.
                                    let (wt, ws) = if ES == 4 {
                                        (w.add(r * wrb + k0 * ES).cast::<f32>(), k)
                                    } else {
                                        (wbuf.as_ptr(), KB)
                                    };
                                    let widen_rows = if ES == 4 { 0 } else { rt };
                                    for i in 0..widen_rows {
                                        let src = w.add((r + i) * wrb + k0 * ES);
                                        let dst = wbuf.as_mut_ptr().add(i * KB);
                                        let mut e = 0;
                                        while e + 8 <= kl {
                                            _mm256_storeu_ps(dst.add(e), $load(src.add(e * ES)));
                                            e += 8;
                                        }
                                        while e < kl {
                                            *dst.add(e) = $one(src.add(e * ES));
                                            e += 1;
                                        }
                                    }
                                    let o = out.add(t0 * nr + r);
                                    if rt == 4 {
                                        tokens_acc::<4>(xbuf.as_ptr(), KB, nt, wt, ws, kl, o, nr);
                                    } else {
                                        tokens_acc::<1>(xbuf.as_ptr(), KB, nt, wt, ws, kl, o, nr);
                                    }
                                    r += rt;
                                }
                                k0 += kl;
                            }
                            t0 += nt;
                        }
                    }
                }

                /// out[t*nr + r] = dot(x[t], w[r]) for t < ns, r < nr.
                #[target_feature(enable = "avx2,fma,f16c")]
                pub(crate) unsafe fn block(
                    x: *const f32,
                    ns: usize,
                    k: usize,
                    w: *const u8,
                    nr: usize,
                    out: *mut f32,
                ) {
                    // SAFETY: x: ns*k floats, w: nr rows of k elements, out: ns*nr.
                    unsafe {
                        if ns > 1 {
                            return block_multi(x, ns, k, w, nr, out);
                        }
                        let wrb = k * ES;
                        let mut r = 0;
                        while r + 8 <= nr {
                            tile::<8, 1>(x, k, w.add(r * wrb), out.add(r), nr);
                            r += 8;
                        }
                        while r + 4 <= nr {
                            tile::<4, 1>(x, k, w.add(r * wrb), out.add(r), nr);
                            r += 4;
                        }
                        while r < nr {
                            tile::<1, 1>(x, k, w.add(r * wrb), out.add(r), nr);
                            r += 1;
                        }
                    }
                }
            }
        };
    }

    /// Largest K for [`gemv_bf16_perm`] (its permuted copy of x lives on
    /// the stack).
    pub(super) const GEMV_PERM_MAX_K: usize = 16384;

    /// BF16 GEMV without shuffles: 16 bf16 weights (one 32-byte load) give
    /// the even elements as f32 via a 16-bit left shift and the odd ones by
    /// masking the low halves; x is permuted once into matching
    /// [8 evens, 8 odds] groups. 4 rows × 2 accumulators.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv_bf16_perm(
        x: *const f32,
        k: usize,
        w: *const u8,
        nr: usize,
        out: *mut f32,
    ) {
        // SAFETY: x has k floats (k % 16 == 0, k <= GEMV_PERM_MAX_K), w has
        // nr rows of k bf16, out has nr floats.
        unsafe {
            let mut xp_mem = std::mem::MaybeUninit::<[f32; GEMV_PERM_MAX_K]>::uninit();
            let xp = xp_mem.as_mut_ptr().cast::<f32>();
            let mut e = 0;
            while e < k {
                for i in 0..8 {
                    *xp.add(e + i) = *x.add(e + 2 * i);
                    *xp.add(e + 8 + i) = *x.add(e + 2 * i + 1);
                }
                e += 16;
            }
            let wrb = k * 2;
            let hi_mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
            let mut r = 0;
            while r + 4 <= nr {
                let mut ae = [_mm256_setzero_ps(); 4];
                let mut ao = [_mm256_setzero_ps(); 4];
                let mut e = 0;
                while e < k {
                    let xe = _mm256_loadu_ps(xp.add(e));
                    let xo = _mm256_loadu_ps(xp.add(e + 8));
                    for i in 0..4 {
                        let v = _mm256_loadu_si256(w.add((r + i) * wrb + e * 2).cast());
                        let lo = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
                        let hi = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
                        ae[i] = _mm256_fmadd_ps(lo, xe, ae[i]);
                        ao[i] = _mm256_fmadd_ps(hi, xo, ao[i]);
                    }
                    e += 16;
                }
                let v = hsum4(
                    _mm256_add_ps(ae[0], ao[0]),
                    _mm256_add_ps(ae[1], ao[1]),
                    _mm256_add_ps(ae[2], ao[2]),
                    _mm256_add_ps(ae[3], ao[3]),
                );
                _mm_storeu_ps(out.add(r), v);
                r += 4;
            }
            while r < nr {
                let mut a = _mm256_setzero_ps();
                let mut e = 0;
                while e < k {
                    let v = _mm256_loadu_si256(w.add(r * wrb + e * 2).cast());
                    let lo = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
                    let hi = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
                    a = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xp.add(e)), a);
                    a = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xp.add(e + 8)), a);
                    e += 16;
                }
                *out.add(r) = hsum(a);
                r += 1;
            }
        }
    }

    tile_kernels!(f32w, 4, load_f32, one_f32);
    tile_kernels!(f16w, 2, load_f16, one_f16);
    tile_kernels!(bf16w, 2, load_bf16, one_bf16);
}
