#!/usr/bin/env python3
"""The cost of a speculative verification step by the tokens it feeds, A/B of
two llama-graph binaries, interleaved (the machine may be shared: compare
ratios, not absolute times):

    python3 benches/probes/spec_step_ab.py BEFORE_BIN AFTER_BIN MODEL \
        [--rounds 3] [--threads 1] [--prompt rename] [--drafter ngram]

Each run is `run --spec-ngram --draft-max 8 --temp 0 -n 128` (or
`--draft-model Q4_1`) on one of `benches/speculative/spec_bench.py`'s prompts
with `LLAMA_GRAPH_SPEC_TRACE=1`; the trace's `fed N ... step T ms` lines give
every step's time by tokens fed (the first step, the prompt, is left out).
Prints per tokens fed the median step time of each binary, after/before,
the number of steps behind each median, and each binary's decode tokens/s.
The drafter adapts to the measured step costs, so the two binaries may feed
different mixes of step sizes; per-size medians stay comparable.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benches" / "speculative"))
import spec_bench  # noqa: E402

STEP = re.compile(r"^spec: pos \d+ fed (\d+) kept \d+ step ([0-9.]+) ms")


def run(binary, model, ids, threads, drafter):
    extra = (["--spec-ngram"] if drafter == "ngram"
             else ["--draft-model", str(spec_bench.variant("Q4_1"))])
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [binary, "run", "-m", model, "--prompt-tokens", ",".join(map(str, ids)),
               "--temp", "0", "-n", "128", "-t", str(threads), "--draft-max", "8",
               "--stats-json", f.name, *extra]
        env = dict(os.environ, LLAMA_GRAPH_SPEC_TRACE="1")
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, check=True)
        tps = json.load(open(f.name))["decode_tokens_per_s"]
    steps = [(int(m.group(1)), float(m.group(2)))
             for m in map(STEP.match, p.stderr.splitlines()) if m]
    return steps[1:], tps


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", default="rename", choices=list(spec_bench.PROMPTS))
    ap.add_argument("--drafter", default="ngram", choices=["ngram", "q4_1"])
    a = ap.parse_args()
    ids = spec_bench.prompt_ids(spec_bench.PROMPTS[a.prompt])
    times = {"before": {}, "after": {}}
    tps = {"before": [], "after": []}
    for _ in range(a.rounds):
        for which, binary in (("before", a.before), ("after", a.after)):
            steps, t = run(binary, a.model, ids, a.threads, a.drafter)
            tps[which].append(t)
            for n, ms in steps:
                times[which].setdefault(n, []).append(ms)
    print(f"{a.prompt}, {a.drafter}, {a.threads} thread(s), {a.rounds} rounds")
    print("fed  before_ms  after_ms  after/before  steps_before  steps_after")
    for n in sorted(set(times["before"]) | set(times["after"])):
        b, f = times["before"].get(n), times["after"].get(n)
        mb = statistics.median(b) if b else float("nan")
        mf = statistics.median(f) if f else float("nan")
        print(f"{n:<4} {mb:9.2f} {mf:9.2f} {mf / mb:13.3f} {len(b or []):13d} {len(f or []):12d}")
    for which in ("before", "after"):
        print(f"{which} decode tokens/s: " + " ".join(f"{t:.1f}" for t in tps[which]))


if __name__ == "__main__":
    main()
