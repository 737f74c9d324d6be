#!/usr/bin/env python3
"""Before/after throughput of two llama-graph binaries, interleaved.

Runs `BIN bench -o json` of binary A and binary B alternately (A B, then
B A, ... for --rounds rounds) on each model, and prints each test's tokens/s
per run and the ratio B/A of the medians. Interleaving spreads the load of a
shared machine over both binaries; report the ratios, not the absolute
numbers, when the machine is shared.

    python3 benches/compare/ab.py --a /path/main/llama-graph --b target/release/llama-graph \
        --model ~/.cache/llama-graph/SmolLM2-135M-Instruct.Q4_1.gguf --rounds 3 -- -t 2 -r 3
"""

import argparse
import json
import statistics
import subprocess
import sys


def run(binary, model, extra):
    out = subprocess.run(
        [binary, "bench", "-m", model, "-o", "json", *extra],
        check=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ).stdout
    return {r["test"]: r["avg_ts"] for r in json.loads(out)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="the baseline binary")
    ap.add_argument("--b", required=True, help="the binary measured against it")
    ap.add_argument("--model", action="append", required=True, help="a model file (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("extra", nargs="*", help="flags passed to `bench` (after --)")
    args = ap.parse_args()
    for model in args.model:
        ts = {"a": [], "b": []}
        for i in range(args.rounds):
            order = ("a", "b") if i % 2 == 0 else ("b", "a")
            for who in order:
                r = run(getattr(args, who), model, args.extra)
                ts[who].append(r)
                print(f"round {i} {who}: " + ", ".join(f"{k} {v:.1f} t/s" for k, v in r.items()), flush=True)
        print(f"# {model}")
        for test in ts["a"][0]:
            a = statistics.median(r[test] for r in ts["a"])
            b = statistics.median(r[test] for r in ts["b"])
            print(f"{test}: A {a:.1f} t/s, B {b:.1f} t/s, B/A {b / a:.3f} (medians of {args.rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
