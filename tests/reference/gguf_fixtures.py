#!/usr/bin/env python3
"""Reference fixtures for the GGUF reader and the quantized-block kernels.

Expected values come from the PyPI `gguf` package (gguf-py, maintained with llama.cpp):
`gguf.quants.dequantize` / `gguf.quants.quantize` and `gguf.GGUFWriter`.

Re-run (from the repo root):
    /work/pyenv/bin/pip install gguf numpy      # any venv with gguf>=0.10 works
    /work/pyenv/bin/python tests/reference/gguf_fixtures.py

Writes:
    tests/fixtures/gguf/quant_blocks.json  per format: raw block bytes (hex) and the
        dequantized f32 values; for Q8_0/Q4_0/Q4_1 also f32 inputs and the quantized bytes.
    tests/fixtures/gguf/pywriter.gguf      a small GGUF v3 file written by gguf.GGUFWriter with
        every metadata value type and one tensor of each supported tensor type.
    tests/fixtures/gguf/pywriter.json      what the reader must find in pywriter.gguf.
"""
import json
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "gguf")
rng = np.random.default_rng(20261122)


def f16_bytes(vals):
    return np.asarray(vals, dtype=np.float16).view(np.uint8)


def random_blocks(qtype, n_blocks):
    """Random block bytes with sane (finite, moderate) f16 scale fields."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype in (T.Q8_0, T.Q4_0):
        b[:, 0:2] = f16_bytes(rng.normal(0, 0.02, size=n_blocks)).reshape(n_blocks, 2)
    elif qtype == T.Q4_1:
        b[:, 0:2] = f16_bytes(rng.uniform(0.001, 0.02, size=n_blocks)).reshape(n_blocks, 2)
        b[:, 2:4] = f16_bytes(rng.normal(0, 0.1, size=n_blocks)).reshape(n_blocks, 2)
    elif qtype == T.Q4_K:
        b[:, 0:2] = f16_bytes(rng.uniform(0.0005, 0.003, size=n_blocks)).reshape(n_blocks, 2)
        b[:, 2:4] = f16_bytes(rng.uniform(0.0005, 0.003, size=n_blocks)).reshape(n_blocks, 2)
    elif qtype == T.Q6_K:
        b[:, 208:210] = f16_bytes(rng.uniform(0.0001, 0.002, size=n_blocks)).reshape(n_blocks, 2)
    return b


rng2 = np.random.default_rng(20261124)


def random_blocks_v2(qtype, n_blocks):
    """As random_blocks, for the types added in the second round (own generator)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng2.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)

    def put(at, vals):
        b[:, at:at + 2] = f16_bytes(vals).reshape(n_blocks, 2)

    if qtype in (T.Q5_0, T.IQ4_NL):
        put(0, rng2.normal(0, 0.02, size=n_blocks))
    elif qtype == T.Q5_1:
        put(0, rng2.uniform(0.001, 0.02, size=n_blocks))
        put(2, rng2.normal(0, 0.1, size=n_blocks))
    elif qtype == T.Q2_K:
        put(80, rng2.uniform(0.0005, 0.003, size=n_blocks))
        put(82, rng2.uniform(0.0005, 0.003, size=n_blocks))
    elif qtype == T.Q3_K:
        put(108, rng2.uniform(0.0005, 0.003, size=n_blocks))
    elif qtype == T.Q5_K:
        put(0, rng2.uniform(0.0005, 0.003, size=n_blocks))
        put(2, rng2.uniform(0.0005, 0.003, size=n_blocks))
    elif qtype == T.IQ4_XS:
        put(0, rng2.uniform(0.0005, 0.003, size=n_blocks))
    return b


def plain_bytes(qtype, n):
    v = rng.normal(0, 1, size=n).astype(np.float32)
    if qtype == T.F32:
        return v.view(np.uint8)
    if qtype == T.F16:
        return v.astype(np.float16).view(np.uint8)
    if qtype == T.BF16:
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raise ValueError(qtype)


def floats(a):
    return [float(x) for x in np.asarray(a, dtype=np.float32).reshape(-1)]


