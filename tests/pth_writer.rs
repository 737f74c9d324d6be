//! The .pth writer and the random Meta checkpoint generator. torch.load
//! compatibility is checked by tests/reference/check_rust_written.py on the
//! committed files in tests/fixtures/pth/rust_written/, and the test below
//! proves the current writer still produces exactly those bytes.
//!
//! Regenerate the committed files (then re-run the Python check):
//!   LLAMA_GRAPH_REGEN_FIXTURES=1 cargo test --test pth_writer
//!   python tests/reference/check_rust_written.py   (with torch installed)

use half::{bf16, f16};
use llama_graph::ir::DType;
use llama_graph::weights::pth::{
    ffn_hidden_dim, generate_random_checkpoint, load_meta_checkpoint, meta_tensor_shapes, open_pth,
    write_pth, MetaParams, PthError, PthWriter,
};
use llama_graph::weights::{TensorBytes, WeightTensor};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn owned(dtype: DType, shape: &[usize], bytes: Vec<u8>) -> WeightTensor {
    WeightTensor {
        dtype,
        shape: shape.to_vec(),
        data: TensorBytes::Owned(Arc::new(bytes)),
    }
}

/// Tensors whose values follow formulas that check_rust_written.py repeats.
fn formula_tensors() -> Vec<(String, WeightTensor)> {
    let f32s = |n: usize, f: &dyn Fn(usize) -> f32| -> Vec<u8> {
        (0..n).flat_map(|i| f(i).to_le_bytes()).collect()
    };
    vec![
        (
            "a.f32".into(),
            owned(DType::F32, &[3, 5], f32s(15, &|i| i as f32 * 0.25 - 1.0)),
        ),
        (
            "b.f16".into(),
            owned(
                DType::F16,
                &[4],
                (0..4)
                    .flat_map(|i| f16::from_f32(i as f32 * 0.5 - 0.75).to_le_bytes())
                    .collect(),
            ),
        ),
        (
            "c.bf16".into(),
            owned(
                DType::BF16,
                &[2, 3],
                (0..6)
                    .flat_map(|i| bf16::from_f32(i as f32 * -1.5 + 0.125).to_le_bytes())
                    .collect(),
            ),
        ),
        (
            "d.i32".into(),
            owned(
                DType::I32,
                &[6],
                (0..6)
                    .flat_map(|i: i32| (i * 1000 - 2500).to_le_bytes())
                    .collect(),
            ),
        ),
        (
            "e.scalar".into(),
            owned(DType::F32, &[], 7.0f32.to_le_bytes().to_vec()),
        ),
        (
            "f.4d".into(),
            owned(
                DType::BF16,
                &[2, 1, 2, 2],
                (0..8)
                    .flat_map(|i| bf16::from_f32(i as f32).to_le_bytes())
                    .collect(),
            ),
        ),
        ("g.empty".into(), owned(DType::F16, &[0, 3], Vec::new())),
    ]
}

fn tiny_params() -> MetaParams {
    MetaParams::from_json(
        r#"{"dim": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 40,
            "multiple_of": 16, "ffn_dim_multiplier": 1.5, "norm_eps": 1e-05,
            "rope_theta": 500000.0, "use_scaled_rope": true}"#,
    )
    .expect("params")
}

fn write_all_fixtures(dir: &Path) {
    let ts = formula_tensors();
    let refs: Vec<(&str, &WeightTensor)> = ts.iter().map(|(n, t)| (n.as_str(), t)).collect();
    std::fs::create_dir_all(dir).expect("mkdir");
    write_pth(&dir.join("values.pth"), &refs).expect("write values");
    generate_random_checkpoint(&dir.join("random_bf16"), &tiny_params(), 42, DType::BF16)
        .expect("gen bf16");
    generate_random_checkpoint(&dir.join("random_f32"), &tiny_params(), 7, DType::F32)
        .expect("gen f32");
}

fn committed() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pth/rust_written")
}

