//! Every weight format of the fast path seen as 32-element *units*: a unit
//! decodes to 32 small integer quants `q` (as `i8`), one scale per unit or
//! per 16-element half and an additive term, with weight
//! `w_i = d[i / 16] · q_i + m`, exactly the value the dequantizer
//! ([`crate::kernels::quantized::blocks`]) gives (the products are formed
//! in the same f32 order, so the test below compares for equality).
//!
//! | dtype  | units / block | quants `q` | `OFF` | scales per unit | m |
//! |--------|---------------|------------|-------|-----------------|---|
//! | Q8_0   | 1 | −128..127 | 128 | 1 (`d`) | 0 |
//! | Q4_0   | 1 | −8..7 | 8 | 1 (`d`) | 0 |
//! | Q4_1   | 1 | 0..15 | 0 | 1 (`d`) | `m` |
//! | Q5_0   | 1 | −16..15 | 16 | 1 (`d`) | 0 |
//! | Q5_1   | 1 | 0..31 | 0 | 1 (`d`) | `m` |
//! | IQ4_NL | 1 | grid −127..113 | 128 | 1 (`d`) | 0 |
//! | Q3_K   | 8 | −4..3 | 4 | 2 (`d·sc`, 16-element sub-blocks) | 0 |
//! | Q4_K   | 8 | 0..15 | 0 | 1 (`d·sc`) | `−dmin·m` |
//! | Q5_K   | 8 | 0..31 | 0 | 1 (`d·sc`) | `−dmin·m` |
//! | Q6_K   | 8 | −32..31 | 32 | 2 (`d·sc`, 16-element sub-blocks) | 0 |
//! | IQ4_XS | 8 | grid −127..113 | 128 | 1 (`d·sc`) | 0 |
//!
//! `q + OFF` is never negative and fits a byte: kernels that need an
//! unsigned operand (`vpdpbusd`, `vpmaddubsw`) use it and take `OFF · Σ a`
//! back off in integers. Q2_K (a minimum per 16 elements) is left to the
//! exact path.
//!
//! # The arithmetic of one output
//!
//! Every kernel at every level computes a weight row's product with one
//! activation row ([`Q8Act`] blocks) with exactly this sequence of f32
//! operations, [`unit_acc`] (so the kernels agree with the scalar reference
//! bit for bit, and a row's result does not depend on which kernel ran it
//! or on the other rows of the step): `f = 0`, then for every unit in
//! element order,
//! * `I = Σ q_i (256 qs_i + qr_i)` over the unit, an exact integer (over
//!   each 16-element half separately, `I_lo` and `I_hi`, for formats with a
//!   scale per half);
//! * `f = fma(f32(I), d_a · d_w, f)` (per half: `fma(f32(I_lo), d_a · d_lo, f)`
//!   then `fma(f32(I_hi), d_a · d_hi, f)`);
//! * for formats with an additive term, `f = fma(m, s_a, f)`.

use super::Q8Act;
use crate::ir::DType;
use crate::kernels::quantized::blocks::{iq4xs_scale, k_scale_min, q3k_scale, rd_f16, IQ4_VALUES};

/// True for the dtypes of the fast path (see the module table).
pub fn is_unit_format(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::IQ4_NL
            | DType::Q3_K
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
            | DType::IQ4_XS
    )
}

/// 32-element units per storage block of `dtype`.
pub const fn units_per_block(dtype: DType) -> usize {
    dtype.block_elems() / 32
}

/// True where a unit has one scale per 16-element half (Q3_K, Q6_K).
pub const fn split_scales(dtype: DType) -> bool {
    matches!(dtype, DType::Q3_K | DType::Q6_K)
}

/// True where the weights have an additive term `m`.
pub const fn has_min(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K)
}

/// `OFF`: what makes every quant of `dtype` non-negative (see the table).
pub const fn offset(dtype: DType) -> i32 {
    match dtype {
        DType::Q8_0 | DType::IQ4_NL | DType::IQ4_XS => 128,
        DType::Q4_0 => 8,
        DType::Q5_0 => 16,
        DType::Q3_K => 4,
        DType::Q6_K => 32,
        _ => 0,
    }
}

