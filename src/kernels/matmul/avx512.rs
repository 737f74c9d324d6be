//! AVX-512 tile kernels ([`super::tiles`]): 16-lane accumulators, up to 4
//! weight rows × 6 tokens (24 zmm accumulators, 10 loads per 24 FMAs),
//! weights read in their stored dtype (F16 widened with `VCVTPH2PS`, BF16
//! zero-extended and shifted, 256-bit loads), K tail by masked loads.
//!
//! With several tokens nothing is packed: the only reuse is through the
//! caches (a chunk's weight rows stay in L2 while all token groups pass over
//! them, and a 4-row tile stays in L1 across the token tiles of one group).
//! The earlier AVX2 path copied every 4-row weight tile and packed x per
//! chunk; for F32 weights those copies were a fifth of prefill time (see
//! docs/design/batch-invariance.md, "The float tiles").

// Register tiles are indexed explicitly on purpose.
#![allow(clippy::needless_range_loop)]

use super::tiles::{Sums, Tiles, BF16, F16, F32, RT};

/// The AVX-512 level's tiles.
pub(crate) struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Tiles for Avx512 {
    const TT: usize = 6;

    unsafe fn tile(
        dt: u8,
        r: usize,
        t: usize,
        x: *const f32,
        k: usize,
        w: &[*const u8; RT],
        out: &mut Sums,
    ) {
        // SAFETY: forwarded to the monomorphic kernel.
        unsafe {
            match dt {
                F32 => x86::tile_r::<F32>(r, t, x, k, w, out),
                F16 => x86::tile_r::<F16>(r, t, x, k, w, out),
                _ => x86::tile_r::<BF16>(r, t, x, k, w, out),
            }
        }
    }

    unsafe fn widen(dt: u8, src: *const u8, k: usize, dst: *mut f32) {
        // SAFETY: forwarded.
        unsafe {
            match dt {
                F32 => x86::widen::<F32>(src, k, dst),
                F16 => x86::widen::<F16>(src, k, dst),
                _ => x86::widen::<BF16>(src, k, dst),
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
impl Tiles for Avx512 {
    const TT: usize = 6;
    unsafe fn tile(
        _: u8,
        _: usize,
        _: usize,
        _: *const f32,
        _: usize,
        _: &[*const u8; RT],
        _: &mut Sums,
    ) {
        unreachable!("no AVX-512 on this architecture");
    }
    unsafe fn widen(_: u8, _: *const u8, _: usize, _: *mut f32) {
        unreachable!("no AVX-512 on this architecture");
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::tiles::{elem_size, Sums, F16, F32, RT};
    use std::arch::x86_64::*;

    /// 16 weights at `p` as f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn load<const DT: u8>(p: *const u8) -> __m512 {
        // SAFETY: caller guarantees 16 readable elements at p.
        unsafe {
            match DT {
                F32 => _mm512_loadu_ps(p.cast()),
                F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256(p.cast()),
                ))),
            }
        }
    }

    /// The elements of `m` at `p` as f32, zeros elsewhere (masked-off lanes
    /// are not read).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn load_mask<const DT: u8>(p: *const u8, m: __mmask16) -> __m512 {
        // SAFETY: caller guarantees the lanes set in m are readable.
        unsafe {
            match DT {
                F32 => _mm512_maskz_loadu_ps(m, p.cast()),
                F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p.cast())),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_maskz_loadu_epi16(m, p.cast()),
                ))),
            }
        }
    }

    /// `[sum(a), sum(b), sum(c), sum(d)]`, each by the same tree: the two
    /// 256-bit halves added lane by lane, then pairs of neighbours twice
    /// (`hadd`), then the two 128-bit halves.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    fn hsum4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
        let fold = |v: __m512| {
            let hi = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v));
            _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(hi))
        };
        let t0 = _mm256_hadd_ps(fold(a), fold(b));
        let t1 = _mm256_hadd_ps(fold(c), fold(d));
        let t2 = _mm256_hadd_ps(t0, t1);
        _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps::<1>(t2))
    }

    /// [`tile`] for `r` rows.
    ///
    /// # Safety
    /// As [`super::Tiles::tile`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    pub(super) unsafe fn tile_r<const DT: u8>(
        r: usize,
        t: usize,
        x: *const f32,
        k: usize,
        w: &[*const u8; RT],
        out: &mut Sums,
    ) {
        // SAFETY: forwarded.
        unsafe {
            match r {
                4 => tile_t::<DT, 4>(t, x, k, w, out),
                3 => tile_t::<DT, 3>(t, x, k, w, out),
                2 => tile_t::<DT, 2>(t, x, k, w, out),
                _ => tile_t::<DT, 1>(t, x, k, w, out),
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn tile_t<const DT: u8, const R: usize>(
        t: usize,
        x: *const f32,
        k: usize,
        w: &[*const u8; RT],
        out: &mut Sums,
    ) {
        // SAFETY: forwarded.
        unsafe {
            match t {
                6 => tile::<DT, R, 6>(x, k, w, out),
                5 => tile::<DT, R, 5>(x, k, w, out),
                4 => tile::<DT, R, 4>(x, k, w, out),
                3 => tile::<DT, R, 3>(x, k, w, out),
                2 => tile::<DT, R, 2>(x, k, w, out),
                _ => tile::<DT, R, 1>(x, k, w, out),
            }
        }
    }

    /// `out[j][i] = dot(x[j], w[i])` for `j < T`, `i < R` (other lanes 0).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn tile<const DT: u8, const R: usize, const T: usize>(
        x: *const f32,
        k: usize,
        w: &[*const u8; RT],
        out: &mut Sums,
    ) {
        let es = elem_size(DT);
        // SAFETY (whole body): x has T rows of k floats (stride k), each
        // w[i] for i < R has k elements; loads stop at k.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); T]; R];
            let k16 = k & !15;
            let mut e = 0;
            while e < k16 {
                let mut xv = [_mm512_setzero_ps(); T];
                for j in 0..T {
                    xv[j] = _mm512_loadu_ps(x.add(j * k + e));
                }
                for i in 0..R {
                    let wv = load::<DT>(w[i].add(e * es));
                    for j in 0..T {
                        acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
                    }
                }
                e += 16;
            }
            if e < k {
                let m: __mmask16 = ((1u32 << (k - e)) - 1) as u16;
                let mut xv = [_mm512_setzero_ps(); T];
                for j in 0..T {
                    xv[j] = _mm512_maskz_loadu_ps(m, x.add(j * k + e));
                }
                for i in 0..R {
                    let wv = load_mask::<DT>(w[i].add(e * es), m);
                    for j in 0..T {
                        acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
                    }
                }
            }
            let z = _mm512_setzero_ps();
            for j in 0..T {
                let row = |i: usize| acc.get(i).map_or(z, |a| a[j]);
                let v = hsum4(row(0), row(1), row(2), row(3));
                _mm_storeu_ps(out[j].as_mut_ptr(), v);
            }
        }
    }

    /// Converts `k` weights at `src` to f32 at `dst`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    pub(super) unsafe fn widen<const DT: u8>(src: *const u8, k: usize, dst: *mut f32) {
        let es = elem_size(DT);
        // SAFETY: caller guarantees k elements at src and k floats at dst.
        unsafe {
            let mut e = 0;
            while e + 16 <= k {
                _mm512_storeu_ps(dst.add(e), load::<DT>(src.add(e * es)));
                e += 16;
            }
            if e < k {
                let m: __mmask16 = ((1u32 << (k - e)) - 1) as u16;
                _mm512_mask_storeu_ps(dst.add(e), m, load_mask::<DT>(src.add(e * es), m));
            }
        }
    }
}
