//! AVX-512 tile kernels ([`super::tiles`]): 16-lane accumulators, up to 4
//! weight rows × 6 tokens (24 zmm accumulators, 10 loads per 24 FMAs),
//! weights read in their stored dtype (F16 widened with `VCVTPH2PS`, BF16
//! zero-extended and shifted, 256-bit loads), K tail by masked loads. The
//! kernels are [`super::tiles::simd`]'s, at `__m512`.
//!
//! With several tokens nothing is packed: the only reuse is through the
//! caches (a chunk's weight rows stay in L2 while all token groups pass over
//! them, and a 4-row tile stays in L1 across the token tiles of one group).
//! The earlier AVX2 path copied every 4-row weight tile and packed x per
//! chunk; for F32 weights those copies were a fifth of prefill time (see
//! docs/design/batch-invariance.md, "The float tiles").

use super::tiles::simd::tiles_level;

/// The AVX-512 level's tiles.
pub(crate) struct Avx512;

/// Bytes ahead of each row's position that the single-token product
/// prefetches. With the 256-row blocks ([`super::gemv`]) on the Zen 5 VM
/// (GB/s, SmolLM2's shapes at 1 thread; the 1B shapes of `gemv_bench`
/// without `SHAPES`): no
/// prefetch 31-34 (F16), 1024 bytes 32-33, 2048 bytes 35-38 (1B: 40,
/// without either change 28), 4096 bytes 35 (1B); F32 unchanged (35,
/// 1B 43) and BF16 as F16. At 2 threads F16 31-37 -> 40-46, F32 45-47
/// either way.
const GEMV_PREFETCH: usize = 2048;

/// Several-token products convert F16 weights in registers (once per
/// 6-token tile) and prefetch in their first token tile (any value above
/// 0; the single-token product uses [`GEMV_PREFETCH`]). On the Zen 5 VM
/// (`HEAD=1 DTYPES=f16,f32 ROUNDS=5 fgemm_steps 1 9`, the SmolLM2-135M
/// products of a verification step over DRAM-resident weights), widening
/// each F16 row tile into a buffer first and no prefetch made a step of 2
/// tokens cost 2.3 one-token steps and of 8 tokens 4.7; converting in
/// registers alone 2.3 and 3.0; with the prefetch 1.13 and 1.7 (F32: 1.5
/// and 2.3 -> 1.4 and 1.55). F16 prefill moved with it (`fgemm_bench 2
/// 128`, GFLOP/s): the 1B shapes' QKV 315 -> 367, gate+up 297 -> 355, down
/// 325 -> 295, SmolLM2's FFN 301 -> 322 and head 239 -> 285.
const PREFETCH_ROWS: usize = 4;

tiles_level!(Avx512, std::arch::x86_64::__m512, "avx512f,avx512bw,avx512vl,fma,f16c", widen_f16: false, prefetch_rows: PREFETCH_ROWS, tokens: [6, 5, 4, 3, 2], gemv_prefetch: GEMV_PREFETCH);

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::tiles::simd::TileVec;
    use super::super::tiles::{F16, F32};
    use std::arch::x86_64::*;

    impl TileVec for __m512 {
        const REGS: usize = 32;

        #[inline(always)]
        unsafe fn load_w<const DT: u8>(p: *const u8) -> Self {
            // SAFETY: caller guarantees 16 readable elements at p and the
            // level's features.
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

        /// Masked loads: the lanes past `n` are not read.
        #[inline(always)]
        unsafe fn load_w_part<const DT: u8>(p: *const u8, n: usize) -> Self {
            let m: __mmask16 = ((1u32 << n) - 1) as u16;
            // SAFETY: caller guarantees the n lanes set in m are readable.
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

        /// Each sum by the same tree: the two 256-bit halves added lane by
        /// lane, then pairs of neighbours twice (`hadd`), then the two
        /// 128-bit halves.
        #[inline(always)]
        unsafe fn hsum4(a: Self, b: Self, c: Self, d: Self) -> __m128 {
            #[inline(always)]
            unsafe fn fold(v: __m512) -> __m256 {
                // SAFETY: as below.
                unsafe {
                    let hi = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v));
                    _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(hi))
                }
            }
            // SAFETY: the level's features are enabled (trait contract).
            unsafe {
                let t0 = _mm256_hadd_ps(fold(a), fold(b));
                let t1 = _mm256_hadd_ps(fold(c), fold(d));
                let t2 = _mm256_hadd_ps(t0, t1);
                _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps::<1>(t2))
            }
        }
    }
}
