#!/usr/bin/env python3
"""Replays prompt lookup over a prompt's greedy output, to compare lookup
rules without timing noise.

    python3 benches/speculative/replay_lookup.py [--target F16] [--k 8] [PROMPT ...]

For each spec_bench prompt (default: all), runs `llama-graph run --temp 0`
once for the plain output tokens, then replays n-gram lookup (3 down to 2
tokens, the rule of `src/generate/spec.rs`) over prompt + output with `k`
guesses a step, each step keeping the guesses the output confirms plus one
token. It prints, per rule, the speed-up over plain decoding under a table
of step costs by tokens fed (`COSTS`: SmolLM2-135M F16, 1 thread, from
`LLAMA_GRAPH_SPEC_TRACE` runs on the AVX2 VM), and that of an oracle that
feeds exactly the guesses that will be kept. Rules:

* `whole`: the latest occurrence's whole continuation;
* `agree`: cut where up to 8 earlier occurrences of the n-gram went on
  differently (at least one token) -- what `ngram_continuation` does.

A replay, not a measurement: the real controller also picks `k` from the
measured acceptance (`spec_bench.py` measures that).
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spec_bench as sb  # noqa: E402

# ms per step by tokens fed (index), F16 SmolLM2-135M, 1 thread.
COSTS = [0, 33.5, 34.4, 43.5, 54.5, 64, 74, 85, 96, 104]


def continuation(h, agree):
    for n in (3, 2):
        if n >= len(h):
            continue
        tail = h[len(h) - n:]
        starts = [s + n for s in range(len(h) - n - 1, -1, -1) if h[s:s + n] == tail]
        if not starts:
            continue
        nxt = h[starts[0]:]
        if agree:
            same = len(nxt)
            for s in starts[1:9]:
                m = 0
                while m < len(nxt) and s + m < len(h) and h[s + m] == nxt[m]:
                    m += 1
                same = min(same, m)
            nxt = nxt[:max(same, 1)]
        return nxt
    return []


def replay(prompt, out, k, agree, oracle=False):
    h, done, ms = list(prompt) + out[:1], 1, 0.0
    while done < len(out):
        g = continuation(h, agree)[:k]
        kept = 0
        while kept < len(g) and done + kept < len(out) and g[kept] == out[done + kept]:
            kept += 1
        ms += COSTS[min((kept if oracle else len(g)) + 1, len(COSTS) - 1)]
        take = min(kept + 1, len(out) - done)
        h += out[done:done + take]
        done += take
    return COSTS[1] * (len(out) - 1) / ms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompts", nargs="*", default=list(sb.PROMPTS))
    ap.add_argument("--target", default="F16")
    ap.add_argument("--k", type=int, default=8)
    a = ap.parse_args()
    print("| prompt | whole | agree | oracle |\n|---|---|---|---|")
    for p in a.prompts:
        ids = sb.prompt_ids(sb.PROMPTS[p])
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([str(sb.LG), "run", "-m", str(sb.variant(a.target)), "--prompt-tokens",
                            ",".join(map(str, ids)), "--temp", "0", "-n", str(sb.N), "--stats-json", f.name],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            out = json.load(open(f.name))["generated"]
        print(f"| {p} | {replay(ids, out, a.k, False):.2f} | {replay(ids, out, a.k, True):.2f} "
              f"| {replay(ids, out, a.k, False, oracle=True):.2f} |")


if __name__ == "__main__":
    main()
