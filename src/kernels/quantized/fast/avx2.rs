//! AVX2 kernels of the fast path: activation quantization, the unit
//! decoders of every weight format ([`Fmt`]), the unit products of the
//! small-S kernel of `small.rs` ([`Maddubs`]: `maddubs`/`madd`), the
//! decoding and packing of the packed kernels' operands (shared with
//! AVX-512) and the packed prefill kernel ([`kern16`]: 16-bit weights
//! times 16-bit activations with `vpmaddwd`, 16 tokens in two registers). Both
//! compute every output with the shared arithmetic of `units.rs`.

use super::small::{self, UnitDot};
use super::{units, Q8Act, QK, RES, RES_SHIFT};
use crate::ir::DType;
use std::arch::x86_64::*;

/// `max |v|` over 32 floats (four vectors).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn amax32(v: &[__m256; 4]) -> f32 {
    let sign = _mm256_set1_ps(-0.0);
    let abs = |x| _mm256_andnot_ps(sign, x);
    let m = _mm256_max_ps(
        _mm256_max_ps(abs(v[0]), abs(v[1])),
        _mm256_max_ps(abs(v[2]), abs(v[3])),
    );
    let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
    let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    _mm_cvtss_f32(m4)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_i32(v: __m256i) -> i32 {
    let s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32::<1>(s4));
    _mm_cvtsi128_si32(s4)
}

/// Same results as the scalar reference `quantize_act_scalar`, bit for
/// bit; `plain`: [`ActQuant::Plain`](super::ActQuant::Plain) (every
/// remainder 0).
///
/// # Safety
/// The CPU must support avx2/fma/f16c; `x.len() == 32 * out.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize(x: &[f32], out: &mut [Q8Act], plain: bool) {
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let res = _mm256_set1_ps(RES as f32);
    let (lo, hi) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
    for (xb, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
        // SAFETY: xb has 32 f32; unaligned loads.
        let v = unsafe {
            [
                _mm256_loadu_ps(xb.as_ptr()),
                _mm256_loadu_ps(xb.as_ptr().add(8)),
                _mm256_loadu_ps(xb.as_ptr().add(16)),
                _mm256_loadu_ps(xb.as_ptr().add(24)),
            ]
        };
        let c = amax32(&v) / 127.0;
        let id = _mm256_set1_ps(if c != 0.0 { 1.0 / c } else { 0.0 });
        let mut q = [_mm256_setzero_si256(); 4];
        let mut r = [_mm256_setzero_si256(); 4];
        for i in 0..4 {
            let vi = _mm256_mul_ps(v[i], id);
            // cvtps2dq rounds to nearest even under the default MXCSR.
            q[i] = _mm256_cvtps_epi32(vi);
            if plain {
                continue;
            }
            let ri = _mm256_mul_ps(_mm256_sub_ps(vi, _mm256_cvtepi32_ps(q[i])), res);
            r[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(ri), lo), hi);
        }
        let pack = |a: &[__m256i; 4]| {
            let p01 = _mm256_packs_epi32(a[0], a[1]);
            let p23 = _mm256_packs_epi32(a[2], a[3]);
            _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), perm)
        };
        // SAFETY: qs and qr have 32 bytes each; unaligned stores.
        unsafe {
            _mm256_storeu_si256(o.qs.as_mut_ptr() as *mut __m256i, pack(&q));
            _mm256_storeu_si256(o.qr.as_mut_ptr() as *mut __m256i, pack(&r));
        }
        // Σ (256 q + r) over each 16-element half.
        let half = |i: usize| {
            let qq = _mm256_add_epi32(q[i], q[i + 1]);
            let rr = _mm256_add_epi32(r[i], r[i + 1]);
            hsum_i32(_mm256_add_epi32(_mm256_slli_epi32::<RES_SHIFT>(qq), rr))
        };
        o.d = c / RES as f32;
        o.isum = [half(0), half(2)];
        o.s = o.d * (o.isum[0] + o.isum[1]) as f32;
    }
}

