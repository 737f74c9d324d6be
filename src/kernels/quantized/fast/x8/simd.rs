//! The x8 small-S kernels: AVX2 (`maddubs`, 16-bit sums where they
//! cannot overflow; `vpmaddwd` on 16-bit values for signed quants) and
//! AVX-512 VNNI (256-bit `vpdpbusd`), each in two forms: with the
//! activations' remainders and, for activations quantized without them
//! ([`ActQuant::Plain`](super::super::ActQuant::Plain), every `qr` 0),
//! without their products (`PLAIN`), which gives the same sums.

use super::super::avx2::{
    iq4_grid_u, with_fmt, DecodedUnit, FIq4Nl, FIq4Xs, Fmt, WUnit, FQ3K, FQ4K, FQ4_0, FQ4_1, FQ5K,
    FQ5_0, FQ5_1, FQ6K, FQ8_0,
};
use super::super::{Q8Act, RES};
use super::{part_offset, parts, Part, G};
use crate::ir::DType;
use std::arch::x86_64::*;

/// A fast-path format in the x8 layout.
pub(in super::super) trait X8Fmt: Fmt {
    /// `parts(dtype)`.
    const PARTS: &'static [Part] = match parts(Self::D) {
        Some(p) => p,
        None => panic!("no x8 layout"),
    };
    /// Largest `q + OFF` (bounds the 16-bit sums of the AVX2 kernel).
    const UMAX: i32;
    /// The scales of every unit (`d[u][h]`, per half; equal halves
    /// unless the format has a scale per half) and additive terms
    /// (`m[u]`, formats with one) of block column `x`, lane = row,
    /// exactly as `units::block_scales` gives them.
    ///
    /// # Safety
    /// avx2/fma/f16c; `x` holds one block column.
    unsafe fn scales8(x: &[u8], d: &mut Scales, m: &mut Mins);
    /// `q + OFF` of elements `4j..4j+4` of unit `u` of the 8 rows
    /// (lane `r` = row `r`).
    ///
    /// # Safety
    /// avx2/fma/f16c; `x` holds one block column, `u < UNITS`, `j < 8`.
    unsafe fn quad(x: &[u8], u: usize, j: usize) -> __m256i;
}

/// The scales of a block column's units, per half (`d[u][h]`, lane = row).
type Scales = [[__m256; 2]; 8];
/// The additive terms of a block column's units (`m[u]`, lane = row).
type Mins = [__m256; 8];

/// Offset of part `i` of `F`'s layout.
const fn off<F: X8Fmt>(i: usize) -> usize {
    part_offset(F::PARTS, i)
}

/// The 8 rows' f16 at part offset `o` (a `Rows(_, 2)` part), widened.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x8(x: &[u8], o: usize) -> __m256 {
    let x = &x[o..o + 16];
    // SAFETY: 16 bytes; unaligned load.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(x.as_ptr() as *const __m128i) })
}

/// Word `w` of the 8 rows of the `Words` part at offset `o`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn word8(x: &[u8], o: usize, w: usize) -> __m256i {
    let x = &x[o + 32 * w..o + 32 * w + 32];
    // SAFETY: 32 bytes; unaligned load.
    unsafe { _mm256_loadu_si256(x.as_ptr() as *const __m256i) }
}

/// The low (`hi` false) or high nibbles of every byte.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibble(v: __m256i, hi: bool) -> __m256i {
    let v = if hi { _mm256_srli_epi16::<4>(v) } else { v };
    _mm256_and_si256(v, _mm256_set1_epi8(15))
}

/// `(v >> shift) & mask` in every `i32` lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn field32(v: __m256i, shift: usize, mask: i32) -> __m256i {
    _mm256_and_si256(
        _mm256_srlv_epi32(v, _mm256_set1_epi32(shift as i32)),
        _mm256_set1_epi32(mask),
    )
}

/// Byte `i` of every lane of `v` (as `i32`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lane_byte(v: __m256i, i: usize) -> __m256i {
    field32(v, 8 * i, 255)
}

/// The 6-bit scales `(lo | hi << 4) - 32` of `i32` lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale6(lo: __m256i, hi: __m256i) -> __m256i {
    _mm256_sub_epi32(
        _mm256_or_si256(lo, _mm256_slli_epi32::<4>(hi)),
        _mm256_set1_epi32(32),
    )
}

/// Bits `2k..2k+2` of every byte of `v`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn crumb(v: __m256i, k: usize) -> __m256i {
    _mm256_and_si256(
        _mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * k as i32)),
        _mm256_set1_epi8(3),
    )
}