#[test]
fn writer_output_matches_the_torch_checked_fixtures() {
    if std::env::var_os("LLAMA_GRAPH_REGEN_FIXTURES").is_some() {
        write_all_fixtures(&committed());
    }
    let tmp = tempfile::tempdir().expect("tmp");
    write_all_fixtures(tmp.path());
    for f in [
        "values.pth",
        "random_bf16/consolidated.00.pth",
        "random_bf16/params.json",
        "random_f32/consolidated.00.pth",
        "random_f32/params.json",
    ] {
        let a = std::fs::read(tmp.path().join(f)).expect("new");
        let b = std::fs::read(committed().join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert!(
            a == b,
            "{f}: writer output differs from the committed, torch-checked file"
        );
    }
}

#[test]
fn write_then_read_roundtrip_is_exact_and_aligned() {
    let tmp = tempfile::tempdir().expect("tmp");
    let path = tmp.path().join("values.pth");
    let ts = formula_tensors();
    let refs: Vec<(&str, &WeightTensor)> = ts.iter().map(|(n, t)| (n.as_str(), t)).collect();
    write_pth(&path, &refs).expect("write");
    let store = open_pth(&path).expect("read");
    assert_eq!(store.tensors.len(), ts.len());
    for (n, t) in &ts {
        let r = &store.tensors[n];
        assert_eq!(r.dtype, t.dtype, "{n}");
        assert_eq!(r.shape, t.shape, "{n}");
        assert_eq!(r.data.as_bytes(), t.data.as_bytes(), "{n}");
        if let TensorBytes::Mapped { offset, .. } = r.data {
            assert_eq!(offset % 64, 0, "{n}: data not 64-byte aligned");
        } else if !t.data.is_empty() {
            panic!("{n}: not a mapped view");
        }
    }
}

#[test]
fn random_checkpoint_has_meta_names_shapes_and_sane_values() {
    let tmp = tempfile::tempdir().expect("tmp");
    let p = tiny_params();
    assert_eq!(ffn_hidden_dim(&p), 64);
    generate_random_checkpoint(tmp.path(), &p, 1, DType::BF16).expect("gen");
    let back = MetaParams::from_json(
        &std::fs::read_to_string(tmp.path().join("params.json")).expect("pj"),
    )
    .expect("params.json parses");
    assert_eq!(back, p);
    let store = load_meta_checkpoint(tmp.path()).expect("load");
    let shapes = meta_tensor_shapes(&p).expect("shapes");
    assert_eq!(store.tensors.len(), shapes.len());
    assert_eq!(
        store.tensors["layers.1.attention.wk.weight"].shape,
        vec![8, 16]
    );
    assert_eq!(
        store.tensors["layers.0.feed_forward.w2.weight"].shape,
        vec![16, 64]
    );
    for (n, s) in &shapes {
        let t = &store.tensors[n];
        assert_eq!(&t.shape, s, "{n}");
        let v: Vec<f32> = t
            .data
            .as_bytes()
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let sd = (v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / v.len() as f32).sqrt();
        if n.ends_with("norm.weight") {
            // 16 values near 1, where bf16 steps are 1/128 apart.
            assert!((mean - 1.0).abs() < 0.03, "{n}: mean {mean}");
            assert!(v.iter().all(|x| (x - 1.0).abs() < 0.1), "{n}");
        } else {
            assert!(mean.abs() < 0.01, "{n}: mean {mean}");
            assert!(sd > 0.015 && sd < 0.025, "{n}: std {sd}");
        }
    }
    // Different tensors get different streams, and the seed matters.
    let a = store.tensors["layers.0.attention.wq.weight"]
        .data
        .as_bytes();
    let b = store.tensors["layers.1.attention.wq.weight"]
        .data
        .as_bytes();
    assert_ne!(a, b);
    let tmp2 = tempfile::tempdir().expect("tmp");
    generate_random_checkpoint(tmp2.path(), &p, 2, DType::BF16).expect("gen");
    let s2 = load_meta_checkpoint(tmp2.path()).expect("load");
    assert_ne!(
        s2.tensors["layers.0.attention.wq.weight"].data.as_bytes(),
        a
    );
}

#[test]
fn writer_rejects_wrong_sizes_and_params() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut w = PthWriter::create(&tmp.path().join("x.pth")).expect("create");
    let e = w
        .add_tensor_with("short", DType::F32, &[4], |out| out.write_all(&[0u8; 12]))
        .expect_err("short write");
    assert!(
        matches!(&e, PthError::Write { tensor, .. } if tensor == "short"),
        "{e}"
    );
    let e = w
        .add_tensor_with("q", DType::Q4_0, &[32], |out| out.write_all(&[0u8; 18]))
        .expect_err("q4_0");
    assert!(e.to_string().contains("q4_0"), "{e}");
    let mut p = tiny_params();
    p.vocab_size = -1;
    let e = generate_random_checkpoint(tmp.path(), &p, 0, DType::BF16).expect_err("vocab -1");
    assert!(matches!(e, PthError::Params(_)), "{e}");
    p.vocab_size = 40;
    p.n_kv_heads = Some(3);
    assert!(meta_tensor_shapes(&p).is_err());
}
