//! `llama_graph::fetch` end to end, offline: a wheel built here is "downloaded"
//! with pip from a local path (pip accepts a file path as requirement).
//! One test function because it sets `XDG_CACHE_HOME` for the process.
use std::io::Write;
use std::path::Path;

use llama_graph::fetch::{cache_dir, fetch_wheel_member, FetchError, WheelAsset};
use sha2::{Digest, Sha256};

fn sha_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn make_wheel(path: &Path, member: &str, body: &[u8]) {
    let f = std::fs::File::create(path).unwrap();
    let mut z = zip::ZipWriter::new(f);
    let opts = zip::write::SimpleFileOptions::default();
    z.start_file(member, opts).unwrap();
    z.write_all(body).unwrap();
    z.start_file("fakepkg-0.1.dist-info/METADATA", opts)
        .unwrap();
    z.write_all(b"Metadata-Version: 2.1\nName: fakepkg\nVersion: 0.1\n")
        .unwrap();
    z.start_file("fakepkg-0.1.dist-info/WHEEL", opts).unwrap();
    z.write_all(b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        .unwrap();
    z.start_file("fakepkg-0.1.dist-info/RECORD", opts).unwrap();
    z.finish().unwrap();
}

#[test]
fn fetch_extracts_verifies_caches_and_explains_failures() {
    let cache = tempfile::tempdir().unwrap();
    let src = tempfile::tempdir().unwrap();
    // Edition 2021: set_var is safe; this binary has a single test.
    std::env::set_var("XDG_CACHE_HOME", cache.path());
    assert_eq!(cache_dir(), cache.path().join("llama-graph"));

    let body: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let sha = sha_hex(&body);
    let wheel = src.path().join("fakepkg-0.1-py3-none-any.whl");
    make_wheel(&wheel, "fakepkg/data.bin", &body);
    let wheel_str = wheel.display().to_string();
    let spec = WheelAsset {
        package: &wheel_str,
        member: "fakepkg/data.bin",
        file_name: "data.bin",
        size: Some(body.len() as u64),
        sha256: Some(&sha),
    };

    // First call: pip "downloads" the local wheel, the member is extracted.
    let p = fetch_wheel_member(&spec).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p, cache_dir().join("data.bin"));
    assert_eq!(std::fs::read(&p).unwrap(), body);
    // No temporary files are left behind; the verification is recorded.
    let mut left: Vec<_> = std::fs::read_dir(cache_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    left.sort();
    assert_eq!(left, [".verified", "data.bin"]);
    let marker = cache_dir().join(".verified").join("data.bin");
    let record = std::fs::read_to_string(&marker).unwrap();
    assert!(
        record.starts_with(&format!("{sha} {} ", body.len())),
        "{record}"
    );

    // Second call: served from the cache (the wheel is gone, pip would fail).
    std::fs::remove_file(&wheel).unwrap();
    assert_eq!(fetch_wheel_member(&spec).unwrap(), p);

    // Without the record the file is hashed again, found good, and the
    // record is written back.
    std::fs::remove_file(&marker).unwrap();
    assert_eq!(fetch_wheel_member(&spec).unwrap(), p);
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), record);

    // A corrupted cache entry is not trusted: a re-fetch is attempted, and
    // its failure explains what to run by hand. (The write changes the
    // modification time, which invalidates the record; file times come
    // from a clock that ticks every few milliseconds, hence the pause.)
    let mut bad = body.clone();
    bad[100] ^= 1;
    std::thread::sleep(std::time::Duration::from_millis(50));
    std::fs::write(&p, &bad).unwrap();
    let e = fetch_wheel_member(&spec).unwrap_err();
    assert!(matches!(e, FetchError::PipFailed { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("pip download --no-deps '{wheel_str}'")),
        "{msg}"
    );
    assert!(
        msg.contains("fakepkg/data.bin") && msg.contains(&p.display().to_string()),
        "{msg}"
    );

    // Wrong expected hash: the extracted file is rejected and not cached.
    make_wheel(&wheel, "fakepkg/data.bin", &body);
    std::fs::remove_file(&p).unwrap();
    let wrong = "0".repeat(64);
    let spec_wrong = WheelAsset {
        sha256: Some(&wrong),
        ..spec
    };
    let e = fetch_wheel_member(&spec_wrong).unwrap_err();
    assert!(matches!(e, FetchError::Mismatch { .. }), "{e:?}");
    assert!(e.to_string().contains(&sha), "{e}");
    assert!(!p.exists());

    // A member that is not in the wheel.
    let spec_missing = WheelAsset {
        member: "fakepkg/nope.bin",
        file_name: "nope.bin",
        ..spec
    };
    let e = fetch_wheel_member(&spec_missing).unwrap_err();
    assert!(matches!(e, FetchError::NoMember { .. }), "{e:?}");

    // An invalid requirement: pip fails at once (no network involved).
    let spec_invalid = WheelAsset {
        package: "not a valid requirement ==",
        ..spec
    };
    let e = fetch_wheel_member(&spec_invalid).unwrap_err();
    assert!(e
        .to_string()
        .contains("python3 -m pip download --no-deps 'not a valid requirement =='"));
}