/// `d · v` for `i32` lanes `v`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn times(d: __m256, v: __m256i) -> __m256 {
    _mm256_mul_ps(d, _mm256_cvtepi32_ps(v))
}

/// 16 in byte `4r + i` where bit `4j + i` of lane `r` of `qh` is set (the
/// fifth bit of Q5_0/Q5_1 elements `4j..4j+4`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_high(qh: __m256i, j: usize) -> __m256i {
    let idx = _mm256_add_epi8(
        _mm256_setr_epi8(
            0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, //
            0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
        ),
        _mm256_set1_epi8((j / 2) as i8),
    );
    let bits = _mm256_set1_epi32(if j.is_multiple_of(2) {
        0x0804_0201
    } else {
        0x8040_2010u32 as i32
    });
    let m = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, idx), bits), bits);
    _mm256_and_si256(m, _mm256_set1_epi8(16))
}

/// `v` where bit `bit` of each byte of `w` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bit_to(w: __m256i, bit: usize, v: i8) -> __m256i {
    let b = _mm256_set1_epi8((1u8 << bit) as i8);
    _mm256_and_si256(
        _mm256_cmpeq_epi8(_mm256_and_si256(w, b), b),
        _mm256_set1_epi8(v),
    )
}

/// The one-unit formats' scales: the f16 scale in part 0, the minimum
/// in part 1 where there is one.
#[inline(always)]
unsafe fn one_unit_scales<F: X8Fmt>(x: &[u8], dv: __m256, d: &mut Scales, m: &mut Mins) {
    // SAFETY: as the caller's.
    unsafe {
        d[0][0] = dv;
        d[0][1] = d[0][0];
        if F::HAS_MIN {
            m[0] = f16x8(x, off::<F>(1));
        }
    }
}

/// An [`X8Fmt`] whose scales are `$scales` (of `x` and the f16 `d` of
/// its part 0) and whose quads are `$quad` (of `x`, the unit and the quad
/// index).
macro_rules! x8_fmt {
    ($f:ident, $umax:expr, $scales:ident, |$x:ident, $u:ident, $j:ident| $quad:expr) => {
        impl X8Fmt for $f {
            const UMAX: i32 = $umax;
            #[inline(always)]
            unsafe fn scales8(x: &[u8], d: &mut Scales, m: &mut Mins) {
                // SAFETY: as the caller's (every format's `d` is the f16 of part 0).
                unsafe { $scales::<Self>(x, f16x8(x, 0), d, m) }
            }
            #[inline(always)]
            unsafe fn quad($x: &[u8], $u: usize, $j: usize) -> __m256i {
                // SAFETY: as the caller's.
                unsafe { $quad }
            }
        }
    };
}

x8_fmt!(FQ8_0, 255, one_unit_scales, |x, _u, j| {
    _mm256_xor_si256(word8(x, off::<Self>(1), j), _mm256_set1_epi8(-128))
});

x8_fmt!(FQ4_0, 15, one_unit_scales, |x, _u, j| nibble(
    word8(x, off::<Self>(1), j % 4),
    j >= 4
));

x8_fmt!(FIq4Nl, 241, one_unit_scales, |x, _u, j| {
    iq4_grid_u(nibble(word8(x, off::<Self>(1), j % 4), j >= 4))
});

x8_fmt!(FQ4_1, 15, one_unit_scales, |x, _u, j| nibble(
    word8(x, off::<Self>(2), j % 4),
    j >= 4
));

x8_fmt!(FQ5_0, 31, one_unit_scales, |x, _u, j| {
    let nib = nibble(word8(x, off::<Self>(2), j % 4), j >= 4);
    _mm256_or_si256(nib, q5_high(word8(x, off::<Self>(1), 0), j))
});

x8_fmt!(FQ5_1, 31, one_unit_scales, |x, _u, j| {
    let nib = nibble(word8(x, off::<Self>(3), j % 4), j >= 4);
    _mm256_or_si256(nib, q5_high(word8(x, off::<Self>(2), 0), j))
});

