#!/usr/bin/env python3
"""Generate the .pth reader fixtures in tests/fixtures/pth/ with real torch.

Re-run from the repository root:

    /work/pyenv/bin/python tests/reference/pth_fixtures.py

Writes (all tiny):
  good.pth              torch.save of bf16/f16/f32/i32 tensors, two views of one
                        shared storage at different offsets, a transposed
                        (non-contiguous) tensor, a column slice, an
                        nn.Parameter, a 0-d tensor, an empty tensor, a nested dict
  good_proto4.pth       the same state dict saved with pickle protocol 4
  meta2/                Meta-layout tiny model split in 2 shards (Llama 2 style,
                        tok_embeddings split on dim 1) + params.json
  meta3/                same, Llama 3 style (tok_embeddings split on dim 0)
  bad_*.pth / bad_*     hostile and corrupt files (see CASES below)
  expected.json         SHA-256 of every tensor's contiguous little-endian
                        bytes, dtype and shape, and the expected error of
                        each bad file (variant name + message substring)
"""
import collections
import hashlib
import io
import json
import os
import pickle
import struct
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "pth"
SENTINEL = "/tmp/llama-graph-pth-pwned"
FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # reproducible zip timestamps

DT = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32", torch.int32: "i32"}


def tensor_info(t):
    b = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": DT[t.dtype], "shape": list(t.shape), "sha256": hashlib.sha256(b).hexdigest()}


def flat(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flat(v, prefix + k + "."))
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out


