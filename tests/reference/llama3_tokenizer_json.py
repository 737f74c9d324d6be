#!/usr/bin/env python3
"""The real Llama 3 vocabulary as a tokenizer.json (tests/hf_tokenizer.rs,
tests/convert.rs).

Meta's Llama 3 `tokenizer.model` (tiktoken ranks, from PyPI llama-models==0.3.0)
is converted by transformers' `TikTokenConverter` -- the converter behind the
tokenizer.json of Meta's Hugging Face releases: vocabulary in GPT-2's byte
alphabet, every split of every token as a merge, ignore_merges, the Llama 3
split regex + ByteLevel, Meta's 256 special tokens -- with the post-processor
Meta's files have (ByteLevel, then TemplateProcessing adding <|begin_of_text|>).

The file itself is ~9 MB, so it is not committed: its skeleton is (everything
but model.vocab and model.merges, tests/fixtures/tokenizer/llama3_hf_skeleton.json),
and the tests fill in the vocabulary and the merges with llama-graph's own code
from the same tokenizer.model, checked against the digests recorded here.
Writes tests/fixtures/tokenizer/llama3_hf.json:
  n_vocab, n_merges           sizes of model.vocab and model.merges
  vocab_sha256                SHA-256 of "token\\tid\\n" for model.vocab in id order
  merges_sha256               SHA-256 of "left right\\n" for model.merges in order
  added_tokens                [id, content, special] of every added token
  cases / long                `tokenizers` on that file, over the tokenizer corpus:
                              ids (added tokens matched), ids_special (special tokens
                              as text), ids_bos (post-processor's BOS), decoded; and
                              count, first 200 ids and sum of the ids of ~1 MB of text
                              (the layout of tests/reference/hf_tokenizer_fixtures.py)

Re-run from the repo root (needs transformers, tokenizers, tiktoken, llama-models; ~1 min):
  /work/pyenv/bin/python tests/reference/llama3_tokenizer_json.py [--save DIR]
--save also writes the converted tokenizer.json into DIR (for inspection).
"""
import argparse
import hashlib
import json
import sys
from pathlib import Path

import llama_models
import tokenizers
import transformers
from tokenizers import Tokenizer, processors
from transformers.convert_slow_tokenizer import TikTokenConverter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tokenizer_fixtures import expected  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "tokenizer" / "llama3_hf.json"
SKELETON = ROOT / "tests" / "fixtures" / "tokenizer" / "llama3_hf_skeleton.json"


def llama3_special_tokens():
    # As llama_models/llama3/tokenizer.py lists them.
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
             "<|python_tag|>", "<|image|>"]
    return named + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(named))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    model_file = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer
    meta = MetaTokenizer(model_file)
    specials = llama3_special_tokens()
    assert [meta.special_tokens[s] for s in specials] == list(range(128000, 128256))

    tk = TikTokenConverter(vocab_file=str(model_file), extra_special_tokens=specials).converted()
    bot = tk.token_to_id("<|begin_of_text|>")
    tk.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
            special_tokens=[("<|begin_of_text|>", bot)])])
    j = json.loads(tk.to_str())
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        (args.save / "tokenizer.json").write_text(tk.to_str(), encoding="utf-8")
    # Reload through the file, as a user would.
    tk = Tokenizer.from_str(json.dumps(j))

    vocab = sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    vh = hashlib.sha256("".join(f"{t}\t{i}\n" for t, i in vocab).encode()).hexdigest()
    mh = hashlib.sha256("".join(f"{m}\n" for m in merges).encode()).hexdigest()
    assert j["model"]["ignore_merges"] is True
    out = expected(tk, "llama3_real", "transformers TikTokenConverter of Meta's Llama 3 tokenizer.model")
    out.update({
        "source": f"llama-models=={llama_models.__version__ if hasattr(llama_models, '__version__') else '0.3.0'} "
                  f"llama3/tokenizer.model; transformers {transformers.__version__}; "
                  f"tokenizers {tokenizers.__version__}",
        "n_vocab": len(vocab),
        "n_merges": len(merges),
        "vocab_sha256": vh,
        "merges_sha256": mh,
        "added_tokens": [[a["id"], a["content"], a["special"]] for a in j["added_tokens"]],
    })
    # The vocabulary and the merges agree with Meta's tokenizer on the corpus.
    for c in out["cases"]:
        assert c["ids_special"] == meta.encode(c["text"], bos=False, eos=False,
                                               allowed_special=set(), disallowed_special=()), c["text"]
    skel = json.loads(json.dumps(j))
    skel["model"]["vocab"] = {}
    skel["model"]["merges"] = []
    with open(SKELETON, "w", encoding="utf-8") as f:
        json.dump(skel, f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{OUT}: {len(vocab)} tokens, {len(merges)} merges, {len(out['cases'])} cases")


if __name__ == "__main__":
    main()
