//! How well `bf16z` stores a model's matrices: each 2-D F32/F16/BF16 tensor
//! of MODEL is rounded to bf16 (exactly as is, for BF16) and encoded; prints
//! the size against bf16 and the share of weights stored as exceptions.
//!
//! `cargo run --release --example bf16z_stats -- MODEL`

use llama_graph::ir::DType;
use llama_graph::kernels::matmul::bf16z;
use llama_graph::session::Model;

fn main() {
    let path = std::env::args().nth(1).expect("usage: bf16z_stats MODEL");
    let model = Model::open(std::path::Path::new(&path)).expect("open model");
    let (mut plain, mut packed, mut weights, mut exceptions) = (0usize, 0usize, 0usize, 0usize);
    for (name, t) in &model.weights.tensors {
        let [n, k] = t.shape[..] else { continue };
        if k % bf16z::BLOCK != 0 {
            continue;
        }
        let src = t.data.as_bytes();
        let bf16: Vec<u8> = match t.dtype {
            DType::BF16 => src.to_vec(),
            DType::F16 => src
                .chunks_exact(2)
                .flat_map(|c| {
                    let v = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
                    half::bf16::from_f32(v).to_le_bytes()
                })
                .collect(),
            DType::F32 => src
                .chunks_exact(4)
                .flat_map(|c| {
                    let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    half::bf16::from_f32(v).to_le_bytes()
                })
                .collect(),
            _ => continue,
        };
        let z = bf16z::encode(&bf16, n, k).expect("encode");
        let e = bf16z::Bf16z::parse(&z, n, k).expect("parse").n_exceptions();
        plain += bf16.len();
        packed += z.len();
        weights += n * k;
        exceptions += e;
        println!(
            "{name:<40} [{n} x {k}] {:.4} of bf16, exceptions {:.5}%",
            z.len() as f64 / bf16.len() as f64,
            100.0 * e as f64 / (n * k) as f64
        );
    }
    println!(
        "total: {:.1} MB bf16 -> {:.1} MB bf16z ({:.4}); {exceptions} exceptions in {weights} weights ({:.5}%)",
        plain as f64 / 1e6,
        packed as f64 / 1e6,
        packed as f64 / plain.max(1) as f64,
        100.0 * exceptions as f64 / weights.max(1) as f64
    );
}
