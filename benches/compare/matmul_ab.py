#!/usr/bin/env python3
"""Before/after GFLOP/s of two builds of the `matmul` bench, interleaved.

Runs binary A and binary B of `benches/matmul.rs` alternately (A B, then
B A, ... for --rounds rounds), each with the same arguments, and prints for
every `matmul ...` line the median GFLOP/s of each and the ratio B/A.
Interleaving spreads the load of a shared machine over both binaries; on a
shared machine report the ratios, not the absolute numbers.

Build each binary with a non-incremental release build (unset
CARGO_PROFILE_RELEASE_INCREMENTAL), e.g. `cargo bench --bench matmul --no-run`,
and pass the executable it names:

    python3 benches/compare/matmul_ab.py --a /tmp/matmul-main --b target/release/deps/matmul-HASH \\
        --rounds 5 -- quick nopool
"""

import argparse
import re
import statistics
import subprocess
import sys

LINE = re.compile(r"^(matmul .*?):\s+([0-9.]+) GFLOP/s")


def run(binary, extra):
    out = subprocess.run([binary, *extra], check=True, stdout=subprocess.PIPE, text=True).stdout
    return {m.group(1): float(m.group(2)) for m in map(LINE.match, out.splitlines()) if m}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="the baseline bench binary")
    ap.add_argument("--b", required=True, help="the bench binary measured against it")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("extra", nargs="*", help="arguments of the bench (after --)")
    args = ap.parse_args()
    res = {"a": [], "b": []}
    for i in range(args.rounds):
        for who in ("a", "b") if i % 2 == 0 else ("b", "a"):
            res[who].append(run(getattr(args, who), args.extra))
        print(f"round {i} done", file=sys.stderr, flush=True)
    for key in res["a"][0]:
        a = statistics.median(r[key] for r in res["a"])
        b = statistics.median(r[key] for r in res["b"])
        print(f"{key}: A {a:7.2f} B {b:7.2f} GFLOP/s  B/A {b / a:.3f} (medians of {args.rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