def quant_fixture():
    out = {"gguf_version": gguf.__version__ if hasattr(gguf, "__version__") else "unknown", "formats": []}
    for name, qtype, n_blocks in [
        ("q8_0", T.Q8_0, 4), ("q4_0", T.Q4_0, 4), ("q4_1", T.Q4_1, 4),
        ("q4_K", T.Q4_K, 3), ("q6_K", T.Q6_K, 3),
    ]:
        block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
        raw = random_blocks(qtype, n_blocks).reshape(-1)
        vals = dequantize(raw, qtype)
        assert vals.size == n_blocks * block_size and np.all(np.isfinite(vals))
        out["formats"].append({"dtype": name, "ggml_type": int(qtype), "n": int(vals.size),
                               "bytes_hex": raw.tobytes().hex(), "values": floats(vals)})
    # Types added later draw from their own generator, so the blocks above
    # (and everything after) stay byte-identical to earlier runs.
    for name, qtype, n_blocks in [
        ("q5_0", T.Q5_0, 4), ("q5_1", T.Q5_1, 4), ("q2_K", T.Q2_K, 3), ("q3_K", T.Q3_K, 3),
        ("q5_K", T.Q5_K, 3), ("iq4_nl", T.IQ4_NL, 4), ("iq4_xs", T.IQ4_XS, 3),
    ]:
        block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
        raw = random_blocks_v2(qtype, n_blocks).reshape(-1)
        vals = dequantize(raw, qtype)
        assert vals.size == n_blocks * block_size and np.all(np.isfinite(vals))
        out["formats"].append({"dtype": name, "ggml_type": int(qtype), "n": int(vals.size),
                               "bytes_hex": raw.tobytes().hex(), "values": floats(vals)})
    for name, qtype, n in [("f32", T.F32, 19), ("f16", T.F16, 37), ("bf16", T.BF16, 37)]:
        raw = plain_bytes(qtype, n)
        vals = dequantize(raw, qtype)
        out["formats"].append({"dtype": name, "ggml_type": int(qtype), "n": n,
                               "bytes_hex": raw.tobytes().hex(), "values": floats(vals)})
    out["quantize"] = []
    for name, qtype in [("q8_0", T.Q8_0), ("q4_0", T.Q4_0), ("q4_1", T.Q4_1)]:
        x = rng.normal(0, 1, size=96).astype(np.float32)
        x[40:64] *= 10.0  # blocks with different ranges
        x[64:96] = 0.0     # an all-zero block (d = 0 path)
        q = quantize(x.reshape(1, -1), qtype).reshape(-1)
        out["quantize"].append({"dtype": name, "input": floats(x), "bytes_hex": q.tobytes().hex()})
    with open(os.path.join(OUT, "quant_blocks.json"), "w") as f:
        json.dump(out, f, indent=0)


