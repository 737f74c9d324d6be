//! Quantized-block kernels against the `gguf` Python package
//! (fixture: tests/reference/gguf_fixtures.py -> tests/fixtures/gguf/quant_blocks.json).

use llama_graph::ir::DType;
use llama_graph::kernels::quantized::{
    dequantize_row, dot_row_at, dot_row_scalar, dot_row_simd, quantize_row, simd_available,
};
use llama_graph::kernels::Isa;
use serde_json::Value;

fn fixture() -> Value {
    let s = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/gguf/quant_blocks.json"
    ))
    .expect("fixture quant_blocks.json");
    serde_json::from_str(&s).expect("valid JSON")
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn dtype(name: &str) -> DType {
    match name {
        "f32" => DType::F32,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        "q8_0" => DType::Q8_0,
        "q4_0" => DType::Q4_0,
        "q4_1" => DType::Q4_1,
        "q5_0" => DType::Q5_0,
        "q5_1" => DType::Q5_1,
        "q2_K" | "q2_k" => DType::Q2_K,
        "q3_K" | "q3_k" => DType::Q3_K,
        "q4_K" | "q4_k" => DType::Q4_K,
        "q5_K" | "q5_k" => DType::Q5_K,
        "q6_K" | "q6_k" => DType::Q6_K,
        "iq4_nl" => DType::IQ4_NL,
        "iq4_xs" => DType::IQ4_XS,
        other => panic!("unknown dtype {other}"),
    }
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

/// Deterministic pseudo-random activations in [-1, 1).
fn activations(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn dequantize_matches_gguf_py_bit_exact() {
    let fx = fixture();
    let formats = fx["formats"].as_array().expect("formats");
    assert_eq!(formats.len(), 15, "every supported format is covered");
    for f in formats {
        let dt = dtype(f["dtype"].as_str().expect("dtype"));
        let bytes = hex(f["bytes_hex"].as_str().expect("hex"));
        let expected = f32s(&f["values"]);
        let mut out = vec![f32::NAN; expected.len()];
        dequantize_row(dt, &bytes, &mut out).expect("dequantize");
        for (i, (a, e)) in out.iter().zip(&expected).enumerate() {
            assert_eq!(
                a.to_bits(),
                e.to_bits(),
                "{dt} element {i}: got {a}, gguf-py {e}"
            );
        }
    }
}

#[test]
fn dot_matches_dequantize_then_multiply() {
    let fx = fixture();
    for (k, f) in fx["formats"]
        .as_array()
        .expect("formats")
        .iter()
        .enumerate()
    {
        let dt = dtype(f["dtype"].as_str().expect("dtype"));
        let bytes = hex(f["bytes_hex"].as_str().expect("hex"));
        let w = f32s(&f["values"]);
        let x = activations(w.len(), k as u64 + 1);
        let exact: f64 = w
            .iter()
            .zip(&x)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum();
        let scale: f64 = w
            .iter()
            .zip(&x)
            .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
            .sum();
        let tol = 1e-5 * scale + 1e-7;
        let scalar = dot_row_scalar(dt, &bytes, &x);
        assert!(
            (f64::from(scalar) - exact).abs() <= tol,
            "{dt} scalar {scalar} vs {exact} (tol {tol})"
        );
        let simd = dot_row_simd(dt, &bytes, &x);
        if let Some(simd) = simd {
            assert!(
                (f64::from(simd) - exact).abs() <= tol,
                "{dt} simd {simd} vs {exact} (tol {tol})"
            );
        } else {
            eprintln!("note: no AVX2/FMA/F16C on this CPU; SIMD kernels not exercised");
        }
        assert_eq!(
            dot_row_at(Isa::detect(), dt, &bytes, &x),
            simd.unwrap_or(scalar)
        );
    }
}

#[test]
fn dot_longer_rows_simd_vs_scalar() {
    // Rows of many blocks: repeat each fixture row 16 times, with different activations.
    let fx = fixture();
    for (k, f) in fx["formats"]
        .as_array()
        .expect("formats")
        .iter()
        .enumerate()
    {
        let dt = dtype(f["dtype"].as_str().expect("dtype"));
        let one = hex(f["bytes_hex"].as_str().expect("hex"));
        let w1 = f32s(&f["values"]);
        let bytes: Vec<u8> = one.iter().copied().cycle().take(one.len() * 16).collect();
        let w: Vec<f32> = w1.iter().copied().cycle().take(w1.len() * 16).collect();
        let x = activations(w.len(), 100 + k as u64);
        let exact: f64 = w
            .iter()
            .zip(&x)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum();
        let scale: f64 = w
            .iter()
            .zip(&x)
            .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
            .sum();
        let tol = 1e-5 * scale + 1e-7;
        let s = dot_row_scalar(dt, &bytes, &x);
        assert!(
            (f64::from(s) - exact).abs() <= tol,
            "{dt} scalar {s} vs {exact}"
        );
        if let Some(v) = dot_row_simd(dt, &bytes, &x) {
            assert!(
                (f64::from(v) - exact).abs() <= tol,
                "{dt} simd {v} vs {exact}"
            );
        }
    }
}

#[test]
fn simd_detection_reported() {
    // Not an assertion on the machine, but make the CI log say which path ran.
    eprintln!("simd_available = {}", simd_available());
}

#[test]
fn quantize_matches_gguf_py() {
    let fx = fixture();
    let cases = fx["quantize"].as_array().expect("quantize");
    assert_eq!(cases.len(), 3);
    for c in cases {
        let dt = dtype(c["dtype"].as_str().expect("dtype"));
        let x = f32s(&c["input"]);
        let expected = hex(c["bytes_hex"].as_str().expect("hex"));
        let mut out = vec![0u8; dt.bytes_for(x.len()).expect("whole blocks")];
        quantize_row(dt, &x, &mut out).expect("quantize");
        assert_eq!(out, expected, "{dt} quantized bytes differ from gguf-py");
    }
}

#[test]
#[should_panic(expected = "dot_row")]
fn dot_row_rejects_wrong_length() {
    let _ = dot_row_at(Isa::detect(), DType::Q4_0, &[0u8; 17], &[0f32; 32]);
}

/// Throughput of the row kernels (run with `cargo test --release --test gguf_quant -- --ignored --nocapture`).
#[test]
#[ignore]
fn bench_dot_rows() {
    let (rows, cols) = (1536usize, 576 * 4);
    let x = activations(cols, 7);
    for dt in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q4_K,
        DType::Q6_K,
    ] {
        let row_bytes = dt.bytes_for(cols).unwrap();
        // Deterministic bytes with small f16 scales: quantize where we can, else patterned bytes.
        let w: Vec<f32> = activations(rows * cols, 3);
        let mut m = vec![0u8; rows * row_bytes];
        if quantize_row(dt, &w, &mut m).is_err() {
            for (i, b) in m.iter_mut().enumerate() {
                *b = (i * 37 % 251) as u8;
            }
            for r in m.chunks_exact_mut(dt.block_bytes()) {
                let at = if dt == DType::Q6_K { 208 } else { 0 };
                r[at..at + 2].copy_from_slice(&half::f16::from_f32(0.001).to_le_bytes());
                if dt == DType::Q4_K {
                    r[2..4].copy_from_slice(&half::f16::from_f32(0.001).to_le_bytes());
                }
            }
        }
        for (label, simd) in [("scalar", false), ("simd", true)] {
            if simd && !simd_available() {
                continue;
            }
            let t = std::time::Instant::now();
            let mut acc = 0f32;
            let reps = 5;
            for _ in 0..reps {
                for r in m.chunks_exact(row_bytes) {
                    acc += if simd {
                        dot_row_simd(dt, r, &x).unwrap()
                    } else {
                        dot_row_scalar(dt, r, &x)
                    };
                }
            }
            let s = t.elapsed().as_secs_f64() / reps as f64;
            eprintln!(
                "{dt:>5} {label:>6}: {rows}x{cols} matvec {:.3} ms, {:.2} GB/s weights, {:.2} GFLOP/s (acc {acc:.3})",
                s * 1e3,
                m.len() as f64 / s / 1e9,
                2.0 * (rows * cols) as f64 / s / 1e9
            );
        }
    }
}
