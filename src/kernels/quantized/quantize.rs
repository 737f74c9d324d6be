//! Block quantizers for `convert`: f32 rows into the GGUF block formats,
//! computed as llama.cpp's reference quantizers compute them
//! (`quantize_row_{q8_0,q4_0,q5_0,q5_1,q4_K,q5_K,q6_K}_ref` in
//! `ggml-quants.c`: the same f32 operations in the same order, the same
//! rounding -- `roundf`, truncating casts, ggml's `nearest_int` -- and
//! scales rounded to f16 to nearest even), so that the blocks are
//! bit-identical to `llama-quantize`'s, which uses exactly these functions
//! when no importance matrix is given. The K-quant ones search for the best
//! scale (and min) of each sub-block; the search is replicated step by step,
//! including where it reuses a min found by an earlier step. The layouts are
//! in [`super::blocks`].

use crate::ir::DType;
use half::{bf16, f16};

/// Quantizes one row of `x` (a whole number of blocks) into `out`, which
/// must hold `dtype.bytes_for(x.len())` bytes. F32, F16 and BF16 are
/// conversions (round to nearest even). `None` for a dtype this module does
/// not write, or a row that is not whole blocks.
pub fn quantize_row(dtype: DType, x: &[f32], out: &mut [u8]) -> Option<()> {
    if !x.len().is_multiple_of(dtype.block_elems()) || dtype.bytes_for(x.len())? != out.len() {
        return None;
    }
    match dtype {
        DType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        DType::BF16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        DType::Q8_0 => {
            for (b, xs) in out.chunks_exact_mut(34).zip(x.chunks_exact(32)) {
                q8_0_block(xs, b);
            }
        }
        DType::Q4_0 => {
            for (b, xs) in out.chunks_exact_mut(18).zip(x.chunks_exact(32)) {
                q4_0_block(xs, b);
            }
        }
        DType::Q5_0 => {
            for (b, xs) in out.chunks_exact_mut(22).zip(x.chunks_exact(32)) {
                q5_0_block(xs, b);
            }
        }
        DType::Q5_1 => {
            for (b, xs) in out.chunks_exact_mut(24).zip(x.chunks_exact(32)) {
                q5_1_block(xs, b);
            }
        }
        DType::Q4_K => {
            for (b, xs) in out.chunks_exact_mut(144).zip(x.chunks_exact(256)) {
                q4_k_block(xs, b);
            }
        }
        DType::Q5_K => {
            for (b, xs) in out.chunks_exact_mut(176).zip(x.chunks_exact(256)) {
                q5_k_block(xs, b);
            }
        }
        DType::Q6_K => {
            for (b, xs) in out.chunks_exact_mut(210).zip(x.chunks_exact(256)) {
                q6_k_block(xs, b);
            }
        }
        _ => return None,
    }
    Some(())
}

/// `quantize_row_q8_0_ref`: `d = amax / 127`, `q = roundf(x / d)`.
fn q8_0_block(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (q, v) in b[2..].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
}

/// `quantize_row_q4_0_ref`: `d = max / -8` where `max` is the value of
/// largest magnitude (the first one on ties), `q = min(15, (int8)(x/d + 8.5))`.
fn q4_0_block(x: &[f32], b: &mut [u8]) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for j in 0..16 {
        let x0 = x[j] * id;
        let x1 = x[16 + j] * id;
        // C's (int8_t) conversion truncates toward zero; the values are in
        // [0.5, 16.5] here, or NaN (which C leaves undefined; 0 here).
        let xi0 = ((x0 + 8.5) as i8).min(15) as u8;
        let xi1 = ((x1 + 8.5) as i8).min(15) as u8;
        b[2 + j] = xi0 | (xi1 << 4);
    }
}

