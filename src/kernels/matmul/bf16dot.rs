//! Optional AVX-512 BF16 path for BF16 weights ([`super::matmul_bf16_dot`]).
//!
//! Activations are rounded to bf16 (round-to-nearest-even, as llama.cpp does
//! for its BF16 dot products) and multiplied with `VDPBF16PS`, which does 32
//! bf16 multiply-adds per instruction into 16 f32 lanes: twice the
//! arithmetic of an f32 FMA. Results differ from the exact-f32 path by the
//! activation rounding (relative ~2⁻⁹ per product), so this is opt-in.
//!
//! Per K block of [`KB`] elements the x rows of the token block are
//! converted once into a stack buffer; weight rows are read in place
//! (already bf16). Tiles are 4 weight rows × up to 6 tokens (24 zmm
//! accumulators).

// Register tiles are indexed explicitly on purpose.
#![allow(clippy::needless_range_loop)]

/// Tokens per call (the caller's token block) this path supports.
pub(crate) const MAX_NS: usize = 24;

/// Whether this CPU has AVX-512F/BW and AVX-512 BF16.
pub(crate) fn available() -> bool {
    crate::kernels::Isa::detect().avx512_bf16()
}

/// `out[t * nr + r] = dot(bf16(x[t]), W[row0 + r])` for BF16 `w_bytes`
/// (`[*, k]`); requires [`available`] and `ns <= MAX_NS`.
pub(crate) fn block(
    x: &[f32],
    ns: usize,
    k: usize,
    w_bytes: &[u8],
    row0: usize,
    nr: usize,
    out: &mut [f32],
) {
    assert!(ns <= MAX_NS && x.len() >= ns * k && out.len() >= ns * nr);
    assert!((row0 + nr) * k * 2 <= w_bytes.len() && available());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: features checked; x has ns rows of k floats, the weight rows
    // row0..row0+nr are in bounds, out has ns*nr elements.
    unsafe {
        x86::block(
            x.as_ptr(),
            ns,
            k,
            w_bytes.as_ptr().add(row0 * k * 2),
            nr,
            out.as_mut_ptr(),
        )
    }
}

