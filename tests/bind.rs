//! Binding weights to the graph, and vocabulary consistency when a model
//! directory is opened.
mod common;

use llama_graph::ir::{DType, LogitRows};
use llama_graph::session::{Model, Session, SessionError, SessionOptions};
use llama_graph::weights::{TensorBytes, WeightTensor};
use std::sync::Arc;

fn model() -> Model {
    Model::open(&common::root().join("tests/fixtures/meta/gqa_scaled")).unwrap()
}

fn bind_error(m: &Model) -> String {
    let opts = SessionOptions {
        context: Some(32),
        batch: 8,
        threads: 1,
        logit_rows: LogitRows::Last,
        ..SessionOptions::default()
    };
    match Session::new(m, &opts) {
        Err(SessionError::Bind(e)) => e.to_string(),
        Err(e) => panic!("expected a binding error, got {e}"),
        Ok(_) => panic!("expected a binding error"),
    }
}

#[test]
fn missing_tensor_is_named() {
    let mut m = model();
    m.weights.tensors.remove("layers.1.feed_forward.w3.weight");
    assert_eq!(
        bind_error(&m),
        "missing tensor `layers.1.feed_forward.w3.weight` (the graph expects bf16[224, 64])"
    );
}

#[test]
fn wrong_shape_is_named_with_expected_and_actual() {
    let mut m = model();
    let t = m
        .weights
        .tensors
        .get_mut("layers.0.attention.wk.weight")
        .unwrap();
    t.shape = vec![8, 256];
    assert_eq!(
        bind_error(&m),
        "tensor `layers.0.attention.wk.weight` has shape [8, 256], expected [16, 64]"
    );
}

#[test]
fn unsupported_dtype_and_wrong_size_are_named() {
    let mut m = model();
    let t = m.weights.tensors.get_mut("norm.weight").unwrap();
    *t = WeightTensor {
        dtype: DType::I32,
        shape: vec![64],
        data: TensorBytes::Owned(Arc::new(vec![0u8; 256])),
    };
    // The graph takes the store's dtypes, so an integer weight reaches the executor's check.
    let opts = SessionOptions {
        context: Some(32),
        batch: 8,
        threads: 1,
        logit_rows: LogitRows::Last,
        ..SessionOptions::default()
    };
    let err = Session::new(&m, &opts)
        .err()
        .expect("an i32 norm weight is refused")
        .to_string();
    assert_eq!(
        err,
        "norm.weight: i32 is not a floating-point or quantized weight type"
    );

    let mut m = model();
    let t = m.weights.tensors.get_mut("output.weight").unwrap();
    t.data = TensorBytes::Owned(Arc::new(vec![0u8; 10]));
    assert_eq!(
        bind_error(&m),
        "tensor `output.weight` holds 10 bytes, but bf16[512, 64] needs 65536"
    );
}

#[test]
fn unused_tensors_are_reported() {
    let mut m = model();
    let extra = m.weights.tensors["norm.weight"].clone();
    m.weights.tensors.insert("rope.freqs".into(), extra);
    let opts = SessionOptions {
        context: Some(32),
        batch: 8,
        threads: 1,
        logit_rows: LogitRows::Last,
        ..SessionOptions::default()
    };
    let s = Session::new(&m, &opts).unwrap();
    assert_eq!(s.unused_weights(), vec!["rope.freqs".to_string()]);
}

#[test]
fn vocab_disagreements_are_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let src = common::root().join("tests/fixtures/meta/gqa_scaled");
    let dir = tmp.path().join("m");
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(
        src.join("consolidated.00.pth"),
        dir.join("consolidated.00.pth"),
    )
    .unwrap();
    let params = std::fs::read_to_string(src.join("params.json")).unwrap();
    // params.json disagrees with the embedding.
    std::fs::write(
        dir.join("params.json"),
        params.replace("\"vocab_size\": 512", "\"vocab_size\": 500"),
    )
    .unwrap();
    let err = Model::open(&dir)
        .err()
        .expect("a vocab mismatch is refused")
        .to_string();
    assert_eq!(
        err,
        "vocab_size disagrees: params.json says 500, tok_embeddings.weight has 512 rows"
    );
    // -1 takes it from the embedding.
    std::fs::write(
        dir.join("params.json"),
        params.replace("\"vocab_size\": 512", "\"vocab_size\": -1"),
    )
    .unwrap();
    assert_eq!(Model::open(&dir).unwrap().args.vocab_size, Some(512));
    // A tokenizer larger than the embedding is refused.
    let lines: String = (0..600u32)
        .map(|i| format!("{} {i}\n", b64(&i.to_le_bytes())))
        .collect();
    std::fs::write(dir.join("tokenizer.model"), lines).unwrap();
    let err = Model::open(&dir)
        .err()
        .expect("a tokenizer larger than the vocabulary is refused")
        .to_string();
    assert!(
        err.contains("the tokenizer has") && err.contains("vocabulary is 512"),
        "{err}"
    );
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}