/// The Q4_K/Q5_K scales of the 8 rows: `d·sc` and `−(dmin·m)` per unit,
/// from the three words of 6-bit values (parts 0, 1, 2 = d, dmin, scales).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_scales8<F: X8Fmt>(x: &[u8], dv: __m256, d: &mut Scales, m: &mut Mins) {
    unsafe {
        let dmv = f16x8(x, off::<F>(1));
        let o = off::<F>(2);
        let (w0, w1, w2) = (word8(x, o, 0), word8(x, o, 1), word8(x, o, 2));
        let k1 = _mm256_set1_epi32(0x3f3f_3f3f);
        let k2 = _mm256_set1_epi32(0x0f0f_0f0f);
        let k3 = _mm256_set1_epi32(0x0303_0303);
        let sc_lo = _mm256_and_si256(w0, k1);
        let sc_hi = _mm256_or_si256(
            _mm256_and_si256(w2, k2),
            _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(w0), k3)),
        );
        let mn_lo = _mm256_and_si256(w1, k1);
        let mn_hi = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi32::<4>(w2), k2),
            _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(w1), k3)),
        );
        let neg = _mm256_set1_ps(-0.0);
        for u in 0..8 {
            let (sc, mn) = if u < 4 {
                (sc_lo, mn_lo)
            } else {
                (sc_hi, mn_hi)
            };
            d[u][0] = times(dv, lane_byte(sc, u % 4));
            d[u][1] = d[u][0];
            m[u] = _mm256_xor_ps(times(dmv, lane_byte(mn, u % 4)), neg);
        }
    }
}

x8_fmt!(FQ4K, 15, k_scales8, |x, u, j| nibble(
    word8(x, off::<Self>(3), 8 * (u / 2) + j),
    u % 2 == 1
));

x8_fmt!(FQ5K, 31, k_scales8, |x, u, j| {
    let nib = nibble(word8(x, off::<Self>(4), 8 * (u / 2) + j), u % 2 == 1);
    _mm256_or_si256(nib, bit_to(word8(x, off::<Self>(3), j), u, 16))
});

/// The Q6_K scales: `d · sc` per half, from the signed bytes of part 1.
#[inline(always)]
unsafe fn q6k_scales8<F: X8Fmt>(x: &[u8], dv: __m256, d: &mut Scales, _m: &mut Mins) {
    unsafe {
        let o = off::<F>(1);
        for u in 0..8 {
            for h in 0..2 {
                let i = 2 * u + h;
                let b = &x[o + G * i..o + G * i + 8];
                let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(b.as_ptr() as *const __m128i));
                d[u][h] = times(dv, v);
            }
        }
    }
}

x8_fmt!(FQ6K, 63, q6k_scales8, |x, u, j| {
    let (n, k) = (u / 4, u % 4);
    let lo = nibble(word8(x, off::<Self>(2), 16 * n + 8 * (k & 1) + j), k >= 2);
    let qh = word8(x, off::<Self>(3), 8 * n + j);
    _mm256_or_si256(lo, _mm256_slli_epi16::<4>(crumb(qh, k)))
});

/// The Q3_K scales: `d · sc` per half, the 6-bit values from the words of
/// part 1 (low 4 bits, then 2 high bits in the third word), minus 32.
#[inline(always)]
unsafe fn q3k_scales8<F: X8Fmt>(x: &[u8], dv: __m256, d: &mut Scales, _m: &mut Mins) {
    unsafe {
        let o = off::<F>(1);
        let w = [word8(x, o, 0), word8(x, o, 1), word8(x, o, 2)];
        for i in 0..16 {
            let (lw, sh) = if i < 8 {
                (w[i / 4], 8 * (i % 4))
            } else {
                (w[(i - 8) / 4], 8 * ((i - 8) % 4) + 4)
            };
            let hs = 8 * (i % 4) + 2 * (i / 4);
            let s = scale6(field32(lw, sh, 15), field32(w[2], hs, 3));
            d[i / 2][i % 2] = times(dv, s);
        }
    }
}

x8_fmt!(FQ3K, 7, q3k_scales8, |x, u, j| {
    let (h, s) = (u / 4, u % 4);
    let low = crumb(word8(x, off::<Self>(3), 8 * h + j), s);
    _mm256_or_si256(low, bit_to(word8(x, off::<Self>(2), j), u, 4))
});

/// The IQ4_XS scales: `d · sc` per unit, the 6-bit values from parts 1
/// (high 2 bits) and 2 (low 4 bits), minus 32.
#[inline(always)]
unsafe fn iq4xs_scales8<F: X8Fmt>(x: &[u8], dv: __m256, d: &mut Scales, _m: &mut Mins) {
    unsafe {
        let hb = &x[off::<F>(1)..off::<F>(1) + 16];
        let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(hb.as_ptr() as *const __m128i));
        let l = word8(x, off::<F>(2), 0);
        for k in 0..8 {
            let s = scale6(field32(l, 4 * k, 15), field32(h, 2 * k, 3));
            d[k][0] = times(dv, s);
            d[k][1] = d[k][0];
        }
    }
}

