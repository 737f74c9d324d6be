//! Hostile and broken safetensors files and Hugging Face directories: each
//! gives one clear error naming the problem, never a panic, never an
//! allocation sized by the file.
mod common;

use llama_graph::ir::DType;
use llama_graph::session::Model;
use llama_graph::weights::safetensors::{parse_header, to_safetensors_bytes, SafetensorsError};
use std::path::Path;

/// An image with the header text `json` (padded to 8) followed by `data`.
fn image(json: &str, data: &[u8]) -> Vec<u8> {
    let mut h = json.to_string();
    while !h.len().is_multiple_of(8) {
        h.push(' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(data);
    out
}

fn err(bytes: &[u8]) -> String {
    let e = parse_header(bytes).expect_err("must be refused");
    // The format's own library must refuse it too, unless the reason is one
    // of the checks we add on top (duplicates, our dtype allow-list).
    let ours_only = matches!(
        e,
        SafetensorsError::DuplicateTensor(_) | SafetensorsError::UnsupportedDtype { .. }
    );
    if !ours_only {
        assert!(
            safetensors::SafeTensors::read_metadata(bytes).is_err(),
            "the safetensors crate accepts what we refuse: {e}"
        );
    }
    e.to_string()
}

fn assert_err(bytes: &[u8], want: &[&str]) {
    let e = err(bytes);
    assert!(!e.contains('\n'), "one line: {e}");
    for w in want {
        assert!(e.contains(w), "`{w}` not in: {e}");
    }
}

#[test]
fn header_length_and_encoding() {
    assert_err(b"\x01\x00", &["shorter than the 8-byte header length"]);
    let mut huge = (200_000_000u64).to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    assert_err(
        &huge,
        &["200000000", "larger than the 100000000-byte limit"],
    );
    let mut past = (64u64).to_le_bytes().to_vec();
    past.extend_from_slice(b"{}      ");
    assert_err(
        &past,
        &[
            "header length 64 runs past the end of the file (16 bytes)",
            "truncated",
        ],
    );
    let mut max = u64::MAX.to_le_bytes().to_vec();
    max.extend_from_slice(b"{}");
    assert_err(&max, &["larger than"]);
    assert_err(&image("{\"a\": \u{0}", &[]), &["not valid JSON"]);
    let mut bad_utf8 = (8u64).to_le_bytes().to_vec();
    bad_utf8.extend_from_slice(b"{\"\xff\": 1}");
    assert_err(&bad_utf8[..16], &["not valid UTF-8"]);
    assert_err(&image("[1, 2]", &[]), &["not valid JSON"]);
}

#[test]
fn entries() {
    let d = [0u8; 8];
    let cases: &[(&str, &[u8], &[&str])] = &[
        (
            r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}"#,
            &d,
            &["`a` appears twice"],
        ),
        (
            r#"{"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}"#,
            &d,
            &["`w` has dtype F64", "F32, F16, BF16"],
        ),
        (
            r#"{"w": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}"#,
            &d,
            &["dtype I64"],
        ),
        (
            r#"{"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}"#,
            &d,
            &["`w`", "is 12 bytes", "[0, 8) hold 8"],
        ),
        (
            r#"{"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}"#,
            &d,
            &["`w`", "end before they begin"],
        ),
        (
            r#"{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}"#,
            &d,
            &[
                "`w`",
                "[0, 16) runs past the end of the data section (8 bytes",
                "truncated",
            ],
        ),
        (
            r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}"#,
            &d,
            &["`b`", "overlaps tensor `a` [0, 8)"],
        ),
        (
            r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}"#,
            &d,
            &["bytes [0, 4) belong to no tensor"],
        ),
        (
            r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}"#,
            &d,
            &["4 bytes after the last tensor"],
        ),
        (
            r#"{"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 4], "data_offsets": [0, 8]}}"#,
            &d,
            &["`a`", "overflows"],
        ),
        (
            r#"{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}"#,
            &d,
            &["`a`", "`shape` holds -1"],
        ),
        (
            r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}"#,
            &d,
            &["`data_offsets` has 1 values, expected 2"],
        ),
        (
            r#"{"a": {"shape": [2], "data_offsets": [0, 8]}}"#,
            &d,
            &["`dtype` is missing"],
        ),
        (r#"{"a": 5}"#, &d, &["`a`", "entry is a number"]),
        (
            r#"{"__metadata__": {"format": 1}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}"#,
            &d,
            &["__metadata__", "`format`"],
        ),
    ];
    for (json, data, want) in cases {
        let bytes = image(json, data);
        let e = err(&bytes);
        for w in *want {
            assert!(e.contains(w), "{json}\n`{w}` not in: {e}");
        }
    }
}

#[test]
fn valid_edge_cases_are_accepted() {
    // Zero-size tensors may share an offset; no tensors at all is a valid file.
    let ok = image(
        r#"{"e1": {"dtype": "BF16", "shape": [0], "data_offsets": [0, 0]}, "e2": {"dtype": "F16", "shape": [0, 3], "data_offsets": [0, 0]}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}"#,
        &[0; 8],
    );
    let h = parse_header(&ok).unwrap();
    assert_eq!(h.tensors.len(), 3);
    assert!(parse_header(&image("{}", &[])).unwrap().tensors.is_empty());
    // Out-of-order entries are ordered by their data.
    let h = parse_header(&image(
        r#"{"b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}"#,
        &[0; 8],
    ))
    .unwrap();
    assert_eq!(h.tensors[0].name, "a");
}

