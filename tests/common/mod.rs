//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod llamacpp;
pub mod openai;
pub mod server;

use std::path::PathBuf;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// insta settings that keep every snapshot in the top-level `snapshots/`.
pub fn snapshot_settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path(root().join("snapshots"));
    s.set_prepend_module_to_snapshot(false);
    s
}

/// Reads a params.json under `graphs/` (or, for the other families, a
/// Hugging Face config.json).
pub fn graph_params(arch: &str) -> llama_graph::model::ModelArgs {
    let cfg = root().join("graphs").join(arch).join("config.json");
    if cfg.is_file() {
        let text = std::fs::read_to_string(&cfg).expect("config file");
        return llama_graph::weights::hf::HfConfig::parse(&text)
            .expect("valid config.json")
            .args;
    }
    let p = root().join("graphs").join(arch).join("params.json");
    let text = std::fs::read_to_string(&p).expect("params file");
    llama_graph::model::ModelArgs::from_params_json(&text).expect("valid params")
}
pub mod tokenizer_fixture;