/// The value of largest magnitude (the first one on ties) and its magnitude.
fn signed_max(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

/// `quantize_row_q5_0_ref`: `d = max / -16`, `q = min(31, (int8)(x/d + 16.5))`,
/// low nibbles in `qs` (element j and j+16 share a byte), fifth bits in `qh`.
fn q5_0_block(x: &[f32], b: &mut [u8]) {
    let (_, max) = signed_max(x);
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    let mut qh = 0u32;
    for j in 0..16 {
        // (int8_t) truncates toward zero; the values are in [0.5, 32.5].
        let xi0 = ((x[j] * id + 16.5) as i8).min(31) as u8;
        let xi1 = ((x[16 + j] * id + 16.5) as i8).min(31) as u8;
        b[6 + j] = (xi0 & 0x0f) | ((xi1 & 0x0f) << 4);
        qh |= (((xi0 & 0x10) >> 4) as u32) << j;
        qh |= (((xi1 & 0x10) >> 4) as u32) << (j + 16);
    }
    b[2..6].copy_from_slice(&qh.to_le_bytes());
}

/// `quantize_row_q5_1_ref`: `d = (max - min) / 31`, `m = min`,
/// `q = (uint8)((x - min)/d + 0.5)`.
fn q5_1_block(x: &[f32], b: &mut [u8]) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    b[2..4].copy_from_slice(&f16::from_f32(min).to_le_bytes());
    let mut qh = 0u32;
    for j in 0..16 {
        let xi0 = ((x[j] - min) * id + 0.5) as u8;
        let xi1 = ((x[16 + j] - min) * id + 0.5) as u8;
        b[8 + j] = (xi0 & 0x0f) | ((xi1 & 0x0f) << 4);
        qh |= (((xi0 & 0x10) >> 4) as u32) << j;
        qh |= (((xi1 & 0x10) >> 4) as u32) << (j + 16);
    }
    b[4..8].copy_from_slice(&qh.to_le_bytes());
}

