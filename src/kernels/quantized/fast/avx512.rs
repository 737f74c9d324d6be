//! AVX-512 VNNI kernels of the fast path: an outer-product formulation
//! with `vpdpbusd` for S>1 (prefill), and a small-S kernel with 256-bit
//! `vpdpbusd` that computes every (row, token) with the same arithmetic.
//!
//! * Activations of 16 tokens are packed per 32-element block
//!   ([`PackedBlock`]): for each group `j` of 4 elements, one 64-byte vector
//!   holding those 4 quants of all 16 tokens (lane `t` = token `t`), stored
//!   offset by +128 as unsigned bytes (`q ^ 0x80`); the same again for the
//!   remainders `qr`.
//! * Weight rows are decoded once per work chunk into [`WBlock`]s: 32 signed
//!   quants in element order (Q8_0 as stored, Q4_0 `q - 8`, Q4_1 `q`), the
//!   scale, the Q4_1 minimum, and `corr = -128 · Σ quants`.
//! * `vpdpbusd(acc, acts_j, broadcast(w[4j..4j+4]))` then adds, in lane `t`,
//!   `Σ (q_t + 128) · w` over 4 elements; starting the accumulator at `corr`
//!   makes the lane exactly `Σ q_t · w` over the block. One instruction does
//!   16 tokens x 4 elements; the quants and the remainders go into two
//!   accumulators that meet as `256·Σ q·w + Σ r·w`, and the f32 work
//!   (convert, scale, fmadd) is paid once per block for 16 tokens.
//! * For small S ([`dot_rows`]), the weights are the unsigned operand
//!   ([`Block::load_u`]: Q8_0 offset by +128, Q4 nibbles as stored); each
//!   block's total over the vector is reduced for 4 rows at once into the
//!   lanes of one register, and the offset is taken back off in integers
//!   (`OFF · isum`). Per (row, token) this is the packed kernel's arithmetic
//!   exactly: the exact block integer, then `fma(f32(i), d_a·d_w, f)` and
//!   the Q4_1 term `fma(m, s, f)`, blocks in order. A token's outputs are
//!   therefore the same bits whether it is decoded alone or in a prefill
//!   batch (batch invariance, see `quantized::invariance`); so is the
//!   SwiGLU epilogue ([`swiglu_slice`] and [`swiglu`] share one formula).

use super::avx2::{Block, BQ4_0, BQ4_1, BQ8_0};
use super::{Q8Act, QK, RES_SHIFT};
use crate::ir::DType;
use std::arch::x86_64::*;

/// [`RES_SHIFT`] as the `u32` shift count of `_mm512_slli_epi32`.
const RES_SHIFT_U: u32 = RES_SHIFT as u32;

/// Tokens per packed group (one i32 lane each in a 512-bit register).
pub(super) const TG: usize = 16;
/// Weight rows per kernel call.
pub(super) const R: usize = 8;

/// One 32-element block of 16 tokens' quantized activations (see the
/// module docs); padding tokens are zero (`qs` = 0x80, `d` = `s` = 0).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub struct PackedBlock {
    qs: [[u8; 64]; 8],
    qr: [[u8; 64]; 8],
    d: [f32; TG],
    s: [f32; TG],
}

impl Default for PackedBlock {
    fn default() -> Self {
        PackedBlock {
            qs: [[0x80; 64]; 8],
            qr: [[0x80; 64]; 8],
            d: [0.0; TG],
            s: [0.0; TG],
        }
    }
}

/// Packs up to 16 tokens' quantized rows (`acts[t]`, `nb` blocks each) into
/// `out` (`nb` blocks).
pub(super) fn pack(acts: &[&[Q8Act]], nb: usize, out: &mut [PackedBlock]) {
    assert!(acts.len() <= TG && out.len() == nb);
    for (b, o) in out.iter_mut().enumerate() {
        for t in 0..TG {
            match acts.get(t) {
                Some(a) => {
                    let ab = &a[b];
                    for j in 0..QK / 4 {
                        for i in 0..4 {
                            o.qs[j][4 * t + i] = ab.qs[4 * j + i] as u8 ^ 0x80;
                            o.qr[j][4 * t + i] = ab.qr[4 * j + i] as u8 ^ 0x80;
                        }
                    }
                    o.d[t] = ab.d;
                    o.s[t] = ab.s;
                }
                None => {
                    for j in 0..QK / 4 {
                        o.qs[j][4 * t..4 * t + 4].fill(0x80);
                        o.qr[j][4 * t..4 * t + 4].fill(0x80);
                    }
                    o.d[t] = 0.0;
                    o.s[t] = 0.0;
                }
            }
        }
    }
}

