//! The .pth reader against fixtures written by real torch
//! (tests/reference/pth_fixtures.py): bit-exact tensor bytes, zero-copy
//! views, shard merging, and the specific error for every bad file.

use llama_graph::ir::DType;
use llama_graph::weights::pth::{
    load_meta_checkpoint, merge_shards, open_pth, read_pth_bytes, shard_paths, PthError,
};
use llama_graph::weights::{TensorBytes, WeightStore, WeightTensor};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pth")
}

fn expected() -> Value {
    let s = std::fs::read_to_string(fixtures().join("expected.json")).expect("expected.json");
    serde_json::from_str(&s).expect("json")
}

fn sha(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn check_store(label: &str, store: &WeightStore, exp: &Value) {
    let exp = exp.as_object().expect("object");
    let got: Vec<&String> = store.tensors.keys().collect();
    let mut want: Vec<&String> = exp.keys().collect();
    want.sort();
    assert_eq!(got, want, "{label}: tensor names");
    for (name, e) in exp {
        let t = &store.tensors[name];
        let dt = match t.dtype {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::I32 => "i32",
            d => panic!("{label}/{name}: unexpected dtype {d}"),
        };
        assert_eq!(dt, e["dtype"], "{label}/{name}: dtype");
        let shape: Vec<usize> = e["shape"]
            .as_array()
            .expect("shape")
            .iter()
            .map(|x| x.as_u64().expect("dim") as usize)
            .collect();
        assert_eq!(t.shape, shape, "{label}/{name}: shape");
        assert_eq!(sha(t.data.as_bytes()), e["sha256"], "{label}/{name}: bytes");
    }
}

#[test]
fn torch_saved_files_read_bit_exact() {
    let exp = expected();
    for f in [
        "good.pth",
        "good_proto4.pth",
        "good_deflated.pth",
        "handmade_ok.pth",
    ] {
        let path = fixtures().join(f);
        let store = open_pth(&path).unwrap_or_else(|e| panic!("{f}: {e}"));
        check_store(f, &store, &exp["tensors"][f]);
        let bytes = std::fs::read(&path).expect("read");
        let store2 = read_pth_bytes(&bytes).unwrap_or_else(|e| panic!("{f}: {e}"));
        check_store(f, &store2, &exp["tensors"][f]);
    }
}

#[test]
fn contiguous_tensors_are_zero_copy_views() {
    let path = fixtures().join("good.pth");
    let store = open_pth(&path).expect("open");
    let file_len = std::fs::metadata(&path).expect("stat").len() as usize;
    for name in [
        "w_bf16",
        "w_f16",
        "w_f32",
        "shared_a",
        "shared_b",
        "param",
        "nested.inner",
    ] {
        match &store.tensors[name].data {
            TensorBytes::Mapped { offset, len, .. } => assert!(offset + len <= file_len, "{name}"),
            o => panic!("{name} should be a mapped view, is {o:?}"),
        }
    }
    // The two views of one storage point into the same entry, 16 elements apart.
    let (a, b) = (
        &store.tensors["shared_a"].data,
        &store.tensors["shared_b"].data,
    );
    if let (TensorBytes::Mapped { offset: oa, .. }, TensorBytes::Mapped { offset: ob, .. }) = (a, b)
    {
        assert_eq!(ob - oa, 16 * 2);
    }
    // Non-contiguous tensors are copied.
    for name in ["transposed", "col_slice"] {
        assert!(
            matches!(store.tensors[name].data, TensorBytes::Owned(_)),
            "{name}"
        );
    }
}

#[test]
fn sharded_meta_checkpoints_merge_to_the_full_model() {
    let exp = expected();
    for d in ["meta2", "meta3"] {
        let store =
            load_meta_checkpoint(&fixtures().join(d)).unwrap_or_else(|e| panic!("{d}: {e}"));
        check_store(d, &store, &exp["tensors"][d]);
        // Concatenated tensors are owned; replicated ones stay views of shard 0.
        for (n, t) in &store.tensors {
            let replicated = n.ends_with("norm.weight") || n == "rope.freqs";
            assert_eq!(
                matches!(t.data, TensorBytes::Owned(_)),
                !replicated,
                "{d}/{n}"
            );
        }
    }
}

#[test]
fn bad_files_give_their_specific_error() {
    let sentinel = Path::new("/tmp/llama-graph-pth-pwned");
    let _ = std::fs::remove_file(sentinel);
    let exp = expected();
    let errors = exp["errors"].as_object().expect("errors");
    assert!(errors.len() >= 17);
    for (f, e) in errors {
        let path = fixtures().join(f);
        let err = match open_pth(&path) {
            Ok(s) => panic!("{f}: loaded {} tensors, expected an error", s.tensors.len()),
            Err(err) => err,
        };
        let variant = e["variant"].as_str().expect("variant");
        let dbg = format!("{err:?}");
        assert!(
            dbg.starts_with(variant),
            "{f}: got {dbg}, expected variant {variant}"
        );
        let msg = err.to_string();
        eprintln!("{f}: {msg}");
        let want = e["contains"].as_str().expect("contains");
        assert!(msg.contains(want), "{f}: message `{msg}` lacks `{want}`");
        // Same result from the in-memory path.
        let bytes = std::fs::read(&path).expect("read");
        let err2 = read_pth_bytes(&bytes).expect_err(f);
        assert_eq!(err2.to_string(), msg, "{f}");
    }
    assert!(
        !sentinel.exists(),
        "a hostile pickle created the sentinel file"
    );
}

#[test]
fn disallowed_global_is_named() {
    let err = open_pth(&fixtures().join("bad_os_system.pth")).expect_err("hostile");
    assert_eq!(
        err.to_string(),
        "data.pkl: pickle refers to global `os.system`, which is not on the allow-list (refusing to load)"
    );
}

fn t(dtype: DType, shape: &[usize], bytes: Vec<u8>) -> WeightTensor {
    WeightTensor {
        dtype,
        shape: shape.to_vec(),
        data: TensorBytes::Owned(Arc::new(bytes)),
    }
}

fn store(items: &[(&str, WeightTensor)]) -> WeightStore {
    let mut s = WeightStore::default();
    for (n, w) in items {
        s.tensors.insert(n.to_string(), w.clone());
    }
    s
}

#[test]
fn merge_concatenates_naively() {
    // wq: dim 0, wo: dim 1; i32 elements are their own row-major index in
    // the full tensor, so the merged bytes must be 0..n.
    let full = |rows: usize, cols: usize| -> Vec<i32> { (0..(rows * cols) as i32).collect() };
    let le = |v: &[i32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let f = full(4, 6);
    let rows = |a: usize, b: usize| le(&f[a * 6..b * 6]);
    let cols = |a: usize, b: usize| -> Vec<u8> {
        le(&(0..4)
            .flat_map(|r| f[r * 6 + a..r * 6 + b].to_vec())
            .collect::<Vec<_>>())
    };
    let s0 = store(&[
        ("l.attention.wq.weight", t(DType::I32, &[2, 6], rows(0, 2))),
        ("l.attention.wo.weight", t(DType::I32, &[4, 3], cols(0, 3))),
        ("norm.weight", t(DType::I32, &[6], le(&[1; 6]))),
    ]);
    let s1 = store(&[
        ("l.attention.wq.weight", t(DType::I32, &[2, 6], rows(2, 4))),
        ("l.attention.wo.weight", t(DType::I32, &[4, 3], cols(3, 6))),
        ("norm.weight", t(DType::I32, &[6], le(&[1; 6]))),
    ]);
    let m = merge_shards(vec![s0.clone(), s1.clone()]).expect("merge");
    for n in ["l.attention.wq.weight", "l.attention.wo.weight"] {
        assert_eq!(m.tensors[n].shape, vec![4, 6], "{n}");
        assert_eq!(m.tensors[n].data.as_bytes(), &le(&f)[..], "{n}");
    }
    // A replicated tensor that differs is an error naming it.
    let mut s1b = s1.clone();
    s1b.tensors
        .insert("norm.weight".into(), t(DType::I32, &[6], le(&[2; 6])));
    let e = merge_shards(vec![s0.clone(), s1b]).expect_err("differs");
    assert!(
        matches!(&e, PthError::Merge { tensor, .. } if tensor == "norm.weight"),
        "{e}"
    );
    // Shape mismatch outside the split dim.
    let mut s1c = s1;
    s1c.tensors.insert(
        "l.attention.wq.weight".into(),
        t(DType::I32, &[2, 5], rows(0, 2)[..40].to_vec()),
    );
    let e = merge_shards(vec![s0, s1c]).expect_err("mismatch");
    assert!(
        matches!(&e, PthError::Merge { tensor, .. } if tensor == "l.attention.wq.weight"),
        "{e}"
    );
}

#[test]
fn shard_discovery() {
    let d = tempfile::tempdir().expect("tmp");
    assert!(matches!(shard_paths(d.path()), Err(PthError::NoShards(_))));
    let src = fixtures().join("meta2/consolidated.00.pth");
    std::fs::copy(&src, d.path().join("consolidated.00.pth")).expect("copy");
    std::fs::copy(&src, d.path().join("consolidated.02.pth")).expect("copy");
    std::fs::write(d.path().join("consolidated.xx.pth"), b"ignored").expect("w");
    let e = load_meta_checkpoint(d.path()).expect_err("gap");
    assert!(
        matches!(
            e,
            PthError::MissingShard {
                index: 1,
                found: 2,
                ..
            }
        ),
        "{e}"
    );
    std::fs::rename(
        d.path().join("consolidated.02.pth"),
        d.path().join("consolidated.01.pth"),
    )
    .expect("mv");
    let p = shard_paths(d.path()).expect("paths");
    assert_eq!(p.len(), 2);
    assert!(p[0].ends_with("consolidated.00.pth") && p[1].ends_with("consolidated.01.pth"));
    // One shard alone stays zero-copy.
    std::fs::remove_file(d.path().join("consolidated.01.pth")).expect("rm");
    let s = load_meta_checkpoint(d.path()).expect("single");
    assert!(s
        .tensors
        .values()
        .all(|t| matches!(t.data, TensorBytes::Mapped { .. })));
}