/// `0xff` in byte `i` where bit `i` of `x` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bit_bytes(x: u32) -> __m256i {
    let v = _mm256_set1_epi32(x as i32);
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, //
        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(v, spread), mask), mask)
}

/// The first 32 bytes of `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load32(p: &[u8]) -> __m256i {
    let p = &p[..32];
    // SAFETY: p has 32 bytes; unaligned load.
    unsafe { _mm256_loadu_si256(p.as_ptr() as *const __m256i) }
}

/// `0xff` in byte `i` where bit `n` of byte `i` of the 32 bytes at `p` is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bit_n(p: &[u8], n: usize) -> __m256i {
    // SAFETY: as the caller's (avx2).
    let v = unsafe { load32(p) };
    let bit = _mm256_set1_epi8((1u8 << n) as i8);
    _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit)
}

/// 32 bytes at `p` shifted right by `n` bits (per byte: `n` < 8) and masked with `mask`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bits_at(p: &[u8], n: usize, mask: i8) -> __m256i {
    // SAFETY: as the caller's (avx2).
    let v = unsafe { load32(p) };
    let v = _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32));
    _mm256_and_si256(v, _mm256_set1_epi8(mask))
}

/// The IQ4 grid plus 128 (so unsigned) looked up for 32 nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn iq4_grid_u(nib: __m256i) -> __m256i {
    let g = crate::kernels::quantized::blocks::IQ4_VALUES.map(|v| (v as u8) ^ 0x80);
    // SAFETY: the table has 16 bytes; unaligned load.
    let t = unsafe { _mm_loadu_si128(g.as_ptr() as *const __m128i) };
    _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nib)
}

/// The 32 nibbles of 16 bytes in element order (low nibbles, then high).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles32(q: &[u8]) -> __m256i {
    let q = &q[..16];
    // SAFETY: q has 16 bytes; unaligned load.
    let v = unsafe { _mm_loadu_si128(q.as_ptr() as *const __m128i) };
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(v), v);
    _mm256_and_si256(both, _mm256_set1_epi8(15))
}

/// A weight format of the fast path, seen as 32-element units (see
/// `units.rs`; the constants are its table's, as constants so kernels
/// specialise on them).
pub(super) trait Fmt {
    /// The format.
    const D: DType;
    /// Bytes per storage block.
    const BYTES: usize = Self::D.block_bytes();
    /// Units per storage block.
    const UNITS: usize = units::units_per_block(Self::D);
    /// `units::offset`: `q + OFF` is the unsigned quant.
    const OFF: i32 = units::offset(Self::D);
    /// `units::split_scales`.
    const SPLIT: bool = units::split_scales(Self::D);
    /// `units::has_min`.
    const HAS_MIN: bool = units::has_min(Self::D);
    /// The 32 quants of unit `u` of block `b` as unsigned bytes `q + OFF`,
    /// in element order.
    ///
    /// # Safety
    /// The CPU must support avx2/fma/f16c; `b` holds one block, `u < UNITS`.
    unsafe fn load_u(b: &[u8], u: usize) -> __m256i;
    /// The scales of every unit of block `b` (of its first half, `dlo`, and
    /// of its second, `dhi`, written only for formats with a scale per
    /// half) and the additive terms `m` (written only for formats with one),
    /// exactly as `units::block_scales` gives them. This default serves the
    /// one-unit formats: an f16 scale at byte 0 and the minimum at byte 2.
    ///
    /// # Safety
    /// The CPU must support avx2/fma/f16c; `b` holds one block.
    #[inline(always)]
    unsafe fn scales(b: &[u8], dlo: &mut [f32; 8], _dhi: &mut [f32; 8], m: &mut [f32; 8]) {
        let b = &b[..4];
        let dm = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        // SAFETY: f16c is enabled in every caller.
        let v = unsafe { _mm_cvtph_ps(_mm_cvtsi32_si128(dm as i32)) };
        dlo[0] = _mm_cvtss_f32(v);
        if Self::HAS_MIN {
            m[0] = _mm_cvtss_f32(_mm_movehdup_ps(v));
        }
    }
}

