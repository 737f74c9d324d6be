"""llama.cpp's first-step margin between the reference's top-2 tokens, per
committed prompt (tests/fixtures/smollm2/expected.json), to compare with the
margins benches/probes/fast_vs_exact.rs prints for llama-graph.

    ~/.cache/llama-graph/compare/venv/bin/python benches/compare/first_step_margin.py MODEL.gguf
"""
import json
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama

REPO = Path(__file__).resolve().parents[2]
doc = json.loads((REPO / "tests/fixtures/smollm2/expected.json").read_text())
m = Llama(model_path=sys.argv[1], n_ctx=512, n_batch=512, n_threads=1,
          logits_all=True, verbose=False)
for ci, case in enumerate(doc["cases"]):
    m.reset()
    m.eval(case["prompt_tokens"])
    logits = np.array(m.scores[m.n_tokens - 1])
    top = case["steps"][0]["top"]
    (i1, r1), (i2, r2) = top[0], top[1]
    print(f"case {ci}: step 0 margin top1-top2 ({i1} vs {i2}): "
          f"reference {r1 - r2:.3f}, llama.cpp {logits[i1] - logits[i2]:.3f}")
