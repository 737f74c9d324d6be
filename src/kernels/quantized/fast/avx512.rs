//! AVX-512 VNNI kernels of the fast path, both computing every output with
//! the shared arithmetic of `units.rs` (so they agree bit for bit with each
//! other, with the AVX2 kernels and with the scalar reference):
//!
//! * Small S ([`Vnni`]): the unit products of the small-S kernel of
//!   `small.rs` by 256-bit `vpdpbusd` (unsigned quants `q + OFF` times the
//!   signed activation quants and remainders, no `i16` limit, so no sign
//!   juggling); `OFF · isum` taken off after.
//! * Prefill ([`kern`]): an outer product over 16 tokens per 512-bit
//!   register, `vpdpbusd` with broadcast weights. Weight rows are decoded
//!   once per work chunk ([`WUnit8`]: signed quants and `corr = -128 Σ q`
//!   per half), activations packed per group of 4 elements ([`Act16`],
//!   offset by +128); per unit (or half) one convert, scale and `fmadd`
//!   for 16 tokens. (A `vpdpwssd` form over 16-bit weights and
//!   activations, as the AVX2 kernel does with `vpmaddwd`, measured 1.5-1.9x
//!   slower here: twice the weight broadcasts and bigger decoded rows.)

use super::avx2::{decode_rows, DecodedUnit, Fmt, PackedAct};
use super::small::{self, UnitDot};
use super::{Q8Act, RES_SHIFT};
use std::arch::x86_64::*;

/// Tokens per packed group (one i32 lane each in a 512-bit register).
pub(super) const TG: usize = 16;
/// Weight rows per packed kernel call.
pub(super) const R: usize = 8;

/// The AVX-512 VNNI unit products of the small-S kernel (`small.rs`):
/// 256-bit `vpdpbusd` of the unsigned quants `q + OFF` with the signed
/// activation quants and remainders (no `i16` limit, so no sign juggling).
pub(super) struct Vnni;

impl UnitDot for Vnni {
    #[inline(always)]
    fn signed<F: Fmt>() -> bool {
        false
    }
    #[inline(always)]
    unsafe fn operands<F: Fmt>(v: __m256i) -> [__m256i; 2] {
        [v, v]
    }
    #[inline(always)]
    unsafe fn prod<F: Fmt>(w: [__m256i; 2], av: __m256i, ar: __m256i) -> __m256i {
        // SAFETY: the VNNI level (the caller's contract).
        unsafe {
            // 256·Σ u·qs + Σ u·qr per 4 elements (< 2^31 in total).
            let q = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[0], av);
            _mm256_dpbusd_epi32(_mm256_slli_epi32::<RES_SHIFT>(q), w[0], ar)
        }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn rows<F: Fmt>(w: &[u8], row_bytes: usize, acts: &[&[Q8Act]], out: &mut [f32]) {
        // SAFETY: the level's features are enabled here.
        unsafe { small::rows::<F, Self>(w, row_bytes, acts, out) }
    }
}

/// [`RES_SHIFT`] as the `u32` shift count of `_mm512_slli_epi32`.
const RES_SHIFT_U: u32 = RES_SHIFT as u32;

/// One decoded weight unit of the packed kernel: the signed quants in
/// element order, the scale of each half (equal unless the format has a
/// scale per half), the additive term, and `corr[h] = -128 · Σ q` over
/// each half.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(16))]
pub struct WUnit8 {
    q: [i8; 32],
    d: [f32; 2],
    m: f32,
    corr: [i32; 2],
}

impl DecodedUnit for WUnit8 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn set<F: Fmt>(&mut self, v: __m256i, dlo: f32, dhi: f32, m: f32) {
        let q = _mm256_sub_epi8(v, _mm256_set1_epi8(F::OFF as u8 as i8));
        // SAFETY: q has 32 bytes; unaligned store.
        unsafe { _mm256_storeu_si256(self.q.as_mut_ptr() as *mut __m256i, q) };
        // Σ q per half: lanes 0..4 hold elements 0..16.
        let s = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_set1_epi8(1), q),
            _mm256_set1_epi16(1),
        );
        let h = _mm256_hadd_epi32(s, s);
        let h = _mm256_hadd_epi32(h, h);
        self.corr = [
            -128 * _mm256_extract_epi32::<0>(h),
            -128 * _mm256_extract_epi32::<4>(h),
        ];
        self.d = [dlo, if F::SPLIT { dhi } else { dlo }];
        self.m = if F::HAS_MIN { m } else { 0.0 };
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode_rows<F: Fmt>(w: &[u8], row_bytes: usize, out: &mut [Self]) {
        // SAFETY: the level's features are enabled here.
        unsafe { decode_rows::<F, Self>(w, row_bytes, out) }
    }
}

/// One 32-element block of 16 tokens' quantized activations: for each
/// group `j` of 4 elements, one 64-byte vector holding those 4 quants of all
/// 16 tokens (lane `t` = token `t`), offset by +128 as unsigned bytes
/// (`q ^ 0x80`); the same for the remainders; the tokens' scales and sums.
/// Missing tokens are zero (`qs` = 0x80, `d` = `s` = 0).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub struct Act16 {
    qs: [[u8; 64]; 8],
    qr: [[u8; 64]; 8],
    d: [f32; TG],
    s: [f32; TG],
}

