//! Fuzz the block dequantizers, the quantized dot products and the integer
//! fast path (`qmatmul_fast_with`, small-S and packed kernels) with arbitrary
//! block bytes (NaN and infinite f16 scales included): the first byte picks
//! the weight format, the rest is cut into whole blocks. Nothing may panic or
//! misbehave; the exact path's SIMD and scalar dot products agree wherever the
//! values are finite, the fast path's bit for bit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llama_graph::ir::DType;
use llama_graph::kernels::matmul::Epilogue;
use llama_graph::kernels::quantized::fast::{
    qmatmul_fast_with, scratch_len_for, supports, x8, ActQuant, Layout, Q8Act,
};
use llama_graph::kernels::quantized::{dequantize_row, dot_row_scalar, dot_row_simd};
use llama_graph::kernels::{Isa, LinearArgs, WeightRef};
use llama_graph::pool::ThreadPool;
use std::sync::OnceLock;

static POOL: OnceLock<ThreadPool> = OnceLock::new();

const TYPES: [DType; 15] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::IQ4_NL,
    DType::IQ4_XS,
];

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let dtype = TYPES[sel as usize % TYPES.len()];
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    let nblocks = rest.len() / bb;
    let bytes = &rest[..nblocks * bb];
    let n = nblocks * be;
    let mut out = vec![0f32; n];
    dequantize_row(dtype, bytes, &mut out).expect("whole blocks");
    // Every element is a function of its block alone: dequantizing block by
    // block gives the same bits.
    let mut one = vec![0f32; be];
    for (b, chunk) in bytes.chunks_exact(bb).zip(out.chunks_exact(be)) {
        dequantize_row(dtype, b, &mut one).expect("one block");
        for (a, c) in one.iter().zip(chunk) {
            assert_eq!(a.to_bits(), c.to_bits());
        }
    }
    let x: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.0) * 0.25).collect();
    let s = dot_row_scalar(dtype, bytes, &x);
    if let Some(v) = dot_row_simd(dtype, bytes, &x) {
        let sum_abs: f64 = out
            .iter()
            .zip(&x)
            .map(|(w, x)| f64::from((w * x).abs()))
            .sum();
        // Q4_1/Q4_K factor the block minimum out of the sum: their rounding
        // is bounded by other terms (see the gguf_reader target).
        let comparable = !matches!(dtype, DType::Q4_1 | DType::Q4_K);
        if comparable && s.is_finite() && v.is_finite() && sum_abs < 1e30 {
            let tol = 4.0 * n as f64 * f64::from(f32::EPSILON) * sum_abs + 1e-30;
            assert!(
                (f64::from(s) - f64::from(v)).abs() <= tol,
                "{dtype}: scalar {s} vs simd {v}"
            );
        }
    }
    // The fast path: the bytes as one weight row, 2 activation rows (the
    // small-S kernels) and 17 (the packed prefill kernels), at the scalar
    // level and at this CPU's own, with the activations' remainder and
    // without it (a draft model's precision). Every level computes the same
    // f32 operations, so the results agree bit for bit (or are both NaN).
    if supports(dtype) && n > 0 {
        let pool = POOL.get_or_init(|| ThreadPool::new(2));
        let w = WeightRef::new(dtype, bytes);
        for (quant, s) in [ActQuant::Remainder, ActQuant::Plain]
            .into_iter()
            .flat_map(|q| [(q, 2usize), (q, 17)])
        {
            let xs: Vec<f32> = (0..s)
                .flat_map(|t| x.iter().map(move |v| v * (1.0 + t as f32)))
                .collect();
            let mut got = [vec![0f32; s], vec![0f32; s]];
            for (i, isa) in [Isa::Scalar, llama_graph::kernels::Kernels::current().isa()].into_iter().enumerate() {
                let need = scratch_len_for(isa, dtype, s, n).expect("whole blocks");
                let mut scratch = vec![Q8Act::default(); need];
                let args = LinearArgs::new(&xs, s, n, w, 1, Epilogue::None);
                qmatmul_fast_with(isa, quant, pool, args, &mut got[i], &mut scratch)
                    .expect("valid shapes");
            }
            for t in 0..s {
                let (a, b) = (got[0][t], got[1][t]);
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{dtype} fast path {quant:?}, s={s} token {t}: scalar {a} vs {b}"
                );
            }
        }
    }
    // The x8 layout: 8 rows (row r = the blocks rotated by r), interleaved,
    // at this CPU's level against the row-major rows at the scalar level,
    // bit for bit, in both activation modes.
    if x8::supports(dtype, x8::G, n) {
        let pool = POOL.get_or_init(|| ThreadPool::new(2));
        let mut rows = Vec::with_capacity(x8::G * bytes.len());
        for r in 0..x8::G {
            let cut = (r % nblocks) * bb;
            rows.extend_from_slice(&bytes[cut..]);
            rows.extend_from_slice(&bytes[..cut]);
        }
        let mut inter = vec![0u8; rows.len()];
        x8::repack(dtype, &rows, bytes.len(), &mut inter);
        for (quant, s) in [ActQuant::Remainder, ActQuant::Plain]
            .into_iter()
            .flat_map(|q| [(q, 1usize), (q, 3), (q, 17)])
        {
            let xs: Vec<f32> = (0..s)
                .flat_map(|t| x.iter().map(move |v| v * (1.0 - t as f32)))
                .collect();
            let mut got = [vec![0f32; s * x8::G], vec![0f32; s * x8::G]];
            let ws = [
                (Isa::Scalar, WeightRef::new(dtype, &rows)),
                (llama_graph::kernels::Kernels::current().isa(), WeightRef::new(dtype, &inter).with_layout(Layout::X8)),
            ];
            for (i, (isa, w)) in ws.into_iter().enumerate() {
                let need = scratch_len_for(isa, dtype, s, n).expect("whole blocks");
                let mut scratch = vec![Q8Act::default(); need];
                let args = LinearArgs::new(&xs, s, n, w, x8::G, Epilogue::None);
                qmatmul_fast_with(isa, quant, pool, args, &mut got[i], &mut scratch)
                    .expect("valid shapes");
            }
            for (j, (a, b)) in got[0].iter().zip(&got[1]).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{dtype} x8 {quant:?}, s={s} output {j}: rows {a} vs x8 {b}"
                );
            }
        }
    }
});