x8_fmt!(FIq4Xs, 241, iq4xs_scales8, |x, u, j| {
    iq4_grid_u(nibble(word8(x, off::<Self>(3), 4 * u + j % 4), j >= 4))
});

/// Decodes whole x8 groups (`w`, groups of 8 rows of `row_bytes`) into
/// the units of the AVX2 packed kernel, row-major: the same units
/// `avx2::decode` makes of the GGUF rows, without unpacking them first.
/// Units of `out` past the rows are zeroed.
///
/// # Safety
/// The CPU must support avx2/fma/f16c; `dtype` has an x8 layout.
pub(in super::super) unsafe fn decode_units(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    out: &mut [WUnit],
) {
    unsafe { with_fmt!(dtype, decode_units_t::<_>(w, row_bytes, out)) }
}

/// Rows of an 8x8 matrix of 32-bit words: `v[j]` lane `r` in, `out[r]`
/// lane `j` out.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose8(v: [__m256i; 8]) -> [__m256i; 8] {
    // Per 128-bit half: pairs of words, then the four words of a row.
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (a, b) = (v[2 * (i / 2)], v[2 * (i / 2) + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi32(a, b)
        } else {
            _mm256_unpackhi_epi32(a, b)
        }
    });
    // s[4h + k]: rows k and k + 4 of words 4h..4h+4 (low, high half).
    let s: [__m256i; 8] = std::array::from_fn(|i| {
        let (h, k) = (i / 4, i % 4);
        let (a, b) = (t[4 * h + k / 2], t[4 * h + 2 + k / 2]);
        if k % 2 == 0 {
            _mm256_unpacklo_epi64(a, b)
        } else {
            _mm256_unpackhi_epi64(a, b)
        }
    });
    std::array::from_fn(|r| {
        let (a, b) = (s[r % 4], s[4 + r % 4]);
        if r < 4 {
            _mm256_permute2x128_si256::<0x20>(a, b)
        } else {
            _mm256_permute2x128_si256::<0x31>(a, b)
        }
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_units_t<F: X8Fmt>(w: &[u8], row_bytes: usize, out: &mut [WUnit]) {
    let nblk = row_bytes / F::BYTES;
    assert!(nblk * F::BYTES == row_bytes && nblk > 0);
    let nu = nblk * F::UNITS;
    let (gb, cb) = (G * row_bytes, G * F::BYTES);
    let ng = w.len() / gb;
    assert!(ng * gb == w.len() && out.len() >= ng * G * nu);
    let mut d = [[_mm256_setzero_ps(); 2]; 8];
    let mut m = [_mm256_setzero_ps(); 8];
    let (mut dlo, mut dhi, mut mm) = ([0f32; 8], [0f32; 8], [0f32; 8]);
    for g in 0..ng {
        for blk in 0..nblk {
            let x = &w[g * gb + blk * cb..g * gb + (blk + 1) * cb];
            // SAFETY: x holds one block column; the features are enabled here.
            unsafe { F::scales8(x, &mut d, &mut m) };
            for u in 0..F::UNITS {
                // SAFETY: as above; u < UNITS, j < 8.
                let rows = transpose8(std::array::from_fn(|j| unsafe { F::quad(x, u, j) }));
                // SAFETY: 8 f32 each; unaligned stores.
                unsafe {
                    _mm256_storeu_ps(dlo.as_mut_ptr(), d[u][0]);
                    _mm256_storeu_ps(dhi.as_mut_ptr(), d[u][1]);
                    _mm256_storeu_ps(mm.as_mut_ptr(), m[u]);
                }
                for (r, v) in rows.into_iter().enumerate() {
                    out[(g * G + r) * nu + blk * F::UNITS + u].set::<F>(v, dlo[r], dhi[r], mm[r]);
                }
            }
        }
    }
    out[ng * G * nu..].fill(WUnit::default());
}

/// `out[r * nt + t] = row_r · acts[t]` for the x8 groups in `w` (whole
/// groups of `row_bytes` rows) and 1..=4 activation rows; `plain`: the
/// activations have no remainders (every `qr` 0, which the kernels then
/// do not read).
///
/// # Safety
/// The CPU must support `vnni ? Avx512Vnni : Avx2`; `dtype` has an x8 layout.
pub(in super::super) unsafe fn dot_rows(
    vnni: bool,
    plain: bool,
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &[&[Q8Act]],
    out: &mut [f32],
) {
    unsafe {
        match (vnni, plain) {
            (true, false) => with_fmt!(dtype, rows_vnni::<_, false>(w, row_bytes, acts, out)),
            (true, true) => with_fmt!(dtype, rows_vnni::<_, true>(w, row_bytes, acts, out)),
            (false, false) => with_fmt!(dtype, rows_avx2::<_, false>(w, row_bytes, acts, out)),
            (false, true) => with_fmt!(dtype, rows_avx2::<_, true>(w, row_bytes, acts, out)),
        }
    }
}

/// Splits `w` into groups and `acts` into tiles of at most `NT` tokens.
#[inline(always)]
fn tiles<const NT: usize>(
    w: &[u8],
    row_bytes: usize,
    nu: usize,
    acts: &[&[Q8Act]],
    out: &mut [f32],
    mut kern: impl FnMut(&[u8], &[&[Q8Act]], &mut [[f32; G]; 4]),
) {
    let gb = G * row_bytes;
    let ng = w.len() / gb;
    let nt = acts.len();
    assert!(ng * gb == w.len() && out.len() == ng * G * nt && (1..=4).contains(&nt));
    for a in acts {
        assert!(a.len() >= nu);
    }
    let mut v = [[0f32; G]; 4];
    for g in 0..ng {
        let mut t0 = 0;
        while t0 < nt {
            let tn = (nt - t0).min(NT);
            kern(&w[g * gb..(g + 1) * gb], &acts[t0..t0 + tn], &mut v);
            for t in 0..tn {
                for r in 0..G {
                    out[(g * G + r) * nt + t0 + t] = v[t][r];
                }
            }
            t0 += tn;
        }
    }
}

/// True for the formats whose AVX2 kernel takes up to 4 tokens per pass
/// over a group (2 for the others): those whose quads are costly to
/// assemble (low and high bits from two parts), so that sharing a quad
/// among more tokens pays for the registers the extra tokens take.
/// Measured (`qmatmul_bench 1 4`, 1B in-cache shape, best of 6
/// interleaved runs, ms, 2 vs 4 tokens per pass): Q3_K 0.879/0.694,
/// Q5_K 0.613/0.534, Q6_K 0.823/0.655, Q4_K 0.468/0.436; on the
/// 1B-shaped Q4_K_M file (`benches/probes/op_profile MODEL 16 2 4`, 6 rounds,
/// ms per 4-sequence step) Q6_K alone at 4 gave a median of 108.8
/// against 121, and Q4_K at 4 as well 115 (within noise of either).
const fn four_tokens(dtype: DType) -> bool {
    matches!(dtype, DType::Q3_K | DType::Q5_K | DType::Q6_K)
}

/// `$k::<$p.., NT>(g, nblk, [a[0], ..], v)` for a tile of `NT = a.len()`
/// tokens (1..=4).
macro_rules! by_tokens {
    ($k:ident::<$($p:ident),+>($g:expr, $nblk:expr, $a:expr, $v:expr)) => {{
        let (g, nblk, a, v) = ($g, $nblk, $a, $v);
        match a.len() {
            1 => $k::<$($p),+, 1>(g, nblk, [a[0]], v),
            2 => $k::<$($p),+, 2>(g, nblk, [a[0], a[1]], v),
            3 => $k::<$($p),+, 3>(g, nblk, [a[0], a[1], a[2]], v),
            _ => $k::<$($p),+, 4>(g, nblk, [a[0], a[1], a[2], a[3]], v),
        }
    }};
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2<F: X8Fmt, const PLAIN: bool>(
    w: &[u8],
    row_bytes: usize,
    acts: &[&[Q8Act]],
    out: &mut [f32],
) {
    let nblk = row_bytes / F::BYTES;
    let nu = nblk * F::UNITS;
    // SAFETY (both closures): they run inside a function with these features.
    if four_tokens(F::D) {
        tiles::<4>(w, row_bytes, nu, acts, out, |g, a, v| unsafe {
            by_tokens!(group::<F, Maddubs8, PLAIN>(g, nblk, a, v))
        });
    } else {
        tiles::<2>(w, row_bytes, nu, acts, out, |g, a, v| unsafe {
            by_tokens!(group::<F, Maddubs8, PLAIN>(g, nblk, a, v))
        });
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn rows_vnni<F: X8Fmt, const PLAIN: bool>(
    w: &[u8],
    row_bytes: usize,
    acts: &[&[Q8Act]],
    out: &mut [f32],
) {
    let nblk = row_bytes / F::BYTES;
    tiles::<4>(w, row_bytes, nblk * F::UNITS, acts, out, |g, a, v| {
        // SAFETY: this closure runs inside a function with these features.
        unsafe { by_tokens!(group::<F, Vnni8, PLAIN>(g, nblk, a, v)) }
    });
}

/// How far ahead of the block column being multiplied the AVX2 kernel
/// prefetches its weights, in bytes. Decode streams every weight from
/// DRAM once per token while the core is busy with the integer work, and
/// the hardware prefetcher alone does not keep far enough ahead: on the
/// 2-vCPU AMD EPYC (Zen 3) development VM, decode steps at 2 threads
/// (`benches/probes/op_profile MODEL 48 2`, two runs each, ms per step) went
/// 1B-shaped Q4_K_M 42.9/42.2 -> 35.1/40.2, Q8_0 54.7/57.4 -> 47.2/45.2,
/// Q4_1 41.1/47.3 -> 33.1/38.7, SmolLM2 Q4_1 7.1/6.3 -> 5.7/5.6 with
/// 1024 bytes; 512 was too short, 2048-3072 no better.
const PREFETCH_AHEAD: usize = 1024;

/// Four bytes of `v` at element `4j` (an activation word), broadcast.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bcast(v: &[i8; 32], j: usize) -> __m256i {
    // SAFETY: 4j + 4 <= 32; unaligned read.
    _mm256_set1_epi32(unsafe { std::ptr::read_unaligned(v.as_ptr().add(4 * j) as *const i32) })
}

/// `qs · RES + qr` of a unit's 32 activations (exact: at most
/// `127 · 256 + 127` in magnitude), elements 0-15 and 16-31.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn wide16(a: &Q8Act) -> [__m256i; 2] {
    let half = |v: &[i8; 32], i: usize| {
        // SAFETY: 16 of the 32 bytes; unaligned load.
        _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(v.as_ptr().add(16 * i) as *const __m128i) })
    };
    std::array::from_fn(|i| {
        _mm256_add_epi16(
            _mm256_slli_epi16::<{ super::super::RES_SHIFT }>(half(&a.qs, i)),
            half(&a.qr, i),
        )
    })
}

/// The 8 rows' totals, lane `r` = row `r`, from the pair sums of rows
/// 0-3 (`lo`: lanes `2r`, `2r + 1`) and rows 4-7 (`hi`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows8(lo: __m256i, hi: __m256i) -> __m256i {
    // Per 128-bit half: [r0 r1 r4 r5 | r2 r3 r6 r7], then in row order.
    _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_hadd_epi32(lo, hi))
}

