//! AVX2 kernels of the fast path: activation quantization and the
//! `maddubs`/`madd` block products (R weight rows x up to 4 tokens).

use super::{Q8Act, QK, RES, RES_SHIFT};
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

/// Same results as the scalar reference `quantize_act_scalar`, bit for bit.
///
/// # Safety
/// The CPU must support avx2/fma/f16c; `x.len() == 32 * out.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize(x: &[f32], out: &mut [Q8Act]) {
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
        let sum = |a: &[__m256i; 4]| {
            _mm256_add_epi32(_mm256_add_epi32(a[0], a[1]), _mm256_add_epi32(a[2], a[3]))
        };
        let isum = _mm256_add_epi32(_mm256_slli_epi32::<RES_SHIFT>(sum(&q)), sum(&r));
        o.d = c / RES as f32;
        o.isum = hsum_i32(isum);
        o.s = o.d * o.isum as f32;
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    let bits = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// A weight block decoded to 32 bytes in element order: signed (Q8_0,
/// Q4_0) or unsigned 0..15 (Q4_1).
pub(super) trait Block {
    const BYTES: usize;
    const SIGNED: bool;
    const HAS_MIN: bool;
    /// (quants, d, m)
    ///
    /// # Safety
    /// The CPU must support avx2/fma/f16c; `b` holds one block.
    unsafe fn load(b: &[u8]) -> (__m256i, f32, f32);
    /// The weights as unsigned bytes `u = q + OFF` in element order (Q8_0
    /// `q ^ 0x80`, Q4_0 and Q4_1 the stored nibbles), for kernels that use
    /// them as `vpdpbusd`'s unsigned operand and take `OFF · Σ a` back off
    /// in integers.
    ///
    /// # Safety
    /// As [`Block::load`].
    unsafe fn load_u(b: &[u8]) -> __m256i;
    /// What [`Block::load_u`] adds to every signed quant.
    const OFF: i32;
}

pub(super) struct BQ8_0;
pub(super) struct BQ4_0;
pub(super) struct BQ4_1;

