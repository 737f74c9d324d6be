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

/// `-ctk`/`-ctv` (llama.cpp's names): the cache's types and size are
/// printed at start, q8_0 takes 34/64 of f16's bytes, and a type that does
/// not fit the model (or that does not exist) is one clear error.
#[test]
fn kv_cache_types_are_chosen_printed_and_checked() {
    let m = fixture("mha_llama2"); // head dim 32
    let mib_of = |args: &[&str]| -> f64 {
        let mut all = vec![
            "run",
            "-m",
            &m,
            "--prompt-tokens",
            "1,2,3",
            "-n",
            "2",
            "--temp",
            "0",
            "-c",
            "2048",
        ];
        all.extend(args);
        let (code, _, stderr) = run(&all);
        assert_eq!(code, 0, "{all:?}: {stderr}");
        let line = stderr
            .lines()
            .find(|l| l.starts_with("KV cache: "))
            .unwrap_or_else(|| panic!("no KV cache line: {stderr}"));
        let want = match args {
            [] => "keys f16, values f16".to_string(),
            [_, k, _, v] => format!("keys {k}, values {v}"),
            _ => unreachable!(),
        };
        assert!(line.contains(&want), "{line}");
        line.rsplit(", ")
            .next()
            .and_then(|s| s.strip_suffix(" MiB"))
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no size in {line}"))
    };
    let f16 = mib_of(&[]);
    let q8 = mib_of(&["-ctk", "q8_0", "-ctv", "q8_0"]);
    let q4 = mib_of(&["--cache-type-k", "q4_0", "--cache-type-v", "q4_0"]);
    let f32 = mib_of(&["-ctk", "f32", "-ctv", "f32"]);
    mib_of(&["-ctk", "bf16", "-ctv", "q8_0"]);
    // The sizes are printed to 0.01 MiB (2048 positions: 1 MiB of f16).
    assert!(
        (q8 - f16 * 34.0 / 64.0).abs() <= 0.006,
        "q8_0 {q8} vs f16 {f16}"
    );
    assert!(
        (q4 - f16 * 18.0 / 64.0).abs() <= 0.006,
        "q4_0 {q4} vs f16 {f16}"
    );
    assert!((f32 - 2.0 * f16).abs() <= 0.006, "f32 {f32} vs f16 {f16}");
    let ids = "1,2,3";
    expect_error(
        &[
            "run",
            "-m",
            &fixture("gqa_scaled"),
            "--prompt-tokens",
            ids,
            "-ctk",
            "q8_0",
        ],
        "head dim is 8",
    );
    let (code, _, stderr) = run(&["run", "-m", &m, "--prompt-tokens", ids, "-ctv", "q5_1"]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("q5_1") && stderr.contains("f32, f16, bf16, q8_0, q4_0"),
        "{stderr}"
    );
}

/// `bench -d`: each test again after that many tokens in the cache, named
/// as llama-bench names it, with n_depth in the JSON.
#[test]
fn bench_depth_rows() {
    let m = fixture("mha_llama2");
    let (code, stdout, stderr) = run(&[
        "bench", "-m", &m, "-p", "8", "-n", "4", "-d", "0,40", "-r", "1", "-t", "1", "-o", "json",
        "-ctk", "q8_0",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&stdout).unwrap();
    let got: Vec<(String, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["test"].as_str().unwrap().to_string(),
                r["n_depth"].as_u64().unwrap(),
            )
        })
        .collect();
    let want = [("pp8", 0), ("tg4", 0), ("pp8 @ d40", 40), ("tg4 @ d40", 40)];
    assert_eq!(got, want.map(|(t, d)| (t.to_string(), d)));
    assert!(rows
        .iter()
        .all(|r| r["type_k"] == "q8_0" && r["type_v"] == "f16"));
    expect_error(
        &["bench", "-m", &m, "-d", "8", "--in-flight", "2"],
        "-d (depth) with --in-flight",
    );
    // A depth past the model's context is refused before any run, with
    // the numbers (this file says 4096 positions).
    let q = common::root()
        .join("tests/fixtures/families/qwen2/model-f32.gguf")
        .display()
        .to_string();
    expect_error(
        &["bench", "-m", &q, "-p", "8", "-n", "4", "-d", "0,4096"],
        "needs 4104 positions (4096 of depth (-d) and 8 of test) but the model's context length is 4096",
    );
}