/// K block (elements), a multiple of 32.
pub(crate) const KB: usize = 1024;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{KB, MAX_NS};
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2")]
    unsafe fn half_sum(z: __m512) -> __m256 {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(z)));
        _mm256_add_ps(_mm512_castps512_ps256(z), hi)
    }

    /// `[sum(a), sum(b), sum(c), sum(d)]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2")]
    unsafe fn hsum4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
        let t0 = _mm256_hadd_ps(half_sum(a), half_sum(b));
        let t1 = _mm256_hadd_ps(half_sum(c), half_sum(d));
        let t2 = _mm256_hadd_ps(t0, t1);
        _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps::<1>(t2))
    }

    /// `kl` bf16 weights of each of the rows at `w`, `wrb` bytes apart.
    #[derive(Clone, Copy)]
    struct Rows {
        w: *const u8,
        wrb: usize,
        kl: usize,
    }

    /// out[j*os + i] += dot(xb[j*KB..][..kl], w[i*wrb..][..kl]) (bf16 pairs).
    /// `xb` is zero-padded to a multiple of 32; the weight tail is masked.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2")]
    unsafe fn tile<const R: usize, const T: usize>(
        xb: *const u16,
        rows: Rows,
        out: *mut f32,
        os: usize,
    ) {
        let Rows { w, wrb, kl } = rows;
        // SAFETY (whole body): xb has T rows of KB u16 (zero past kl, up to
        // the next multiple of 32), w has R rows (stride wrb bytes) of kl
        // bf16, out has T rows of stride os >= R.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); T]; R];
            let full = kl & !31;
            let mut e = 0;
            while e < full {
                let mut xv = [_mm512_setzero_ps(); T];
                for j in 0..T {
                    xv[j] = _mm512_castsi512_ps(_mm512_loadu_si512(xb.add(j * KB + e).cast()));
                }
                for i in 0..R {
                    let wv: __m512bh =
                        std::mem::transmute(_mm512_loadu_si512(w.add(i * wrb + e * 2).cast()));
                    for j in 0..T {
                        acc[i][j] = _mm512_dpbf16_ps(
                            acc[i][j],
                            std::mem::transmute::<__m512, __m512bh>(xv[j]),
                            wv,
                        );
                    }
                }
                e += 32;
            }
            if e < kl {
                let mask: __mmask32 = (1u32 << (kl - e)) - 1;
                for i in 0..R {
                    let wv: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(
                        mask,
                        w.add(i * wrb + e * 2).cast(),
                    ));
                    for j in 0..T {
                        let xv: __m512bh =
                            std::mem::transmute(_mm512_loadu_si512(xb.add(j * KB + e).cast()));
                        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv);
                    }
                }
            }
            if R == 4 {
                for j in 0..T {
                    let v = hsum4(acc[0][j], acc[1][j], acc[2][j], acc[3][j]);
                    let o = out.add(j * os);
                    _mm_storeu_ps(o, _mm_add_ps(_mm_loadu_ps(o), v));
                }
            } else {
                for i in 0..R {
                    for j in 0..T {
                        *out.add(j * os + i) += _mm512_reduce_add_ps(acc[i][j]);
                    }
                }
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2")]
    unsafe fn tokens<const R: usize>(
        xb: *const u16,
        ns: usize,
        rows: Rows,
        out: *mut f32,
        os: usize,
    ) {
        // SAFETY: forwards the caller's bounds.
        unsafe {
            let mut t = 0;
            while t + 6 <= ns {
                tile::<R, 6>(xb.add(t * KB), rows, out.add(t * os), os);
                t += 6;
            }
            let (xb, out) = (xb.add(t * KB), out.add(t * os));
            match ns - t {
                5 => tile::<R, 5>(xb, rows, out, os),
                4 => tile::<R, 4>(xb, rows, out, os),
                3 => tile::<R, 3>(xb, rows, out, os),
                2 => tile::<R, 2>(xb, rows, out, os),
                1 => tile::<R, 1>(xb, rows, out, os),
                _ => {}
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2")]
    pub(super) unsafe fn block(
        x: *const f32,
        ns: usize,
        k: usize,
        w: *const u8,
        nr: usize,
        out: *mut f32,
    ) {
        // SAFETY: x: ns*k floats, w: nr rows of k bf16, out: ns*nr; ns <= MAX_NS.
        unsafe {
            for i in 0..ns * nr {
                *out.add(i) = 0.0;
            }
            let wrb = k * 2;
            // Only the converted part (rows < ns, elements < kl rounded up
            // to 32) is ever read, and it is written first each K block.
            let mut xbuf_mem = std::mem::MaybeUninit::<[u16; MAX_NS * KB]>::uninit();
            let xbuf_ptr = xbuf_mem.as_mut_ptr().cast::<u16>();
            let mut k0 = 0;
            while k0 < k {
                let kl = (k - k0).min(KB);
                for t in 0..ns {
                    let src = x.add(t * k + k0);
                    let dst = xbuf_ptr.add(t * KB);
                    let mut e = 0;
                    while e < kl {
                        let n = (kl - e).min(32);
                        let lo_mask: __mmask16 = if n >= 16 {
                            0xffff
                        } else {
                            ((1u32 << n) - 1) as u16
                        };
                        let hi_mask: __mmask16 = if n <= 16 {
                            0
                        } else {
                            ((1u32 << (n - 16)) - 1) as u16
                        };
                        let lo = _mm512_maskz_loadu_ps(lo_mask, src.add(e));
                        let hi = _mm512_maskz_loadu_ps(hi_mask, src.add(e + 16));
                        let v = _mm512_cvtne2ps_pbh(hi, lo);
                        _mm512_storeu_si512(
                            dst.add(e).cast(),
                            std::mem::transmute::<__m512bh, __m512i>(v),
                        );
                        e += 32;
                    }
                }
                let mut r = 0;
                while r < nr {
                    let rows = Rows {
                        w: w.add(r * wrb + k0 * 2),
                        wrb,
                        kl,
                    };
                    if r + 4 <= nr {
                        tokens::<4>(xbuf_ptr, ns, rows, out.add(r), nr);
                        r += 4;
                    } else {
                        tokens::<1>(xbuf_ptr, ns, rows, out.add(r), nr);
                        r += 1;
                    }
                }
                k0 += kl;
            }
        }
    }
}
