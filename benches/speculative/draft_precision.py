#!/usr/bin/env python3
"""A draft model's precision: two llama-graph binaries (a baseline, e.g. an
earlier build, and this one), interleaved, plain decoding against
`--draft-model` with the shipped Q4_1 as the draft.

    cargo build --release
    cp target/release/llama-graph /tmp/lg-new   # and a baseline build as /tmp/lg-base
    python3 benches/speculative/draft_precision.py --base /tmp/lg-base --lg /tmp/lg-new \\
        --threads 1,2 --rounds 3

Per round, thread count, prompt and target (F16, F32; the files of
`spec_bench.py prepare`), each binary runs, in an order that rotates every
round:

* `plain`: `run --temp 0 -n 128`;
* `draft`: the same with `--draft-model Q4_1 --draft-max 8` (adaptive draft
  length, as `spec_bench.py`'s `lg-draft-q4_1`), checked to print the plain
  run's tokens;
* on the F16 target only, `draft-fixed`: `--draft-fixed` with
  `LLAMA_GRAPH_SPEC_TRACE=1`, whose per-draft lines give the draft model's
  time per guess (`drafted in X ms` over the guesses made; every draft
  step but the first of each draft feeds one token).

Prints, per configuration, the median decode tokens/s of each binary, the
ratio draft/plain of each, the ratio of the two binaries' draft runs, and
the median ms per guess.
"""

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import spec_bench as sb  # noqa: E402


def run_one(lg, target, ids, threads, extra, trace=False):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [str(lg), "run", "-m", str(target), "--prompt-tokens", ",".join(map(str, ids)),
               "--temp", "0", "-n", str(sb.N), "-t", str(threads), "--stats-json", f.name, *extra]
        env = dict(os.environ)
        if trace:
            env["LLAMA_GRAPH_SPEC_TRACE"] = "1"
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {p.stderr[-2000:]}")
        s = json.load(open(f.name))
    out = {"tps": s["decode_tokens_per_s"], "tokens": s["generated"]}
    if trace:
        per_guess = [float(ms) / int(got) for got, ms in
                     re.findall(r"spec: draft k \d+ got (\d+) .*drafted in ([\d.]+) ms", p.stderr)
                     if int(got) > 0]
        out["ms_per_guess"] = statistics.median(per_guess) if per_guess else None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the baseline llama-graph binary")
    ap.add_argument("--lg", required=True, help="the llama-graph binary measured against it")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", default="rename,list")
    ap.add_argument("--targets", default="F16,F32")
    ap.add_argument("--out", help="JSON of every run (default: none)")
    args = ap.parse_args()
    sb.LG = Path(args.lg).resolve()
    bins = {"base": Path(args.base).resolve(), "new": sb.LG}
    draft = ["--draft-model", str(sb.variant("Q4_1")), "--draft-max", str(sb.DRAFT_MAX)]
    ids = {k: sb.prompt_ids(sb.PROMPTS[k]) for k in args.prompts.split(",")}
    results = []
    for rnd in range(args.rounds):
        for th, pk, tname in itertools.product([int(t) for t in args.threads.split(",")], ids,
                                               args.targets.split(",")):
            target = sb.variant(tname)
            cfgs = [(b, c) for b in bins for c in ("plain", "draft")]
            if tname == "F16":
                cfgs += [(b, "draft-fixed") for b in bins]
            r = rnd % len(cfgs)
            cfgs = cfgs[r:] + cfgs[:r]
            for b, c in cfgs:
                extra = {"plain": [], "draft": draft, "draft-fixed": [*draft, "--draft-fixed"]}[c]
                res = run_one(bins[b], target, ids[pk], th, extra, trace=c == "draft-fixed")
                res.update(round=rnd, threads=th, prompt=pk, target=tname, bin=b, config=c)
                results.append(res)
                sb.log(f"round {rnd} t{th} {pk:6} {tname} {b:4} {c:11} {res['tps']:7.1f} t/s"
                       + (f"  {res['ms_per_guess']:.2f} ms/guess" if res.get("ms_per_guess") else ""))
            same = [x for x in results if (x["round"], x["threads"], x["prompt"], x["target"])
                    == (rnd, th, pk, tname)]
            plain = next(x["tokens"] for x in same if x["config"] == "plain" and x["bin"] == "base")
            for x in same:
                if x["tokens"] != plain:
                    raise SystemExit(f"{x['bin']} {x['config']} printed other tokens than the plain run "
                                     f"({pk}, {tname}, {th} threads)")
            if args.out:
                json.dump(results, open(args.out, "w"), indent=1)
    groups = {}
    for x in results:
        groups.setdefault((x["threads"], x["prompt"], x["target"]), {}).setdefault(
            (x["bin"], x["config"]), []).append(x)
    print("| threads | prompt | target | base plain | base draft (x plain) | new plain | new draft (x plain) "
          "| new/base draft | ms/guess base -> new |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k in sorted(groups):
        g = groups[k]
        med = {c: statistics.median(x["tps"] for x in v) for c, v in g.items()}
        ms = {b: g.get((b, "draft-fixed")) for b in bins}
        guess = " -> ".join(f"{statistics.median(x['ms_per_guess'] for x in ms[b]):.2f}" if ms[b] else "-"
                            for b in bins)
        print(f"| {k[0]} | {k[1]} | {k[2]} | {med[('base', 'plain')]:.1f} "
              f"| {med[('base', 'draft')]:.1f} ({med[('base', 'draft')] / med[('base', 'plain')]:.2f}) "
              f"| {med[('new', 'plain')]:.1f} "
              f"| {med[('new', 'draft')]:.1f} ({med[('new', 'draft')] / med[('new', 'plain')]:.2f}) "
              f"| {med[('new', 'draft')] / med[('base', 'draft')]:.2f} | {guess} |")


if __name__ == "__main__":
    main()