/// The scales `d[u] = [d_lo, d_hi]` and additive terms `m[u]` of every
/// unit `u` of block `b` (the first [`units_per_block`] entries are set).
///
/// # Panics
/// If `dtype` is not a unit format or `b` is shorter than one block.
#[inline]
pub fn block_scales(dtype: DType, b: &[u8], d: &mut [[f32; 2]; 8], m: &mut [f32; 8]) {
    match dtype {
        DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::IQ4_NL => {
            let v = rd_f16(b, 0);
            (d[0], m[0]) = ([v, v], 0.0);
        }
        DType::Q4_1 | DType::Q5_1 => {
            let v = rd_f16(b, 0);
            (d[0], m[0]) = ([v, v], rd_f16(b, 2));
        }
        DType::Q3_K => {
            let v = rd_f16(b, 108);
            let dl = |i: usize| v * q3k_scale(&b[96..108], i) as f32;
            for u in 0..8 {
                (d[u], m[u]) = ([dl(2 * u), dl(2 * u + 1)], 0.0);
            }
        }
        DType::Q4_K | DType::Q5_K => {
            let (v, vmin) = (rd_f16(b, 0), rd_f16(b, 2));
            for u in 0..8 {
                let (sc, mn) = k_scale_min(&b[4..16], u);
                let dl = v * sc as f32;
                (d[u], m[u]) = ([dl, dl], -(vmin * mn as f32));
            }
        }
        DType::Q6_K => {
            let v = rd_f16(b, 208);
            for u in 0..8 {
                let sc = |i: usize| v * (b[192 + 2 * u + i] as i8) as f32;
                (d[u], m[u]) = ([sc(0), sc(1)], 0.0);
            }
        }
        DType::IQ4_XS => {
            let v = rd_f16(b, 0);
            for u in 0..8 {
                let dl = v * iq4xs_scale(b, u) as f32;
                (d[u], m[u]) = ([dl, dl], 0.0);
            }
        }
        _ => panic!("block_scales: {dtype} is not a unit format"),
    }
}

/// The 32 quants of unit `u` of block `b`.
///
/// # Panics
/// If `dtype` is not a unit format, `u` is out of range or `b` is short.
pub fn unit_quants(dtype: DType, b: &[u8], u: usize) -> [i8; 32] {
    assert!(
        u < units_per_block(dtype),
        "unit_quants: unit {u} of {dtype}"
    );
    let mut q = [0i8; 32];
    match dtype {
        DType::Q8_0 => {
            for i in 0..32 {
                q[i] = b[2 + i] as i8;
            }
        }
        DType::Q4_0 | DType::Q4_1 => {
            let (at, off) = if dtype == DType::Q4_0 { (2, 8) } else { (4, 0) };
            for i in 0..16 {
                q[i] = (b[at + i] & 15) as i8 - off;
                q[i + 16] = (b[at + i] >> 4) as i8 - off;
            }
        }
        DType::Q5_0 | DType::Q5_1 => {
            let h = if dtype == DType::Q5_0 { 2 } else { 4 };
            let qh = u32::from_le_bytes([b[h], b[h + 1], b[h + 2], b[h + 3]]);
            let off = if dtype == DType::Q5_0 { 16 } else { 0 };
            for i in 0..16 {
                let v = b[h + 4 + i];
                q[i] = (((v & 15) as u32 | ((qh >> i) & 1) << 4) as i32 - off) as i8;
                q[i + 16] = (((v >> 4) as u32 | ((qh >> (i + 16)) & 1) << 4) as i32 - off) as i8;
            }
        }
        DType::IQ4_NL => {
            for i in 0..16 {
                q[i] = IQ4_VALUES[(b[2 + i] & 15) as usize];
                q[i + 16] = IQ4_VALUES[(b[2 + i] >> 4) as usize];
            }
        }
        DType::Q3_K => {
            let (hmask, qs) = (&b[0..32], &b[32..96]);
            let (h, s) = (u / 4, u % 4);
            for l in 0..32 {
                let low = ((qs[32 * h + l] >> (2 * s)) & 3) as i8;
                let high = (hmask[l] >> u) & 1;
                q[l] = low - if high == 0 { 4 } else { 0 };
            }
        }
        DType::Q4_K | DType::Q5_K => {
            let (qs_at, five) = if dtype == DType::Q4_K {
                (16, false)
            } else {
                (48, true)
            };
            let qs = &b[qs_at + 32 * (u / 2)..qs_at + 32 * (u / 2) + 32];
            for l in 0..32 {
                let mut v = (qs[l] >> (4 * (u % 2))) & 15;
                if five {
                    v |= ((b[16 + l] >> u) & 1) << 4;
                }
                q[l] = v as i8;
            }
        }
        DType::Q6_K => {
            let (n, k) = (u / 4, u % 4);
            let ql = &b[64 * n + 32 * (k & 1)..64 * n + 32 * (k & 1) + 32];
            let qh = &b[128 + 32 * n..128 + 32 * n + 32];
            for l in 0..32 {
                let lo = (ql[l] >> (4 * (k >> 1))) & 15;
                let hi = (qh[l] >> (2 * k)) & 3;
                q[l] = (lo | (hi << 4)) as i8 - 32;
            }
        }
        DType::IQ4_XS => {
            let qs = &b[8 + 16 * u..8 + 16 * u + 16];
            for l in 0..16 {
                q[l] = IQ4_VALUES[(qs[l] & 15) as usize];
                q[l + 16] = IQ4_VALUES[(qs[l] >> 4) as usize];
            }
        }
        _ => panic!("unit_quants: {dtype} is not a unit format"),
    }
    q
}