/// A minimal valid HF directory: config.json and a model.safetensors whose
/// tensors the test chooses.
fn hf_dir(dir: &Path, config_extra: &str, tensors: &[(&str, Vec<usize>)]) {
    let config = format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 16, "rms_norm_eps": 1e-5{config_extra}}}"#
    );
    std::fs::write(dir.join("config.json"), config).unwrap();
    let datas: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, s)| vec![0u8; 2 * s.iter().product::<usize>()])
        .collect();
    let list: Vec<_> = tensors
        .iter()
        .zip(&datas)
        .map(|((n, s), d)| (*n, DType::BF16, s.as_slice(), d.as_slice()))
        .collect();
    std::fs::write(
        dir.join("model.safetensors"),
        to_safetensors_bytes(&list, &[]),
    )
    .unwrap();
}

fn llama_tensors(with_head: bool) -> Vec<(&'static str, Vec<usize>)> {
    let mut v = vec![
        ("model.embed_tokens.weight", vec![16, 8]),
        ("model.norm.weight", vec![8]),
        ("model.layers.0.input_layernorm.weight", vec![8]),
        ("model.layers.0.post_attention_layernorm.weight", vec![8]),
        ("model.layers.0.self_attn.q_proj.weight", vec![8, 8]),
        ("model.layers.0.self_attn.k_proj.weight", vec![4, 8]),
        ("model.layers.0.self_attn.v_proj.weight", vec![4, 8]),
        ("model.layers.0.self_attn.o_proj.weight", vec![8, 8]),
        ("model.layers.0.mlp.gate_proj.weight", vec![16, 8]),
        ("model.layers.0.mlp.up_proj.weight", vec![16, 8]),
        ("model.layers.0.mlp.down_proj.weight", vec![8, 16]),
    ];
    if with_head {
        v.push(("lm_head.weight", vec![16, 8]));
    }
    v
}

fn open_err(dir: &Path) -> String {
    let e = Model::open(dir).err().expect("must be refused").to_string();
    assert!(!e.contains('\n'), "one line: {e}");
    e
}

#[test]
fn hf_directories() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    // Valid, untied: loads and runs.
    hf_dir(d, "", &llama_tensors(true));
    let m = Model::open(d).unwrap();
    assert_eq!(m.weights.tensors.len(), 12);
    let mut s = llama_graph::session::Session::new(
        &m,
        &llama_graph::session::SessionOptions {
            context: Some(8),
            threads: 1,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(s.feed(&[1, 2, 3]).unwrap().len(), 16);
    // Tied: lm_head may be absent.
    hf_dir(d, r#", "tie_word_embeddings": true"#, &llama_tensors(false));
    assert!(Model::open(d).unwrap().args.tied_embeddings);
    // Untied without lm_head.
    hf_dir(d, "", &llama_tensors(false));
    assert!(open_err(d).contains("lm_head.weight is missing"));
    // A bias tensor.
    let mut with_bias = llama_tensors(true);
    with_bias.push(("model.layers.0.self_attn.q_proj.bias", vec![8]));
    hf_dir(d, "", &with_bias);
    let e = open_err(d);
    assert!(
        e.contains("q_proj.bias") && e.contains("biases are not supported"),
        "{e}"
    );
    // A tensor LlamaForCausalLM does not have.
    let mut extra = llama_tensors(true);
    extra.push(("model.layers.0.self_attn.q_norm.weight", vec![4]));
    hf_dir(d, "", &extra);
    assert!(open_err(d).contains("q_norm.weight`: not a tensor of LlamaForCausalLM"));
    // A wrong shape is caught when the session binds the weights.
    let mut wrong = llama_tensors(true);
    wrong[4].1 = vec![8, 4];
    hf_dir(d, "", &wrong);
    let m = Model::open(d).unwrap();
    let e = llama_graph::session::Session::new(&m, &Default::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("layers.0.attention.wq.weight"), "{e}");
    // Other architectures and features are refused by config.json.
    hf_dir(d, r#", "attention_bias": true"#, &llama_tensors(true));
    assert!(open_err(d).contains("attention_bias"));
    hf_dir(
        d,
        r#", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}"#,
        &llama_tensors(true),
    );
    assert!(open_err(d).contains("rope type `yarn`"));
    std::fs::write(
        d.join("config.json"),
        r#"{"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}"#,
    )
    .unwrap();
    assert!(open_err(d).contains("Qwen2MoeForCausalLM"));
    // No weights at all, but a pickle checkpoint.
    hf_dir(d, "", &llama_tensors(true));
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    std::fs::write(d.join("pytorch_model.bin"), b"x").unwrap();
    assert!(open_err(d).contains("pytorch_model.bin checkpoints are not read"));
    // A truncated file names the file.
    hf_dir(d, "", &llama_tensors(true));
    let f = d.join("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() - 10]).unwrap();
    let e = open_err(d);
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );
}

#[test]
fn cli_refuses_with_one_line() {
    let t = tempfile::tempdir().unwrap();
    hf_dir(t.path(), "", &llama_tensors(true));
    let f = t.path().join("model.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[0..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&f, &bytes).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_llama-graph"))
        .args(["run", "-n", "1", "-p", "hi", "-m"])
        .arg(t.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("larger than the 100000000-byte limit"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}