/// ggml's `nearest_int`: adding 1.5 * 2^23 rounds to the nearest integer
/// (ties to even) and leaves it in the low mantissa bits. Bit for bit the
/// same, also outside the range ggml asserts (where it wraps).
fn nearest_int(f: f32) -> i32 {
    let v = f + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// `make_qkx2_quants` for a 32-element sub-block without MAD: the scale and
/// min (returned as `(scale, -min)`, so both are normally >= 0) that
/// minimise the weighted squared error of `scale * L + min`, `L` in
/// `0..=nmax`, over `nstep + 1` candidate grids. `l` gets the levels.
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32; 32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l[..n].fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        // `min` may have moved in an earlier step; ggml uses the new one.
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let (w, lf) = (weights[i], q as f32);
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// The shared part of Q4_K and Q5_K (`quantize_row_q{4,5}_K_ref`): per
/// 32-element sub-block a scale and min from [`make_qkx2_quants`]
/// (weights `rms + |x|`), both quantized to 6 bits against the block's
/// largest (`d`, `dmin` as f16), then the levels recomputed with the stored
/// scales. Writes `d`, `dmin` and the 12 packed scale bytes into
/// `b[..16]`; returns the 256 levels.
fn k_block_levels(x: &[f32], b: &mut [u8], nmax: i32, rmin: f32, nstep: i32) -> [u8; 256] {
    let mut l = [0u8; 256];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    let mut weights = [0f32; 32];
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (s, m) = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            rmin,
            0.1,
            nstep,
        );
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = &mut b[4..16];
    for j in 0..8 {
        // (uint8_t) of an int keeps the low byte, then min(63).
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    b[..2].copy_from_slice(&d.to_le_bytes());
    b[2..4].copy_from_slice(&dmin.to_le_bytes());
    let sc: [u8; 12] = b[4..16].try_into().expect("12 scale bytes");
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, &sc);
        let d = d.to_f32() * s as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * m as f32;
        for ii in 0..32 {
            let q = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, nmax);
            l[32 * j + ii] = q as u8;
        }
    }
    l
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j`.
fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `quantize_row_q4_K_ref`: levels 0..15, 20 extra grids from -1.0 in 0.1
/// steps; element `l` and `l + 32` of each 64 share a byte.
fn q4_k_block(x: &[f32], b: &mut [u8]) {
    let l = k_block_levels(x, b, 15, -1.0, 20);
    let q = &mut b[16..144];
    for (c, j) in (0..256).step_by(64).enumerate() {
        for i in 0..32 {
            q[32 * c + i] = l[j + i] | (l[j + i + 32] << 4);
        }
    }
}

/// `quantize_row_q5_K_ref`: levels 0..31, 15 extra grids from -0.5; low
/// nibbles as Q4_K, fifth bits in `qh` (two bits per 64 elements).
fn q5_k_block(x: &[f32], b: &mut [u8]) {
    let l = k_block_levels(x, b, 31, -0.5, 15);
    let (qh, ql) = b[16..176].split_at_mut(32);
    qh.fill(0);
    let (mut m1, mut m2) = (1u8, 2u8);
    for (c, n) in (0..256).step_by(64).enumerate() {
        for j in 0..32 {
            let mut l1 = l[n + j];
            if l1 > 15 {
                l1 -= 16;
                qh[j] |= m1;
            }
            let mut l2 = l[n + j + 32];
            if l2 > 15 {
                l2 -= 16;
                qh[j] |= m2;
            }
            ql[32 * c + j] = l1 | (l2 << 4);
        }
        m1 <<= 2;
        m2 <<= 2;
    }
}

/// `make_qx_quants` with `rmse_type` 1 and no importance weights, as Q6_K
/// calls it (16 elements, `nmax` 32): a symmetric scale, searched over 18
/// grids around `-nmax / max` for the least `x^2`-weighted squared error.
/// `l` gets the levels offset by `nmax`.
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [u8]) -> f32 {
    let (amax, max) = signed_max(x);
    if amax < GROUP_MAX_EPS {
        l[..x.len()].fill(0);
        return 0.0;
    }
    let quant = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let mut iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for (i, &v) in x.iter().enumerate() {
        let q = quant(iscale, v);
        l[i] = (q + nmax) as u8;
        let w = v * v;
        sumlx += w * v * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let q = quant(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (i, &v) in x.iter().enumerate() {
                l[i] = (quant(iscale, v) + nmax) as u8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `GROUP_MAX_EPS`: a group whose largest magnitude is below this is
/// all zeros.
const GROUP_MAX_EPS: f32 = 1e-15;

/// `quantize_row_q6_K_ref`: per 16 elements a scale from [`make_qx_quants`]
/// stored as int8 against the block's largest (`d = max / -128` as f16),
/// levels -32..31 recomputed with the stored scales. Layout: `ql[128]`
/// (low nibbles), `qh[64]` (high two bits), `scales[16]`, `d`.
fn q6_k_block(x: &[f32], b: &mut [u8]) {
    let mut l = [0u8; 256];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for ib in 0..16 {
        let s = make_qx_quants(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
        scales[ib] = s;
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        b.fill(0);
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = f16::from_f32(1.0 / iscale);
    b[208..210].copy_from_slice(&d.to_le_bytes());
    let mut sc = [0i8; 16];
    for (s, &v) in sc.iter_mut().zip(&scales) {
        // MIN(127, nearest_int(..)) stored into an int8_t.
        *s = nearest_int(iscale * v).min(127) as i8;
    }
    for (o, &s) in b[192..208].iter_mut().zip(&sc) {
        *o = s as u8;
    }
    for j in 0..16 {
        let dj = d.to_f32() * sc[j] as f32;
        if dj == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let q = nearest_int(x[16 * j + ii] / dj).clamp(-32, 31);
            l[16 * j + ii] = (q + 32) as u8;
        }
    }
    let (ql, rest) = b.split_at_mut(128);
    let qh = &mut rest[..64];
    for (c, j) in (0..256).step_by(128).enumerate() {
        for i in 0..32 {
            let (q1, q2, q3, q4) = (l[j + i], l[j + i + 32], l[j + i + 64], l[j + i + 96]);
            ql[64 * c + i] = (q1 & 0x0f) | ((q3 & 0x0f) << 4);
            ql[64 * c + i + 32] = (q2 & 0x0f) | ((q4 & 0x0f) << 4);
            qh[32 * c + i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quantized::dequantize_row;

    fn row(seed: u32, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                ((s >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 0.2
            })
            .collect()
    }

    #[test]
    fn round_trips_within_the_step() {
        for dtype in [
            DType::Q8_0,
            DType::Q4_0,
            DType::F16,
            DType::BF16,
            DType::F32,
        ] {
            let x = row(7, 256);
            let mut q = vec![0u8; dtype.bytes_for(256).unwrap()];
            quantize_row(dtype, &x, &mut q).unwrap();
            let mut y = vec![0f32; 256];
            dequantize_row(dtype, &q, &mut y).unwrap();
            for (blk_x, blk_y) in x.chunks(32).zip(y.chunks(32)) {
                let amax = blk_x.iter().fold(0f32, |m, v| m.max(v.abs()));
                // Half a quantization step; Q4_0's grid is -8..7 times
                // d = max/-8, so a value at the other extreme clips by a
                // whole step.
                let step = match dtype {
                    DType::Q8_0 => amax / 127.0,
                    DType::Q4_0 => amax / 4.0,
                    _ => amax / 128.0,
                };
                for (a, b) in blk_x.iter().zip(blk_y) {
                    // Plus the f16 rounding of the scale.
                    assert!(
                        (a - b).abs() <= step * 0.5 + amax / 1024.0,
                        "{dtype}: {a} vs {b}"
                    );
                }
            }
        }
    }

    fn rel_rmse(dtype: DType, x: &[f32]) -> f32 {
        let mut q = vec![0u8; dtype.bytes_for(x.len()).unwrap()];
        quantize_row(dtype, x, &mut q).unwrap();
        let mut y = vec![0f32; x.len()];
        dequantize_row(dtype, &q, &mut y).unwrap();
        let e: f32 = x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum();
        let s: f32 = x.iter().map(|a| a * a).sum();
        (e / s).sqrt()
    }

    #[test]
    fn more_bits_less_error() {
        let x = row(11, 4096);
        let e: Vec<f32> = [
            DType::Q4_0,
            DType::Q4_K,
            DType::Q5_0,
            DType::Q5_1,
            DType::Q5_K,
            DType::Q6_K,
            DType::Q8_0,
        ]
        .iter()
        .map(|&d| rel_rmse(d, &x))
        .collect();
        // A uniform row: relative RMS error about step / sqrt(12) / rms,
        // 0.063 at 4 bits, 0.031 at 5, 0.016 at 6, 0.004 at 8.
        assert!(e[0] < 0.09 && e[1] < 0.09, "{e:?}");
        assert!(e[2] < 0.045 && e[3] < 0.045 && e[4] < 0.045, "{e:?}");
        assert!(e[5] < 0.025 && e[6] < 0.006, "{e:?}");
        assert!(e[2].max(e[3]).max(e[4]) < e[0].min(e[1]), "{e:?}");
        assert!(e[5] < e[2].min(e[3]).min(e[4]) && e[6] < e[5], "{e:?}");
    }

    #[test]
    fn nearest_int_is_ggml_s() {
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(3.5), 4);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-0.4), 0);
        assert_eq!(nearest_int(4194303.0), 4194303);
    }

    #[test]
    fn k_blocks_of_zeros_and_nan_do_not_panic() {
        for dtype in [
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
            DType::Q5_0,
            DType::Q5_1,
        ] {
            let mut q = vec![0u8; dtype.bytes_for(256).unwrap()];
            quantize_row(dtype, &[0.0; 256], &mut q).unwrap();
            let mut y = vec![1f32; 256];
            dequantize_row(dtype, &q, &mut y).unwrap();
            assert!(y.iter().all(|&v| v == 0.0), "{dtype}");
            let mut x = row(3, 256);
            x[7] = f32::NAN;
            x[9] = f32::INFINITY;
            quantize_row(dtype, &x, &mut q).unwrap();
        }
    }

    #[test]
    fn zero_and_extreme_blocks() {
        let z = vec![0f32; 32];
        let mut q = vec![0u8; 18];
        quantize_row(DType::Q4_0, &z, &mut q).unwrap();
        assert_eq!(&q[2..], &[0x88; 16]);
        let mut q8 = vec![0u8; 34];
        quantize_row(DType::Q8_0, &z, &mut q8).unwrap();
        assert!(q8.iter().all(|&b| b == 0));
        // The largest-magnitude value maps to -8 exactly (Q4_0 quant 0).
        let mut x = vec![0.1f32; 32];
        x[5] = -1.0;
        quantize_row(DType::Q4_0, &x, &mut q).unwrap();
        assert_eq!(q[2 + 5] & 15, 0);
        assert!(quantize_row(DType::Q4_0, &x[..31], &mut q).is_none());
    }
}
