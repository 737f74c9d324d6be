//! Dequantization of one storage block of every weight format, bit for bit
//! as ggml's reference `dequantize_row_*` and the `gguf` Python package
//! compute it (the same f32 operations in the same order; Rust never fuses
//! a multiply and an add on its own).
//!
//! Layouts (ggml's `ggml-common.h`, little-endian, `f16` = IEEE half):
//!
//! | type | elems | bytes | layout and value |
//! |------|-------|-------|------------------|
//! | Q8_0 | 32  | 34  | `f16 d; i8 qs[32]`: `d * qs[i]` |
//! | Q4_0 | 32  | 18  | `f16 d; u8 qs[16]`: element `i` is the low nibble of `qs[i]`, `i+16` the high one; `d * (q - 8)` |
//! | Q4_1 | 32  | 20  | `f16 d, m; u8 qs[16]`: nibbles as Q4_0; `d * q + m` |
//! | Q5_0 | 32  | 22  | `f16 d; u32 qh; u8 qs[16]`: nibbles as Q4_0, bit `i` of `qh` is bit 4 of element `i`; `d * (q - 16)` |
//! | Q5_1 | 32  | 24  | `f16 d, m; u32 qh; u8 qs[16]`: as Q5_0; `d * q + m` |
//! | IQ4_NL | 32 | 18 | `f16 d; u8 qs[16]`: nibbles as Q4_0 index [`IQ4_VALUES`]; `d * value` |
//! | Q2_K | 256 | 84  | `u8 scales[16]; u8 qs[64]; f16 d, dmin`: 16 sub-blocks of 16 |
//! | Q3_K | 256 | 110 | `u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d`: 16 sub-blocks of 16 |
//! | Q4_K | 256 | 144 | `f16 d, dmin; u8 scales[12]; u8 qs[128]`: 8 sub-blocks of 32 |
//! | Q5_K | 256 | 176 | `f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]`: 8 sub-blocks of 32 |
//! | Q6_K | 256 | 210 | `u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d`: 16 sub-blocks of 16 |
//! | IQ4_XS | 256 | 136 | `f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]`: 8 sub-blocks of 32 |
//!
//! Element order inside the 256-element super-blocks:
//! * **Q2_K**: for half `h` (`qs[32h..32h+32]`) and shift `s` in 0..4,
//!   element `128h + 32s + l` is `(qs[32h + l] >> 2s) & 3`; sub-block
//!   `e / 16` has `dl = d * (scales[e/16] & 15)`, `ml = dmin * (scales[e/16] >> 4)`;
//!   value `dl * q - ml`.
//! * **Q3_K**: low two bits as Q2_K; the third bit of element `e` is bit
//!   `e / 32` of `hmask[e % 32]`, and a clear bit subtracts 4. The 16 6-bit
//!   scales: low nibble `scales[i] & 15` (`i < 8`) or `scales[i-8] >> 4`, high
//!   bits `(scales[8 + i%4] >> 2(i/4)) & 3`, minus 32; value `(d * scale) * q`.
//! * **Q4_K / Q5_K**: for chunk `j` in 0..4 (`qs[32j..32j+32]`), element
//!   `64j + l` is the low nibble of `qs[32j+l]`, `64j + 32 + l` the high one;
//!   Q5_K's fifth bit of element `e` is bit `e / 32` of `qh[e % 32]`. The 6-bit
//!   (scale, min) of sub-block `k` are given by `k_scale_min`; value
//!   `(d * sc) * q - (dmin * m)`.
//! * **Q6_K**: per 128-element half `h` (`ql += 64h`, `qh += 32h`,
//!   `scales += 8h`), for `l < 32`: `q1 = (ql[l] & 15) | ((qh[l] & 3) << 4)`,
//!   `q2 = (ql[l+32] & 15) | (((qh[l] >> 2) & 3) << 4)`, `q3 = (ql[l] >> 4) |
//!   (((qh[l] >> 4) & 3) << 4)`, `q4 = (ql[l+32] >> 4) | (((qh[l] >> 6) & 3) << 4)`;
//!   elements `l, l+32, l+64, l+96` are `(d * scales[l/16 + 0/2/4/6]) * (q - 32)`.
//! * **IQ4_XS**: sub-block `k` (`qs[16k..16k+16]`, nibbles as Q4_0) has the
//!   6-bit scale `((scales_l[k/2] >> 4(k%2)) & 15) | (((scales_h >> 2k) & 3) << 4)`
//!   minus 32; value `(d * scale) * IQ4_VALUES[nibble]`.
//!
//! Scales are read as stored: an f16 NaN or infinity gives NaN or infinite
//! weights, never undefined behaviour (the loader does not validate values).

// Block kernels index several arrays with one loop counter, mirroring ggml's reference code.
#![allow(clippy::needless_range_loop)]

use crate::ir::DType;
use half::{bf16, f16};

/// The non-linear 4-bit grid of IQ4_NL and IQ4_XS (ggml's `kvalues_iq4nl`).
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