/// One decoded weight block (see the module docs).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(16))]
pub struct WBlock {
    qs: [i8; 32],
    d: f32,
    m: f32,
    corr: i32,
}

/// Decodes the rows of `w` (`row_bytes` each) into `out` (`nb` blocks per
/// row, row-major); rows of `out` past the end of `w` are zeroed.
///
/// # Safety
/// The CPU must support the [`Isa::Avx512Vnni`](crate::kernels::Isa::Avx512Vnni) level; `dtype` is Q8_0/Q4_0/Q4_1.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn decode(dtype: DType, w: &[u8], row_bytes: usize, out: &mut [WBlock]) {
    match dtype {
        DType::Q8_0 => decode_t::<BQ8_0>(w, row_bytes, out),
        DType::Q4_0 => decode_t::<BQ4_0>(w, row_bytes, out),
        DType::Q4_1 => decode_t::<BQ4_1>(w, row_bytes, out),
        _ => unreachable!("checked by supports()"),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn decode_t<B: Block>(w: &[u8], row_bytes: usize, out: &mut [WBlock]) {
    let nb = row_bytes / B::BYTES;
    assert!(nb * B::BYTES == row_bytes && nb > 0);
    let nr = w.len() / row_bytes;
    assert!(nr * row_bytes == w.len() && out.len() >= nr * nb && out.len().is_multiple_of(nb));
    let ones = _mm256_set1_epi8(1);
    for (blk, o) in w.chunks_exact(B::BYTES).zip(out.iter_mut()) {
        // SAFETY: blk holds one block; avx2 is enabled here.
        let (q, d, m) = unsafe { B::load(blk) };
        // SAFETY: o.qs has 32 bytes; unaligned store.
        unsafe { _mm256_storeu_si256(o.qs.as_mut_ptr() as *mut __m256i, q) };
        let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, q);
        let s = _mm256_hadd_epi32(s, s);
        let s = _mm256_hadd_epi32(s, s);
        o.d = d;
        o.m = if B::HAS_MIN { m } else { 0.0 };
        o.corr = -128 * (_mm256_extract_epi32::<0>(s) + _mm256_extract_epi32::<4>(s));
    }
    out[nr * nb..].fill(WBlock::default());
}

