//! Hugging Face checkpoints, and one model in three formats.
//!
//! `tests/reference/hf_fixtures.py` wrote one random model (dim 32, GQA,
//! Llama 3.1 RoPE scaling) as Meta `.pth` (torch.save), as a Hugging Face
//! directory (transformers' `save_pretrained`, Q/K rows in HF's rotate-half
//! order) and as GGUF F32 (llama.cpp's `convert_hf_to_gguf.py` on that
//! directory), and recorded transformers' `LlamaForCausalLM` greedy run on
//! the HF directory (Meta's llama_models agrees with it to 2.4e-7).
//!
//! * The three load into the same arguments and so the same graph (pinned
//!   as a snapshot).
//! * Their logits agree within 1e-5 at every position of 60 tokens.
//! * The HF directory matches transformers: same greedy tokens, top-10
//!   logits within 1e-4 (bf16 weights, f32 compute; as `meta_reference.rs`).
//! * The same directory split into shards (with an index) loads the same
//!   bytes.
mod common;

use llama_graph::ir::{print, LogitRows};
use llama_graph::model::{build_llama, BuildOptions};
use llama_graph::passes::PassList;
use llama_graph::session::{Model, ModelFormat, Session, SessionOptions};
use llama_graph::weights::safetensors::to_safetensors_bytes;
use serde_json::Value;
use std::path::PathBuf;

fn dir() -> PathBuf {
    common::root().join("tests/fixtures/hf/xformat")
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("expected.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn three() -> [(&'static str, Model); 3] {
    let d = dir();
    [
        ("meta", Model::open(&d.join("meta")).unwrap()),
        ("hf", Model::open(&d.join("hf")).unwrap()),
        ("gguf", Model::open(&d.join("model-f32.gguf")).unwrap()),
    ]
}

fn opts(rows: LogitRows, batch: usize) -> SessionOptions {
    SessionOptions {
        context: Some(128),
        batch,
        parallel: 1,
        threads: 2,
        logit_rows: rows,
        passes: PassList::all(),
        exact: true,
    }
}

#[test]
fn formats_are_recognised() {
    let [(_, meta), (_, hf), (_, gguf)] = three();
    assert_eq!(meta.format, ModelFormat::MetaDir);
    assert_eq!(hf.format, ModelFormat::HfDir);
    assert_eq!(gguf.format, ModelFormat::Gguf);
}

#[test]
fn same_graph_whatever_the_format() {
    let models = three();
    let dumps: Vec<String> = models
        .iter()
        .map(|(_, m)| {
            let g = build_llama(&m.args, &BuildOptions::new(128)).unwrap();
            print::dump(&g).unwrap()
        })
        .collect();
    assert_eq!(dumps[0], dumps[1], "Meta .pth vs Hugging Face");
    assert_eq!(dumps[0], dumps[2], "Meta .pth vs GGUF");
    common::snapshot_settings().bind(|| insta::assert_snapshot!("graph_hf_xformat", dumps[1]));
    // With the weights' own dtypes, the two bf16 checkpoints agree too.
    let with_dtypes = |m: &Model| {
        let mut o = BuildOptions::new(128);
        o.weight_dtypes = llama_graph::exec::store_dtypes(&m.weights);
        print::dump(&build_llama(&m.args, &o).unwrap()).unwrap()
    };
    assert_eq!(with_dtypes(&models[0].1), with_dtypes(&models[1].1));
}

/// Logits of every position of `tokens`, fed in chunks of 16.
fn all_logits(m: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut s = Session::new(m, &opts(LogitRows::All, 16)).unwrap();
    let mut rows = Vec::new();
    for c in tokens.chunks(16) {
        let out = s.feed_step(c).unwrap();
        for r in 0..out.rows {
            rows.push(out.row(r).to_vec());
        }
    }
    rows
}

#[test]
fn logits_agree_across_formats() {
    let e = expected();
    let mut tokens = ids(&e["prompt_tokens"]);
    let gen = ids(&e["generated_tokens"]);
    tokens.extend_from_slice(&gen[..gen.len() - 1]);
    let models = three();
    let logits: Vec<Vec<Vec<f32>>> = models.iter().map(|(_, m)| all_logits(m, &tokens)).collect();
    for (i, j) in [(0, 1), (0, 2), (1, 2)] {
        let mut worst = 0f32;
        for (a, b) in logits[i].iter().zip(&logits[j]) {
            for (x, y) in a.iter().zip(b) {
                worst = worst.max((x - y).abs());
            }
        }
        eprintln!(
            "{} vs {}: max |logit diff| {worst:.2e} over {} positions",
            models[i].0,
            models[j].0,
            tokens.len()
        );
        assert!(worst <= 1e-5, "{} vs {}: {worst}", models[i].0, models[j].0);
    }
}

fn top10(logits: &[f32]) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    idx.into_iter().take(10).map(|i| (i, logits[i])).collect()
}

