//! Malformed params.json files: each exits non-zero with one line naming the
//! problem, never a panic.
mod common;

use std::process::Command;

fn run_graph(params: &str) -> (i32, String, String) {
    let dir = std::env::temp_dir().join(format!("llama-graph-params-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{:x}.json", fxhash(params)));
    std::fs::write(&path, params).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_llama-graph"))
        .args(["graph", "--params"])
        .arg(&path)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

const GOOD: &str = r#""dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "multiple_of": 32, "norm_eps": 1e-5"#;

#[test]
fn malformed_params_are_one_line_errors() {
    let cases: &[(&str, String, &str)] = &[
        ("empty file", String::new(), "params.json is empty"),
        ("not JSON", "dim = 4096".into(), "not valid JSON"),
        ("array", "[1, 2]".into(), "must be a JSON object"),
        (
            "missing dim",
            r#"{"n_layers": 2, "n_heads": 4, "vocab_size": 256, "norm_eps": 1e-5}"#.into(),
            "`dim` is missing",
        ),
        (
            "missing norm_eps",
            r#"{"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256}"#.into(),
            "`norm_eps` is missing",
        ),
        (
            "missing vocab_size",
            r#"{"dim": 64, "n_layers": 2, "n_heads": 4, "norm_eps": 1e-5}"#.into(),
            "`vocab_size` is missing",
        ),
        (
            "negative dim",
            format!("{{{GOOD}, \"dim\": -64}}"),
            "`dim` must be positive, got -64",
        ),
        (
            "zero layers",
            format!("{{{GOOD}, \"n_layers\": 0}}"),
            "`n_layers` must be positive",
        ),
        (
            "wrong type",
            format!("{{{GOOD}, \"dim\": \"4096\"}}"),
            "`dim` must be an integer, got a string",
        ),
        (
            "float dim",
            format!("{{{GOOD}, \"dim\": 64.5}}"),
            "`dim` must be an integer, got a number",
        ),
        (
            "bool eps",
            format!("{{{GOOD}, \"norm_eps\": true}}"),
            "`norm_eps` must be a number",
        ),
        (
            "heads not dividing dim",
            format!("{{{GOOD}, \"n_heads\": 5}}"),
            "`n_heads` must divide dim",
        ),
        (
            "kv heads not dividing",
            format!("{{{GOOD}, \"n_kv_heads\": 3}}"),
            "`n_kv_heads` must divide n_heads",
        ),
        (
            "negative kv heads",
            format!("{{{GOOD}, \"n_kv_heads\": -2}}"),
            "`n_kv_heads` must be positive",
        ),
        (
            "negative theta",
            format!("{{{GOOD}, \"rope_theta\": -1}}"),
            "`rope_theta` must be a positive number",
        ),
        (
            "scaled rope string",
            format!("{{{GOOD}, \"use_scaled_rope\": \"yes\"}}"),
            "`use_scaled_rope` must be true or false",
        ),
        (
            "huge layers",
            format!("{{{GOOD}, \"n_layers\": 100000000000}}"),
            "`n_layers` is 100000000000, larger than the supported",
        ),
        (
            "zero vocab",
            format!("{{{GOOD}, \"vocab_size\": 0}}"),
            "`vocab_size` must be positive",
        ),
        (
            "odd head_dim",
            r#"{"dim": 36, "n_layers": 1, "n_heads": 4, "vocab_size": 8, "norm_eps": 1e-5}"#.into(),
            "odd head_dim 9",
        ),
    ];
    for (what, text, want) in cases {
        let (code, _stdout, stderr) = run_graph(text);
        assert_ne!(code, 0, "{what}: must fail");
        assert!(!stderr.contains("panicked"), "{what}: panicked: {stderr}");
        assert_eq!(
            stderr.trim_end().lines().count(),
            1,
            "{what}: one line, got {stderr:?}"
        );
        assert!(stderr.starts_with("error: "), "{what}: {stderr}");
        assert!(
            stderr.contains(want),
            "{what}: expected {want:?} in {stderr:?}"
        );
    }
}

#[test]
fn valid_params_print_summary() {
    let path = common::root().join("graphs/llama-3.1-8b/params.json");
    let out = Command::new(env!("CARGO_BIN_EXE_llama-graph"))
        .args(["graph", "--params"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    for want in [
        "head_dim          128",
        "n_rep             4",
        "ffn_hidden_dim    14336",
        "nodes             1197",
    ] {
        assert!(s.contains(want), "missing {want:?} in\n{s}");
    }
}