/// The f16 at byte `at` of `b`, widened.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_at(b: &[u8], at: usize) -> f32 {
    let bits = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// `d · v` for 8 small integers `v` (bytes of `x`, signed if `SIGNED`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale8<const SIGNED: bool>(d: f32, x: u64, out: &mut [f32; 8]) {
    let v = _mm_cvtsi64_si128(x as i64);
    let i = if SIGNED {
        _mm256_cvtepi8_epi32(v)
    } else {
        _mm256_cvtepu8_epi32(v)
    };
    let f = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(i));
    // SAFETY: out holds 8 f32; unaligned store.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), f) };
}

/// The scales of a format with one per half: `d · lo[u]` and `d · hi[u]`
/// (signed bytes), `d` the f16 at byte `at` of `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn split_scales(
    b: &[u8],
    at: usize,
    lo: [u8; 8],
    hi: [u8; 8],
    dlo: &mut [f32; 8],
    dhi: &mut [f32; 8],
) {
    let d = f16_at(b, at);
    scale8::<true>(d, u64::from_le_bytes(lo), dlo);
    scale8::<true>(d, u64::from_le_bytes(hi), dhi);
}

/// The Q4_K/Q5_K scales: `d·sc` and `−(dmin·m)` of the 8 sub-blocks (the
/// 6-bit values rearranged as in `blocks::k_scale_min`, four bytes at a time).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k_scales(b: &[u8], dlo: &mut [f32; 8], _dhi: &mut [f32; 8], m: &mut [f32; 8]) {
    let w = |i: usize| u32::from_le_bytes([b[4 + 4 * i], b[5 + 4 * i], b[6 + 4 * i], b[7 + 4 * i]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    let (k1, k2, k3) = (0x3f3f_3f3fu32, 0x0f0f_0f0fu32, 0x0303_0303u32);
    let sc = (w0 & k1) as u64 | (((w2 & k2) | (((w0 >> 6) & k3) << 4)) as u64) << 32;
    let mn = (w1 & k1) as u64 | ((((w2 >> 4) & k2) | (((w1 >> 6) & k3) << 4)) as u64) << 32;
    scale8::<false>(f16_at(b, 0), sc, dlo);
    scale8::<false>(f16_at(b, 2), mn, m);
    for v in m.iter_mut() {
        *v = -*v;
    }
}

/// A format `$t` (of `$dt`) whose unit `u` is `$load` of its block `b`,
/// with the scales of `$scales` (default: the one-unit formats').
macro_rules! unit_fmt {
    ($t:ident, $dt:expr, $($scales:ident,)? |$b:ident, $u:ident| $load:expr) => {
        pub(super) struct $t;
        impl Fmt for $t {
            const D: DType = $dt;
            $(
                #[inline(always)]
                unsafe fn scales(
                    b: &[u8],
                    dlo: &mut [f32; 8],
                    dhi: &mut [f32; 8],
                    m: &mut [f32; 8],
                ) {
                    // SAFETY: avx2/f16c are enabled in every caller.
                    unsafe { $scales(b, dlo, dhi, m) }
                }
            )?
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn load_u($b: &[u8], $u: usize) -> __m256i {
                // SAFETY: the (checked) ranges lie inside the block.
                unsafe { $load }
            }
        }
    };
}

/// A Q5_0/Q5_1 unit: the 32 fifth bits at byte `at` of `b`, then the nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_unit(b: &[u8], at: usize) -> __m256i {
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    // SAFETY: 16 checked bytes.
    let nib = unsafe { nibbles32(&b[at + 4..at + 20]) };
    _mm256_or_si256(nib, _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(16)))
}