impl Default for Act16 {
    fn default() -> Self {
        Act16 {
            qs: [[0x80; 64]; 8],
            qr: [[0x80; 64]; 8],
            d: [0.0; TG],
            s: [0.0; TG],
        }
    }
}

impl PackedAct for Act16 {
    const TG: usize = TG;
    #[inline]
    fn put(&mut self, t: usize, ab: &Q8Act) {
        for j in 0..8 {
            for i in 0..4 {
                self.qs[j][4 * t + i] = ab.qs[4 * j + i] as u8 ^ 0x80;
                self.qr[j][4 * t + i] = ab.qr[4 * j + i] as u8 ^ 0x80;
            }
        }
        self.d[t] = ab.d;
        self.s[t] = ab.s;
    }
}

/// `out[r][t] = row_r · token_t` for [`R`] decoded rows (`w`, `R * nu`
/// units, row-major) and one packed group of 16 tokens (`a`, `nu` blocks):
/// `vpdpbusd(acc, acts_j, broadcast(w[4j..4j+4]))` adds in lane `t` the
/// products of 4 elements with token `t`'s quants offset by 128; starting
/// at `corr` makes the lane exactly `Σ q·qs`, and the remainders go into a
/// second accumulator: `256·Σ q·qs + Σ q·qr` per unit (or half), then the
/// shared f32 step for 16 tokens at once.
///
/// # Safety
/// The CPU must support the [`Isa::Avx512Vnni`](crate::kernels::Isa::Avx512Vnni) level.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn kern<const SPLIT: bool, const MIN: bool>(
    w: &[WUnit8],
    nu: usize,
    a: &[Act16],
    out: &mut [[f32; TG]; R],
) {
    assert!(w.len() == R * nu && a.len() == nu);
    let wp = w.as_ptr();
    let mut f = [_mm512_setzero_ps(); R];
    for (u, pb) in a.iter().enumerate() {
        // SAFETY (every access below): qs[j], qr[j], d and s are 64 bytes,
        // 64-byte aligned (repr(align(64)), every field a multiple of 64
        // bytes); r * nu + u < R * nu = w.len(), 4j + 4 <= 32.
        let da = unsafe { _mm512_load_ps(pb.d.as_ptr()) };
        let halves: &[(usize, usize)] = if SPLIT { &[(0, 4), (4, 8)] } else { &[(0, 8)] };
        for (h, &(j0, j1)) in halves.iter().enumerate() {
            let mut acc = [_mm512_setzero_si512(); R];
            let mut accr = [_mm512_setzero_si512(); R];
            for r in 0..R {
                let c = unsafe { (*wp.add(r * nu + u)).corr };
                acc[r] = _mm512_set1_epi32(if SPLIT { c[h] } else { c[0] + c[1] });
                accr[r] = acc[r];
            }
            for j in j0..j1 {
                let (av, ar) = unsafe {
                    (
                        _mm512_load_si512(pb.qs[j].as_ptr() as *const __m512i),
                        _mm512_load_si512(pb.qr[j].as_ptr() as *const __m512i),
                    )
                };
                for r in 0..R {
                    let wq = _mm512_set1_epi32(unsafe {
                        let wu = &*wp.add(r * nu + u);
                        std::ptr::read_unaligned(wu.q.as_ptr().add(4 * j) as *const i32)
                    });
                    acc[r] = _mm512_dpbusd_epi32(acc[r], av, wq);
                    accr[r] = _mm512_dpbusd_epi32(accr[r], ar, wq);
                }
            }
            for r in 0..R {
                let p = _mm512_add_epi32(_mm512_slli_epi32::<RES_SHIFT_U>(acc[r]), accr[r]);
                let dw = unsafe { (*wp.add(r * nu + u)).d[h] };
                f[r] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(p),
                    _mm512_mul_ps(da, _mm512_set1_ps(dw)),
                    f[r],
                );
            }
        }
        if MIN {
            let sv = unsafe { _mm512_load_ps(pb.s.as_ptr()) };
            for r in 0..R {
                let m = unsafe { (*wp.add(r * nu + u)).m };
                f[r] = _mm512_fmadd_ps(_mm512_set1_ps(m), sv, f[r]);
            }
        }
    }
    for r in 0..R {
        // SAFETY: out[r] is 16 f32; unaligned store.
        unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), f[r]) };
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

    /// The AVX2 SwiGLU (`elementwise::silu`) gives the same bits as this
    /// level's, so a token's outputs do not depend on which of the two SIMD
    /// levels ran it.
    #[test]
    fn swiglu_avx2_is_bit_identical() {
        if !crate::kernels::Isa::detect().vnni() {
            return;
        }
        let mut v = -120.0f32;
        while v < 100.0 {
            let g0: Vec<f32> = (0..37).map(|i| v + i as f32 * 2.9e-3).collect();
            let u: Vec<f32> = (0..37).map(|i| 0.5 + 0.03 * i as f32).collect();
            let (mut a, mut b) = (g0.clone(), g0.clone());
            // SAFETY: the VNNI level (which implies avx2/fma) was detected above.
            unsafe {
                swiglu_slice(&mut a, &u);
                crate::kernels::elementwise::silu::swiglu_slice_avx2(&mut b, &u);
            }
            for i in 0..a.len() {
                assert_eq!(a[i].to_bits(), b[i].to_bits(), "silu({}) * {}", g0[i], u[i]);
            }
            v += 0.0731;
        }
    }

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
