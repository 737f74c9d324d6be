//! Block-quantized weight formats: row dequantization, exact dot products and the
//! reference quantizers. The block layouts and their dequantization (bit-exact with
//! ggml's reference and the `gguf` Python package) are in [`blocks`]; the exact
//! f32-activation matmul is [`exact`], the integer fast path [`fast`].
//!
//! [`dot_row_at`] multiplies one quantized row with an f32 vector without materialising the
//! row: an AVX2+FMA+F16C kernel when the CPU has them (runtime detection), else the scalar
//! reference [`dot_row_scalar`]. The two agree up to f32 summation order.

// Block kernels index several arrays with one loop counter, mirroring ggml's reference code.
#![allow(clippy::needless_range_loop)]

pub mod blocks;
pub mod exact;
pub mod fast;
#[cfg(test)]
mod invariance;
pub mod quantize;

use self::blocks::dequant_block;
use crate::ir::DType;
use crate::kernels::Isa;
use half::{bf16, f16};
use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum QuantError {
    #[error("{dtype}: {n} elements need {expected} bytes, got {got}")]
    Length {
        dtype: DType,
        n: usize,
        expected: usize,
        got: usize,
    },
    #[error("{dtype}: {n} elements is not a whole number of {block}-element blocks")]
    PartialBlock {
        dtype: DType,
        n: usize,
        block: usize,
    },
    #[error("{0} is not a floating-point or quantized weight type")]
    NotFloat(DType),
    #[error("quantizing to {0} is not implemented")]
    NoQuantizer(DType),
}

fn check(dtype: DType, n: usize, bytes: usize) -> Result<(), QuantError> {
    if matches!(dtype, DType::I32 | DType::BF16Z) {
        // BF16Z rows are not self-contained (see `kernels::bf16z`).
        return Err(QuantError::NotFloat(dtype));
    }
    let expected = dtype.bytes_for(n).ok_or(QuantError::PartialBlock {
        dtype,
        n,
        block: dtype.block_elems(),
    })?;
    if expected != bytes {
        return Err(QuantError::Length {
            dtype,
            n,
            expected,
            got: bytes,
        });
    }
    Ok(())
}

/// Dequantizes a row of `out.len()` elements stored as `dtype` in `bytes`.
pub fn dequantize_row(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    check(dtype, out.len(), bytes.len())?;
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        _ => {
            let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
            for (o, b) in out.chunks_exact_mut(be).zip(bytes.chunks_exact(bb)) {
                dequant_block(dtype, b, o);
            }
        }
    }
    Ok(())
}

/// Scalar reference dot product of a stored row with `x` (f32 accumulation in element order).
///
/// # Panics
/// If `row` is not exactly `dtype.bytes_for(x.len())` bytes or `dtype` is `I32`
/// (weights are validated at load time, so this is a programming error).
pub fn dot_row_scalar(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    if let Err(e) = check(dtype, x.len(), row.len()) {
        panic!("dot_row: {e}");
    }
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    let mut buf = [0f32; 256];
    let mut sum = 0f32;
    for (xb, b) in x.chunks_exact(be).zip(row.chunks_exact(bb)) {
        dequant_block(dtype, b, &mut buf[..be]);
        for (w, v) in buf[..be].iter().zip(xb) {
            sum += w * v;
        }
    }
    sum
}

/// True when the AVX2 kernels can run on this CPU (the [`Isa::Avx2`] level).
pub fn simd_available() -> bool {
    Isa::detect().avx2()
}

/// The AVX2 kernel, or `None` when the CPU lacks AVX2/FMA/F16C. Same contract as
/// [`dot_row_scalar`].
pub fn dot_row_simd(dtype: DType, row: &[u8], x: &[f32]) -> Option<f32> {
    if let Err(e) = check(dtype, x.len(), row.len()) {
        panic!("dot_row: {e}");
    }
    #[cfg(target_arch = "x86_64")]
    {
        if simd_available() {
            // SAFETY: the CPU supports avx2, fma and f16c (checked just above), and `row`
            // holds exactly the blocks for `x.len()` elements (checked by `check`).
            return Some(unsafe { avx2::dot(dtype, row, x) });
        }
    }
    None
}

/// Dot product of a stored row with `x`, dequantizing in registers: the AVX2
/// kernel at the [`Isa::Avx2`] level and above (lowered to what the CPU
/// supports), else the scalar reference.
///
/// # Panics
/// As [`dot_row_scalar`].
pub fn dot_row_at(isa: Isa, dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    if isa.avx2() {
        if let Some(v) = dot_row_simd(dtype, row, x) {
            return v;
        }
    }
    dot_row_scalar(dtype, row, x)
}

