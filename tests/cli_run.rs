//! `llama-graph run` on bad input: one clear error line, non-zero exit,
//! never a panic. And: only generated text on stdout.
mod common;

use std::process::{Command, Stdio};

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_llama-graph"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn fixture(case: &str) -> String {
    common::root()
        .join("tests/fixtures/meta")
        .join(case)
        .display()
        .to_string()
}

fn expect_error(args: &[&str], want: &str) {
    let (code, stdout, stderr) = run(args);
    assert_ne!(code, 0, "{args:?} must fail");
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    let last = stderr.trim_end().lines().last().unwrap_or_default();
    assert!(last.starts_with("error: "), "{args:?}: {stderr}");
    assert!(
        last.contains(want),
        "{args:?}: expected {want:?} in {last:?}"
    );
    assert!(
        stdout.trim().is_empty(),
        "{args:?}: nothing on stdout, got {stdout:?}"
    );
}

#[test]
fn bad_flags_are_clear_errors() {
    let m = fixture("gqa_scaled");
    let ids = "1,2,3";
    expect_error(
        &["run", "-m", &m, "--prompt-tokens", ids, "-n", "0"],
        "-n must be at least 1",
    );
    expect_error(
        &["run", "-m", &m, "--prompt-tokens", ids, "--temp", "-1"],
        "--temp must be 0 (greedy) or positive",
    );
    expect_error(
        &["run", "-m", &m, "--prompt-tokens", ids, "--top-p", "2"],
        "--top-p must be in (0, 1]",
    );
    expect_error(
        &["run", "-m", &m, "--prompt-tokens", ids, "-t", "0"],
        "-t/--threads must be at least 1",
    );
    expect_error(
        &["run", "-m", &m, "--prompt-tokens", ids, "-b", "0"],
        "-b/--batch-size must be at least 1",
    );
    expect_error(
        &["run", "-m", &m, "--prompt-tokens", "1,2,9999"],
        "token id 9999 is outside the vocabulary of 512",
    );
}

#[test]
fn prompt_longer_than_context_fails_before_any_work() {
    let m = fixture("gqa_scaled");
    let long: Vec<String> = (0..40).map(|i| (i % 500).to_string()).collect();
    expect_error(
        &[
            "run",
            "-m",
            &m,
            "--prompt-tokens",
            &long.join(","),
            "-c",
            "32",
            "-n",
            "4",
        ],
        "the prompt (40 tokens) plus 4 tokens to generate exceed the planned context of 32 tokens",
    );
    expect_error(
        &[
            "run",
            "-m",
            &m,
            "--prompt-tokens",
            "1,2,3",
            "-c",
            "16",
            "-n",
            "20",
        ],
        "exceed the planned context of 16 tokens",
    );
}

#[test]
fn broken_model_directories_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("noweights");
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(
        common::root().join("tests/fixtures/meta/gqa_scaled/params.json"),
        dir.join("params.json"),
    )
    .unwrap();
    let d = dir.display().to_string();
    expect_error(&["run", "-m", &d, "--prompt-tokens", "1,2"], "consolidated");
    // Weights but no tokenizer: ids still work, text does not.
    let (code, stdout, stderr) = run(&[
        "run",
        "-m",
        &fixture("gqa_scaled"),
        "--prompt-tokens",
        "1,2",
        "-n",
        "3",
        "--temp",
        "0",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        stdout.split_whitespace().count(),
        3,
        "three token ids printed: {stdout:?}"
    );
    expect_error(
        &["run", "-m", &fixture("gqa_scaled"), "-p", "hello"],
        "has no tokenizer",
    );
    expect_error(
        &["run", "-m", "/nonexistent/model", "-p", "hi"],
        "/nonexistent/model: cannot open",
    );
    let junk = tmp.path().join("junk.gguf");
    std::fs::write(&junk, b"not a model at all").unwrap();
    expect_error(
        &["run", "-m", &junk.display().to_string(), "-p", "hi"],
        "neither a GGUF file nor a checkpoint directory",
    );
    expect_error(
        &["run", "-m", &fixture("gqa_scaled")],
        "no prompt: standard input was empty",
    );
}

#[test]
fn stdout_holds_only_generated_text_and_stats_json_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let stats = tmp.path().join("stats.json");
    let logits = tmp.path().join("logits.json");
    let (code, stdout, stderr) = run(&[
        "run",
        "-m",
        &fixture("nrep3"),
        "--prompt-tokens",
        "5,6,7,8",
        "-n",
        "6",
        "--temp",
        "0",
        "--stats-json",
        &stats.display().to_string(),
        "--logits-out",
        &logits.display().to_string(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout.split_whitespace().count(), 6, "{stdout:?}");
    assert!(
        stderr.contains("tokens/s") && stderr.contains("stop: length"),
        "{stderr}"
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    for k in [
        "load_s",
        "prompt_tokens",
        "prefill_tokens_per_s",
        "generated_tokens",
        "decode_tokens_per_s",
        "stop_reason",
    ] {
        assert!(s.get(k).is_some(), "stats JSON lacks {k}: {s}");
    }
    assert_eq!(s["generated_tokens"], 6);
    assert_eq!(s["stop_reason"], "length");
    let l: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&logits).unwrap()).unwrap();
    assert_eq!(l["prompt_tokens"], serde_json::json!([5, 6, 7, 8]));
    assert_eq!(l["steps"].as_array().unwrap().len(), 6);
    assert_eq!(l["steps"][0]["top"].as_array().unwrap().len(), 10);
    let printed: Vec<u64> = stdout
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(serde_json::json!(printed), l["generated_tokens"]);
}

#[test]
fn seeded_sampling_is_reproducible_and_prints_the_seed() {
    let args = [
        "run",
        "-m",
        &fixture("nrep3"),
        "--prompt-tokens",
        "5,6,7",
        "-n",
        "8",
        "--temp",
        "1.0",
        "--seed",
        "42",
    ];
    let a = run(&args);
    let b = run(&args);
    assert_eq!(a.0, 0, "{}", a.2);
    assert_eq!(a.1, b.1, "same seed, same tokens");
    assert!(a.2.contains("seed 42"), "{}", a.2);
}