impl Block for BQ8_0 {
    const BYTES: usize = 34;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(b: &[u8]) -> (__m256i, f32, f32) {
        let q = &b[2..34];
        // SAFETY: q has 32 bytes; unaligned load.
        let v = unsafe { _mm256_loadu_si256(q.as_ptr() as *const __m256i) };
        (v, f16_at(b, 0), 0.0)
    }
    const OFF: i32 = 128;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_u(b: &[u8]) -> __m256i {
        let q = &b[2..34];
        // SAFETY: q has 32 bytes; unaligned load.
        let v = unsafe { _mm256_loadu_si256(q.as_ptr() as *const __m256i) };
        _mm256_xor_si256(v, _mm256_set1_epi8(-128))
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles32(q: &[u8]) -> __m256i {
    let q = &q[..16];
    // SAFETY: q has 16 bytes; unaligned load. AVX2 is enabled in every caller.
    unsafe {
        let v = _mm_loadu_si128(q.as_ptr() as *const __m128i);
        let both = _mm256_set_m128i(_mm_srli_epi16::<4>(v), v);
        _mm256_and_si256(both, _mm256_set1_epi8(15))
    }
}

impl Block for BQ4_0 {
    const BYTES: usize = 18;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(b: &[u8]) -> (__m256i, f32, f32) {
        // SAFETY: as nibbles32.
        let v = unsafe { _mm256_sub_epi8(nibbles32(&b[2..18]), _mm256_set1_epi8(8)) };
        (v, f16_at(b, 0), 0.0)
    }
    const OFF: i32 = 8;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_u(b: &[u8]) -> __m256i {
        // SAFETY: as nibbles32.
        unsafe { nibbles32(&b[2..18]) }
    }
}

impl Block for BQ4_1 {
    const BYTES: usize = 20;
    const SIGNED: bool = false;
    const HAS_MIN: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(b: &[u8]) -> (__m256i, f32, f32) {
        // SAFETY: as nibbles32.
        let v = unsafe { nibbles32(&b[4..20]) };
        (v, f16_at(b, 0), f16_at(b, 2))
    }
    const OFF: i32 = 0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_u(b: &[u8]) -> __m256i {
        // SAFETY: as nibbles32.
        unsafe { nibbles32(&b[4..20]) }
    }
}

/// # Safety
/// The CPU must support avx2/fma/f16c; `dtype` must be one the fast path
/// [supports](super::supports).
#[target_feature(enable = "avx2,fma,f16c")]
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
        DType::Q5_0 => unit_rows::<UQ5_0>(w, row_bytes, acts, out),
        DType::Q5_1 => unit_rows::<UQ5_1>(w, row_bytes, acts, out),
        DType::IQ4_NL => unit_rows::<UIq4Nl>(w, row_bytes, acts, out),
        DType::Q3_K => unit_rows::<UQ3K>(w, row_bytes, acts, out),
        DType::Q4_K => unit_rows::<UQ4K>(w, row_bytes, acts, out),
        DType::Q5_K => unit_rows::<UQ5K>(w, row_bytes, acts, out),
        DType::Q6_K => unit_rows::<UQ6K>(w, row_bytes, acts, out),
        DType::IQ4_XS => unit_rows::<UIq4Xs>(w, row_bytes, acts, out),
        _ => unreachable!("checked by supports()"),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn rows<B: Block>(w: &[u8], row_bytes: usize, acts: &[&[Q8Act]], out: &mut [f32]) {
    // R rows x NT tokens of independent accumulators per kernel call:
    // enough chains to hide the fmadd latency, few enough for 16 registers.
    match acts.len() {
        // Two interleaved rows help short rows (k=576 Q4: 360 bytes) but
        // stall on loads for long ones (Q8_0 rows, k=1536): measured on
        // the benchmark machine (AMD EPYC), 1.4 vs 1.9 ms and 3.2 vs 1.4 ms.
        1 if row_bytes <= 512 => rows_nt::<B, 1, 2>(w, row_bytes, acts, out),
        1 => rows_nt::<B, 1, 1>(w, row_bytes, acts, out),
        2 => rows_nt::<B, 2, 2>(w, row_bytes, acts, out),
        3 => rows_nt::<B, 3, 2>(w, row_bytes, acts, out),
        4 => rows_nt::<B, 4, 2>(w, row_bytes, acts, out),
        _ => unreachable!("tiles have 1..=4 tokens"),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn rows_nt<B: Block, const NT: usize, const R: usize>(
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
    let mut r = 0;
    while r + R <= nr {
        kern::<B, R, NT>(
            &w[r * row_bytes..(r + R) * row_bytes],
            nb,
            &a,
            &mut out[r * NT..(r + R) * NT],
        );
        r += R;
    }
    while r < nr {
        kern::<B, 1, NT>(
            &w[r * row_bytes..(r + 1) * row_bytes],
            nb,
            &a,
            &mut out[r * NT..(r + 1) * NT],
        );
        r += 1;
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn kern<B: Block, const R: usize, const NT: usize>(
    w: &[u8],
    nb: usize,
    a: &[&[Q8Act]; NT],
    out: &mut [f32],
) {
    let rb = nb * B::BYTES;
    assert!(w.len() == R * rb && out.len() == R * NT);
    let ones = _mm256_set1_epi16(1);
    let res = _mm256_set1_epi16(RES as i16);
    let mut acc = [[_mm256_setzero_ps(); NT]; R];
    let mut msum = [[0f32; NT]; R];
    for b in 0..nb {
        // Plain loops, not `array::from_fn`: its closure is not inlined
        // into this target-feature function (it showed up as its own
        // symbol in the profile, called per block and row).
        let mut q = [_mm256_setzero_si256(); R];
        let mut qu = [_mm256_setzero_si256(); R];
        let mut dw = [0f32; R];
        let mut mw = [0f32; R];
        for r in 0..R {
            let at = r * rb + b * B::BYTES;
            // SAFETY: the slice has B::BYTES bytes.
            let (qq, d, m) = unsafe { B::load(&w[at..at + B::BYTES]) };
            q[r] = qq;
            qu[r] = if B::SIGNED {
                _mm256_sign_epi8(qq, qq)
            } else {
                qq
            };
            dw[r] = d;
            mw[r] = m;
        }
        for t in 0..NT {
            let ab = &a[t][b];
            // SAFETY: qs and qr have 32 bytes each; unaligned loads.
            let (av, ar) = unsafe {
                (
                    _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i),
                    _mm256_loadu_si256(ab.qr.as_ptr() as *const __m256i),
                )
            };
            for r in 0..R {
                let (sa, sr) = if B::SIGNED {
                    (_mm256_sign_epi8(av, q[r]), _mm256_sign_epi8(ar, q[r]))
                } else {
                    (av, ar)
                };
                // 256·Σ w·qs + Σ w·qr per 4 elements; every maddubs pair
                // sum is at most 2·128·127, inside i16.
                let p = _mm256_add_epi32(
                    _mm256_madd_epi16(_mm256_maddubs_epi16(qu[r], sa), res),
                    _mm256_madd_epi16(_mm256_maddubs_epi16(qu[r], sr), ones),
                );
                acc[r][t] = _mm256_fmadd_ps(
                    _mm256_set1_ps(dw[r] * ab.d),
                    _mm256_cvtepi32_ps(p),
                    acc[r][t],
                );
                if B::HAS_MIN {
                    msum[r][t] += mw[r] * ab.s;
                }
            }
        }
    }
    for r in 0..R {
        for t in 0..NT {
            out[r * NT + t] = hsum(acc[r][t]) + msum[r][t];
        }
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

/// `0xff` in byte `i` where bit `n` of byte `i` of the 32 bytes at `p` is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bit_n(p: &[u8], n: usize) -> __m256i {
    let p = &p[..32];
    // SAFETY: p has 32 bytes; unaligned load.
    let v = unsafe { _mm256_loadu_si256(p.as_ptr() as *const __m256i) };
    let bit = _mm256_set1_epi8((1u8 << n) as i8);
    _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit)
}

/// 32 bytes at `p` shifted right by `n` bits (per byte: `n` < 8) and masked with `mask`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bits_at(p: &[u8], n: usize, mask: i8) -> __m256i {
    let p = &p[..32];
    // SAFETY: p has 32 bytes; unaligned load.
    let v = unsafe { _mm256_loadu_si256(p.as_ptr() as *const __m256i) };
    let v = _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32));
    _mm256_and_si256(v, _mm256_set1_epi8(mask))
}

/// The IQ4 grid looked up for 32 nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn iq4_grid(nib: __m256i) -> __m256i {
    let g = crate::kernels::quantized::blocks::IQ4_VALUES;
    // SAFETY: the grid has 16 bytes; unaligned load.
    let t = unsafe { _mm_loadu_si128(g.as_ptr() as *const __m128i) };
    _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nib)
}

