"""Generates tests/fixtures/kernels/rope_meta.json from Meta's reference RoPE.

Uses llama_models==0.3.0 (llama_models/llama3/model.py: precompute_freqs_cis,
apply_scaling, apply_rotary_emb) on small deterministic inputs.

Re-run (from the repo root):
    /work/pyenv/bin/python tests/reference/rope_fixture.py
"""
import json
import math
import pathlib

import torch
from llama_models.llama3.model import apply_rotary_emb, precompute_freqs_cis

CASES = [
    # name, head_dim, theta, use_scaled, n_heads, s, pos
    ("llama31_scaled", 128, 500000.0, True, 2, 3, 5000),
    ("unscaled_d64", 64, 10000.0, False, 3, 2, 17),
]


def main():
    out = []
    for name, d, theta, scaled, h, s, pos in CASES:
        n = s * h * d
        x = torch.tensor([math.sin(0.37 * i + 0.1) for i in range(n)], dtype=torch.float32)
        x = x.reshape(1, s, h, d)
        freqs = precompute_freqs_cis(d, pos + s, theta, scaled)[pos : pos + s]
        y, _ = apply_rotary_emb(x, x.clone(), freqs)
        out.append(
            {
                "name": name,
                "head_dim": d,
                "theta": theta,
                "scaled": scaled,
                "n_heads": h,
                "s": s,
                "pos": pos,
                "x": x.flatten().tolist(),
                "y": y.flatten().tolist(),
            }
        )
    path = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "kernels" / "rope_meta.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