#[inline(always)]
pub(crate) fn rd_f16(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The 6-bit (scale, min) of sub-block `k` (0..8) of a Q4_K/Q5_K block from
/// its 12 scale bytes `s`.
#[inline(always)]
pub(crate) fn k_scale_min(s: &[u8], k: usize) -> (u8, u8) {
    if k < 4 {
        (s[k] & 63, s[k + 4] & 63)
    } else {
        (
            (s[k + 4] & 15) | ((s[k - 4] >> 6) << 4),
            (s[k + 4] >> 4) | ((s[k] >> 6) << 4),
        )
    }
}

/// `(d·sc, dmin·m)` of sub-blocks `2j` and `2j + 1` (the two halves of
/// 64 elements `j`) of a Q4_K/Q5_K block with scale bytes `s`.
#[inline(always)]
fn k_pair(s: &[u8], j: usize, d: f32, dmin: f32) -> [(f32, f32); 2] {
    [2 * j, 2 * j + 1].map(|k| {
        let (sc, m) = k_scale_min(s, k);
        (d * sc as f32, dmin * m as f32)
    })
}

/// The signed 6-bit scale (already minus 32) of sub-block `i` (0..16) of a
/// Q3_K block from its 12 scale bytes `s`.
#[inline(always)]
pub(crate) fn q3k_scale(s: &[u8], i: usize) -> i32 {
    let lo = if i < 8 { s[i] & 15 } else { s[i - 8] >> 4 };
    let hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    (lo | (hi << 4)) as i32 - 32
}

/// The signed scale (already minus 32) of sub-block `k` (0..8) of an IQ4_XS block.
#[inline(always)]
pub(crate) fn iq4xs_scale(b: &[u8], k: usize) -> i32 {
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let lo = (b[4 + k / 2] >> (4 * (k % 2))) & 15;
    let hi = ((scales_h >> (2 * k)) & 3) as u8;
    (lo | (hi << 4)) as i32 - 32
}

/// The 32 5-bit quants of a Q5_0/Q5_1 block: `qh` at byte `h`, nibbles at `h + 4`.
#[inline(always)]
fn q5_quants(b: &[u8], h: usize) -> [u8; 32] {
    let qh = u32::from_le_bytes([b[h], b[h + 1], b[h + 2], b[h + 3]]);
    let mut q = [0u8; 32];
    for i in 0..16 {
        let v = b[h + 4 + i];
        q[i] = (v & 15) | ((((qh >> i) & 1) as u8) << 4);
        q[i + 16] = (v >> 4) | ((((qh >> (i + 16)) & 1) as u8) << 4);
    }
    q
}

/// Dequantizes one block (`dtype.block_bytes()` bytes) into `out`
/// (`dtype.block_elems()` values).
///
/// # Panics
/// For `I32` and `BF16Z` (not self-contained weight blocks; callers reject
/// them first), or when `b`/`out` are shorter than one block.
pub(crate) fn dequant_block(dtype: DType, b: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        DType::F16 => out[0] = rd_f16(b, 0),
        DType::BF16 => out[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        DType::I32 | DType::BF16Z => panic!("dequant_block: {dtype} is not a weight block format"),
        DType::Q8_0 => {
            let d = rd_f16(b, 0);
            for i in 0..32 {
                out[i] = (b[2 + i] as i8) as f32 * d;
            }
        }
        DType::Q4_0 => {
            let d = rd_f16(b, 0);
            for i in 0..16 {
                let q = b[2 + i];
                out[i] = ((q & 15) as i32 - 8) as f32 * d;
                out[i + 16] = ((q >> 4) as i32 - 8) as f32 * d;
            }
        }
        DType::Q4_1 => {
            let d = rd_f16(b, 0);
            let m = rd_f16(b, 2);
            for i in 0..16 {
                let q = b[4 + i];
                out[i] = (q & 15) as f32 * d + m;
                out[i + 16] = (q >> 4) as f32 * d + m;
            }
        }
        DType::Q5_0 => {
            let d = rd_f16(b, 0);
            for (o, q) in out.iter_mut().zip(q5_quants(b, 2)) {
                *o = d * (q as i32 - 16) as f32;
            }
        }
        DType::Q5_1 => {
            let d = rd_f16(b, 0);
            let m = rd_f16(b, 2);
            for (o, q) in out.iter_mut().zip(q5_quants(b, 4)) {
                *o = d * q as f32 + m;
            }
        }
        DType::IQ4_NL => {
            let d = rd_f16(b, 0);
            for i in 0..16 {
                let q = b[2 + i];
                out[i] = d * IQ4_VALUES[(q & 15) as usize] as f32;
                out[i + 16] = d * IQ4_VALUES[(q >> 4) as usize] as f32;
            }
        }
        DType::Q2_K => {
            let (scales, qs) = (&b[0..16], &b[16..80]);
            let d = rd_f16(b, 80);
            let dmin = rd_f16(b, 82);
            for e in 0..256 {
                let (h, s, l) = (e / 128, (e / 32) % 4, e % 32);
                let q = (qs[32 * h + l] >> (2 * s)) & 3;
                let sc = scales[e / 16];
                let dl = d * (sc & 15) as f32;
                let ml = dmin * (sc >> 4) as f32;
                out[e] = dl * q as f32 - ml;
            }
        }
        DType::Q3_K => {
            let (hmask, qs, scales) = (&b[0..32], &b[32..96], &b[96..108]);
            let d = rd_f16(b, 108);
            for e in 0..256 {
                let (h, s, l) = (e / 128, (e / 32) % 4, e % 32);
                let low = ((qs[32 * h + l] >> (2 * s)) & 3) as i32;
                let high = (hmask[l] >> (e / 32)) & 1;
                let q = low - if high == 0 { 4 } else { 0 };
                let dl = d * q3k_scale(scales, e / 16) as f32;
                out[e] = dl * q as f32;
            }
        }
        DType::Q4_K => {
            let d = rd_f16(b, 0);
            let dmin = rd_f16(b, 2);
            let scales = &b[4..16];
            let qs = &b[16..144];
            for j in 0..4 {
                let [(d1, mm1), (d2, mm2)] = k_pair(scales, j, d, dmin);
                let q = &qs[32 * j..32 * j + 32];
                let y = &mut out[64 * j..64 * j + 64];
                for l in 0..32 {
                    y[l] = d1 * (q[l] & 15) as f32 - mm1;
                    y[l + 32] = d2 * (q[l] >> 4) as f32 - mm2;
                }
            }
        }
        DType::Q5_K => {
            let d = rd_f16(b, 0);
            let dmin = rd_f16(b, 2);
            let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
            for j in 0..4 {
                let [(d1, mm1), (d2, mm2)] = k_pair(scales, j, d, dmin);
                let q = &qs[32 * j..32 * j + 32];
                let y = &mut out[64 * j..64 * j + 64];
                for l in 0..32 {
                    let h1 = (qh[l] >> (2 * j)) & 1;
                    let h2 = (qh[l] >> (2 * j + 1)) & 1;
                    y[l] = d1 * ((q[l] & 15) | (h1 << 4)) as f32 - mm1;
                    y[l + 32] = d2 * ((q[l] >> 4) | (h2 << 4)) as f32 - mm2;
                }
            }
        }
        DType::Q6_K => {
            let d = rd_f16(b, 208);
            for h in 0..2 {
                let ql = &b[64 * h..64 * h + 64];
                let qh = &b[128 + 32 * h..128 + 32 * h + 32];
                let sc = &b[192 + 8 * h..192 + 8 * h + 8];
                let y = &mut out[128 * h..128 * h + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 15) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
        DType::IQ4_XS => {
            let d = rd_f16(b, 0);
            let qs = &b[8..136];
            for k in 0..8 {
                let dl = d * iq4xs_scale(b, k) as f32;
                let q = &qs[16 * k..16 * k + 16];
                let y = &mut out[32 * k..32 * k + 32];
                for l in 0..16 {
                    y[l] = dl * IQ4_VALUES[(q[l] & 15) as usize] as f32;
                    y[l + 16] = dl * IQ4_VALUES[(q[l] >> 4) as usize] as f32;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block values built from their definition, element by element, in an
    /// order independent of the kernel's loops.
    #[test]
    fn q5_0_high_bits_by_hand() {
        let mut b = vec![0u8; 22];
        b[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        // Element i has quant i (0..31): low nibbles i & 15, bit 4 in qh.
        let mut qh = 0u32;
        for i in 0..32u32 {
            if i & 16 != 0 {
                qh |= 1 << i;
            }
        }
        b[2..6].copy_from_slice(&qh.to_le_bytes());
        for i in 0..16 {
            b[6 + i] = (i as u8) | (((i + 16) as u8 & 15) << 4);
        }
        let mut out = [0f32; 32];
        dequant_block(DType::Q5_0, &b, &mut out);
        for (i, v) in out.iter().enumerate() {
            assert_eq!(*v, 0.5 * (i as f32 - 16.0), "element {i}");
        }
    }

    #[test]
    fn iq4_nl_uses_the_grid() {
        let mut b = vec![0u8; 18];
        b[..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        for i in 0..16 {
            b[2 + i] = (i as u8) | (((15 - i) as u8) << 4);
        }
        let mut out = [0f32; 32];
        dequant_block(DType::IQ4_NL, &b, &mut out);
        for i in 0..16 {
            assert_eq!(out[i], 2.0 * IQ4_VALUES[i] as f32);
            assert_eq!(out[16 + i], 2.0 * IQ4_VALUES[15 - i] as f32);
        }
    }

    #[test]
    fn nan_scales_do_not_panic() {
        for dtype in [
            DType::Q5_0,
            DType::Q5_1,
            DType::Q2_K,
            DType::Q3_K,
            DType::Q5_K,
            DType::IQ4_NL,
            DType::IQ4_XS,
        ] {
            let b = vec![0xffu8; dtype.block_bytes()];
            let mut out = vec![0f32; dtype.block_elems()];
            dequant_block(dtype, &b, &mut out);
            assert!(out.iter().any(|v| !v.is_finite()), "{dtype}");
        }
    }
}