/// A weight format seen as 32-element units (`units.rs`): per block the
/// scales and additive terms of its units, per unit its 32 quants.
pub(super) trait Unit {
    /// Bytes per storage block.
    const BYTES: usize;
    /// Units per storage block.
    const UNITS: usize;
    /// Signed quants (else 0..31).
    const SIGNED: bool;
    /// A non-zero additive term `m`.
    const HAS_MIN: bool;
    /// One scale per 16-element half (else `d[u][0] == d[u][1]`).
    const SPLIT: bool;
    /// The dtype (its scales are decoded by `units::block_scales`).
    const DTYPE: DType;
    /// The 32 quants of unit `u` of block `b`, as `decode_unit` gives them.
    ///
    /// # Safety
    /// The CPU must support avx2/fma/f16c; `b` holds one block, `u < UNITS`.
    unsafe fn quants(b: &[u8], u: usize) -> __m256i;
}

pub(super) struct UQ5_0;
pub(super) struct UQ5_1;
pub(super) struct UIq4Nl;
pub(super) struct UQ3K;
pub(super) struct UQ4K;
pub(super) struct UQ5K;
pub(super) struct UQ6K;
pub(super) struct UIq4Xs;

impl Unit for UQ5_0 {
    const BYTES: usize = 22;
    const UNITS: usize = 1;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    const SPLIT: bool = false;
    const DTYPE: DType = DType::Q5_0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(b: &[u8], _u: usize) -> __m256i {
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        // SAFETY: as nibbles32.
        let nib = unsafe { nibbles32(&b[6..22]) };
        let q = _mm256_or_si256(nib, _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(16)));
        _mm256_sub_epi8(q, _mm256_set1_epi8(16))
    }
}