unit_fmt!(FQ8_0, DType::Q8_0, |b, _u| _mm256_xor_si256(
    load32(&b[2..34]),
    _mm256_set1_epi8(-128)
));
unit_fmt!(FQ4_0, DType::Q4_0, |b, _u| nibbles32(&b[2..18]));
unit_fmt!(FQ4_1, DType::Q4_1, |b, _u| nibbles32(&b[4..20]));
unit_fmt!(FQ5_0, DType::Q5_0, |b, _u| q5_unit(b, 2));
unit_fmt!(FQ5_1, DType::Q5_1, |b, _u| q5_unit(b, 4));
unit_fmt!(FIq4Nl, DType::IQ4_NL, |b, _u| iq4_grid_u(nibbles32(
    &b[2..18]
)));

pub(super) struct FQ3K;
pub(super) struct FQ6K;
pub(super) struct FIq4Xs;

impl Fmt for FQ3K {
    const D: DType = DType::Q3_K;
    #[inline(always)]
    unsafe fn scales(b: &[u8], dlo: &mut [f32; 8], dhi: &mut [f32; 8], _m: &mut [f32; 8]) {
        let s = &b[96..108];
        let mut lo = [0u8; 8];
        let mut hi = [0u8; 8];
        for i in 0..16 {
            let v = crate::kernels::quantized::blocks::q3k_scale(s, i) as i8 as u8;
            if i % 2 == 0 {
                lo[i / 2] = v;
            } else {
                hi[i / 2] = v;
            }
        }
        // SAFETY: f16c is enabled in every caller.
        unsafe { split_scales(b, 108, lo, hi, dlo, dhi) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_u(b: &[u8], u: usize) -> __m256i {
        let (h, s) = (u / 4, u % 4);
        // SAFETY: both ranges lie inside the block.
        let (low, high) = unsafe { (bits_at(&b[32 + 32 * h..], 2 * s, 3), bit_n(&b[0..32], u)) };
        // q + 4 = low + 4 · (high bit).
        _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(4)))
    }
}

unit_fmt!(FQ4K, DType::Q4_K, k_scales, |b, u| bits_at(
    &b[16 + 32 * (u / 2)..],
    4 * (u % 2),
    15
));

unit_fmt!(FQ5K, DType::Q5_K, k_scales, |b, u| {
    let lo = bits_at(&b[48 + 32 * (u / 2)..], 4 * (u % 2), 15);
    _mm256_or_si256(
        lo,
        _mm256_and_si256(bit_n(&b[16..48], u), _mm256_set1_epi8(16)),
    )
});

impl Fmt for FQ6K {
    const D: DType = DType::Q6_K;
    #[inline(always)]
    unsafe fn scales(b: &[u8], dlo: &mut [f32; 8], dhi: &mut [f32; 8], _m: &mut [f32; 8]) {
        let sc = &b[192..208];
        let (mut lo, mut hi) = ([0u8; 8], [0u8; 8]);
        for u in 0..8 {
            (lo[u], hi[u]) = (sc[2 * u], sc[2 * u + 1]);
        }
        // SAFETY: f16c is enabled in every caller.
        unsafe { split_scales(b, 208, lo, hi, dlo, dhi) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_u(b: &[u8], u: usize) -> __m256i {
        let (n, k) = (u / 4, u % 4);
        // SAFETY: both ranges lie inside the block.
        let (lo, hi) = unsafe {
            (
                bits_at(&b[64 * n + 32 * (k & 1)..], 4 * (k >> 1), 15),
                bits_at(&b[128 + 32 * n..], 2 * k, 3),
            )
        };
        _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi))
    }
}

