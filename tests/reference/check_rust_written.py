#!/usr/bin/env python3
"""Check that torch.load reads the .pth files written by llama-graph's Rust
writer (tests/fixtures/pth/rust_written/) with the intended values.

Re-run from the repository root (after regenerating the files with
`LLAMA_GRAPH_REGEN_FIXTURES=1 cargo test --test pth_writer`):

    /work/pyenv/bin/python tests/reference/check_rust_written.py

Optionally spot-check a big generated checkpoint (e.g. the 16 GB 8B-shaped
one from `cargo run --release --example pth_open_bench -- DIR --preset 8b`,
seed 0, bf16), loading it with torch.load(mmap=True): names, shapes, and the
first 256 values of every tensor:

    /work/pyenv/bin/python tests/reference/check_rust_written.py --big DIR [SEED]

Values are recomputed here independently: the formulas of values.pth, and
the SplitMix64-based generator of generate_random_checkpoint (see
src/weights/pth/random.rs), with Meta's tensor names/shapes and FFN formula.
"""
import json
import struct
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
DIR = ROOT / "tests" / "fixtures" / "pth" / "rust_written"
M64 = (1 << 64) - 1


def check_alignment(path):
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if "/data/" not in info.filename:
                continue
            assert info.compress_type == zipfile.ZIP_STORED, info.filename
            off = info.header_offset
            nlen, xlen = struct.unpack_from("<HH", raw, off + 26)
            start = off + 30 + nlen + xlen
            assert start % 64 == 0, f"{path.name}:{info.filename} data at {start}"


def check_values():
    p = DIR / "values.pth"
    check_alignment(p)
    sd = torch.load(p, weights_only=True)
    want = {
        "a.f32": (torch.arange(15, dtype=torch.float32) * 0.25 - 1.0).reshape(3, 5),
        "b.f16": (torch.arange(4, dtype=torch.float32) * 0.5 - 0.75).to(torch.float16),
        "c.bf16": (torch.arange(6, dtype=torch.float32) * -1.5 + 0.125).to(torch.bfloat16).reshape(2, 3),
        "d.i32": torch.arange(6, dtype=torch.int32) * 1000 - 2500,
        "e.scalar": torch.tensor(7.0),
        "f.4d": torch.arange(8, dtype=torch.float32).to(torch.bfloat16).reshape(2, 1, 2, 2),
        "g.empty": torch.zeros(0, 3, dtype=torch.float16),
    }
    assert list(sd.keys()) == list(want.keys()), sd.keys()
    for k, v in want.items():
        assert sd[k].dtype == v.dtype and sd[k].shape == v.shape, (k, sd[k].dtype, sd[k].shape)
        assert torch.equal(sd[k], v), k


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


def fnv1a64(s):
    h = 0xCBF29CE484222325
    for b in s.encode():
        h = ((h ^ b) * 0x100000001B3) & M64
    return h


def stream(seed, name, n):
    _, state = splitmix64(seed ^ fnv1a64(name))
    out = np.empty(n, dtype=np.float32)
    base = np.float32(1.0 if name.endswith("norm.weight") else 0.0)
    for i in range(n):
        state, r = splitmix64(state)
        s = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48)
        x = (np.float32(s) / np.float32(65536.0) - np.float32(2.0)) * np.float32(1.7320508)
        out[i] = base + np.float32(0.02) * x
    return out


def meta_shapes(p):
    dim, nh = p["dim"], p["n_heads"]
    nkv = p.get("n_kv_heads") or nh
    hd = dim // nh
    hidden = 4 * dim
    hidden = int(2 * hidden / 3)
    if p.get("ffn_dim_multiplier") is not None:
        hidden = int(p["ffn_dim_multiplier"] * hidden)
    m = p["multiple_of"]
    ffn = m * ((hidden + m - 1) // m)
    v = p["vocab_size"]
    out = [("tok_embeddings.weight", (v, dim))]
    for l in range(p["n_layers"]):
        a, f = f"layers.{l}.attention", f"layers.{l}.feed_forward"
        out += [(f"{a}.wq.weight", (nh * hd, dim)), (f"{a}.wk.weight", (nkv * hd, dim)),
                (f"{a}.wv.weight", (nkv * hd, dim)), (f"{a}.wo.weight", (dim, nh * hd)),
                (f"{f}.w1.weight", (ffn, dim)), (f"{f}.w2.weight", (dim, ffn)), (f"{f}.w3.weight", (ffn, dim)),
                (f"layers.{l}.attention_norm.weight", (dim,)), (f"layers.{l}.ffn_norm.weight", (dim,))]
    return out + [("norm.weight", (dim,)), ("output.weight", (v, dim))]


def check_random(sub, seed, dtype):
    d = DIR / sub
    p = json.loads((d / "params.json").read_text())
    check_alignment(d / "consolidated.00.pth")
    sd = torch.load(d / "consolidated.00.pth", weights_only=True)
    shapes = meta_shapes(p)
    assert list(sd.keys()) == [n for n, _ in shapes], list(sd.keys())
    for name, shape in shapes:
        t = sd[name]
        assert t.dtype == dtype and tuple(t.shape) == shape, (name, t.dtype, t.shape)
        want = torch.from_numpy(stream(seed, name, t.numel())).reshape(shape).to(dtype)
        assert torch.equal(t.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           want.view(torch.int16 if dtype != torch.float32 else torch.int32)), name


def check_big(d, seed):
    p = json.loads((d / "params.json").read_text())
    sd = torch.load(d / "consolidated.00.pth", weights_only=True, mmap=True)
    shapes = meta_shapes(p)
    assert list(sd.keys()) == [n for n, _ in shapes]
    for name, shape in shapes:
        t = sd[name]
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == shape, name
        want = torch.from_numpy(stream(seed, name, 256)).to(torch.bfloat16)
        assert torch.equal(t.reshape(-1)[:256].view(torch.int16), want.view(torch.int16)), name
    print(f"torch.load(mmap=True) reads {len(shapes)} tensors of {d} with the expected values")


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--big":
        return check_big(Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    check_values()
    check_random("random_bf16", 42, torch.bfloat16)
    check_random("random_f32", 7, torch.float32)
    print("torch.load reads the Rust-written files with the expected values")


if __name__ == "__main__":
    sys.exit(main())