impl Unit for UQ5_1 {
    const BYTES: usize = 24;
    const UNITS: usize = 1;
    const SIGNED: bool = false;
    const HAS_MIN: bool = true;
    const SPLIT: bool = false;
    const DTYPE: DType = DType::Q5_1;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(b: &[u8], _u: usize) -> __m256i {
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        // SAFETY: as nibbles32.
        let nib = unsafe { nibbles32(&b[8..24]) };
        _mm256_or_si256(nib, _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(16)))
    }
}

impl Unit for UIq4Nl {
    const BYTES: usize = 18;
    const UNITS: usize = 1;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    const SPLIT: bool = false;
    const DTYPE: DType = DType::IQ4_NL;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(b: &[u8], _u: usize) -> __m256i {
        // SAFETY: as nibbles32.
        iq4_grid(unsafe { nibbles32(&b[2..18]) })
    }
}

impl Unit for UQ3K {
    const BYTES: usize = 110;
    const UNITS: usize = 8;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    const SPLIT: bool = true;
    const DTYPE: DType = DType::Q3_K;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(b: &[u8], u: usize) -> __m256i {
        let (h, s) = (u / 4, u % 4);
        // SAFETY: both ranges lie inside the block.
        let (low, high) = unsafe { (bits_at(&b[32 + 32 * h..], 2 * s, 3), bit_n(&b[0..32], u)) };
        _mm256_sub_epi8(low, _mm256_andnot_si256(high, _mm256_set1_epi8(4)))
    }
}

impl Unit for UQ4K {
    const BYTES: usize = 144;
    const UNITS: usize = 8;
    const SIGNED: bool = false;
    const HAS_MIN: bool = true;
    const SPLIT: bool = false;
    const DTYPE: DType = DType::Q4_K;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(b: &[u8], u: usize) -> __m256i {
        // SAFETY: the range lies inside the block.
        unsafe { bits_at(&b[16 + 32 * (u / 2)..], 4 * (u % 2), 15) }
    }
}

impl Unit for UQ5K {
    const BYTES: usize = 176;
    const UNITS: usize = 8;
    const SIGNED: bool = false;
    const HAS_MIN: bool = true;
    const SPLIT: bool = false;
    const DTYPE: DType = DType::Q5_K;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(b: &[u8], u: usize) -> __m256i {
        // SAFETY: both ranges lie inside the block.
        let (lo, hi) = unsafe {
            (
                bits_at(&b[48 + 32 * (u / 2)..], 4 * (u % 2), 15),
                bit_n(&b[16..48], u),
            )
        };
        _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(16)))
    }
}

impl Unit for UQ6K {
    const BYTES: usize = 210;
    const UNITS: usize = 8;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    const SPLIT: bool = true;
    const DTYPE: DType = DType::Q6_K;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(b: &[u8], u: usize) -> __m256i {
        let (n, k) = (u / 4, u % 4);
        // SAFETY: both ranges lie inside the block.
        let (lo, hi) = unsafe {
            (
                bits_at(&b[64 * n + 32 * (k & 1)..], 4 * (k >> 1), 15),
                bits_at(&b[128 + 32 * n..], 2 * k, 3),
            )
        };
        let q = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi));
        _mm256_sub_epi8(q, _mm256_set1_epi8(32))
    }
}