/// The shared f32 step for 8 rows (lanes) and one token: `i` the unit's
/// (or half's) exact `Σ (q + OFF)·a` per row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn step<F: X8Fmt>(
    f: __m256,
    i: [__m256i; 2],
    a: &Q8Act,
    d: &[__m256; 2],
    m: __m256,
    off: i32,
) -> __m256 {
    let da = _mm256_set1_ps(a.d);
    let mut f = f;
    if F::SPLIT {
        for h in 0..2 {
            let t = _mm256_sub_epi32(i[h], _mm256_set1_epi32(off * a.isum[h]));
            f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(da, d[h]), f);
        }
    } else {
        let t = _mm256_sub_epi32(i[0], _mm256_set1_epi32(off * (a.isum[0] + a.isum[1])));
        f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(da, d[0]), f);
    }
    if F::HAS_MIN {
        f = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s), f);
    }
    f
}

/// One level's integer products of a unit of a group's 8 rows (lanes)
/// with `NT` tokens.
trait GroupDot {
    /// True where the kernel prefetches the weights [`PREFETCH_AHEAD`]
    /// bytes on.
    const PREFETCH: bool;
    /// True where the sums of formats with `OFF = 128` (signed quants)
    /// are `Σ q·a` (the offset already off) rather than `Σ (q + OFF)·a`.
    const SIGNED_SUMS: bool;
    /// The exact sums of unit `u` of block column `x` with the tokens'
    /// blocks `ab`, per half (`[t][h]`; half 0 holds the whole unit for
    /// formats with one scale per unit), lane `r` = row `r`. `PLAIN`: the
    /// blocks' remainders are 0 and not read.
    ///
    /// # Safety
    /// Inlined into a function with the level's features only; `x` holds
    /// one block column, `u < UNITS`.
    unsafe fn unit<F: X8Fmt, const PLAIN: bool, const NT: usize>(
        x: &[u8],
        u: usize,
        ab: &[&Q8Act; NT],
    ) -> Sums<NT>;
}

