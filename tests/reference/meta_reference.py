#!/usr/bin/env python3
"""Reference outputs for Meta-layout Llama checkpoints (tests/fixtures/meta/<case>/).

For each case this script
  1. builds a small random-weight model (seeded), stores it exactly like Meta's
     releases: `consolidated.00.pth` (torch.save of a dict name -> bf16 tensor)
     plus `params.json`;
  2. re-loads those files and runs the *unmodified* reference implementation
     `llama_models.llama3.model.Transformer` from PyPI llama-models==0.3.0 on CPU
     in float32 (bf16 -> f32 weight conversion is exact), with torch.distributed
     (gloo, world size 1) and fairscale model parallel of size 1 initialised the
     same way as `llama_models/llama3/generation.py` (Llama3.build) does;
  3. does greedy generation the way Llama3.generate does with temperature 0:
     one `model.forward(tokens[:, 0:len(prompt)], 0)` prefill call, then one
     `model.forward(tokens[:, p:p+1], p)` call per generated token; argmax of the
     last row of the logits (torch.argmax: first index on exact ties);
  4. repeats the whole run a second time and checks it is bit-identical;
  5. repeats the run with a chunked prefill (chunks of 16 at start_pos 0, 16, 32)
     to show that chunked == one-pass in the reference;
  6. recomputes every logit (teacher-forced on the same tokens) in float64
     (everything, including RoPE tables, RMSNorm and softmax, in float64; see
     `float64_mode`) and reports max |f32 - f64| as an estimate of the
     pure rounding / summation-order error of a float32 implementation;
  7. for the scaled-RoPE case, also reports how much the logits move if the
     RoPE scaling is (wrongly) left out, so tests can check their tolerance is
     far below that sensitivity;
  8. writes tests/fixtures/meta/<case>/expected.json (format in README.md).

Re-run (from the repository root, ~1 minute on one core):
    /work/pyenv/bin/python tests/reference/meta_reference.py
Options: --cases gqa_scaled,mha_llama2,nrep3   --out-dir tests/fixtures/meta
         --no-write-weights (re-use the existing .pth/params.json, only recompute
         expected.json)
"""

import argparse
import collections
import contextlib
import hashlib
import json
import math
import os
import socket
import sys
from importlib.metadata import version as pkg_version
from pathlib import Path

import torch

import fairscale.nn.model_parallel.initialize as fs_init
import llama_models.llama3.model as meta_model
from llama_models.llama3.args import ModelArgs

REPO_ROOT = Path(__file__).resolve().parents[2]

PROMPT_LEN = 40
N_GEN = 20  # generated tokens (= number of recorded steps)
CHUNK = 16  # prefill chunk size for the chunked-prefill check
MAX_SEQ_LEN = 128
TOPK = 10
NEAR_TIE = 1e-3  # top-2 gaps below this are flagged as near ties

# Each case: params.json content (exactly what is written), the init seed,
# init standard deviations and the seed of the random prompt.
CASES = {
    # GQA with n_rep = 4, Llama-3.1 style scaled RoPE (all three regimes of
    # apply_scaling are hit with head_dim 8: wavelengths 6.3, 167 (unchanged),
    # 4443 (smoothly interpolated), 1.2e5 (divided by 8)).
    "gqa_scaled": {
        "params": {
            "dim": 64,
            "n_layers": 2,
            "n_heads": 8,
            "n_kv_heads": 2,
            "vocab_size": 512,
            "multiple_of": 32,
            "ffn_dim_multiplier": 1.3,
            "norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "use_scaled_rope": True,
        },
        "seed": 1001,
        "prompt_seed": 2001,
    },
    # Llama-2 style: no n_kv_heads key (=> MHA), no ffn_dim_multiplier.
    # llama-models 0.3.0 ModelArgs defaults rope_theta to 500000 (NOT 10000),
    # so the Llama-2 value 10000 is written explicitly.
    "mha_llama2": {
        "params": {
            "dim": 64,
            "n_layers": 2,
            "n_heads": 2,
            "vocab_size": 512,
            "multiple_of": 32,
            "norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "use_scaled_rope": False,
        },
        "seed": 1002,
        "prompt_seed": 2002,
    },
    # n_rep = 3 with 3 KV groups and head_dim 16 (SmolLM2-like head layout),
    # rope_theta 100000 like SmolLM2, norm_eps 1e-6 (as some checkpoints use).
    "nrep3": {
        "params": {
            "dim": 144,
            "n_layers": 2,
            "n_heads": 9,
            "n_kv_heads": 3,
            "vocab_size": 256,
            "multiple_of": 32,
            "ffn_dim_multiplier": 0.5,
            "norm_eps": 1e-06,
            "rope_theta": 100000.0,
            "use_scaled_rope": False,
        },
        "seed": 1003,
        "prompt_seed": 2003,
        # pickled as collections.OrderedDict (what torch.save(model.state_dict())
        # produces); the other cases pickle a plain dict. Parsers must accept both.
        "ordered_dict": True,
    },
}