impl Fmt for FIq4Xs {
    const D: DType = DType::IQ4_XS;
    #[inline(always)]
    unsafe fn scales(b: &[u8], dlo: &mut [f32; 8], _dhi: &mut [f32; 8], _m: &mut [f32; 8]) {
        let mut sc = [0u8; 8];
        for (k, v) in sc.iter_mut().enumerate() {
            *v = crate::kernels::quantized::blocks::iq4xs_scale(b, k) as i8 as u8;
        }
        // SAFETY: f16c is enabled in every caller.
        unsafe { scale8::<true>(f16_at(b, 0), u64::from_le_bytes(sc), dlo) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_u(b: &[u8], u: usize) -> __m256i {
        // SAFETY: 16 bytes inside the block.
        iq4_grid_u(unsafe { nibbles32(&b[8 + 16 * u..8 + 16 * u + 16]) })
    }
}

/// Calls `$f::<F, ...>` with the format type of `$dtype`.
macro_rules! with_fmt {
    ($dtype:expr, $f:ident :: < _ $(, $g:tt)* > ( $($arg:expr),* )) => {
        match $dtype {
            DType::Q8_0 => $f::<$crate::kernels::quantized::fast::avx2::FQ8_0 $(, $g)*>($($arg),*),
            DType::Q4_0 => $f::<$crate::kernels::quantized::fast::avx2::FQ4_0 $(, $g)*>($($arg),*),
            DType::Q4_1 => $f::<$crate::kernels::quantized::fast::avx2::FQ4_1 $(, $g)*>($($arg),*),
            DType::Q5_0 => $f::<$crate::kernels::quantized::fast::avx2::FQ5_0 $(, $g)*>($($arg),*),
            DType::Q5_1 => $f::<$crate::kernels::quantized::fast::avx2::FQ5_1 $(, $g)*>($($arg),*),
            DType::IQ4_NL => $f::<$crate::kernels::quantized::fast::avx2::FIq4Nl $(, $g)*>($($arg),*),
            DType::Q3_K => $f::<$crate::kernels::quantized::fast::avx2::FQ3K $(, $g)*>($($arg),*),
            DType::Q4_K => $f::<$crate::kernels::quantized::fast::avx2::FQ4K $(, $g)*>($($arg),*),
            DType::Q5_K => $f::<$crate::kernels::quantized::fast::avx2::FQ5K $(, $g)*>($($arg),*),
            DType::Q6_K => $f::<$crate::kernels::quantized::fast::avx2::FQ6K $(, $g)*>($($arg),*),
            DType::IQ4_XS => $f::<$crate::kernels::quantized::fast::avx2::FIq4Xs $(, $g)*>($($arg),*),
            _ => unreachable!("not a fast-path format"),
        }
    };
}
pub(super) use with_fmt;

/// The AVX2 unit products of the small-S kernel (`small.rs`):
/// `vpmaddubsw`/`vpmaddwd` of the unsigned quants `q + OFF` with the
/// activation quants and remainders. Formats with `OFF = 128` use `|q|`
/// and the activations' signs moved by `q` (which keeps every pair sum
/// inside `i16`), so their products are `Σ q·a` itself.
pub(super) struct Maddubs;

impl UnitDot for Maddubs {
    #[inline(always)]
    fn signed<F: Fmt>() -> bool {
        F::OFF >= 128
    }
    #[inline(always)]
    unsafe fn operands<F: Fmt>(v: __m256i) -> [__m256i; 2] {
        // SAFETY: avx2 (the caller's contract).
        unsafe {
            if Self::signed::<F>() {
                // The magnitudes and the signed quants.
                let qs = _mm256_xor_si256(v, _mm256_set1_epi8(-128));
                [_mm256_abs_epi8(qs), qs]
            } else {
                [v, _mm256_setzero_si256()]
            }
        }
    }
    #[inline(always)]
    unsafe fn prod<F: Fmt>(w: [__m256i; 2], av: __m256i, ar: __m256i) -> __m256i {
        // SAFETY: avx2 (the caller's contract).
        unsafe {
            let (sa, sr) = if Self::signed::<F>() {
                (_mm256_sign_epi8(av, w[1]), _mm256_sign_epi8(ar, w[1]))
            } else {
                (av, ar)
            };
            // 256·Σ u·qs + Σ u·qr per 4 elements; every maddubs pair sum is
            // at most 2·128·127 (signed) or 2·63·127, inside i16.
            _mm256_add_epi32(
                _mm256_madd_epi16(
                    _mm256_maddubs_epi16(w[0], sa),
                    _mm256_set1_epi16(RES as i16),
                ),
                _mm256_madd_epi16(_mm256_maddubs_epi16(w[0], sr), _mm256_set1_epi16(1)),
            )
        }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows<F: Fmt>(w: &[u8], row_bytes: usize, acts: &[&[Q8Act]], out: &mut [f32]) {
        // SAFETY: the level's features are enabled here.
        unsafe { small::rows::<F, Self>(w, row_bytes, acts, out) }
    }
}

/// One decoded weight unit of the packed kernels: signed quants widened to
/// `i16` in element order, the scale of each half (equal unless the format
/// has a scale per half) and the additive term.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(16))]
pub struct WUnit {
    pub(super) q: [i16; 32],
    pub(super) d: [f32; 2],
    pub(super) m: f32,
}

impl DecodedUnit for WUnit {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn set<F: Fmt>(&mut self, v: __m256i, dlo: f32, dhi: f32, m: f32) {
        let off = _mm256_set1_epi16(F::OFF as i16);
        let lo = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), off);
        let hi = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256::<1>(v)), off);
        // SAFETY: q has 32 i16 (64 bytes); unaligned stores.
        unsafe {
            _mm256_storeu_si256(self.q.as_mut_ptr() as *mut __m256i, lo);
            _mm256_storeu_si256(self.q.as_mut_ptr().add(16) as *mut __m256i, hi);
        }
        self.d = [dlo, if F::SPLIT { dhi } else { dlo }];
        self.m = if F::HAS_MIN { m } else { 0.0 };
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode_rows<F: Fmt>(w: &[u8], row_bytes: usize, out: &mut [Self]) {
        // SAFETY: the level's features are enabled here.
        unsafe { decode_rows::<F, Self>(w, row_bytes, out) }
    }
}