/// Greedy decoding against the recorded transformers run.
fn check_against_transformers(m: &Model, label: &str) {
    let e = expected();
    let prompt = ids(&e["prompt_tokens"]);
    let want = ids(&e["generated_tokens"]);
    let mut s = Session::new(m, &opts(LogitRows::Last, 16)).unwrap();
    let mut logits = s.feed(&prompt).unwrap().to_vec();
    let mut worst = 0f32;
    for (step, st) in e["steps"].as_array().unwrap().iter().enumerate() {
        let got = top10(&logits);
        assert_eq!(got[0].0 as u32, want[step], "{label}: token at step {step}");
        for pair in st["top"].as_array().unwrap() {
            let (id, v) = (
                pair[0].as_u64().unwrap() as usize,
                pair[1].as_f64().unwrap() as f32,
            );
            let d = (logits[id] - v).abs();
            worst = worst.max(d);
            assert!(
                d <= 1e-4,
                "{label}: step {step} id {id}: {} vs {v}",
                logits[id]
            );
        }
        if step + 1 < want.len() {
            logits = s.feed(&[want[step]]).unwrap().to_vec();
        }
    }
    eprintln!("{label}: 20 greedy tokens equal, max |top-10 logit diff| {worst:.2e}");
}

#[test]
fn hf_dir_matches_transformers() {
    let m = Model::open(&dir().join("hf")).unwrap();
    check_against_transformers(&m, "hf");
}

/// The HF directory as transformers shards it: tensors spread over files
/// named in `model.safetensors.index.json`.
#[test]
fn sharded_directory_loads_the_same_bytes() {
    let single = Model::open(&dir().join("hf")).unwrap();
    let src = llama_graph::weights::safetensors::SafetensorsFile::open(
        &dir().join("hf/model.safetensors"),
    )
    .unwrap()
    .to_store();
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(dir().join("hf").join(f), tmp.path().join(f)).unwrap();
    }
    let names: Vec<&String> = src.tensors.keys().collect();
    let (a, b) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (i, part) in [a, b].iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        let tensors: Vec<_> = part
            .iter()
            .map(|n| {
                let t = &src.tensors[*n];
                (n.as_str(), t.dtype, t.shape.as_slice(), t.data.as_bytes())
            })
            .collect();
        std::fs::write(tmp.path().join(&file), to_safetensors_bytes(&tensors, &[])).unwrap();
        for n in part.iter() {
            map.insert(n.to_string(), Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    let index_path = tmp.path().join("model.safetensors.index.json");
    std::fs::write(&index_path, index.to_string()).unwrap();
    let sharded = Model::open(tmp.path()).unwrap();
    assert_eq!(sharded.args, single.args);
    assert_eq!(
        sharded.weights.tensors.keys().collect::<Vec<_>>(),
        single.weights.tensors.keys().collect::<Vec<_>>()
    );
    for (k, t) in &single.weights.tensors {
        assert_eq!(
            sharded.weights.tensors[k].data.as_bytes(),
            t.data.as_bytes(),
            "{k}"
        );
    }
    check_against_transformers(&sharded, "sharded hf");

    // A shard that is gone is named.
    std::fs::remove_file(tmp.path().join("model-00002-of-00002.safetensors")).unwrap();
    let e = Model::open(tmp.path()).err().unwrap().to_string();
    assert!(
        e.contains("shard `model-00002-of-00002.safetensors` is missing"),
        "{e}"
    );
    // An index pointing outside the directory is refused.
    let mut bad = index.clone();
    bad["weight_map"]["lm_head.weight"] = Value::String("../model.safetensors".into());
    std::fs::write(&index_path, bad.to_string()).unwrap();
    let e = Model::open(tmp.path()).err().unwrap().to_string();
    assert!(e.contains("not a file name in the same directory"), "{e}");
}