# Standard deviations of the random init (chosen so that every sub-layer
# contributes to the residual stream at a similar scale and logits have a
# spread of about +-2, i.e. no ties). Norm weights are 1 + 0.1*N(0,1).
INIT_STD = {
    "tok_embeddings": 0.5,
    "wq": 0.08,
    "wk": 0.08,
    "wv": 0.08,
    "wo": 0.08,
    "w1": 0.06,
    "w2": 0.06,
    "w3": 0.06,
    "output": 0.05,
}
NORM_STD = 0.1


# --------------------------------------------------------------------------
# distributed / fairscale set-up, as in llama_models/llama3/generation.py
# --------------------------------------------------------------------------
def init_distributed():
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        # generation.py: device.type == "cpu" -> init_process_group("gloo")
        torch.distributed.init_process_group("gloo")
    if not fs_init.model_parallel_is_initialized():
        fs_init.initialize_model_parallel(1)
    assert fs_init.get_model_parallel_world_size() == 1


# --------------------------------------------------------------------------
# checkpoint creation
# --------------------------------------------------------------------------
def build_args(params, max_seq_len=MAX_SEQ_LEN):
    # Same call as Llama3.build: ModelArgs(max_seq_len=..., max_batch_size=..., **params)
    return ModelArgs(max_seq_len=max_seq_len, max_batch_size=1, **params)


def random_state_dict(case):
    """Seeded random weights in Meta's naming and shapes, returned as bf16."""
    init_distributed()
    torch.set_default_dtype(torch.float32)
    args = build_args(case["params"])
    model = meta_model.Transformer(args)  # only used for names and shapes
    gen = torch.Generator().manual_seed(case["seed"])
    sd = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight"):
            w = 1.0 + NORM_STD * torch.randn(p.shape, generator=gen, dtype=torch.float32)
        else:
            key = name.split(".")[-2]  # e.g. layers.0.attention.wq.weight -> wq
            w = INIT_STD[key] * torch.randn(p.shape, generator=gen, dtype=torch.float32)
        # clone(): every tensor gets its own storage, like Meta's files
        sd[name] = w.to(torch.bfloat16).contiguous().clone()
    return sd


def write_checkpoint(case_dir: Path, case):
    case_dir.mkdir(parents=True, exist_ok=True)
    sd = random_state_dict(case)
    if case.get("ordered_dict"):
        sd = collections.OrderedDict(sd)
    torch.save(sd, case_dir / "consolidated.00.pth")
    with open(case_dir / "params.json", "w") as f:
        json.dump(case["params"], f, indent=2)
        f.write("\n")


# --------------------------------------------------------------------------
# reference runs
# --------------------------------------------------------------------------
@contextlib.contextmanager
def float64_mode():
    """Run llama_models' code entirely in float64.

    The reference code calls `.float()` in RMSNorm, apply_rotary_emb, the
    attention softmax, the final logits and precompute_freqs_cis; with only
    set_default_dtype(float64) those steps would still round to float32. Within
    this context `Tensor.float()` returns a float64 tensor instead, so the whole
    forward pass (and the RoPE table, which then is complex128) is float64.
    """
    old_float = torch.Tensor.float
    old_default = torch.get_default_dtype()
    torch.Tensor.float = lambda self, *a, **k: self.double()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.Tensor.float = old_float
        torch.set_default_dtype(old_default)


