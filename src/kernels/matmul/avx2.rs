//! AVX2 + FMA + F16C tile kernels ([`super::tiles`]): 8-lane accumulators,
//! up to 4 weight rows × 3 tokens (12 ymm accumulators, 7 loads per 12
//! FMAs), and for steps of 4 to 9 tokens 2 rows × up to 7 tokens
//! (`tiles::pair_tiles`; F16 steps of 8 and 9 tokens one row × all of
//! them), weights read in their stored dtype (F16 widened with `VCVTPH2PS`,
//! BF16 zero-extended and shifted, 128-bit loads); the K tail is copied into
//! zero-padded 8-lane buffers and multiply-added like the rest. The kernels
//! are [`super::tiles::simd`]'s, at `__m256`, with this level's prefetch
//! and its F16 4×3 steps written out in assembly.

use super::tiles::simd::tiles_level;

/// The AVX2 level's tiles.
pub(crate) struct Avx2;

/// Half the bytes of a widened row tile, and the conversion costs less
/// than the traffic: F16 GEMMs of the 1B-shaped layers at S = 128 on one
/// Zen 3 core (`benches/probes/fgemm_bench`, three interleaved runs) went
/// from 55/53/59 GFLOP/s widened to 69/68/66 converted in registers
/// (QKV 3072×2048, gate+up 16384×2048, down 2048×8192; the down
/// projection, too long to widen, was at 41 before the F16 full tile was
/// written out in assembly, `x86::f16_steps_4x3`).
const WIDEN_F16: bool = false;

/// Measured when the single-token product read four adjacent rows at a
/// time (this was then the next tile): on the 2-vCPU AMD EPYC (Zen 3)
/// development VM a SmolLM2-135M F16 decode step at 2 threads
/// (`benches/probes/op_profile MODEL 32 2`, two runs each, ms) went
/// 19.0/17.4 -> 15.3/15.1 with 4 rows, 16.0/15.4 with 8, 16.0/15.6 with 16;
/// F32 24.8/24.2 -> 21.8/24.9. Since the product reads runs of four rows
/// ([`super::gemv`]), four rows on is the row the next run reads at this
/// position; 0, 4, 8, 16 and 32 rows then measured the same within the
/// host's noise. Several-token products prefetch too at this level (the
/// first token tile of each row tile, `tiles::columns`).
const PREFETCH_ROWS: usize = 4;

tiles_level!(Avx2, std::arch::x86_64::__m256, "avx2,fma,f16c", widen_f16: WIDEN_F16, prefetch_rows: PREFETCH_ROWS, tokens: [3, 2], pair_tokens: [7, 6, 5, 4], row_tokens: [9, 8]);

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::super::tiles::simd::{one, TileVec};
    use super::super::tiles::{elem_size, Tile, F16, F32, RT};
    use std::arch::x86_64::*;

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

    impl TileVec for __m256 {
        const REGS: usize = 16;

        #[inline(always)]
        unsafe fn load_w<const DT: u8>(p: *const u8) -> Self {
            // SAFETY: caller guarantees 8 readable elements at p and the
            // level's features.
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

        /// Copied into a zero-padded buffer.
        #[inline(always)]
        unsafe fn load_w_part<const DT: u8>(p: *const u8, n: usize) -> Self {
            let mut b = [0f32; 8];
            for (q, v) in b.iter_mut().enumerate().take(n) {
                // SAFETY: caller guarantees n readable elements at p.
                *v = unsafe { one::<DT>(p.add(q * elem_size(DT))) };
            }
            // SAFETY: 8 floats; the level's features are enabled.
            unsafe { _mm256_loadu_ps(b.as_ptr()) }
        }

        #[inline(always)]
        unsafe fn hsum4(a: Self, b: Self, c: Self, d: Self) -> __m128 {
            // SAFETY: the level's features are enabled (trait contract).
            unsafe { hsum4(a, b, c, d) }
        }

        /// The F16 4×3 tile's steps, in assembly (`f16_steps_4x3`).
        #[inline(always)]
        unsafe fn own_steps<const DT: u8, const R: usize, const T: usize>(
            op: &Tile<'_>,
            kf: usize,
            acc: &mut [[Self; T]; R],
        ) -> usize {
            if DT == F16 && R == 4 && T == 3 && kf > 0 {
                // SAFETY: R = 4, T = 3: the same array type; the rest is
                // the caller's guarantee (the trait method's contract).
                unsafe {
                    let a = &mut *acc.as_mut_ptr().cast::<[[__m256; 3]; 4]>();
                    f16_steps_4x3(op.x, op.k, op.w, op.pf, kf, a);
                }
                kf
            } else {
                0
            }
        }
    }

    /// The full-tile steps of `tiles::simd::tile` for F16 weights converted in
    /// registers: elements `0..n8` (`n8 > 0`, a multiple of 8), each
    /// accumulator updated by the same fused multiply-adds in the same
    /// order as the intrinsics loop. Written out because LLVM, given the
    /// 12 accumulators, 3 activation vectors and the converted weights,
    /// spilled one accumulator to the stack, and the store-load on every
    /// step held the loop to about 11 cycles. With `pf > 0` every step also
    /// prefetches `pf` bytes past each row's position (`Tile::pf`).
    ///
    /// # Safety
    /// As `tiles::simd::tile` with `R = 4`, `T = 3`, `DT = F16`, rows of `stride`
    /// floats in `x`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16_steps_4x3(
        x: *const f32,
        stride: usize,
        w: &[*const u8; RT],
        pf: usize,
        n8: usize,
        acc: &mut [[__m256; 3]; 4],
    ) {
        let [[mut a00, mut a01, mut a02], [mut a10, mut a11, mut a12], [mut a20, mut a21, mut a22], [mut a30, mut a31, mut a32]] =
            *acc;
        // The loop, with `$prefetch` lines (and their operands) at the top
        // of every step: once plain, once prefetching.
        macro_rules! steps {
            ($($prefetch:literal,)* ; $($operands:tt)*) => {
                std::arch::asm!(
                    "2:",
                    $($prefetch,)*
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
                    $($operands)*
                    a00 = inout(ymm_reg) a00, a01 = inout(ymm_reg) a01, a02 = inout(ymm_reg) a02,
                    a10 = inout(ymm_reg) a10, a11 = inout(ymm_reg) a11, a12 = inout(ymm_reg) a12,
                    a20 = inout(ymm_reg) a20, a21 = inout(ymm_reg) a21, a22 = inout(ymm_reg) a22,
                    a30 = inout(ymm_reg) a30, a31 = inout(ymm_reg) a31, a32 = inout(ymm_reg) a32,
                    out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                    options(nostack, readonly),
                )
            };
        }
        // SAFETY: the caller guarantees 3 rows of n8 floats at x (stride
        // `stride`) and n8 halves at each w[i]; the loop reads only those
        // (a prefetch never faults).
        unsafe {
            if pf == 0 {
                steps!(;);
            } else {
                steps!(
                    "lea {q}, [{pf} + 2*{e}]",
                    "prefetcht0 byte ptr [{w0} + {q}]",
                    "prefetcht0 byte ptr [{w1} + {q}]",
                    "prefetcht0 byte ptr [{w2} + {q}]",
                    "prefetcht0 byte ptr [{w3} + {q}]",
                    ;
                    pf = in(reg) pf,
                    q = out(reg) _,
                );
            }
        }
        *acc = [
            [a00, a01, a02],
            [a10, a11, a12],
            [a20, a21, a22],
            [a30, a31, a32],
        ];
    }
}