/// `out[r][t] = row_r · token_t` for [`R`] decoded rows (`w`, `R * nb`
/// blocks) and one packed group of 16 tokens (`acts`, `nb` blocks).
/// `min`: add the Q4_1 minimum term `m · s`.
///
/// # Safety
/// The CPU must support the [`Isa::Avx512Vnni`](crate::kernels::Isa::Avx512Vnni) level.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn kern(
    w: &[WBlock],
    nb: usize,
    acts: &[PackedBlock],
    min: bool,
    out: &mut [[f32; TG]; R],
) {
    if min {
        kern_t::<true>(w, nb, acts, out)
    } else {
        kern_t::<false>(w, nb, acts, out)
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn kern_t<const MIN: bool>(
    w: &[WBlock],
    nb: usize,
    acts: &[PackedBlock],
    out: &mut [[f32; TG]; R],
) {
    assert!(w.len() == R * nb && acts.len() == nb);
    let wp = w.as_ptr();
    let mut f = [_mm512_setzero_ps(); R];
    for (b, pb) in acts.iter().enumerate() {
        // Σ w·qs and Σ w·qr per lane, each started at the correction;
        // combined below as 256·Σ w·qs + Σ w·qr (at most 32·128·32639 < 2^31).
        let mut acc = [_mm512_setzero_si512(); R];
        let mut accr = [_mm512_setzero_si512(); R];
        for r in 0..R {
            // SAFETY: r * nb + b < R * nb = w.len().
            let wb = unsafe { &*wp.add(r * nb + b) };
            acc[r] = _mm512_set1_epi32(wb.corr);
            accr[r] = acc[r];
        }
        for j in 0..QK / 4 {
            // SAFETY: qs[j] and qr[j] are 64 bytes, 64-byte aligned
            // (repr(align(64)) and every row a multiple of 64 bytes).
            let (a, ar) = unsafe {
                (
                    _mm512_load_si512(pb.qs[j].as_ptr() as *const __m512i),
                    _mm512_load_si512(pb.qr[j].as_ptr() as *const __m512i),
                )
            };
            for r in 0..R {
                // SAFETY: as above; 4 bytes at 4j < 32 of qs, unaligned read.
                let wq = _mm512_set1_epi32(unsafe {
                    let wb = &*wp.add(r * nb + b);
                    std::ptr::read_unaligned(wb.qs.as_ptr().add(4 * j) as *const i32)
                });
                acc[r] = _mm512_dpbusd_epi32(acc[r], a, wq);
                accr[r] = _mm512_dpbusd_epi32(accr[r], ar, wq);
            }
        }
        // SAFETY: d is 64 bytes, 64-byte aligned.
        let da = unsafe { _mm512_load_ps(pb.d.as_ptr()) };
        for r in 0..R {
            let p = _mm512_add_epi32(_mm512_slli_epi32::<RES_SHIFT_U>(acc[r]), accr[r]);
            // SAFETY: as above.
            let dw = unsafe { (*wp.add(r * nb + b)).d };
            let sc = _mm512_mul_ps(da, _mm512_set1_ps(dw));
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, f[r]);
        }
        if MIN {
            // SAFETY: s is 64 bytes, 64-byte aligned.
            let sv = unsafe { _mm512_load_ps(pb.s.as_ptr()) };
            for r in 0..R {
                // SAFETY: as above.
                let m = unsafe { (*wp.add(r * nb + b)).m };
                f[r] = _mm512_fmadd_ps(_mm512_set1_ps(m), sv, f[r]);
            }
        }
    }
    for r in 0..R {
        // SAFETY: out[r] is 16 f32; unaligned store.
        unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), f[r]) };
    }
}