@contextlib.contextmanager
def patched(attr, fn):
    """Temporarily replace llama_models.llama3.model.<attr> (sensitivity checks only)."""
    old = getattr(meta_model, attr)
    setattr(meta_model, attr, fn)
    try:
        yield
    finally:
        setattr(meta_model, attr, old)


def wrong_rope_rotate_half(xq, xk, freqs_cis):
    """A WRONG RoPE for Meta weights: pairs (j, j + hd/2) instead of (2j, 2j+1)."""

    def rot(x):
        hd = x.shape[-1]
        a, b = x[..., : hd // 2].float(), x[..., hd // 2 :].float()
        f = freqs_cis[None, :, None, :]
        c, s_ = f.real, f.imag
        return torch.cat([a * c - b * s_, a * s_ + b * c], dim=-1).type_as(x)

    return rot(xq), rot(xk)


def wrong_repeat_kv_tile(x, n_rep):
    """A WRONG GQA mapping: query head h uses kv head h % n_kv (instead of h // n_rep)."""
    if n_rep == 1:
        return x
    return x.repeat(1, 1, n_rep, 1)


def load_model(case_dir: Path, dtype=torch.float32, params_override=None):
    """Load params.json + consolidated.00.pth like Llama3.build, compute in `dtype`."""
    init_distributed()
    with open(case_dir / "params.json") as f:
        params = json.load(f)
    if params_override:
        params = {**params, **params_override}
    args = build_args(params)
    sd = torch.load(case_dir / "consolidated.00.pth", map_location="cpu", weights_only=True)
    for k, v in sd.items():
        assert v.dtype == torch.bfloat16, (k, v.dtype)
    sd = {k: v.to(dtype) for k, v in sd.items()}  # bf16 -> f32/f64: exact
    model = meta_model.Transformer(args)
    model.load_state_dict(sd, strict=True)
    model.eval()
    for p in model.parameters():
        assert p.dtype == dtype
    return model, args


def greedy_run(model, prompt, n_gen, chunk=None, forced=None):
    """Greedy decoding exactly like Llama3.generate (temperature 0, bsz 1).

    Returns (generated tokens, list of logits rows (one per step), full logits of
    the prefill). Step 0 = logits at the last prompt position after the
    prefill; step i = logits of the i-th single-token decode call.
    If `chunk` is given the prompt is prefilled in pieces of that size.
    If `forced` is given, these tokens are fed instead of the argmax
    (teacher forcing, used for the float64 comparison).
    """
    total_len = len(prompt) + n_gen
    tokens = torch.zeros((1, total_len), dtype=torch.long)
    tokens[0, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    rows = []
    generated = []
    # prefill
    if chunk is None:
        logits = model.forward(tokens[:, 0 : len(prompt)], 0)
        prefill_logits = logits[0]
    else:
        parts = []
        for s in range(0, len(prompt), chunk):
            e = min(s + chunk, len(prompt))
            parts.append(model.forward(tokens[:, s:e], s)[0])
        prefill_logits = torch.cat(parts, dim=0)
        logits = prefill_logits[None]
    cur = len(prompt)
    for step in range(n_gen):
        last = logits[0, -1]
        rows.append(last.clone())
        nxt = int(torch.argmax(last).item()) if forced is None else forced[step]
        generated.append(nxt)
        tokens[0, cur] = nxt
        if step + 1 < n_gen:
            logits = model.forward(tokens[:, cur : cur + 1], cur)
            cur += 1
    return generated, rows, prefill_logits


def top_entries(row, k=TOPK):
    # stable sort: equal logits keep the lower id first (same as argmax)
    vals, idx = torch.sort(row.float(), descending=True, stable=True)
    return [[int(i), float(v)] for i, v in zip(idx[:k].tolist(), vals[:k].tolist())]


def sha256(path: Path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def max_abs(rows_a, rows_b):
    return max(float((a.double() - b.double()).abs().max()) for a, b in zip(rows_a, rows_b))


def run_case(name, case, out_dir: Path, write_weights: bool):
    case_dir = out_dir / name
    if write_weights:
        write_checkpoint(case_dir, case)
    with open(case_dir / "params.json") as f:
        params = json.load(f)

    g = torch.Generator().manual_seed(case["prompt_seed"])
    prompt = torch.randint(0, params["vocab_size"], (PROMPT_LEN,), generator=g).tolist()

    # --- float32 reference, one-pass prefill (twice, for determinism) ---
    torch.set_default_dtype(torch.float32)
    model, args = load_model(case_dir, torch.float32)
    gen1, rows1, prefill1 = greedy_run(model, prompt, N_GEN)
    model, _ = load_model(case_dir, torch.float32)
    gen2, rows2, prefill2 = greedy_run(model, prompt, N_GEN)
    deterministic = gen1 == gen2 and all(torch.equal(a, b) for a, b in zip(rows1, rows2))
    assert deterministic, f"{name}: two float32 runs differ"

    # --- chunked prefill ---
    model, _ = load_model(case_dir, torch.float32)
    genc, rowsc, prefillc = greedy_run(model, prompt, N_GEN, chunk=CHUNK)
    chunk_prefill_diff = float((prefillc.double() - prefill1.double()).abs().max())
    chunk_steps_diff = max_abs(rowsc, rows1)

    # --- float64 (teacher forced on the f32 tokens) ---
    with float64_mode():
        model64, _ = load_model(case_dir, torch.float64)
        assert model64.freqs_cis.dtype == torch.complex128
        _, rows64, prefill64 = greedy_run(model64, prompt, N_GEN, forced=gen1)
    assert rows64[0].dtype == torch.float64
    f64_steps_diff = max_abs(rows1, rows64)
    f64_prefill_diff = float((prefill1.double() - prefill64).abs().max())
    gen64 = [int(torch.argmax(r).item()) for r in rows64]

    # --- sensitivity to RoPE scaling (only meaningful for the scaled case) ---
    sensitivity = {}
    if params.get("use_scaled_rope"):
        m, _ = load_model(case_dir, torch.float32, {"use_scaled_rope": False})
        _, rows_ns, _ = greedy_run(m, prompt, N_GEN, forced=gen1)
        sensitivity["max_abs_logit_diff_if_rope_scaling_omitted"] = max_abs(rows1, rows_ns)
    # sensitivity to a wrong rope_theta (10000 <-> 500000)
    wrong_theta = 10000.0 if params.get("rope_theta", 500000.0) != 10000.0 else 500000.0
    m, _ = load_model(case_dir, torch.float32, {"rope_theta": wrong_theta})
    _, rows_wt, _ = greedy_run(m, prompt, N_GEN, forced=gen1)
    sensitivity[f"max_abs_logit_diff_if_rope_theta_{wrong_theta:g}"] = max_abs(rows1, rows_wt)

    # sensitivity to a wrong RoPE pairing and (GQA only) a wrong kv-head mapping
    with patched("apply_rotary_emb", wrong_rope_rotate_half):
        m, _ = load_model(case_dir, torch.float32)
        _, rows_rh, _ = greedy_run(m, prompt, N_GEN, forced=gen1)
    sensitivity["max_abs_logit_diff_if_rope_pairs_rotate_half"] = max_abs(rows1, rows_rh)
    if args.n_kv_heads != args.n_heads and args.n_kv_heads > 1:
        with patched("repeat_kv", wrong_repeat_kv_tile):
            m, _ = load_model(case_dir, torch.float32)
            _, rows_gq, _ = greedy_run(m, prompt, N_GEN, forced=gen1)
        sensitivity["max_abs_logit_diff_if_kv_head_is_h_mod_n_kv"] = max_abs(rows1, rows_gq)

    steps = []
    gaps = []
    for r in rows1:
        top = top_entries(r)
        gap = top[0][1] - top[1][1]
        gaps.append(gap)
        steps.append({"top": top, "top2_gap": gap})
    for i, (s, t) in enumerate(zip(steps, gen1)):
        assert s["top"][0][0] == t, (name, i)

    ffn_hidden = model.layers[0].feed_forward.w1.weight.shape[0]
    config = dict(params)
    config.update(
        {
            "effective_n_kv_heads": args.n_kv_heads,
            "effective_rope_theta": args.rope_theta,
            "head_dim": args.dim // args.n_heads,
            "n_rep": args.n_heads // args.n_kv_heads,
            "ffn_hidden_dim": ffn_hidden,
            "max_seq_len": args.max_seq_len,
            "compute_dtype": "float32",
            "weights_dtype": "bfloat16",
            "init_seed": case["seed"],
            "prompt_seed": case["prompt_seed"],
            "init_std": INIT_STD,
            "norm_weight_init": f"1 + {NORM_STD}*N(0,1)",
        }
    )
    pth = case_dir / "consolidated.00.pth"
    expected = {
        "case": name,
        "prompt_tokens": prompt,
        "generated_tokens": gen1,
        "steps": steps,
        "logits_last_prompt_full": [float(x) for x in rows1[0].tolist()],
        "config": config,
        "checkpoint": {
            "file": "consolidated.00.pth",
            "pickled_container": "collections.OrderedDict" if case.get("ordered_dict") else "dict",
            "size": pth.stat().st_size,
            "sha256": sha256(pth),
            "params_json_sha256": sha256(case_dir / "params.json"),
        },
        "procedure": {
            "prefill": f"one forward(tokens[:, 0:{PROMPT_LEN}], 0) call",
            "decode": "one forward(tokens[:, p:p+1], p) call per step",
            "sampling": "greedy, torch.argmax (first index on exact ties)",
            "n_steps": N_GEN,
            "step_semantics": "steps[0] = logits at last prompt position after prefill; "
            "steps[i] = logits of i-th single-token decode call; "
            "generated_tokens[i] = argmax(steps[i])",
        },
        "checks": {
            "deterministic_two_runs_bit_identical": deterministic,
            "chunked_prefill": {
                "chunk": CHUNK,
                "start_positions": list(range(0, PROMPT_LEN, CHUNK)),
                "max_abs_diff_all_prompt_positions_vs_one_pass": chunk_prefill_diff,
                "max_abs_diff_all_steps_vs_one_pass": chunk_steps_diff,
                "generated_tokens_same": genc == gen1,
            },
            "float64": {
                "max_abs_logit_diff_f32_vs_f64_all_steps": f64_steps_diff,
                "max_abs_logit_diff_f32_vs_f64_prefill_all_positions": f64_prefill_diff,
                "argmax_same_all_steps": gen64 == gen1,
            },
            "sensitivity": sensitivity,
            "min_top2_gap": min(gaps),
            "near_tie_threshold": NEAR_TIE,
            "near_tie_steps": [i for i, gp in enumerate(gaps) if gp < NEAR_TIE],
        },
        "torch_version": torch.__version__,
        "llama_models_version": pkg_version("llama_models"),
        "fairscale_version": pkg_version("fairscale"),
        "torch_num_threads": torch.get_num_threads(),
    }
    with open(case_dir / "expected.json", "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    summary = {
        "case": name,
        "pth_bytes": pth.stat().st_size,
        "generated": gen1,
        **{k: v for k, v in expected["checks"].items()},
    }
    print(json.dumps(summary, indent=1))
    return expected


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out-dir", default=str(REPO_ROOT / "tests" / "fixtures" / "meta"))
    ap.add_argument("--no-write-weights", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)  # deterministic, and fair on a shared machine
    torch.set_default_dtype(torch.float32)
    for name in a.cases.split(","):
        run_case(name, CASES[name], Path(a.out_dir), not a.no_write_weights)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