def pywriter_fixture():
    path = os.path.join(OUT, "pywriter.gguf")
    w = gguf.GGUFWriter(path, arch="llama")
    expect_kv = {}

    def kv(key, val, vtype, sub=None, shown=None):
        w.add_key_value(key, val, vtype, sub_type=sub)
        expect_kv[key] = {"type": int(vtype), "value": val if shown is None else shown}

    V = gguf.GGUFValueType
    kv("test.u8", 200, V.UINT8)
    kv("test.i8", -100, V.INT8)
    kv("test.u16", 60000, V.UINT16)
    kv("test.i16", -30000, V.INT16)
    kv("test.u32", 4000000000, V.UINT32)
    kv("test.i32", -2000000000, V.INT32)
    kv("test.f32", 0.15625, V.FLOAT32)
    kv("test.bool", True, V.BOOL)
    kv("test.string", "héllo ✓", V.STRING)
    kv("test.u64", 2**63 + 5, V.UINT64)
    kv("test.i64", -(2**62), V.INT64)
    kv("test.f64", 1e-300, V.FLOAT64)
    kv("test.arr_i32", [1, -2, 3], V.ARRAY, V.INT32)
    kv("test.arr_f32", [0.5, -1.25], V.ARRAY, V.FLOAT32)
    kv("test.arr_str", ["a", "", "ü"], V.ARRAY, V.STRING)
    kv("test.arr_bool", [True, False], V.ARRAY, V.BOOL)
    kv("test.arr_nested", [[1, 2], [3]], V.ARRAY, V.ARRAY)
    # Llama hyper-parameters and tokenizer keys, as llama.cpp's converter writes them.
    llama = {"context_length": 128, "dim": 64, "n_layers": 1, "ffn_dim": 96, "n_heads": 4,
             "n_kv_heads": 2, "rope_theta": 500000.0, "norm_eps": 1e-5, "rope_dim": 16,
             "rope_scaling_type": "linear", "rope_scaling_factor": 2.0,
             "tokenizer_model": "gpt2", "tokenizer_pre": "smollm",
             "tokens": ["<s>", "</s>", "a", "b", "ab"], "scores": [0.0, 0.0, -1.0, -2.0, -3.0],
             "token_type": [3, 3, 1, 1, 1], "merges": ["a b"], "bos": 0, "eos": 1,
             "add_bos": False, "chat_template": "{{ messages }}"}
    w.add_context_length(llama["context_length"]); w.add_embedding_length(llama["dim"])
    w.add_block_count(llama["n_layers"]); w.add_feed_forward_length(llama["ffn_dim"])
    w.add_head_count(llama["n_heads"]); w.add_head_count_kv(llama["n_kv_heads"])
    w.add_rope_freq_base(llama["rope_theta"]); w.add_layer_norm_rms_eps(llama["norm_eps"])
    w.add_rope_dimension_count(llama["rope_dim"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR); w.add_rope_scaling_factor(llama["rope_scaling_factor"])
    w.add_tokenizer_model(llama["tokenizer_model"]); w.add_tokenizer_pre(llama["tokenizer_pre"])
    w.add_token_list(llama["tokens"]); w.add_token_scores(llama["scores"])
    w.add_token_types(llama["token_type"]); w.add_token_merges(llama["merges"])
    w.add_bos_token_id(llama["bos"]); w.add_eos_token_id(llama["eos"]); w.add_add_bos_token(llama["add_bos"])
    w.add_chat_template(llama["chat_template"])

    tensors = []

    def add(name, raw, qtype, shape):
        """shape: PyTorch order; raw: bytes (uint8) for quantized/plain data."""
        arr = raw.reshape(shape[:-1] + [-1]) if qtype not in (T.F32, T.F16) else raw
        if qtype == T.F32:
            arr = raw.view(np.float32).reshape(shape)
            w.add_tensor(name, arr)
        elif qtype == T.F16:
            arr = raw.view(np.float16).reshape(shape)
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=qtype)
        vals = dequantize(raw.reshape(-1), qtype)
        tensors.append({"name": name, "ggml_type": int(qtype), "shape": shape,
                        "values": floats(vals)})

    add("token_embd.weight", plain_bytes(T.F32, 5 * 64), T.F32, [5, 64])
    add("blk.0.attn_norm.weight", plain_bytes(T.F16, 64), T.F16, [64])
    add("blk.0.ffn_norm.weight", plain_bytes(T.BF16, 64), T.BF16, [64])
    add("blk.0.attn_q.weight", random_blocks(T.Q8_0, 2 * 64 // 32).reshape(-1), T.Q8_0, [2, 64])
    add("blk.0.attn_k.weight", random_blocks(T.Q4_0, 3 * 32 // 32).reshape(-1), T.Q4_0, [3, 32])
    add("blk.0.attn_v.weight", random_blocks(T.Q4_1, 2 * 2 * 32 // 32).reshape(-1), T.Q4_1, [2, 2, 32])
    add("blk.0.ffn_gate.weight", random_blocks(T.Q4_K, 2).reshape(-1), T.Q4_K, [2, 256])
    add("blk.0.ffn_down.weight", random_blocks(T.Q6_K, 2).reshape(-1), T.Q6_K, [1, 512])
    add("rope_freqs.weight", plain_bytes(T.F32, 8), T.F32, [8])

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    # Independent check with gguf's own reader.
    r = gguf.GGUFReader(path)
    for t in tensors:
        rt = r.get_tensor([i for i, x in enumerate(r.tensors) if x.name == t["name"]][0])
        assert int(rt.tensor_type) == t["ggml_type"], t["name"]
        assert list(reversed([int(x) for x in rt.shape])) == t["shape"], (t["name"], rt.shape)
    with open(os.path.join(OUT, "pywriter.json"), "w") as f:
        json.dump({"kv": expect_kv, "llama": llama, "tensors": tensors}, f, indent=0)


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    quant_fixture()
    pywriter_fixture()
    for n in sorted(os.listdir(OUT)):
        print(n, os.path.getsize(os.path.join(OUT, n)), file=sys.stderr)