def good_state():
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(64, generator=g, dtype=torch.float32)
    shared = torch.randn(40, generator=g).to(torch.bfloat16)
    m = torch.randn(6, 5, generator=g)
    sd = collections.OrderedDict()
    sd["w_bf16"] = torch.randn(3, 4, generator=g).to(torch.bfloat16)
    sd["w_f16"] = torch.randn(2, 3, 2, generator=g).to(torch.float16)
    sd["w_f32"] = base[:10].clone()
    sd["ids_i32"] = torch.arange(-3, 5, dtype=torch.int32)
    # Two views of one storage, at storage offsets 4 and 20.
    sd["shared_a"] = shared[4:16].view(3, 4)
    sd["shared_b"] = shared[20:30]
    # Non-contiguous: transposed, and a column slice (row stride 5, offset 1).
    sd["transposed"] = m.t()
    sd["col_slice"] = m[:, 1:3]
    sd["param"] = torch.nn.Parameter(torch.randn(2, 2, generator=g).to(torch.float16), requires_grad=False)
    sd["scalar"] = torch.tensor(3.5, dtype=torch.float32)
    sd["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    sd["nested"] = {"inner": torch.randn(5, generator=g).to(torch.bfloat16)}
    sd["not_a_tensor"] = 42
    return sd


# ---------------------------------------------------------------- Meta shards
def meta_model(seed, dim=16, n_layers=2, n_heads=4, n_kv=2, vocab=40, ffn=48):
    g = torch.Generator().manual_seed(seed)
    hd = dim // n_heads
    r = lambda *s: (torch.randn(*s, generator=g) * 0.1).to(torch.bfloat16)
    sd = collections.OrderedDict()
    sd["tok_embeddings.weight"] = r(vocab, dim)
    for l in range(n_layers):
        a, f = f"layers.{l}.attention", f"layers.{l}.feed_forward"
        sd[f"{a}.wq.weight"] = r(n_heads * hd, dim)
        sd[f"{a}.wk.weight"] = r(n_kv * hd, dim)
        sd[f"{a}.wv.weight"] = r(n_kv * hd, dim)
        sd[f"{a}.wo.weight"] = r(dim, n_heads * hd)
        sd[f"{f}.w1.weight"] = r(ffn, dim)
        sd[f"{f}.w2.weight"] = r(dim, ffn)
        sd[f"{f}.w3.weight"] = r(ffn, dim)
        sd[f"layers.{l}.attention_norm.weight"] = (1 + r(dim).float()).to(torch.bfloat16)
        sd[f"layers.{l}.ffn_norm.weight"] = (1 + r(dim).float()).to(torch.bfloat16)
    sd["norm.weight"] = (1 + r(dim).float()).to(torch.bfloat16)
    sd["output.weight"] = r(vocab, dim)
    sd["rope.freqs"] = torch.arange(hd // 2, dtype=torch.float32)
    params = {"dim": dim, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv,
              "vocab_size": vocab, "multiple_of": 16, "norm_eps": 1e-5}
    return sd, params


def split_dim(name, tok_dim):
    last = name.removesuffix(".weight").split(".")[-1]
    if last in ("wq", "wk", "wv", "w1", "w3", "output"):
        return 0
    if last in ("wo", "w2"):
        return 1
    if last == "tok_embeddings":
        return tok_dim
    return None  # replicated


def write_shards(d, sd, params, tok_dim, n=2):
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        shard = collections.OrderedDict()
        for k, v in sd.items():
            dim = split_dim(k, tok_dim)
            shard[k] = v.clone() if dim is None else v.chunk(n, dim=dim)[i].clone()
        torch.save(shard, d / f"consolidated.{i:02d}.pth")
    (d / "params.json").write_text(json.dumps(params))


# ------------------------------------------------------- handmade .pth files
def p_int(v):
    if 0 <= v < 256:
        return b"K" + bytes([v])
    if 0 <= v < 65536:
        return b"M" + struct.pack("<H", v)
    if -(2**31) <= v < 2**31:
        return b"J" + struct.pack("<i", v)
    b = v.to_bytes(16, "little", signed=True).rstrip(b"\x00") or b"\x00"
    if b[-1] & 0x80:
        b += b"\x00"
    return b"\x8a" + bytes([len(b)]) + b


def p_str(s):
    e = s.encode()
    return b"X" + struct.pack("<I", len(e)) + e


def p_tuple(vals):
    body = b"".join(p_int(v) for v in vals)
    return (b"(" + body + b"t") if len(vals) > 3 or len(vals) == 0 else body + bytes([0x84 + len(vals)])


def handmade_pickle(tensors, storage_global=b"ctorch\nFloatStorage\n"):
    """tensors: list of (name, key, numel, offset, size, stride)."""
    o = b"\x80\x02}("
    for name, key, numel, off, size, stride in tensors:
        o += p_str(name) + b"ctorch._utils\n_rebuild_tensor_v2\n(("
        o += p_str("storage") + storage_global + p_str(key) + p_str("cpu") + p_int(numel) + b"tQ"
        o += p_int(off) + p_tuple(size) + p_tuple(stride) + b"\x89ccollections\nOrderedDict\n)RtR"
    return o + b"u."


def write_zip(path, entries, prefix="archive", compress=()):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries:
            ct = zipfile.ZIP_DEFLATED if name in compress else zipfile.ZIP_STORED
            z.writestr(zipfile.ZipInfo(f"{prefix}/{name}", FIXED_TIME), data, compress_type=ct)


class Evil:
    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return (self.fn, (self.arg,))


def evil_pth(path, payload_pickle):
    write_zip(path, [("data.pkl", payload_pickle), ("byteorder", b"little"), ("version", b"3\n")])


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    expected = {"tensors": {}, "errors": {}}

    sd = good_state()
    torch.save(sd, OUT / "good.pth")
    torch.save(sd, OUT / "good_proto4.pth", pickle_protocol=4)
    info = {k: tensor_info(v) for k, v in flat(sd).items()}
    expected["tensors"]["good.pth"] = info
    expected["tensors"]["good_proto4.pth"] = info
    # Same archive with every entry deflate-compressed (a valid zip that
    # torch.save itself never writes): tensors must come out identical.
    with zipfile.ZipFile(OUT / "good.pth") as zin, \
            zipfile.ZipFile(OUT / "good_deflated.pth", "w", zipfile.ZIP_DEFLATED) as zout:
        for i in zin.infolist():
            zout.writestr(zipfile.ZipInfo(i.filename, FIXED_TIME), zin.read(i.filename),
                          compress_type=zipfile.ZIP_DEFLATED)
    expected["tensors"]["good_deflated.pth"] = info
    # The handmade writer below must itself be readable by torch (control).
    ctrl = torch.arange(8, dtype=torch.float32)
    write_zip(OUT / "handmade_ok.pth", [
        ("data.pkl", handmade_pickle([("t", "0", 8, 2, (2, 3), (3, 1))])),
        ("data/0", ctrl.numpy().tobytes()), ("byteorder", b"little"), ("version", b"3\n")])
    loaded = torch.load(OUT / "handmade_ok.pth", weights_only=True)
    assert torch.equal(loaded["t"], ctrl[2:8].view(2, 3))
    expected["tensors"]["handmade_ok.pth"] = {"t": tensor_info(loaded["t"])}

    for style, tok_dim in (("meta2", 1), ("meta3", 0)):
        msd, params = meta_model(7 if style == "meta2" else 8)
        write_shards(OUT / style, msd, params, tok_dim)
        expected["tensors"][style] = {k: tensor_info(v) for k, v in msd.items()}

    # ---------------------------------------------------------- bad inputs
    errors = expected["errors"]

    def bad(name, variant, contains):
        errors[name] = {"variant": variant, "contains": contains}

    # Hostile pickles: through torch.save (writes posix.system on Linux), a
    # protocol-4 STACK_GLOBAL variant, and handmade GLOBALs.
    torch.save({"x": Evil(os.system, f"touch {SENTINEL}")}, OUT / "bad_posix_system.pth")
    bad("bad_posix_system.pth", "Pickle", "posix.system")
    torch.save({"x": Evil(os.system, f"touch {SENTINEL}")}, OUT / "bad_stack_global.pth", pickle_protocol=4)
    bad("bad_stack_global.pth", "Pickle", "posix.system")
    evil_pth(OUT / "bad_os_system.pth",
             b"\x80\x02cos\nsystem\n" + p_str(f"touch {SENTINEL}") + b"\x85R.")
    bad("bad_os_system.pth", "Pickle", "os.system")
    evil_pth(OUT / "bad_eval.pth",
             b"\x80\x02cbuiltins\neval\n" + p_str(f"open('{SENTINEL}', 'w')") + b"\x85R.")
    bad("bad_eval.pth", "Pickle", "builtins.eval")
    # pickle protocol 2 spells it __builtin__.eval (Python 2 compatible name)
    evil_pth(OUT / "bad_eval_pickled.pth",
             pickle.dumps(Evil(eval, f"open('{SENTINEL}', 'w')"), protocol=2))
    bad("bad_eval_pickled.pth", "Pickle", "__builtin__.eval")

    good_pkl = zipfile.ZipFile(OUT / "handmade_ok.pth").read("archive/data.pkl")
    cut = good_pkl.index(b"X\x07\x00\x00\x00storage") + 3  # inside the length field
    write_zip(OUT / "bad_truncated_pickle.pth", [("data.pkl", good_pkl[:cut]), ("data/0", ctrl.numpy().tobytes())])
    bad("bad_truncated_pickle.pth", "Pickle", "truncated")

    write_zip(OUT / "bad_offset_past_entry.pth", [
        ("data.pkl", handmade_pickle([("late", "0", 8, 6, (2, 2), (2, 1))])),
        ("data/0", ctrl.numpy().tobytes())])
    bad("bad_offset_past_entry.pth", "OutOfBounds", "late")

    write_zip(OUT / "bad_storage_short.pth", [
        ("data.pkl", handmade_pickle([("short", "0", 16, 0, (16,), (1,))])),
        ("data/0", ctrl.numpy().tobytes())])
    bad("bad_storage_short.pth", "StorageSize", "short")

    torch.save({"f64": torch.arange(3, dtype=torch.float64)}, OUT / "bad_float64.pth")
    bad("bad_float64.pth", "UnsupportedDtype", "torch.DoubleStorage")

    write_zip(OUT / "bad_unknown_storage.pth", [
        ("data.pkl", handmade_pickle([("t", "0", 8, 0, (8,), (1,))], b"ctorch\nFooStorage\n")),
        ("data/0", ctrl.numpy().tobytes())])
    bad("bad_unknown_storage.pth", "Pickle", "torch.FooStorage")

    write_zip(OUT / "bad_shape_overflow.pth", [
        ("data.pkl", handmade_pickle([("huge", "0", 8, 0, (2**32, 2**32, 2**32), (1, 1, 1))])),
        ("data/0", ctrl.numpy().tobytes())])
    bad("bad_shape_overflow.pth", "ShapeOverflow", "huge")

    write_zip(OUT / "bad_missing_storage.pth", [
        ("data.pkl", handmade_pickle([("orphan", "7", 8, 0, (8,), (1,))])),
        ("data/0", ctrl.numpy().tobytes())])
    bad("bad_missing_storage.pth", "MissingStorage", "orphan")

    # Compressed data entry whose real size (256 bytes) exceeds the declared
    # size (16): patch the uncompressed-size fields of both headers.
    big = torch.arange(64, dtype=torch.float32).numpy().tobytes()
    p = OUT / "bad_compressed_oversize.pth"
    write_zip(p, [("data.pkl", handmade_pickle([("z", "0", 4, 0, (4,), (1,))])), ("data/0", big)],
              compress=("data/0",))
    raw = bytearray(p.read_bytes())
    name = b"archive/data/0"
    # local header: find the one whose name matches
    off = 0
    while True:
        off = raw.index(b"PK\x03\x04", off)
        nlen = struct.unpack_from("<H", raw, off + 26)[0]
        if raw[off + 30:off + 30 + nlen] == name:
            struct.pack_into("<I", raw, off + 22, 16)
            break
        off += 4
    off = 0
    while True:
        off = raw.index(b"PK\x01\x02", off)
        nlen = struct.unpack_from("<H", raw, off + 28)[0]
        if raw[off + 46:off + 46 + nlen] == name:
            struct.pack_into("<I", raw, off + 24, 16)
            break
        off += 4
    p.write_bytes(bytes(raw))
    bad("bad_compressed_oversize.pth", "Entry", "declares 16")

    torch.save({"bcast": torch.arange(3.0).expand(4, 3)}, OUT / "bad_expanded.pth")
    bad("bad_expanded.pth", "OverlappingStrides", "bcast")
    torch.save({"x": torch.ones(2)}, OUT / "bad_legacy_format.pth", _use_new_zipfile_serialization=False)
    bad("bad_legacy_format.pth", "Zip", "legacy")
    (OUT / "bad_not_zip.pth").write_bytes(b"this is not a zip archive, just text\n" * 3)
    bad("bad_not_zip.pth", "Zip", "")
    g = (OUT / "good.pth").read_bytes()
    (OUT / "bad_truncated_zip.pth").write_bytes(g[: len(g) // 2])
    bad("bad_truncated_zip.pth", "Zip", "")
    write_zip(OUT / "bad_no_data_pkl.pth", [("data/0", ctrl.numpy().tobytes()), ("version", b"3\n")])
    bad("bad_no_data_pkl.pth", "NoDataPkl", "data.pkl")
    with zipfile.ZipFile(OUT / "bad_two_data_pkl.pth", "w") as z:
        z.writestr(zipfile.ZipInfo("a/data.pkl", FIXED_TIME), good_pkl)
        z.writestr(zipfile.ZipInfo("b/data.pkl", FIXED_TIME), good_pkl)
    bad("bad_two_data_pkl.pth", "AmbiguousDataPkl", "b/data.pkl")
    write_zip(OUT / "bad_big_endian.pth", [("data.pkl", good_pkl), ("data/0", ctrl.numpy().tobytes()),
                                           ("byteorder", b"big")])
    bad("bad_big_endian.pth", "BigEndian", "big")

    # torch itself must refuse the hostile files under weights_only and the
    # sentinel must not exist (we never run the unsafe loader here).
    for n in ("bad_posix_system.pth", "bad_os_system.pth", "bad_eval.pth", "bad_eval_pickled.pth"):
        try:
            torch.load(OUT / n, weights_only=True)
            raise SystemExit(f"torch accepted {n}")
        except pickle.UnpicklingError:
            pass
    assert not os.path.exists(SENTINEL)

    (OUT / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({total} bytes)")


if __name__ == "__main__":
    main()
