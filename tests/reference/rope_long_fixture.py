#!/usr/bin/env python3
"""Llama 3.1 scaled RoPE at long positions, from Meta's reference model.

Writes tests/fixtures/meta/long_rope/{consolidated.00.pth, params.json,
expected.json}: a one-layer random-weight Llama 3.1-style checkpoint
(scaled RoPE, rope_theta 500000, head_dim 16, so that its 8 frequencies hit
all three branches of `apply_scaling`: wavelengths 6.3 to 872 unchanged,
4518 smoothly interpolated, 23400 and longer divided by 8) and the logits
the unmodified `llama_models.llama3.model.Transformer` (PyPI
llama-models==0.3.0, torch CPU, float32, model parallel of size 1 as in
`meta_reference.py`) gives at positions around 8192 and 32768 of a
33024-token sequence, fed in chunks of 512 (`model.forward(tokens[:, s:e],
s)`, every position's logits kept).

The tokens are not stored: token i is `(x_i >> 16) % vocab` with
`x_0 = seed`, `x_{i+1} = (1664525 x_i + 1013904223) mod 2^32` (the test
computes the same).

Also recorded, to set and justify the test's tolerance:
* `float64`: max |f32 - f64| at the recorded positions, the whole model
  (RoPE table included) in float64 (`meta_reference.float64_mode`);
* `sensitivity_unscaled`: max |logit change| there if the RoPE scaling is
  left out (use_scaled_rope false), the bug the test must catch.

Re-run from the repository root (about 2 minutes on one core):
    python tests/reference/rope_long_fixture.py
Environment: torch 2.15.0 (CPU), fairscale 0.4.13, llama-models 0.3.0
(as tests/reference/README.md).
"""

import json
import sys
from importlib.metadata import version as pkg_version
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meta_reference as mr  # noqa: E402

CASE = {
    "params": {
        "dim": 64,
        "n_layers": 1,
        "n_heads": 4,
        "n_kv_heads": 2,
        "vocab_size": 256,
        "multiple_of": 32,
        "norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "use_scaled_rope": True,
    },
    "seed": 1004,
}
SEQ_LEN = 33024
CHUNK = 512
TOKEN_SEED = 12345
POSITIONS = [100, 8191, 8192, 8193, 12000, 16384, 32767, 32768, 32769, 33023]


def tokens(n, vocab, seed):
    x = seed
    out = []
    for _ in range(n):
        out.append((x >> 16) % vocab)
        x = (1664525 * x + 1013904223) % (1 << 32)
    return out


def run(case_dir, dtype, override=None):
    params = json.loads((case_dir / "params.json").read_text())
    if override:
        params = {**params, **override}
    mr.init_distributed()
    args = mr.ModelArgs(max_seq_len=SEQ_LEN, max_batch_size=1, **params)
    sd = torch.load(case_dir / "consolidated.00.pth", map_location="cpu", weights_only=True)
    model = mr.meta_model.Transformer(args)
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
    model.eval()
    toks = torch.tensor([tokens(SEQ_LEN, params["vocab_size"], TOKEN_SEED)], dtype=torch.long)
    rows = {}
    with torch.inference_mode():
        for s in range(0, SEQ_LEN, CHUNK):
            e = min(s + CHUNK, SEQ_LEN)
            out = model.forward(toks[:, s:e], s)[0]
            for p in POSITIONS:
                if s <= p < e:
                    rows[p] = out[p - s].clone()
    return rows


def main():
    torch.set_num_threads(1)
    case_dir = mr.REPO_ROOT / "tests" / "fixtures" / "meta" / "long_rope"
    mr.write_checkpoint(case_dir, CASE)
    torch.set_default_dtype(torch.float32)
    f32 = run(case_dir, torch.float32)
    with mr.float64_mode():
        f64 = run(case_dir, torch.float64)
    unscaled = run(case_dir, torch.float32, {"use_scaled_rope": False})
    diff = lambda a, b: {  # noqa: E731
        str(p): float((a[p].double() - b[p].double()).abs().max()) for p in POSITIONS
    }
    expected = {
        "case": "long_rope",
        "config": {**CASE["params"], "max_seq_len": SEQ_LEN, "init_seed": CASE["seed"]},
        "tokens": {
            "n": SEQ_LEN,
            "seed": TOKEN_SEED,
            "rule": "token_i = (x_i >> 16) % vocab; x_0 = seed; x_{i+1} = (1664525 x_i + 1013904223) mod 2^32",
        },
        "procedure": f"model.forward(tokens[:, s:s+{CHUNK}], s) for s = 0, {CHUNK}, ...; logits of every position kept",
        "positions": POSITIONS,
        "logits": {str(p): f32[p].tolist() for p in POSITIONS},
        "checks": {
            "float64": diff(f32, f64),
            "sensitivity_unscaled": diff(f32, unscaled),
        },
        "checkpoint_sha256": mr.sha256(case_dir / "consolidated.00.pth"),
        "torch_version": torch.__version__,
        "llama_models_version": pkg_version("llama-models"),
        "torch_num_threads": 1,
    }
    (case_dir / "expected.json").write_text(json.dumps(expected) + "\n")
    print(json.dumps(expected["checks"], indent=1))


if __name__ == "__main__":
    main()
