#!/usr/bin/env python3
"""SmolLM2-135M-Instruct's real weights in Hugging Face layout, and what
transformers' LlamaForCausalLM computes on them (tests/hf_reference.rs).

transformers loads the shipped Q4_1 GGUF (`from_pretrained(dir, gguf_file=...)`:
dequantized to float32 by the `gguf` package, attn_q/attn_k rows put in
Hugging Face's rotate-half order), converts it to bfloat16 and
`save_pretrained`s it: config.json + model.safetensors (~270 MB) -- the HF
directory a user would have. That directory is reloaded with
`dtype=torch.float32` (bf16 weights, f32 compute) and run greedily on the chat
prompts of smollm2_reference.py (prefill, then one token per forward).

The directory is too large to commit. The test makes the same one from the
GGUF with llama-graph's own code (dequantize, round to bf16, Meta -> HF row
order and names); this script records what it must be equal to. Writes
tests/fixtures/smollm2/hf_layout.json:
  config            transformers' config.json, as saved
  tensors           {name: [dtype, shape, sha256 of the bytes]} of model.safetensors
  cases             prompt_tokens, generated_tokens, steps (common step format,
                    tests/reference/README.md) for N_GEN greedy steps

--out DIR keeps the saved directory there (default: a temporary directory).

Re-run from the repo root (~1 min, ~2 GB RAM):
  /work/pyenv/bin/python tests/reference/smollm2_hf_reference.py \
      [--gguf ~/.cache/llama-graph/SmolLM2-135M-Instruct.Q4_1.gguf] [--out DIR]
"""
import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smollm2_reference import PROMPTS, greedy, top_entries  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "smollm2" / "hf_layout.json"
N_GEN = 8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path,
                    default=Path.home() / ".cache" / "llama-graph" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    g = args.gguf
    loaded = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32)
    # transformers 5 will not save_pretrained a model it loaded from GGUF
    # ("quantized with gguf and is not serializable"), so the same weights go
    # into a plain LlamaForCausalLM of the same config, which saves as any
    # downloaded checkpoint.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(
        {k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    model.tie_weights()
    del loaded
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    tmp = None
    out_dir = args.out
    if out_dir is None:
        tmp = tempfile.mkdtemp(prefix="smollm2_hf_")
        out_dir = Path(tmp)
    model.save_pretrained(out_dir)
    del model

    config = json.loads((out_dir / "config.json").read_text())
    tensors = {}
    files = sorted(out_dir.glob("*.safetensors"))
    assert [f.name for f in files] == ["model.safetensors"], files
    with safe_open(files[0], framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name)
            assert t.dtype == torch.bfloat16, (name, t.dtype)
            b = t.contiguous().view(torch.int16).numpy().tobytes()
            tensors[name] = ["BF16", list(t.shape), hashlib.sha256(b).hexdigest()]

    model = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    model.eval()
    cases = []
    for messages in PROMPTS[:2]:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        gen, rows = greedy(model, list(ids), N_GEN)
        steps = []
        for r in rows:
            top = top_entries(r)
            steps.append({"top": top, "top2_gap": top[0][1] - top[1][1]})
        assert [s["top"][0][0] for s in steps] == gen
        cases.append({"messages": messages, "prompt_tokens": list(ids), "generated_tokens": gen,
                      "steps": steps})
    out = {
        "procedure": "transformers AutoModelForCausalLM.from_pretrained(dir, gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf,"
                     " dtype=float32).to(bfloat16).save_pretrained(out); LlamaForCausalLM.from_pretrained(out,"
                     " dtype=float32) greedy (prefill, then one token per forward with the KV cache)",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "config": config,
        "tensors": tensors,
        "cases": cases,
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{OUT}: {len(tensors)} tensors, {len(cases)} cases")
    if tmp:
        shutil.rmtree(tmp, True)


if __name__ == "__main__":
    main()