/// A weight unit as one level's packed kernel takes it.
pub(super) trait DecodedUnit: Copy + Default {
    /// The unit of `F` whose quants are the bytes `v` (`q + OFF`, in
    /// element order), with the scales `dlo`/`dhi` of its halves (`dhi`
    /// read only for formats with a scale per half) and additive term `m`
    /// (read only for formats with one).
    ///
    /// # Safety
    /// The CPU must support the level.
    unsafe fn set<F: Fmt>(&mut self, v: __m256i, dlo: f32, dhi: f32, m: f32);
    /// [`decode_rows`]`::<F, Self>`, compiled with the level's features.
    ///
    /// # Safety
    /// The CPU must support the level.
    unsafe fn decode_rows<F: Fmt>(w: &[u8], row_bytes: usize, out: &mut [Self]);
}

/// Decodes the rows of `w` (`row_bytes` each) into `out` (the row's units
/// one after another, row-major); units of `out` past the rows of `w` are
/// zeroed.
///
/// # Safety
/// The CPU must support `U`'s level; `dtype` must be a fast-path format.
pub(super) unsafe fn decode<U: DecodedUnit>(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    out: &mut [U],
) {
    // SAFETY: as the caller's.
    unsafe { with_fmt!(dtype, level_decode::<_, U>(w, row_bytes, out)) }
}

/// `U::decode_rows::<F>` (a function `with_fmt!` can name).
#[inline(always)]
unsafe fn level_decode<F: Fmt, U: DecodedUnit>(w: &[u8], row_bytes: usize, out: &mut [U]) {
    // SAFETY: as the caller's.
    unsafe { U::decode_rows::<F>(w, row_bytes, out) }
}

