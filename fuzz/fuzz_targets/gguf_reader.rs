//! Fuzz the GGUF reader: any byte string must parse to a file or a `GgufError`, never panic
//! or over-allocate; everything a parsed file exposes must be consistent.
//!
//! Run (stable toolchain): see fuzz/README.md.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llama_graph::ir::DType;
use llama_graph::kernels::quantized::{dequantize_row, dot_row_scalar, dot_row_simd};
use llama_graph::weights::gguf::{GgufFile, LlamaGguf};

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    assert!(f.data_offset <= f.file_len());
    for (name, t) in &f.tensors {
        let bytes = f.tensor_data(name).expect("validated tensor range");
        assert_eq!(bytes.len(), t.n_bytes);
        assert_eq!(t.shape.iter().product::<usize>(), t.n_elements);
        assert_eq!(t.dtype.bytes_for(t.n_elements), Some(t.n_bytes));
        if t.dtype != DType::I32 && t.n_elements <= 1 << 16 {
            let mut out = vec![0f32; t.n_elements];
            dequantize_row(t.dtype, bytes, &mut out).expect("sizes were validated");
            let x = vec![1f32; t.n_elements];
            let s = dot_row_scalar(t.dtype, bytes, &x);
            if let Some(v) = dot_row_simd(t.dtype, bytes, &x) {
                // With x = 1 both sum the dequantized row; they may differ only by
                // summation order (bounded by n * eps * sum |w|). Q4_1/Q4_K are skipped: their
                // SIMD form factors out the block minimum, so the bound needs sum |d*q| + |m|.
                let sum_abs: f64 = out.iter().map(|w| f64::from(w.abs())).sum();
                let comparable = !matches!(t.dtype, DType::Q4_1 | DType::Q4_K);
                if comparable && s.is_finite() && v.is_finite() && sum_abs < 1e30 {
                    let tol = 2.0 * t.n_elements as f64 * f64::from(f32::EPSILON) * sum_abs + 1e-30;
                    assert!(
                        (f64::from(s) - f64::from(v)).abs() <= tol,
                        "{name}: scalar {s} vs simd {v}"
                    );
                }
            }
        }
    }
    let store = f.to_store();
    assert_eq!(store.tensors.len(), f.tensors.len());
    if let Ok(l) = LlamaGguf::from_file(f) {
        let _ = l.validate();
        assert_eq!(l.store.tensors.len(), l.file.tensors.len());
    }
});
