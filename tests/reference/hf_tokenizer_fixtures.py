#!/usr/bin/env python3
"""Reference encodings for tokenizer.json support (tests/hf_tokenizer.rs).

Every tokenizer.json here has the exact structure a Llama-family checkpoint
ships; the vocabularies are small so the files can be committed. Expected
ids come from the Hugging Face `tokenizers` package on the same file, for
each string of tests/fixtures/tokenizer/corpus.json:
  ids          tokenizer.encode(s, add_special_tokens=False)   (added tokens matched)
  ids_special  the same with encode_special_tokens = True       (special tokens as text)
  ids_bos      encode(s, add_special_tokens=True)               (the post-processor's BOS)
  decoded      tokenizer.decode(ids, skip_special_tokens=False)

Writes tests/fixtures/hf/tokenizers/<case>/tokenizer.json and expected.json:
  llama2_metaspace  transformers' conversion of spm_bpe.model (Metaspace
                    pre-tokenizer, prepend_scheme "first"; byte fallback):
                    a copy of tests/fixtures/hf/xformat/hf/tokenizer.json
  llama2_legacy     the same vocabulary in the older layout Llama 2 and
                    TinyLlama files use: normalizer Prepend("▁") +
                    Replace(" ", "▁"), no pre-tokenizer
  gemma_layout      the same vocabulary with the pipeline of Gemma's tokenizer.json
                    (GemmaTokenizer): normalizer Replace(" ", "▁"), pre-tokenizer
                    Split(" ", MergedWithPrevious), no prefix space, byte fallback
  llama3_bpe        a byte-level BPE trained here (vocab 1200) with Llama 3's
                    pipeline: Split(Llama 3 regex, Isolated) + ByteLevel(no
                    regex), ignore_merges, TemplateProcessing with
                    <|begin_of_text|>, special and non-special added tokens

The SmolLM2 configuration (Digits + ByteLevel) is checked on the real
vocabulary against tests/fixtures/tokenizer/smollm2.json (tokenizer_fixtures.py).

Re-run from the repo root (needs tokenizers; ~5 s):
  /work/pyenv/bin/python tests/reference/hf_tokenizer_fixtures.py
"""
import json
import shutil
import sys
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenizer_fixtures import CORPUS, long_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "hf" / "tokenizers"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
EXTRA = [
    "<s>Hello</s> <s> world",
    "<|begin_of_text|>Hi<|eot_id|>\n<|end_of_text|>",
    "a <tool> b<tool>c",
    "<ctrl>x <ctrl> y",
]


def expected(tk: Tokenizer, name: str, note: str):
    cases = []
    for s in CORPUS + EXTRA:
        tk.encode_special_tokens = False
        ids = tk.encode(s, add_special_tokens=False).ids
        bos = tk.encode(s, add_special_tokens=True).ids
        tk.encode_special_tokens = True
        ids_sp = tk.encode(s, add_special_tokens=False).ids
        cases.append({"text": s, "ids": ids, "ids_special": ids_sp, "ids_bos": bos,
                      "decoded": tk.decode(ids, skip_special_tokens=False)})
    tk.encode_special_tokens = True
    lt = long_text()
    long_ids = tk.encode(lt, add_special_tokens=False).ids
    return {"case": name, "note": note, "tokenizers_version": tokenizers.__version__,
            "cases": cases, "long": {"n_chars": len(lt), "ids": len(long_ids),
                                     "first_ids": long_ids[:200], "sum": sum(long_ids)}}


def write(case: str, tk_json: dict, note: str):
    d = OUT / case
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(tk_json, f, ensure_ascii=False, indent=1)
        f.write("\n")
    tk = Tokenizer.from_file(str(d / "tokenizer.json"))
    with open(d / "expected.json", "w", encoding="utf-8") as f:
        json.dump(expected(tk, case, note), f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(case, tk.get_vocab_size())


def main():
    if OUT.exists():
        shutil.rmtree(OUT)
    meta = json.loads((ROOT / "tests/fixtures/hf/xformat/hf/tokenizer.json").read_text())
    write("llama2_metaspace", meta,
          "transformers LlamaTokenizer(legacy=False) conversion of spm_bpe.model")
    legacy = json.loads(json.dumps(meta))
    legacy["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    legacy["pre_tokenizer"] = None
    legacy["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    write("llama2_legacy", legacy,
          "llama2_metaspace's vocabulary with Llama 2 / TinyLlama's normalizer layout and BOS post-processor")

    gemma = json.loads(json.dumps(meta))
    gemma["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    gemma["pre_tokenizer"] = {"type": "Split", "pattern": {"String": " "},
                              "behavior": "MergedWithPrevious", "invert": False}
    gemma["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}]}
    write("gemma_layout", gemma,
          "llama2_metaspace's vocabulary with the pipeline of Gemma's tokenizer.json "
          "(transformers GemmaTokenizer): Replace(' ', '\u2581') normalizer, Split(' ', "
          "MergedWithPrevious), no prefix space, byte fallback")

    tk = Tokenizer(models.BPE(ignore_merges=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(CORPUS + [long_text()[:200000]], trainer)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]])
    tk.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    bot = tk.token_to_id("<|begin_of_text|>")
    tk.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bot)])])
    j = json.loads(tk.to_str())
    assert j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == LLAMA3_SPLIT
    write("llama3_bpe", j, "byte-level BPE trained by tokenizers with Llama 3's pipeline")


if __name__ == "__main__":
    main()