/// Per token, a unit's exact sums per half (lane = row).
type Sums<const NT: usize> = [[__m256i; 2]; NT];

/// One group of 8 rows times `NT` tokens with `K`'s products (without the
/// remainders' where `PLAIN`) and the shared f32 step.
///
/// # Safety
/// Inlined into a function with `K`'s level's features only.
#[inline(always)]
unsafe fn group<F: X8Fmt, K: GroupDot, const PLAIN: bool, const NT: usize>(
    g: &[u8],
    nblk: usize,
    a: [&[Q8Act]; NT],
    out: &mut [[f32; G]; 4],
) {
    let cb = G * F::BYTES;
    let off = if K::SIGNED_SUMS && F::OFF >= 128 {
        0
    } else {
        F::OFF
    };
    // SAFETY (every intrinsic and call): the level's features are enabled
    // where this is inlined (the caller's contract); x holds one block
    // column, u < UNITS.
    unsafe {
        let mut f = [_mm256_setzero_ps(); NT];
        let mut d = [[_mm256_setzero_ps(); 2]; 8];
        let mut m = [_mm256_setzero_ps(); 8];
        for blk in 0..nblk {
            let x = &g[blk * cb..(blk + 1) * cb];
            if K::PREFETCH {
                // The lines PREFETCH_AHEAD bytes on (past the group's end:
                // the next group's, which follows in memory; a prefetch
                // never faults).
                let ahead = g.as_ptr().wrapping_add(blk * cb + PREFETCH_AHEAD);
                for o in (0..cb).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(o) as *const i8);
                }
            }
            F::scales8(x, &mut d, &mut m);
            for u in 0..F::UNITS {
                let mut ab: [&Q8Act; NT] = [&a[0][0]; NT];
                for t in 0..NT {
                    ab[t] = &a[t][blk * F::UNITS + u];
                }
                let i32s = K::unit::<F, PLAIN, NT>(x, u, &ab);
                for t in 0..NT {
                    f[t] = step::<F>(f[t], i32s[t], ab[t], &d[u], m[u], off);
                }
            }
        }
        for t in 0..NT {
            // out[t] holds 8 f32; unaligned store.
            _mm256_storeu_ps(out[t].as_mut_ptr(), f[t]);
        }
    }
}