/// Unit `u` of block `b`: `(q, [d_lo, d_hi], m)` with `w_i = d[i/16]·q_i + m`.
///
/// # Panics
/// As [`unit_quants`].
pub fn decode_unit(dtype: DType, b: &[u8], u: usize) -> ([i8; 32], [f32; 2], f32) {
    let q = unit_quants(dtype, b, u);
    let (mut d, mut m) = ([[0f32; 2]; 8], [0f32; 8]);
    block_scales(dtype, b, &mut d, &mut m);
    (q, d[u], m[u])
}

/// One unit's step of the arithmetic every kernel shares (see the module
/// docs): the exact integer products of the quants `q` with the activation
/// block `a`, added to `f` as `fma(f32(I), d_a · d_w, f)` (per half for the
/// `split` formats), then `fma(m, s_a, f)` for formats with an additive term.
#[inline]
pub fn unit_acc(dtype: DType, f: f32, q: &[i8; 32], d: [f32; 2], m: f32, a: &Q8Act) -> f32 {
    let mut h = [0i32; 2];
    for i in 0..32 {
        h[i / 16] += q[i] as i32 * (super::RES * a.qs[i] as i32 + a.qr[i] as i32);
    }
    let mut f = f;
    if split_scales(dtype) {
        f = (h[0] as f32).mul_add(a.d * d[0], f);
        f = (h[1] as f32).mul_add(a.d * d[1], f);
    } else {
        f = ((h[0] + h[1]) as f32).mul_add(a.d * d[0], f);
    }
    if has_min(dtype) {
        f = m.mul_add(a.s, f);
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quantized::blocks::dequant_block;
    use crate::kernels::testutil::Rng;

    /// Random bytes for every block (random scales included, NaN/Inf
    /// excluded so values compare): the units give the dequantizer's
    /// values exactly.
    #[test]
    fn units_decode_as_the_dequantizer() {
        let mut rng = Rng::new(41);
        for dtype in crate::kernels::testutil::FAST_FORMATS {
            assert!(is_unit_format(dtype));
            let (bb, be) = (dtype.block_bytes(), dtype.block_elems());
            for trial in 0..200 {
                let mut b: Vec<u8> = (0..bb).map(|_| rng.next_u64() as u8).collect();
                // Finite f16 scales: clear the exponent's top bit of every f16 field.
                for &at in crate::kernels::testutil::f16_fields(dtype) {
                    b[at + 1] &= 0xbf;
                }
                let mut want = vec![0f32; be];
                dequant_block(dtype, &b, &mut want);
                for u in 0..units_per_block(dtype) {
                    let (q, d, m) = decode_unit(dtype, &b, u);
                    assert!(split_scales(dtype) || d[0] == d[1]);
                    assert!(has_min(dtype) || m == 0.0);
                    for i in 0..32 {
                        let got = d[i / 16] * q[i] as f32 + m;
                        let u8q = q[i] as i32 + offset(dtype);
                        assert!((0..=255).contains(&u8q), "{dtype}: q + OFF = {u8q}");
                        let w = want[32 * u + i];
                        assert!(
                            got == w,
                            "{dtype} trial {trial} unit {u} elem {i}: {got} vs {w}"
                        );
                    }
                }
            }
        }
        assert!(!is_unit_format(DType::Q2_K) && !is_unit_format(DType::F16));
    }
}