/// Same contract as the AVX2 `dot_rows` (1..=4 tokens).
///
/// # Safety
/// The CPU must support the [`Isa::Avx512Vnni`](crate::kernels::Isa::Avx512Vnni) level; `dtype` is Q8_0/Q4_0/Q4_1.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn dot_rows(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &[&[Q8Act]],
    out: &mut [f32],
) {
    match dtype {
        DType::Q8_0 => rows::<BQ8_0>(w, row_bytes, acts, out),
        DType::Q4_0 => rows::<BQ4_0>(w, row_bytes, acts, out),
        DType::Q4_1 => rows::<BQ4_1>(w, row_bytes, acts, out),
        _ => unreachable!("checked by supports()"),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn rows<B: Block>(w: &[u8], row_bytes: usize, acts: &[&[Q8Act]], out: &mut [f32]) {
    match acts.len() {
        1 => rows_nt::<B, 1>(w, row_bytes, acts, out),
        2 => rows_nt::<B, 2>(w, row_bytes, acts, out),
        3 => rows_nt::<B, 3>(w, row_bytes, acts, out),
        4 => rows_nt::<B, 4>(w, row_bytes, acts, out),
        _ => unreachable!("tiles have 1..=4 tokens"),
    }
}

/// Rows per small-S kernel call (one f32 lane each).
const SR: usize = 4;

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn rows_nt<B: Block, const NT: usize>(
    w: &[u8],
    row_bytes: usize,
    acts: &[&[Q8Act]],
    out: &mut [f32],
) {
    let nr = w.len() / row_bytes;
    assert!(w.len() == nr * row_bytes && out.len() == nr * NT && acts.len() == NT);
    let nb = row_bytes / B::BYTES;
    assert!(nb * B::BYTES == row_bytes);
    let mut a: [&[Q8Act]; NT] = [&[]; NT];
    for t in 0..NT {
        a[t] = &acts[t][..nb];
    }
    let mut v = [[0f32; SR]; NT];
    for r0 in (0..nr).step_by(SR) {
        // A short last group repeats its last row in the spare lanes (every
        // lane is computed on its own; the spare results are dropped).
        let nv = (nr - r0).min(SR);
        let mut rows: [&[u8]; SR] = [&[]; SR];
        for (i, row) in rows.iter_mut().enumerate() {
            let r = r0 + i.min(nv - 1);
            *row = &w[r * row_bytes..(r + 1) * row_bytes];
        }
        small::<B, NT>(&rows, nb, &a, &mut v);
        for i in 0..nv {
            for t in 0..NT {
                out[(r0 + i) * NT + t] = v[t][i];
            }
        }
    }
}

/// `out[t][i] = row_i · token_t` for [`SR`] weight rows (one f32 lane each)
/// with exactly the arithmetic of the packed kernel ([`kern`]) for each
/// (row, token): per block the exact integer `Σ q·(256 qs + qr)`, then
/// `f = fma(f32(that), d_a·d_w, f)` and, for Q4_1, `f = fma(m, s, f)`, blocks
/// in order. So a token's outputs do not depend on how many tokens share
/// the step (decode and prefill agree bit for bit).
///
/// The weights are `vpdpbusd`'s unsigned operand (`u = q + OFF`); the block
/// total `Σ u·a` of each row is reduced across the vector with the other
/// rows' (`vphaddd`) so that lane `i` holds row `i`'s, and `OFF · isum` is
/// taken back off.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn small<B: Block, const NT: usize>(
    rows: &[&[u8]; SR],
    nb: usize,
    a: &[&[Q8Act]; NT],
    out: &mut [[f32; SR]; NT],
) {
    for row in rows {
        assert!(row.len() == nb * B::BYTES);
    }
    let mut f = [_mm_setzero_ps(); NT];
    for b in 0..nb {
        let at = b * B::BYTES;
        let mut u = [_mm256_setzero_si256(); SR];
        for i in 0..SR {
            // SAFETY: the slice holds one block.
            u[i] = unsafe { B::load_u(&rows[i][at..at + B::BYTES]) };
        }
        // The rows' f16 scales (and Q4_1 minimums) side by side.
        let h =
            |i: usize, o: usize| u16::from_le_bytes([rows[i][at + o], rows[i][at + o + 1]]) as i16;
        let dw = _mm_cvtph_ps(_mm_setr_epi16(
            h(0, 0),
            h(1, 0),
            h(2, 0),
            h(3, 0),
            0,
            0,
            0,
            0,
        ));
        let mw = if B::HAS_MIN {
            _mm_cvtph_ps(_mm_setr_epi16(
                h(0, 2),
                h(1, 2),
                h(2, 2),
                h(3, 2),
                0,
                0,
                0,
                0,
            ))
        } else {
            _mm_setzero_ps()
        };
        for t in 0..NT {
            let ab = &a[t][b];
            // SAFETY: qs and qr have 32 bytes each; unaligned loads.
            let (av, ar) = unsafe {
                (
                    _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i),
                    _mm256_loadu_si256(ab.qr.as_ptr() as *const __m256i),
                )
            };
            let mut p = [_mm256_setzero_si256(); SR];
            for i in 0..SR {
                // 256·Σ u·qs + Σ u·qr per 4 elements (< 2^31 in total).
                let q = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u[i], av);
                p[i] = _mm256_dpbusd_epi32(_mm256_slli_epi32::<RES_SHIFT>(q), u[i], ar);
            }
            let hs =
                _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
            let tot = _mm_add_epi32(
                _mm256_castsi256_si128(hs),
                _mm256_extracti128_si256::<1>(hs),
            );
            let isum = if B::OFF != 0 {
                _mm_sub_epi32(tot, _mm_set1_epi32(B::OFF * ab.isum))
            } else {
                tot
            };
            let sc = _mm_mul_ps(_mm_set1_ps(ab.d), dw);
            f[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(isum), sc, f[t]);
            if B::HAS_MIN {
                f[t] = _mm_fmadd_ps(mw, _mm_set1_ps(ab.s), f[t]);
            }
        }
    }
    for t in 0..NT {
        // SAFETY: out[t] holds SR = 4 f32; unaligned store.
        unsafe { _mm_storeu_ps(out[t].as_mut_ptr(), f[t]) };
    }
}

