//! Block quantizers for `convert`: f32 rows into the GGUF block formats,
//! computed as llama.cpp's reference quantizers compute them
//! (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref` in `ggml-quants.c`:
//! the same f32 operations in the same order, `roundf` rounding half away
//! from zero, scales rounded to f16 to nearest even), so that the blocks are
//! bit-identical to `llama-quantize`'s (which uses exactly these for Q8_0
//! and Q4_0 when no importance matrix is given). The layouts are in
//! [`super::blocks`].

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
