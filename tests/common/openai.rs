//! The official `openai` Python client for the server tests: a virtual
//! environment in the cache (`python3 -m venv`, then `pip install` of the
//! pinned versions by package name, with `jsonschema` to validate
//! structured output), made on first use and reused.
#![allow(dead_code)]

use llama_graph::fetch::cache_dir;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

/// The client version the tests are written against.
pub const OPENAI_VERSION: &str = "3.57.0";
/// The JSON-schema validator the structured-output tests check answers with.
pub const JSONSCHEMA_VERSION: &str = "4.26.0";

static MAKE: Mutex<()> = Mutex::new(());

/// The venv's `python`, with `openai` importable.
///
/// # Panics
/// With pip's own message when the venv cannot be made (no network, no
/// `python3 -m venv`): the end-to-end tests cannot run without the client.
pub fn python() -> PathBuf {
    let dir = cache_dir().join(format!(
        "openai-venv-{OPENAI_VERSION}-jsonschema-{JSONSCHEMA_VERSION}"
    ));
    let python = dir.join("bin/python");
    let _guard = MAKE.lock().unwrap_or_else(|e| e.into_inner());
    if python.exists() {
        return python;
    }
    std::fs::create_dir_all(cache_dir()).unwrap();
    // Made under a temporary name and renamed once complete, so that an
    // interrupted set-up is never taken for a finished one. (A venv works
    // after a rename when it is run as `bin/python`.)
    let part = tempfile::Builder::new()
        .prefix(".openai-venv-")
        .tempdir_in(cache_dir())
        .unwrap();
    eprintln!(
        "server tests: creating a Python venv with openai=={OPENAI_VERSION} and jsonschema=={JSONSCHEMA_VERSION} in {} (once)",
        dir.display()
    );
    let run = |cmd: &mut Command, what: &str| {
        let st = cmd
            .status()
            .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
        assert!(
            st.success(),
            "{what} failed ({st}); the end-to-end server tests need the `openai` Python package from PyPI"
        );
    };
    run(
        Command::new("python3")
            .args(["-m", "venv"])
            .arg(part.path()),
        "python3 -m venv (Debian: apt-get install python3-venv)",
    );
    run(
        Command::new(part.path().join("bin/python")).args([
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            &format!("openai=={OPENAI_VERSION}"),
            &format!("jsonschema=={JSONSCHEMA_VERSION}"),
        ]),
        "pip install openai jsonschema",
    );
    let part = part.keep();
    if let Err(e) = std::fs::rename(&part, &dir) {
        // Another process finished first; use its venv.
        let _ = std::fs::remove_dir_all(&part);
        assert!(python.exists(), "cannot move the venv into place: {e}");
    }
    python
}

/// Runs the client script `tests/server/<script>` as
/// `SCRIPT URL KEY COMMAND` with `spec` on stdin, and returns the JSON it
/// prints; a failing script fails the test with the server's log.
pub fn run_client(
    server: &super::server::Server,
    script: &str,
    key: &str,
    command: &str,
    spec: &serde_json::Value,
) -> serde_json::Value {
    use std::io::Write;
    use std::process::Stdio;
    let path = super::root().join("tests/server").join(script);
    let mut child = Command::new(python())
        .arg(&path)
        .args([&server.url(), key, command])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(spec.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{script} {command} failed ({}); server log:\n{}",
        out.status,
        server.log.lock().unwrap()
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{script} prints JSON: {e}"))
}
