//! Widening a run of cached keys or values to f32, for every cache type
//! ([`KvView`]): the attention kernels read the pool one tile at a time
//! through these into f32 scratch. Every form gives the same values (the
//! conversions are exact, a dequantized quant is one f32 product `q · d`),
//! so a tile's contents do not depend on the instruction set, and the
//! kernels' per-row arithmetic after it is the only thing that does.
//!
//! A run is `dst.len()` consecutive elements of the flat layout from `at`:
//! in the attention kernels, one dim of up to `BS` keys of one block (keys)
//! or whole value rows of one block (values); see [`crate::kernels::kv`].

use crate::kernels::kv::{scale_index, KvView, QuantView, QUANT_GROUP};

/// The portable form.
#[inline(always)]
pub(super) fn widen_portable(src: KvView<'_>, at: usize, dst: &mut [f32]) {
    let n = dst.len();
    match src {
        KvView::F32(s) => dst.copy_from_slice(&s[at..at + n]),
        KvView::F16(s) => {
            for (o, &x) in dst.iter_mut().zip(&s[at..at + n]) {
                *o = x.to_f32();
            }
        }
        KvView::Bf16(s) => {
            for (o, &x) in dst.iter_mut().zip(&s[at..at + n]) {
                *o = x.to_f32();
            }
        }
        KvView::Q8_0(_) | KvView::Q4_0(_) => {
            for (j, o) in dst.iter_mut().enumerate() {
                *o = src.get(at + j);
            }
        }
    }
}

/// How a run of a quantized store meets its scales.
enum Run {
    /// Whole groups of 32 along a value row: one scale per 32 elements.
    Rows,
    /// One dim of consecutive keys: one scale per element, contiguous.
    Keys,
    /// Anything else (the portable loop).
    Other,
}

fn run_kind<Q>(s: &QuantView<'_, Q>, at: usize, n: usize) -> Run {
    if s.run == 1 && at.is_multiple_of(QUANT_GROUP) && n.is_multiple_of(QUANT_GROUP) {
        Run::Rows
    } else if s.run > 1 && at % s.run + n <= s.run && at.is_multiple_of(2) {
        Run::Keys
    } else {
        Run::Other
    }
}