/// The AVX2 products: `maddubs` of the unsigned quants with the broadcast
/// activation words, summed in 16 bits over as many words as cannot
/// overflow. Formats with `OFF = 128` (signed quants) instead multiply the
/// quants sign-extended to 16 bits with the activations as exact 16-bit
/// values ([`wide16`]) by `vpmaddwd`; both give the same integer sums.
/// Without remainders (`PLAIN`) the unsigned formats take one `maddubs`
/// per quad and token instead of two, and the signed ones one `maddubs`
/// of `|q|` with the activation quants' signs moved by `q` (each pair sum
/// at most 2·128·127, inside `i16`) instead of two `vpmaddwd`.
struct Maddubs8;

impl GroupDot for Maddubs8 {
    const PREFETCH: bool = true;
    const SIGNED_SUMS: bool = true;
    #[inline(always)]
    unsafe fn unit<F: X8Fmt, const PLAIN: bool, const NT: usize>(
        x: &[u8],
        u: usize,
        ab: &[&Q8Act; NT],
    ) -> Sums<NT> {
        let signed = F::OFF >= 128;
        // Unsigned formats: words per 16-bit sum (each maddubs lane is at
        // most 2·UMAX·127).
        let per16 = (32767 / (2 * F::UMAX * 127)).clamp(1, 8) as usize;
        // SAFETY: avx2 (the caller's contract); x and u as the caller's.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let res = _mm256_set1_epi16(RES as i16);
            let mut i32s = [[_mm256_setzero_si256(); 2]; NT];
            let mut s16q = [_mm256_setzero_si256(); NT];
            let mut s16r = [_mm256_setzero_si256(); NT];
            let mut n16 = 0;
            // Signed formats: the activations as exact 16-bit values.
            let mut a16 = [[_mm256_setzero_si256(); 2]; NT];
            let mut lo = [_mm256_setzero_si256(); NT];
            let mut hi = [_mm256_setzero_si256(); NT];
            if signed && !PLAIN {
                for t in 0..NT {
                    a16[t] = wide16(ab[t]);
                }
            }
            for j in 0..8 {
                let h = if F::SPLIT { j / 4 } else { 0 };
                let wq = F::quad(x, u, j);
                if signed && PLAIN {
                    // |q| times the activation quants with q's sign, in
                    // 16-bit pair sums, then RES · Σ q·qs per row (lane).
                    let q = _mm256_xor_si256(wq, _mm256_set1_epi8(-128));
                    let qa = _mm256_abs_epi8(q);
                    for t in 0..NT {
                        let p = _mm256_maddubs_epi16(qa, _mm256_sign_epi8(bcast(&ab[t].qs, j), q));
                        i32s[t][h] = _mm256_add_epi32(i32s[t][h], _mm256_madd_epi16(p, res));
                    }
                } else if signed {
                    // The signed quants widened to 16 bits: rows 0-3
                    // (`ql`) and 4-7 (`qh`), four elements each.
                    let q = _mm256_xor_si256(wq, _mm256_set1_epi8(-128));
                    let ql = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
                    let qh = _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(q));
                    let pick = _mm256_add_epi32(
                        _mm256_setr_epi32(0, 1, 0, 1, 0, 1, 0, 1),
                        _mm256_set1_epi32(2 * (j % 4) as i32),
                    );
                    for t in 0..NT {
                        let a = _mm256_permutevar8x32_epi32(a16[t][j / 4], pick);
                        lo[t] = _mm256_add_epi32(lo[t], _mm256_madd_epi16(ql, a));
                        hi[t] = _mm256_add_epi32(hi[t], _mm256_madd_epi16(qh, a));
                    }
                    if j == 7 || (F::SPLIT && j == 3) {
                        for t in 0..NT {
                            i32s[t][h] = _mm256_add_epi32(i32s[t][h], rows8(lo[t], hi[t]));
                            lo[t] = _mm256_setzero_si256();
                            hi[t] = _mm256_setzero_si256();
                        }
                    }
                } else {
                    for t in 0..NT {
                        s16q[t] = _mm256_add_epi16(
                            s16q[t],
                            _mm256_maddubs_epi16(wq, bcast(&ab[t].qs, j)),
                        );
                        if !PLAIN {
                            s16r[t] = _mm256_add_epi16(
                                s16r[t],
                                _mm256_maddubs_epi16(wq, bcast(&ab[t].qr, j)),
                            );
                        }
                    }
                    n16 += 1;
                    if n16 == per16 || j == 7 || (F::SPLIT && j == 3) {
                        for t in 0..NT {
                            let mut p = _mm256_madd_epi16(s16q[t], res);
                            if !PLAIN {
                                p = _mm256_add_epi32(p, _mm256_madd_epi16(s16r[t], ones));
                            }
                            i32s[t][h] = _mm256_add_epi32(i32s[t][h], p);
                            s16q[t] = _mm256_setzero_si256();
                            s16r[t] = _mm256_setzero_si256();
                        }
                        n16 = 0;
                    }
                }
            }
            i32s
        }
    }
}