impl Unit for UIq4Xs {
    const BYTES: usize = 136;
    const UNITS: usize = 8;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    const SPLIT: bool = false;
    const DTYPE: DType = DType::IQ4_XS;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(b: &[u8], u: usize) -> __m256i {
        // SAFETY: as nibbles32.
        iq4_grid(unsafe { nibbles32(&b[8 + 16 * u..8 + 16 * u + 16]) })
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn unit_rows<U: Unit>(w: &[u8], row_bytes: usize, acts: &[&[Q8Act]], out: &mut [f32]) {
    match acts.len() {
        1 if row_bytes <= 512 => unit_rows_nt::<U, 1, 2>(w, row_bytes, acts, out),
        1 => unit_rows_nt::<U, 1, 1>(w, row_bytes, acts, out),
        2 => unit_rows_nt::<U, 2, 2>(w, row_bytes, acts, out),
        3 => unit_rows_nt::<U, 3, 2>(w, row_bytes, acts, out),
        4 => unit_rows_nt::<U, 4, 2>(w, row_bytes, acts, out),
        _ => unreachable!("tiles have 1..=4 tokens"),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn unit_rows_nt<U: Unit, const NT: usize, const R: usize>(
    w: &[u8],
    row_bytes: usize,
    acts: &[&[Q8Act]],
    out: &mut [f32],
) {
    let nr = w.len() / row_bytes;
    assert!(w.len() == nr * row_bytes && out.len() == nr * NT && acts.len() == NT);
    let nblk = row_bytes / U::BYTES;
    assert!(nblk * U::BYTES == row_bytes);
    let mut a: [&[Q8Act]; NT] = [&[]; NT];
    for t in 0..NT {
        a[t] = &acts[t][..nblk * U::UNITS];
    }
    let mut r = 0;
    while r + R <= nr {
        unit_kern::<U, R, NT>(
            &w[r * row_bytes..(r + R) * row_bytes],
            nblk,
            &a,
            &mut out[r * NT..(r + R) * NT],
        );
        r += R;
    }
    while r < nr {
        unit_kern::<U, 1, NT>(
            &w[r * row_bytes..(r + 1) * row_bytes],
            nblk,
            &a,
            &mut out[r * NT..(r + 1) * NT],
        );
        r += 1;
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unit_kern<U: Unit, const R: usize, const NT: usize>(
    w: &[u8],
    nblk: usize,
    a: &[&[Q8Act]; NT],
    out: &mut [f32],
) {
    let rb = nblk * U::BYTES;
    assert!(w.len() == R * rb && out.len() == R * NT);
    let ones = _mm256_set1_epi16(1);
    let res = _mm256_set1_epi16(RES as i16);
    let mut acc = [[_mm256_setzero_ps(); NT]; R];
    let mut msum = [[0f32; NT]; R];
    // Overwritten per block (the first UNITS entries), zeroed once.
    let mut d = [[[0f32; 2]; 8]; R];
    let mut m = [[0f32; 8]; R];
    for blk in 0..nblk {
        for r in 0..R {
            let at = r * rb + blk * U::BYTES;
            super::units::block_scales(U::DTYPE, &w[at..at + U::BYTES], &mut d[r], &mut m[r]);
        }
        for u in 0..U::UNITS {
            let mut q = [_mm256_setzero_si256(); R];
            let mut qu = [_mm256_setzero_si256(); R];
            for r in 0..R {
                let at = r * rb + blk * U::BYTES;
                // SAFETY: the slice holds one block; u < UNITS.
                q[r] = unsafe { U::quants(&w[at..at + U::BYTES], u) };
                qu[r] = if U::SIGNED {
                    _mm256_sign_epi8(q[r], q[r])
                } else {
                    q[r]
                };
            }
            for t in 0..NT {
                let ab = &a[t][blk * U::UNITS + u];
                // SAFETY: qs and qr have 32 bytes each; unaligned loads.
                let (av, ar) = unsafe {
                    (
                        _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i),
                        _mm256_loadu_si256(ab.qr.as_ptr() as *const __m256i),
                    )
                };
                for r in 0..R {
                    let (sa, sr) = if U::SIGNED {
                        (_mm256_sign_epi8(av, q[r]), _mm256_sign_epi8(ar, q[r]))
                    } else {
                        (av, ar)
                    };
                    // |q| ≤ 127 (the IQ4 grid's -127 at most): every maddubs
                    // pair sum is at most 2·127·127, inside i16.
                    let p = _mm256_add_epi32(
                        _mm256_madd_epi16(_mm256_maddubs_epi16(qu[r], sa), res),
                        _mm256_madd_epi16(_mm256_maddubs_epi16(qu[r], sr), ones),
                    );
                    // Lanes 0..4 hold elements 0..16, lanes 4..8 elements 16..32.
                    let sc = if U::SPLIT {
                        _mm256_set_m128(
                            _mm_set1_ps(d[r][u][1] * ab.d),
                            _mm_set1_ps(d[r][u][0] * ab.d),
                        )
                    } else {
                        _mm256_set1_ps(d[r][u][0] * ab.d)
                    };
                    acc[r][t] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(p), acc[r][t]);
                    if U::HAS_MIN {
                        msum[r][t] += m[r][u] * ab.s;
                    }
                }
            }
        }
    }
    for r in 0..R {
        for t in 0..NT {
            out[r * NT + t] = hsum(acc[r][t]) + msum[r][t];
        }
    }
}
