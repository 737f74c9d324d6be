//! AVX2 + FMA + F16C tile kernels ([`super::tiles`]): 8-lane accumulators,
//! up to 4 weight rows × 3 tokens (12 ymm accumulators, 7 loads per 12
//! FMAs), weights read in their stored dtype (F16 widened with `VCVTPH2PS`,
//! BF16 zero-extended and shifted, 128-bit loads); the K tail is copied into
//! zero-padded 8-lane buffers and multiply-added like the rest.

// Register tiles are indexed explicitly on purpose.
#![allow(clippy::needless_range_loop)]

use super::tiles::{Sums, Tiles, BF16, F16, F32, RT};

/// The AVX2 level's tiles.
pub(crate) struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Tiles for Avx2 {
    const TT: usize = 3;

    /// Half the bytes of a widened row tile, and the conversion costs less
    /// than the traffic: F16 GEMMs of the 1B-shaped layers at S = 128 on one
    /// Zen 3 core (`benches/probes/fgemm_bench`, three interleaved runs) went
    /// from 55/53/59 GFLOP/s widened to 69/68/66 converted in registers
    /// (QKV 3072×2048, gate+up 16384×2048, down 2048×8192; the down
    /// projection, too long to widen, was at 41 before [`x86::tile`]'s
    /// F16 full tile was written out in assembly).
    const WIDEN_F16: bool = false;

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
impl Tiles for Avx2 {
    const TT: usize = 3;
    unsafe fn tile(
        _: u8,
        _: usize,
        _: usize,
        _: *const f32,
        _: usize,
        _: &[*const u8; RT],
        _: &mut Sums,
    ) {
        unreachable!("no AVX2 on this architecture");
    }
    unsafe fn widen(_: u8, _: *const u8, _: usize, _: *mut f32) {
        unreachable!("no AVX2 on this architecture");
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::super::tiles::{elem_size, Sums, F16, F32, RT};
    use std::arch::x86_64::*;

    /// 8 weights at `p` as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn load<const DT: u8>(p: *const u8) -> __m256 {
        // SAFETY: caller guarantees 8 readable elements at p.
        unsafe {
            match DT {
                F32 => _mm256_loadu_ps(p.cast()),
                F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128(p.cast()),
                ))),
            }
        }
    }

    /// One weight at `p` as f32.
    #[inline]
    unsafe fn one<const DT: u8>(p: *const u8) -> f32 {
        // SAFETY: caller guarantees one readable element at p.
        unsafe {
            match DT {
                F32 => f32::from_le_bytes(p.cast::<[u8; 4]>().read_unaligned()),
                F16 => crate::kernels::f16_to_f32(u16::from_le_bytes(
                    p.cast::<[u8; 2]>().read_unaligned(),
                )),
                _ => crate::kernels::bf16_to_f32(u16::from_le_bytes(
                    p.cast::<[u8; 2]>().read_unaligned(),
                )),
            }
        }
    }

    /// The `n < 8` weights at `p` as f32, zeros in the other lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_part<const DT: u8>(p: *const u8, n: usize) -> __m256 {
        let mut b = [0f32; 8];
        for (q, v) in b.iter_mut().enumerate().take(n) {
            // SAFETY: caller guarantees n readable elements at p.
            *v = unsafe { one::<DT>(p.add(q * elem_size(DT))) };
        }
        // SAFETY: 8 floats.
        unsafe { _mm256_loadu_ps(b.as_ptr()) }
    }

    /// `[sum(a), sum(b), sum(c), sum(d)]`, each by the same tree: pairs of
    /// neighbours twice (`hadd`), then the two 128-bit halves.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn hsum4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
        let t0 = _mm256_hadd_ps(a, b);
        let t1 = _mm256_hadd_ps(c, d);
        let t2 = _mm256_hadd_ps(t0, t1);
        _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps::<1>(t2))
    }

    /// The sum of `a`'s lanes by [`hsum4`]'s tree.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn hsum(a: __m256) -> f32 {
        let z = _mm256_setzero_ps();
        _mm_cvtss_f32(hsum4(a, z, z, z))
    }

    /// [`tile`] for `r` rows.
    ///
    /// # Safety
    /// As [`super::Tiles::tile`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
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
    #[target_feature(enable = "avx2,fma,f16c")]
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
                3 => tile::<DT, R, 3>(x, k, w, out),
                2 => tile::<DT, R, 2>(x, k, w, out),
                _ => tile::<DT, R, 1>(x, k, w, out),
            }
        }
    }

    /// Rows ahead of the row being multiplied whose weights [`tile`]
    /// prefetches in a single-token product. Measured when that product
    /// read four adjacent rows at a time (this was then the next tile): on
    /// the 2-vCPU AMD EPYC (Zen 3) development VM a SmolLM2-135M F16 decode
    /// step at 2 threads (`benches/probes/op_profile MODEL 32 2`, two runs each,
    /// ms) went 19.0/17.4 -> 15.3/15.1 with 4 rows, 16.0/15.4 with 8,
    /// 16.0/15.6 with 16; F32 24.8/24.2 -> 21.8/24.9. Since the product
    /// reads runs of four rows ([`super::super::gemv`]), four rows on is the
    /// row the next run reads at this position; 0, 4, 8, 16 and 32 rows
    /// then measured the same within the host's noise.
    const PREFETCH_ROWS: usize = 4;

    /// `out[j][i] = dot(x[j], w[i])` for `j < T`, `i < R` (other lanes 0).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
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
            let mut acc = [[_mm256_setzero_ps(); T]; R];
            let k8 = k & !7;
            let mut e = 0;
            let pf = PREFETCH_ROWS * k * es;
            if DT == F16 && R == 4 && T == 3 && k8 > 0 {
                // SAFETY: R = 4, T = 3: the same array type.
                let a = &mut *acc.as_mut_ptr().cast::<[[__m256; 3]; 4]>();
                f16_steps_4x3(x, k, w, k8, a);
                e = k8;
            }
            while e < k8 {
                // Single-token products only: several tokens read the
                // tile from cache (or a widened copy).
                if T == 1 && (e * es).is_multiple_of(64) {
                    for i in 0..R {
                        // A prefetch past the weights never faults.
                        _mm_prefetch::<_MM_HINT_T0>(w[i].wrapping_add(e * es + pf) as *const i8);
                    }
                }
                let mut xv = [_mm256_setzero_ps(); T];
                for j in 0..T {
                    xv[j] = _mm256_loadu_ps(x.add(j * k + e));
                }
                for i in 0..R {
                    let wv = load::<DT>(w[i].add(e * es));
                    for j in 0..T {
                        acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
                    }
                }
                e += 8;
            }
            if e < k {
                let n = k - e;
                let mut xv = [_mm256_setzero_ps(); T];
                for j in 0..T {
                    xv[j] = load_part::<F32>(x.add(j * k + e).cast(), n);
                }
                for i in 0..R {
                    let wv = load_part::<DT>(w[i].add(e * es), n);
                    for j in 0..T {
                        acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
                    }
                }
            }
            let z = _mm256_setzero_ps();
            for j in 0..T {
                let row = |i: usize| acc.get(i).map_or(z, |a| a[j]);
                let v = hsum4(row(0), row(1), row(2), row(3));
                _mm_storeu_ps(out[j].as_mut_ptr(), v);
            }
        }
    }

    /// The full-tile steps of [`tile`] for F16 weights converted in
    /// registers: elements `0..n8` (`n8 > 0`, a multiple of 8), each
    /// accumulator updated by the same fused multiply-adds in the same
    /// order as the intrinsics loop. Written out because LLVM, given the
    /// 12 accumulators, 3 activation vectors and the converted weights,
    /// spilled one accumulator to the stack, and the store-load on every
    /// step held the loop to about 11 cycles.
    ///
    /// # Safety
    /// As [`tile`] with `R = 4`, `T = 3`, `DT = F16`, rows of `stride`
    /// floats in `x`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16_steps_4x3(
        x: *const f32,
        stride: usize,
        w: &[*const u8; RT],
        n8: usize,
        acc: &mut [[__m256; 3]; 4],
    ) {
        let [[mut a00, mut a01, mut a02], [mut a10, mut a11, mut a12], [mut a20, mut a21, mut a22], [mut a30, mut a31, mut a32]] =
            *acc;
        // SAFETY: the caller guarantees 3 rows of n8 floats at x (stride
        // `stride`) and n8 halves at each w[i]; the loop reads only those.
        unsafe {
            std::arch::asm!(
                "2:",
                "vmovups ymm12, ymmword ptr [{x0} + 4*{e}]",
                "vmovups ymm13, ymmword ptr [{x1} + 4*{e}]",
                "vmovups ymm14, ymmword ptr [{x2} + 4*{e}]",
                "vcvtph2ps ymm15, xmmword ptr [{w0} + 2*{e}]",
                "vfmadd231ps {a00}, ymm15, ymm12",
                "vfmadd231ps {a01}, ymm15, ymm13",
                "vfmadd231ps {a02}, ymm15, ymm14",
                "vcvtph2ps ymm15, xmmword ptr [{w1} + 2*{e}]",
                "vfmadd231ps {a10}, ymm15, ymm12",
                "vfmadd231ps {a11}, ymm15, ymm13",
                "vfmadd231ps {a12}, ymm15, ymm14",
                "vcvtph2ps ymm15, xmmword ptr [{w2} + 2*{e}]",
                "vfmadd231ps {a20}, ymm15, ymm12",
                "vfmadd231ps {a21}, ymm15, ymm13",
                "vfmadd231ps {a22}, ymm15, ymm14",
                "vcvtph2ps ymm15, xmmword ptr [{w3} + 2*{e}]",
                "vfmadd231ps {a30}, ymm15, ymm12",
                "vfmadd231ps {a31}, ymm15, ymm13",
                "vfmadd231ps {a32}, ymm15, ymm14",
                "add {e}, 8",
                "cmp {e}, {n8}",
                "jb 2b",
                x0 = in(reg) x,
                x1 = in(reg) x.add(stride),
                x2 = in(reg) x.add(2 * stride),
                w0 = in(reg) w[0],
                w1 = in(reg) w[1],
                w2 = in(reg) w[2],
                w3 = in(reg) w[3],
                e = inout(reg) 0usize => _,
                n8 = in(reg) n8,
                a00 = inout(ymm_reg) a00,
                a01 = inout(ymm_reg) a01,
                a02 = inout(ymm_reg) a02,
                a10 = inout(ymm_reg) a10,
                a11 = inout(ymm_reg) a11,
                a12 = inout(ymm_reg) a12,
                a20 = inout(ymm_reg) a20,
                a21 = inout(ymm_reg) a21,
                a22 = inout(ymm_reg) a22,
                a30 = inout(ymm_reg) a30,
                a31 = inout(ymm_reg) a31,
                a32 = inout(ymm_reg) a32,
                out("ymm12") _,
                out("ymm13") _,
                out("ymm14") _,
                out("ymm15") _,
                options(nostack, readonly),
            );
        }
        *acc = [
            [a00, a01, a02],
            [a10, a11, a12],
            [a20, a21, a22],
            [a30, a31, a32],
        ];
    }

    /// Converts `k` weights at `src` to f32 at `dst`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn widen<const DT: u8>(src: *const u8, k: usize, dst: *mut f32) {
        let es = elem_size(DT);
        // SAFETY: caller guarantees k elements at src and k floats at dst.
        unsafe {
            let mut e = 0;
            while e + 8 <= k {
                _mm256_storeu_ps(dst.add(e), load::<DT>(src.add(e * es)));
                e += 8;
            }
            while e < k {
                *dst.add(e) = one::<DT>(src.add(e * es));
                e += 1;
            }
        }
    }
}