/// The body of every level's [`DecodedUnit::decode_rows`].
///
/// # Safety
/// Inlined into a function with `U`'s level's features only.
#[inline(always)]
pub(super) unsafe fn decode_rows<F: Fmt, U: DecodedUnit>(
    w: &[u8],
    row_bytes: usize,
    out: &mut [U],
) {
    let nblk = row_bytes / F::BYTES;
    assert!(nblk * F::BYTES == row_bytes && nblk > 0);
    let nu = nblk * F::UNITS;
    let nr = w.len() / row_bytes;
    assert!(nr * row_bytes == w.len() && out.len() >= nr * nu);
    let (mut dlo, mut dhi, mut m) = ([0f32; 8], [0f32; 8], [0f32; 8]);
    for (bi, blk) in w.chunks_exact(F::BYTES).enumerate() {
        // SAFETY: blk holds one block; the features are enabled (the
        // caller's contract).
        unsafe { F::scales(blk, &mut dlo, &mut dhi, &mut m) };
        for u in 0..F::UNITS {
            // SAFETY: as above; u < UNITS.
            unsafe {
                let v = F::load_u(blk, u);
                out[bi * F::UNITS + u].set::<F>(v, dlo[u], dhi[u], m[u]);
            }
        }
    }
    out[nr * nu..].fill(U::default());
}

/// One block of a group of tokens' activations, packed for one level's
/// kernel.
pub(super) trait PackedAct: Copy + Default {
    /// Tokens per group.
    const TG: usize;
    /// Puts token `t`'s block `ab` in its lanes.
    fn put(&mut self, t: usize, ab: &Q8Act);
}

/// Packs up to `A::TG` tokens' quantized rows (`acts[t]`, `nb` blocks
/// each) into `out` (`nb` blocks); missing tokens are zero.
pub(super) fn pack<A: PackedAct>(acts: &[&[Q8Act]], nb: usize, out: &mut [A]) {
    assert!(acts.len() <= A::TG && out.len() == nb);
    for (b, o) in out.iter_mut().enumerate() {
        *o = A::default();
        for (t, row) in acts.iter().enumerate() {
            o.put(t, &row[b]);
        }
    }
}

/// Tokens per packed group of the AVX2 kernel: two registers of 8 (one
/// `i32` lane each).
pub(super) const TG_I16: usize = 16;
/// Weight rows per call of the AVX2 packed kernel: 6 rows × 2 registers
/// of tokens keep 12 accumulators, each activation pair loaded once for 6
/// rows. Against 4 rows (and 16-row work chunks, now 24), `qmatmul_bench 1
/// S` on the 1B-shaped in-cache shape, 3 interleaved runs, best-of-5 ms:
/// Q6_K S=16 2.70-2.97 -> 1.62-2.14, S=256 26.0-27.5 -> 19.7-20.6; Q4_K
/// S=16 1.38-2.13 -> 1.39-1.84, S=256 18.2-19.3 -> 19.0-19.3; the 2048x8192
/// down shape Q4_K S=16 7.4-8.8 -> 6.1-6.7, Q6_K S=256 109-136 -> 88-92.
/// In a 16-sequence step on the 1B-shaped Q4_K_M file (`benches/probes/op_profile
/// MODEL 6 2 16`, 4 interleaved rounds) the Q6_K output head went from 0.30
/// to 0.235 of the (Q4_K) gate/up time, the down projections (half Q6_K)
/// from 0.86 to 0.75; the gate/up time itself moved within noise.
pub(super) const R_I16: usize = 6;

/// One 32-element block of 16 tokens' activations for the AVX2 packed
/// kernel: per pair `p` of elements, the two 16-bit activations
/// `256 qs + qr` of token `t` at `a[p][2t..2t + 2]` (tokens 0-7 fill the
/// first register, 8-15 the second); the tokens' scales and sums.
/// Missing tokens are zero.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub struct ActI16 {
    a: [[i16; 2 * TG_I16]; 16],
    d: [f32; TG_I16],
    s: [f32; TG_I16],
}