/// The AVX-512 VNNI products: 256-bit `vpdpbusd` of the unsigned quants
/// with the broadcast activation words (the quants' alone where `PLAIN`).
struct Vnni8;

impl GroupDot for Vnni8 {
    const PREFETCH: bool = false;
    const SIGNED_SUMS: bool = false;
    #[inline(always)]
    unsafe fn unit<F: X8Fmt, const PLAIN: bool, const NT: usize>(
        x: &[u8],
        u: usize,
        ab: &[&Q8Act; NT],
    ) -> Sums<NT> {
        // SAFETY: the VNNI level (the caller's contract); x and u as the
        // caller's.
        unsafe {
            let mut sq = [[_mm256_setzero_si256(); 2]; NT];
            let mut sr = [[_mm256_setzero_si256(); 2]; NT];
            for j in 0..8 {
                let h = if F::SPLIT { j / 4 } else { 0 };
                let wq = F::quad(x, u, j);
                for t in 0..NT {
                    sq[t][h] = _mm256_dpbusd_epi32(sq[t][h], wq, bcast(&ab[t].qs, j));
                    if !PLAIN {
                        sr[t][h] = _mm256_dpbusd_epi32(sr[t][h], wq, bcast(&ab[t].qr, j));
                    }
                }
            }
            std::array::from_fn(|t| {
                [0, 1].map(|h| _mm256_add_epi32(_mm256_slli_epi32::<8>(sq[t][h]), sr[t][h]))
            })
        }
    }
}