/// Quantizes `x` into `out` with ggml's reference quantizers (`quantize_row_*_ref`).
/// Supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1.
pub fn quantize_row(dtype: DType, x: &[f32], out: &mut [u8]) -> Result<(), QuantError> {
    check(dtype, x.len(), out.len())?;
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    for (xb, o) in x.chunks_exact(be).zip(out.chunks_exact_mut(bb)) {
        match dtype {
            DType::F32 => o.copy_from_slice(&xb[0].to_le_bytes()),
            DType::F16 => o.copy_from_slice(&f16::from_f32(xb[0]).to_le_bytes()),
            DType::BF16 => o.copy_from_slice(&bf16::from_f32(xb[0]).to_le_bytes()),
            DType::Q8_0 => {
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                o[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                for i in 0..32 {
                    o[2 + i] = ((xb[i] * id).round() as i8) as u8;
                }
            }
            DType::Q4_0 => {
                // The value with the largest magnitude, sign kept.
                let mut max = 0f32;
                let mut amax = 0f32;
                for &v in xb {
                    if v.abs() > amax {
                        amax = v.abs();
                        max = v;
                    }
                }
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                o[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                for i in 0..16 {
                    let a = ((xb[i] * id + 8.5) as u8).min(15);
                    let b = ((xb[i + 16] * id + 8.5) as u8).min(15);
                    o[2 + i] = a | (b << 4);
                }
            }
            DType::Q4_1 => {
                let min = xb.iter().copied().fold(f32::INFINITY, f32::min);
                let max = xb.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                o[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                o[2..4].copy_from_slice(&f16::from_f32(min).to_le_bytes());
                for i in 0..16 {
                    let a = (((xb[i] - min) * id + 0.5) as u8).min(15);
                    let b = (((xb[i + 16] - min) * id + 0.5) as u8).min(15);
                    o[4 + i] = a | (b << 4);
                }
            }
            other => return Err(QuantError::NoQuantizer(other)),
        }
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::blocks::{dequant_block, k_scale_min as q4k_scale_min, rd_f16};
    use crate::ir::DType;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// Loads 8 f32 from `x[at..at + 8]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn ld8(x: &[f32], at: usize) -> __m256 {
        let s = &x[at..at + 8];
        // SAFETY: `s` has exactly 8 f32; unaligned load.
        unsafe { _mm256_loadu_ps(s.as_ptr()) }
    }

    /// Loads 8 bytes `b[at..at + 8]` into the low half of an xmm register.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn ld8b(b: &[u8], at: usize) -> __m128i {
        let s = &b[at..at + 8];
        // SAFETY: `s` has exactly 8 bytes; `_mm_loadl_epi64` reads 8 bytes, unaligned.
        unsafe { _mm_loadl_epi64(s.as_ptr() as *const __m128i) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn ld16b(b: &[u8], at: usize) -> __m128i {
        let s = &b[at..at + 16];
        // SAFETY: `s` has exactly 16 bytes; unaligned load.
        unsafe { _mm_loadu_si128(s.as_ptr() as *const __m128i) }
    }

    /// i8 lanes 0..8 of `v` as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn i8lo(v: __m128i) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
    }
    /// i8 lanes 8..16 of `v` as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn i8hi(v: __m128i) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(v)))
    }

    /// # Safety
    /// The CPU must support avx2, fma and f16c; `row` must hold exactly the blocks for
    /// `x.len()` elements of `dtype` (not I32).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
        match dtype {
            DType::F32 => dot_f32(row, x),
            DType::F16 => dot_f16(row, x),
            DType::BF16 => dot_bf16(row, x),
            DType::Q8_0 => dot_q8_0(row, x),
            DType::Q4_0 => dot_q4_0(row, x),
            DType::Q4_1 => dot_q4_1(row, x),
            DType::Q4_K => dot_q4_k(row, x),
            DType::Q6_K => dot_q6_k(row, x),
            DType::Q5_0
            | DType::Q5_1
            | DType::Q2_K
            | DType::Q3_K
            | DType::Q5_K
            | DType::IQ4_NL
            | DType::IQ4_XS => dot_dequant(dtype, row, x),
            DType::I32 | DType::BF16Z => unreachable!("rejected by check()"),
        }
    }

    /// Any block format: each block dequantized (scalar, exact) into a
    /// buffer, then multiplied with `x` in vector registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_dequant(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
        let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
        let mut buf = [0f32; 256];
        let mut acc = _mm256_setzero_ps();
        for (b, xb) in row.chunks_exact(bb).zip(x.chunks_exact(be)) {
            dequant_block(dtype, b, &mut buf[..be]);
            for i in (0..be).step_by(8) {
                acc = _mm256_fmadd_ps(ld8(&buf, i), ld8(xb, i), acc);
            }
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
        let n8 = x.len() / 8 * 8;
        let mut acc = _mm256_setzero_ps();
        for i in (0..n8).step_by(8) {
            let s = &row[4 * i..4 * i + 32];
            // SAFETY: `s` has exactly 32 bytes (8 f32); unaligned load.
            let w = unsafe { _mm256_loadu_ps(s.as_ptr() as *const f32) };
            acc = _mm256_fmadd_ps(w, ld8(x, i), acc);
        }
        let mut sum = hsum(acc);
        for i in n8..x.len() {
            let c = &row[4 * i..4 * i + 4];
            sum += f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * x[i];
        }
        sum
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
        let n8 = x.len() / 8 * 8;
        let mut acc = _mm256_setzero_ps();
        for i in (0..n8).step_by(8) {
            let w = _mm256_cvtph_ps(ld16b(row, 2 * i));
            acc = _mm256_fmadd_ps(w, ld8(x, i), acc);
        }
        let mut sum = hsum(acc);
        for i in n8..x.len() {
            sum += rd_f16(row, 2 * i) * x[i];
        }
        sum
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
        let n8 = x.len() / 8 * 8;
        let mut acc = _mm256_setzero_ps();
        for i in (0..n8).step_by(8) {
            let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(ld16b(row, 2 * i)));
            acc = _mm256_fmadd_ps(_mm256_castsi256_ps(w), ld8(x, i), acc);
        }
        let mut sum = hsum(acc);
        for i in n8..x.len() {
            let b = u32::from(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])) << 16;
            sum += f32::from_bits(b) * x[i];
        }
        sum
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_q8_0(row: &[u8], x: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (b, xb) in row.chunks_exact(34).zip(x.chunks_exact(32)) {
            let q0 = ld16b(b, 2);
            let q1 = ld16b(b, 18);
            let mut s = _mm256_mul_ps(i8lo(q0), ld8(xb, 0));
            s = _mm256_fmadd_ps(i8hi(q0), ld8(xb, 8), s);
            s = _mm256_fmadd_ps(i8lo(q1), ld8(xb, 16), s);
            s = _mm256_fmadd_ps(i8hi(q1), ld8(xb, 24), s);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(rd_f16(b, 0)), s, acc);
        }
        hsum(acc)
    }

    /// Low and high nibbles of 16 bytes, as bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn nibbles(q: __m128i) -> (__m128i, __m128i) {
        let m = _mm_set1_epi8(15);
        (
            _mm_and_si128(q, m),
            _mm_and_si128(_mm_srli_epi16::<4>(q), m),
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_q4_0(row: &[u8], x: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let eight = _mm_set1_epi8(8);
        for (b, xb) in row.chunks_exact(18).zip(x.chunks_exact(32)) {
            let (lo, hi) = nibbles(ld16b(b, 2));
            let (lo, hi) = (_mm_sub_epi8(lo, eight), _mm_sub_epi8(hi, eight));
            let mut s = _mm256_mul_ps(i8lo(lo), ld8(xb, 0));
            s = _mm256_fmadd_ps(i8hi(lo), ld8(xb, 8), s);
            s = _mm256_fmadd_ps(i8lo(hi), ld8(xb, 16), s);
            s = _mm256_fmadd_ps(i8hi(hi), ld8(xb, 24), s);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(rd_f16(b, 0)), s, acc);
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_q4_1(row: &[u8], x: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (b, xb) in row.chunks_exact(20).zip(x.chunks_exact(32)) {
            // Nibbles are 0..15, so signed i8 conversion is exact.
            let (lo, hi) = nibbles(ld16b(b, 4));
            let (x0, x1, x2, x3) = (ld8(xb, 0), ld8(xb, 8), ld8(xb, 16), ld8(xb, 24));
            let mut s = _mm256_mul_ps(i8lo(lo), x0);
            s = _mm256_fmadd_ps(i8hi(lo), x1, s);
            s = _mm256_fmadd_ps(i8lo(hi), x2, s);
            s = _mm256_fmadd_ps(i8hi(hi), x3, s);
            let sx = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(rd_f16(b, 0)), s, acc);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(rd_f16(b, 2)), sx, acc);
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_q4_k(row: &[u8], x: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (b, xb) in row.chunks_exact(144).zip(x.chunks_exact(256)) {
            let d = rd_f16(b, 0);
            let dmin = rd_f16(b, 2);
            let scales = &b[4..16];
            for j in 0..4 {
                let q = 16 + 32 * j;
                let (lo0, hi0) = nibbles(ld16b(b, q));
                let (lo1, hi1) = nibbles(ld16b(b, q + 16));
                let xs = &xb[64 * j..64 * j + 64];
                for (half, (a, c)) in [(lo0, lo1), (hi0, hi1)].into_iter().enumerate() {
                    let (sc, m) = q4k_scale_min(scales, 2 * j + half);
                    let o = 32 * half;
                    let (x0, x1, x2, x3) =
                        (ld8(xs, o), ld8(xs, o + 8), ld8(xs, o + 16), ld8(xs, o + 24));
                    let mut s = _mm256_mul_ps(i8lo(a), x0);
                    s = _mm256_fmadd_ps(i8hi(a), x1, s);
                    s = _mm256_fmadd_ps(i8lo(c), x2, s);
                    s = _mm256_fmadd_ps(i8hi(c), x3, s);
                    let sx = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc as f32), s, acc);
                    acc = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * m as f32), sx, acc);
                }
            }
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_q6_k(row: &[u8], x: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let m4 = _mm256_set1_epi32(15);
        let m2 = _mm256_set1_epi32(3);
        let off = _mm256_set1_epi32(32);
        for (b, xb) in row.chunks_exact(210).zip(x.chunks_exact(256)) {
            let d = rd_f16(b, 208);
            for h in 0..2 {
                let (ql, qh, sc) = (64 * h, 128 + 32 * h, 192 + 8 * h);
                let xs = &xb[128 * h..128 * h + 128];
                for l in (0..32).step_by(8) {
                    let is = l / 16;
                    let a = _mm256_cvtepu8_epi32(ld8b(b, ql + l));
                    let c = _mm256_cvtepu8_epi32(ld8b(b, ql + l + 32));
                    let hb = _mm256_cvtepu8_epi32(ld8b(b, qh + l));
                    let hpart = |shift: __m128i| {
                        _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srl_epi32(hb, shift), m2))
                    };
                    let q1 = _mm256_or_si256(_mm256_and_si256(a, m4), hpart(_mm_cvtsi32_si128(0)));
                    let q2 = _mm256_or_si256(_mm256_and_si256(c, m4), hpart(_mm_cvtsi32_si128(2)));
                    let q3 =
                        _mm256_or_si256(_mm256_srli_epi32::<4>(a), hpart(_mm_cvtsi32_si128(4)));
                    let q4 =
                        _mm256_or_si256(_mm256_srli_epi32::<4>(c), hpart(_mm_cvtsi32_si128(6)));
                    for (k, q) in [q1, q2, q3, q4].into_iter().enumerate() {
                        let qf = _mm256_cvtepi32_ps(_mm256_sub_epi32(q, off));
                        let scale = d * (b[sc + is + 2 * k] as i8) as f32;
                        let t = _mm256_mul_ps(qf, ld8(xs, l + 32 * k));
                        acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), t, acc);
                    }
                }
            }
        }
        hsum(acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_0_layout_by_hand() {
        // d = 1.0; byte i = (hi << 4) | lo with lo = i, hi = 15 - i.
        let mut b = vec![0u8; 18];
        b[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        for i in 0..16 {
            b[2 + i] = (((15 - i) as u8) << 4) | i as u8;
        }
        let mut out = [0f32; 32];
        dequantize_row(DType::Q4_0, &b, &mut out).unwrap();
        for i in 0..16 {
            assert_eq!(out[i], i as f32 - 8.0);
            assert_eq!(out[16 + i], (15 - i) as f32 - 8.0);
        }
    }

    #[test]
    fn length_errors() {
        let mut out = [0f32; 32];
        assert_eq!(
            dequantize_row(DType::Q8_0, &[0u8; 33], &mut out),
            Err(QuantError::Length {
                dtype: DType::Q8_0,
                n: 32,
                expected: 34,
                got: 33
            })
        );
        let mut out = [0f32; 31];
        assert!(matches!(
            dequantize_row(DType::Q8_0, &[0u8; 34], &mut out),
            Err(QuantError::PartialBlock { .. })
        ));
        assert_eq!(
            dequantize_row(DType::I32, &[0u8; 4], &mut [0f32; 1]),
            Err(QuantError::NotFloat(DType::I32))
        );
    }
}