impl Default for ActI16 {
    fn default() -> ActI16 {
        ActI16 {
            a: [[0; 2 * TG_I16]; 16],
            d: [0.0; TG_I16],
            s: [0.0; TG_I16],
        }
    }
}

impl PackedAct for ActI16 {
    const TG: usize = TG_I16;
    #[inline]
    fn put(&mut self, t: usize, ab: &Q8Act) {
        for p in 0..16 {
            for e in 0..2 {
                let i = 2 * p + e;
                self.a[p][2 * t + e] = (RES * ab.qs[i] as i32 + ab.qr[i] as i32) as i16;
            }
        }
        self.d[t] = ab.d;
        self.s[t] = ab.s;
    }
}

/// `out[r][t] = row_r · token_t` for [`R_I16`] decoded rows (`w`, `R_I16 * nu`
/// units, row-major) and the first `8 NG` tokens of one packed group (`a`,
/// `nu` blocks): per unit (or half) the exact integer by `vpmaddwd` pairs,
/// then the shared f32 step. Each broadcast weight pair meets `NG`
/// registers of tokens; a token's lane sees the same operations whatever
/// `NG` is.
///
/// # Safety
/// The CPU must support avx2/fma/f16c.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn kern16<const SPLIT: bool, const MIN: bool, const NG: usize>(
    w: &[WUnit],
    nu: usize,
    a: &[ActI16],
    out: &mut [[f32; TG_I16]; R_I16],
) {
    assert!(w.len() == R_I16 * nu && a.len() == nu && (1..=2).contains(&NG));
    let wp = w.as_ptr();
    let mut f = [[_mm256_setzero_ps(); NG]; R_I16];
    for (u, ab) in a.iter().enumerate() {
        // SAFETY (every access below): d, s and every a[p] are 32-byte
        // aligned (repr(align(32)), sizes multiples of 32); r * nu + u < R_I16 * nu.
        let da: [__m256; NG] =
            std::array::from_fn(|g| unsafe { _mm256_load_ps(ab.d.as_ptr().add(8 * g)) });
        let halves: &[(usize, usize)] = if SPLIT {
            &[(0, 8), (8, 16)]
        } else {
            &[(0, 16)]
        };
        for (h, &(p0, p1)) in halves.iter().enumerate() {
            let mut acc = [[_mm256_setzero_si256(); NG]; R_I16];
            for p in p0..p1 {
                let av: [__m256i; NG] = std::array::from_fn(|g| unsafe {
                    _mm256_load_si256(ab.a[p].as_ptr().add(16 * g) as *const __m256i)
                });
                for r in 0..R_I16 {
                    let wq = _mm256_set1_epi32(unsafe {
                        let wu = &*wp.add(r * nu + u);
                        std::ptr::read_unaligned(wu.q.as_ptr().add(2 * p) as *const i32)
                    });
                    for g in 0..NG {
                        acc[r][g] = _mm256_add_epi32(acc[r][g], _mm256_madd_epi16(av[g], wq));
                    }
                }
            }
            for r in 0..R_I16 {
                let dw = _mm256_set1_ps(unsafe { (*wp.add(r * nu + u)).d[h] });
                for g in 0..NG {
                    f[r][g] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(acc[r][g]),
                        _mm256_mul_ps(da[g], dw),
                        f[r][g],
                    );
                }
            }
        }
        if MIN {
            for g in 0..NG {
                let sv = unsafe { _mm256_load_ps(ab.s.as_ptr().add(8 * g)) };
                for r in 0..R_I16 {
                    let m = _mm256_set1_ps(unsafe { (*wp.add(r * nu + u)).m });
                    f[r][g] = _mm256_fmadd_ps(m, sv, f[r][g]);
                }
            }
        }
    }
    for r in 0..R_I16 {
        for g in 0..NG {
            // SAFETY: out[r] is 16 f32, g < 2; unaligned store.
            unsafe { _mm256_storeu_ps(out[r].as_mut_ptr().add(8 * g), f[r][g]) };
        }
    }
}