/// `e^x` for 16 lanes: Cephes' `expf` polynomial on `x - n ln 2`, scaled by
/// `2^n` with `vscalefps`; within a few ulp of libm's `expf` (see the test).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn exp16(x: __m512) -> __m512 {
    let x = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(-104.0)),
        _mm512_set1_ps(88.72),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let e = _mm512_fmadd_ps(
        _mm512_mul_ps(p, r),
        r,
        _mm512_add_ps(r, _mm512_set1_ps(1.0)),
    );
    _mm512_scalef_ps(e, n)
}

/// `silu(g) * u` lane-wise (`silu(v) = v / (1 + e^-v)`): the one SwiGLU of
/// every kernel at this level, so that a row's result does not depend on
/// which kernel ran it.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn swiglu16(gv: __m512, uv: __m512) -> __m512 {
    let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    let sv = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0), e));
    _mm512_mul_ps(sv, uv)
}

/// `g[r] = silu(g[r]) * u[r]` lane-wise.
///
/// # Safety
/// The CPU must support the [`Isa::Avx512Vnni`](crate::kernels::Isa::Avx512Vnni) level.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn swiglu(g: &mut [[f32; TG]; R], u: &[[f32; TG]; R]) {
    for r in 0..R {
        // SAFETY: 16 f32 each; unaligned loads/stores.
        unsafe {
            let gv = _mm512_loadu_ps(g[r].as_ptr());
            let uv = _mm512_loadu_ps(u[r].as_ptr());
            _mm512_storeu_ps(g[r].as_mut_ptr(), swiglu16(gv, uv));
        }
    }
}

/// `g[i] = silu(g[i]) * u[i]` for slices of any length (same arithmetic as
/// [`swiglu`]).
///
/// # Safety
/// The CPU must support the [`Isa::Avx512Vnni`](crate::kernels::Isa::Avx512Vnni) level.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn swiglu_slice(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len());
    for (gc, uc) in g.chunks_mut(TG).zip(u.chunks(TG)) {
        let m: __mmask16 = ((1u32 << gc.len()) - 1) as __mmask16;
        // SAFETY: masked loads and stores touch only the chunk's elements.
        unsafe {
            let gv = _mm512_maskz_loadu_ps(m, gc.as_ptr());
            let uv = _mm512_maskz_loadu_ps(m, uc.as_ptr());
            _mm512_mask_storeu_ps(gc.as_mut_ptr(), m, swiglu16(gv, uv));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector SwiGLU against `silu_f32` (libm `expf`) over a wide range,
    /// including saturation at both ends (below -88 libm gives -0, this
    /// a tiny negative number).
    #[test]
    fn swiglu_matches_libm() {
        if !crate::kernels::Isa::detect().vnni() {
            return;
        }
        let mut worst = 0f32;
        let mut v = -120.0f32;
        while v < 100.0 {
            let mut g = [[0f32; TG]; R];
            let mut u = [[0f32; TG]; R];
            for r in 0..R {
                for t in 0..TG {
                    g[r][t] = v + (r * TG + t) as f32 * 1.37e-3;
                    u[r][t] = 1.0 - 0.01 * t as f32;
                }
            }
            let (g0, u0) = (g, u);
            // SAFETY: the VNNI level was detected above.
            unsafe { swiglu(&mut g, &u) };
            for r in 0..R {
                for t in 0..TG {
                    let want = crate::kernels::elementwise::silu_f32(g0[r][t]) * u0[r][t];
                    let err = (g[r][t] - want).abs();
                    let rel = err / want.abs().max(f32::MIN_POSITIVE);
                    assert!(
                        err <= 4e-7 * want.abs() || err < 1e-30,
                        "{}: {} vs {want}",
                        g0[r][t],
                        g[r][t]
                    );
                    if want.abs() > 1e-30 {
                        worst = worst.max(rel);
                    }
                }
            }
            v += 0.173;
        }
        eprintln!("swiglu worst relative error {worst:e}");
    }
}