/// The AVX2 form (F16C for f16 and the scales).
///
/// # Safety
/// Inlined only into functions with AVX2, FMA and F16C enabled, which
/// were detected.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn widen_avx2(src: KvView<'_>, at: usize, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = dst.len();
    let n8 = n & !7;
    let dp = dst.as_mut_ptr();
    // SAFETY (every block below): loads read elements at..at+n of the
    // store (or its scales/bytes for them), stores write dst[..n]; both in
    // bounds (slices indexed first); the features are enabled (contract).
    match src {
        KvView::F32(s) => dst.copy_from_slice(&s[at..at + n]),
        KvView::F16(s) => {
            let s = &s[at..at + n];
            unsafe {
                for i in (0..n8).step_by(8) {
                    let h = _mm_loadu_si128(s.as_ptr().add(i).cast());
                    _mm256_storeu_ps(dp.add(i), _mm256_cvtph_ps(h));
                }
            }
            for (o, &x) in dst[n8..].iter_mut().zip(&s[n8..]) {
                *o = x.to_f32();
            }
        }
        KvView::Bf16(s) => {
            let s = &s[at..at + n];
            unsafe {
                for i in (0..n8).step_by(8) {
                    let h = _mm_loadu_si128(s.as_ptr().add(i).cast());
                    let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                    _mm256_storeu_ps(dp.add(i), _mm256_castsi256_ps(w));
                }
            }
            for (o, &x) in dst[n8..].iter_mut().zip(&s[n8..]) {
                *o = x.to_f32();
            }
        }
        KvView::Q8_0(s) => match run_kind(&s, at, n) {
            Run::Rows => {
                let q = &s.q[at..at + n];
                let d = &s.d[at / QUANT_GROUP..(at + n) / QUANT_GROUP];
                for (g, &dg) in d.iter().enumerate() {
                    let dv = _mm256_set1_ps(dg.to_f32());
                    unsafe {
                        for c in 0..QUANT_GROUP / 8 {
                            let i = g * QUANT_GROUP + 8 * c;
                            let b = _mm_loadl_epi64(q.as_ptr().add(i).cast());
                            let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                            _mm256_storeu_ps(dp.add(i), _mm256_mul_ps(f, dv));
                        }
                    }
                }
            }
            Run::Keys => {
                let q = &s.q[at..at + n];
                let s0 = scale_index(s.run, at);
                let d = &s.d[s0..s0 + n];
                unsafe {
                    for i in (0..n8).step_by(8) {
                        let b = _mm_loadl_epi64(q.as_ptr().add(i).cast());
                        let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                        let dv = _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().add(i).cast()));
                        _mm256_storeu_ps(dp.add(i), _mm256_mul_ps(f, dv));
                    }
                }
                for i in n8..n {
                    dst[i] = q[i] as f32 * d[i].to_f32();
                }
            }
            Run::Other => widen_portable(src, at, dst),
        },
        KvView::Q4_0(s) => match run_kind(&s, at, n) {
            Run::Rows => {
                let q = &s.q[at / 2..(at + n) / 2];
                let d = &s.d[at / QUANT_GROUP..(at + n) / QUANT_GROUP];
                for (g, &dg) in d.iter().enumerate() {
                    let dv = _mm256_set1_ps(dg.to_f32());
                    unsafe {
                        // 16 bytes: element 2j in the low nibble of byte j,
                        // 2j + 1 in the high one.
                        let b = _mm_loadu_si128(q.as_ptr().add(g * 16).cast());
                        let m = _mm_set1_epi8(15);
                        let lo = _mm_and_si128(b, m);
                        let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), m);
                        let eight = _mm_set1_epi8(8);
                        let e0 = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight);
                        let e1 = _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), eight);
                        let o = dp.add(g * QUANT_GROUP);
                        for (k, e) in [e0, e1].into_iter().enumerate() {
                            let a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e));
                            let c =
                                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(e)));
                            _mm256_storeu_ps(o.add(16 * k), _mm256_mul_ps(a, dv));
                            _mm256_storeu_ps(o.add(16 * k + 8), _mm256_mul_ps(c, dv));
                        }
                    }
                }
            }
            Run::Keys => {
                let q = &s.q[at / 2..(at + n).div_ceil(2)];
                let s0 = scale_index(s.run, at);
                let d = &s.d[s0..s0 + n];
                unsafe {
                    let m = _mm_set1_epi8(15);
                    let eight = _mm_set1_epi8(8);
                    for i in (0..n8).step_by(8) {
                        // 4 bytes hold elements i..i+8.
                        let w = i32::from_le_bytes([
                            q[i / 2],
                            q[i / 2 + 1],
                            q[i / 2 + 2],
                            q[i / 2 + 3],
                        ]);
                        let b = _mm_cvtsi32_si128(w);
                        let lo = _mm_and_si128(b, m);
                        let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), m);
                        let e = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight);
                        let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e));
                        let dv = _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().add(i).cast()));
                        _mm256_storeu_ps(dp.add(i), _mm256_mul_ps(f, dv));
                    }
                }
                for (i, o) in dst.iter_mut().enumerate().skip(n8) {
                    *o = src.get(at + i);
                }
            }
            Run::Other => widen_portable(src, at, dst),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::kv::{kv_write_rows, CacheType, KvGeom, KvHalf, KvStore};
    use crate::kernels::testutil::Rng;
    use crate::kernels::Isa;

    /// Every run the kernels read (and some they do not), in every type:
    /// the AVX2 form gives the portable form's bits, which are `get`'s.
    #[test]
    fn every_form_widens_alike() {
        let geom = KvGeom {
            n_blocks: 3,
            n_kv_heads: 2,
            head_dim: 64,
            block: 16,
        };
        let mut rng = Rng::new(5);
        let row = geom.n_kv_heads * geom.head_dim;
        let slots: Vec<i32> = (0..geom.capacity() as i32).collect();
        let x: Vec<f32> = rng.vec(slots.len() * row).iter().map(|v| v * 2.0).collect();
        for ty in CacheType::ALL {
            for (half, run) in [(KvHalf::K, geom.block), (KvHalf::V, 1)] {
                let mut c = KvStore::new(ty, geom.elems(), run).unwrap();
                kv_write_rows(&mut c, half, &geom, &slots, &x).unwrap();
                let v = c.view();
                // Key runs (one dim, whole or part of a block), value rows,
                // and odd runs that take the portable loop.
                let runs = [
                    (0, 16),
                    (16 * 5, 16),
                    (16 * 7, 9),
                    (64, 64),
                    (128, 256),
                    (3, 7),
                    (33, 40),
                ];
                for (at, n) in runs {
                    let want: Vec<f32> = (at..at + n).map(|i| v.get(i)).collect();
                    let mut got = vec![f32::NAN; n];
                    widen_portable(v, at, &mut got);
                    assert_eq!(got, want, "portable {ty} {half:?} at {at} n {n}");
                    #[cfg(target_arch = "x86_64")]
                    if Isa::detect().avx2() {
                        #[target_feature(enable = "avx2,fma,f16c")]
                        unsafe fn run(v: KvView<'_>, at: usize, d: &mut [f32]) {
                            // SAFETY: features enabled here, detected by the caller.
                            unsafe { widen_avx2(v, at, d) }
                        }
                        let mut got = vec![f32::NAN; n];
                        // SAFETY: AVX2 (and with it FMA, F16C) detected.
                        unsafe { run(v, at, &mut got) };
                        assert_eq!(got, want, "avx2 {ty} {half:?} at {at} n {n}");
                    }
                }
            }
        }
    }
}
