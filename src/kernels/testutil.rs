//! Helpers for kernel tests: a small deterministic RNG and dtype encoders.

use crate::ir::DType;

/// xorshift64* — deterministic, dependency-free test data.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub(crate) fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub(crate) fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

/// Encodes `v` as little-endian bytes of `dtype` (F32/F16/BF16, round to nearest).
pub(crate) fn encode(v: &[f32], dtype: DType) -> Vec<u8> {
    super::plain_bytes(v, dtype).expect("unsupported test dtype")
}

/// The values `encode(v, dtype)` represents, as f32.
pub(crate) fn decoded(v: &[f32], dtype: DType) -> Vec<f32> {
    v.iter()
        .map(|&x| match dtype {
            DType::F32 => x,
            DType::F16 => half::f16::from_f32(x).to_f32(),
            DType::BF16 => half::bf16::from_f32(x).to_f32(),
            _ => panic!("unsupported test dtype"),
        })
        .collect()
}

/// Largest |a-b| / (atol + rtol*|b|) ratio; <= 1 means within tolerance.
pub(crate) fn assert_close(a: &[f32], b: &[f64], atol: f64, rtol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        let tol = atol + rtol * y.abs();
        assert!(
            ((x as f64) - y).abs() <= tol || (x.is_infinite() && (x as f64) == y),
            "{what}: element {i}: got {x}, expected {y} (tol {tol})"
        );
    }
}

/// Offsets of the f16 scale fields in one storage block of a quantized
/// `dtype` (ggml's layouts, see `quantized::blocks`).
pub(crate) fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        d if d.is_quantized() => &[0],
        _ => &[],
    }
}

/// `nblocks` storage blocks of a quantized `dtype`: random bytes, with
/// every f16 scale field set to a small finite value (random sign).
pub(crate) fn random_blocks(dtype: DType, nblocks: usize, rng: &mut Rng) -> Vec<u8> {
    let bb = dtype.block_bytes();
    let mut out: Vec<u8> = (0..nblocks * bb).map(|_| rng.next_u64() as u8).collect();
    for b in out.chunks_exact_mut(bb) {
        for &at in f16_fields(dtype) {
            let v = half::f16::from_f32(rng.uniform() * 0.05);
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    out
}

/// Every weight format of the quantized fast path (`quantized::fast::units`).
pub(crate) const FAST_FORMATS: [DType; 11] = [
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::IQ4_NL,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::IQ4_XS,
];

/// The `n` rows of `k` floats in `wf`, each quantized to `dtype` by the
/// crate's quantizer.
pub(crate) fn quantized_rows(dtype: DType, wf: &[f32], n: usize, k: usize) -> Vec<u8> {
    let rb = dtype.bytes_for(k).unwrap();
    let mut wq = vec![0u8; n * rb];
    for (row, q) in wf[..n * k].chunks_exact(k).zip(wq.chunks_exact_mut(rb)) {
        super::quantized::quantize_row(dtype, row, q).unwrap();
    }
    wq
}

/// The values of the `n` quantized rows of `k` elements in `wq`.
pub(crate) fn dequantized_rows(dtype: DType, wq: &[u8], n: usize, k: usize) -> Vec<f32> {
    let rb = dtype.bytes_for(k).unwrap();
    let mut wd = vec![0f32; n * k];
    for (q, row) in wq[..n * rb].chunks_exact(rb).zip(wd.chunks_exact_mut(k)) {
        super::quantized::dequantize_row(dtype, q, row).unwrap();
    }
    wd
}
