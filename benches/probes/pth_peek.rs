//! Print dtype, shape, data offset and the first values of tensors of a
//! `.pth` file, for spot checks against torch:
//!   cargo run --release --example pth_peek -- FILE [NAME...]
use llama_graph::ir::DType;
use llama_graph::weights::pth::open_pth;
use llama_graph::weights::TensorBytes;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args.first().ok_or("usage: pth_peek FILE [NAME...]")?;
    let store = open_pth(std::path::Path::new(path))?;
    let names: Vec<&String> = if args.len() > 1 {
        args[1..].iter().collect()
    } else {
        store.tensors.keys().collect()
    };
    for n in names {
        let t = store
            .tensors
            .get(n)
            .ok_or_else(|| format!("no tensor {n}"))?;
        let b = t.data.as_bytes();
        let vals: Vec<f32> = match t.dtype {
            DType::BF16 => b
                .chunks_exact(2)
                .take(4)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .take(4)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::F32 => b
                .chunks_exact(4)
                .take(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            _ => Vec::new(),
        };
        let at = match &t.data {
            TensorBytes::Mapped { offset, .. } => format!("mapped@{offset}"),
            TensorBytes::Owned(_) => "owned".into(),
            TensorBytes::Arena { offset, .. } => format!("arena@{offset}"),
        };
        println!("{n}: {} {:?} {at} {vals:?}", t.dtype, t.shape);
    }
    Ok(())
}
