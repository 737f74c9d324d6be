#!/usr/bin/env python3
"""Head-to-head benchmark: llama-graph vs llama.cpp on the same GGUF files.

Run with the venv that setup.sh creates (it has llama-cpp-python, pinned):

    bash benches/compare/setup.sh                      # once: builds llama.cpp
    PY=~/.cache/llama-graph/compare/venv/bin/python
    cargo build --release && cargo build --release --example stream
    $PY benches/compare/compare.py prepare             # model variants
    $PY benches/compare/compare.py run --reps 5 --threads 1,2

`prepare` copies the shipped SmolLM2-135M-Instruct Q4_1 file (Q4_1 layers,
Q8_0 embedding) from the llama-graph cache and makes Q8_0, F16 and F32
variants with llama.cpp's own quantizer (`llama_model_quantize`, through the
bindings). The only source is the Q4_1 file, so the variants are
*requantized*: llama.cpp dequantizes each Q4_1/Q8_0 tensor to f32 and
re-encodes it (allow_requantize). F32 is then the exact dequantized model,
F16 its rounding, Q8_0 a requantization: the speed of each format is what is
measured, not the quality of the original weights.

`run` measures, for every variant and thread count, the two runtimes
interleaved (llama-graph, llama.cpp, llama-graph, llama.cpp, ...), each run a
fresh process that loads the model (load time), warms up with an untimed
16-token prompt and 16 generated tokens, and then runs once timed:
  pp128, pp512  prompt processing: one 128/512-token prompt, tokens/s
  tg128         generation: 128 single-token steps from an empty cache
                (llama-bench's tg test), tokens/s
and reports its peak RSS. Tokens are random ids (no tokenizer, no sampling).
llama-graph runs `llama-graph bench -r 1 -o json`; llama.cpp runs this script's
`llamacpp-worker`, which times llama_decode + llama_synchronize exactly as
llama-bench does.

Peak RSS: llama-graph's is the process's ru_maxrss. llama.cpp's is the worker
process's ru_maxrss minus the Python interpreter's own resident memory
(measured after importing the bindings, before loading the model), plus the
resident pages of llama.cpp's shared libraries at that moment.

Output: a table of medians with ratio = llama-graph / llama.cpp per row
(higher is better for tokens/s, lower for load time and RSS), on stdout and
as JSON (--out, default benches/results/<cpu-class>/compare.json, see
benches/harness.py: this host's latest run only), with the raw samples,
the STREAM-style bandwidth (benches/probes/stream.rs) and the memory-bandwidth
bound of decode (weight bytes read per token / read bandwidth).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import shlex
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "benches"))
import harness  # noqa: E402
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-graph"
MODELS = CACHE / "compare" / "models"
SHIPPED = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
VARIANTS = {
    # name: llama_ftype (None = the shipped file as is)
    "q4_1": None,
    "q8_0": 7,  # LLAMA_FTYPE_MOSTLY_Q8_0
    "f16": 1,  # LLAMA_FTYPE_MOSTLY_F16
    "f32": 0,  # LLAMA_FTYPE_ALL_F32
}
TESTS = [("pp128", 128, 0), ("pp512", 512, 0), ("tg128", 0, 128)]


def model_path(variant):
    return MODELS / f"SmolLM2-135M-Instruct.{variant.upper()}.gguf"


def cmd_prepare(args):
    import llama_cpp as lc

    if not SHIPPED.exists():
        sys.exit(
            f"{SHIPPED} is missing: run `cargo run --release -- run -p hi -n 1` once "
            "(it fetches the default model into the cache)"
        )
    MODELS.mkdir(parents=True, exist_ok=True)
    lc.llama_backend_init()
    for v, ftype in VARIANTS.items():
        out = model_path(v)
        if out.exists() and not args.force:
            print(f"{v}: {out} exists")
            continue
        if ftype is None:
            shutil.copyfile(SHIPPED, out)
            print(f"{v}: copied {SHIPPED}")
            continue
        p = lc.llama_model_quantize_default_params()
        p.ftype = ftype
        p.allow_requantize = True
        p.nthread = 2
        t = time.perf_counter()
        rc = lc.llama_model_quantize(str(SHIPPED).encode(), str(out).encode(), p)
        if rc != 0:
            sys.exit(f"{v}: llama_model_quantize failed with {rc}")
        print(f"{v}: {out} ({out.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - t:.1f} s)")


def _libs_rss_kib():
    """Resident KiB of the llama.cpp/ggml shared libraries mapped in this process."""
    total, cur = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "-" in parts[0]:
                name = parts[-1]
                cur = name if ("libllama" in name or "libggml" in name) else None
            elif cur and line.startswith("Rss:"):
                total += int(parts[1])
    return total


def _rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cmd_llamacpp_worker(args):
    """One llama.cpp measurement in this process; prints JSON on stdout."""
    import ctypes
    import random
    import resource

    import llama_cpp as lc

    # Keep a reference: llama.cpp calls it later, and a collected ctypes callback crashes.
    global _QUIET_LOG
    _QUIET_LOG = lc.llama_log_callback(lambda *a: None)
    lc.llama_log_set(_QUIET_LOG, ctypes.c_void_p())
    lc.llama_backend_init()
    base_rss = _rss_kib() - _libs_rss_kib()
    t0 = time.perf_counter()
    mp = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(args.model.encode(), mp)
    if not model:
        sys.exit("llama.cpp could not load the model")
    cp = lc.llama_context_default_params()
    cp.n_ctx = 512
    cp.n_batch = 512
    cp.n_ubatch = 512
    cp.n_threads = args.threads
    cp.n_threads_batch = args.threads
    cp.no_perf = False
    ctx = lc.llama_init_from_model(model, cp)
    if not ctx:
        sys.exit("llama.cpp could not create a context")
    load_s = time.perf_counter() - t0
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    mem = lc.llama_get_memory(ctx)
    rng = random.Random(1234)

    def run(n_prompt, n_gen):
        lc.llama_memory_clear(mem, True)
        if n_prompt:
            toks = (lc.llama_token * n_prompt)(*[rng.randrange(n_vocab) for _ in range(n_prompt)])
            t = time.perf_counter()
            if lc.llama_decode(ctx, lc.llama_batch_get_one(toks, n_prompt)) != 0:
                sys.exit("llama_decode failed")
            lc.llama_synchronize(ctx)
            return n_prompt / (time.perf_counter() - t)
        tok = (lc.llama_token * 1)()
        ids = [rng.randrange(n_vocab) for _ in range(n_gen)]
        t = time.perf_counter()
        for i in range(n_gen):
            tok[0] = ids[i]
            if lc.llama_decode(ctx, lc.llama_batch_get_one(tok, 1)) != 0:
                sys.exit("llama_decode failed")
            lc.llama_synchronize(ctx)
        return n_gen / (time.perf_counter() - t)

    res = {"load_s": load_s}
    run(16, 0)  # warm-up, as llama-graph's pp16 and tg16 below
    run(0, 16)
    for name, n_prompt, n_gen in TESTS:
        res[name] = run(n_prompt, n_gen)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res["peak_rss_mib"] = (peak - base_rss) / 1024
    res["python_base_rss_mib"] = base_rss / 1024
    print(json.dumps(res))


def cmd_llamacpp_logits(args):
    """llama.cpp's own logits on the committed SmolLM2 prompts vs the float32
    reference (tests/fixtures/smollm2/expected.json), teacher-forced on the
    reference tokens: top-1 agreement and the largest |logit difference| over
    the reference's top-10 tokens of every step. Compare with
    `cargo run --release --example fast_vs_exact`."""
    import ctypes

    import llama_cpp as lc

    global _QUIET_LOG
    _QUIET_LOG = lc.llama_log_callback(lambda *a: None)
    lc.llama_log_set(_QUIET_LOG, ctypes.c_void_p())
    lc.llama_backend_init()
    doc = json.loads((REPO / "tests/fixtures/smollm2/expected.json").read_text())
    model = lc.llama_model_load_from_file(args.model.encode(), lc.llama_model_default_params())
    cp = lc.llama_context_default_params()
    cp.n_ctx = 512
    cp.n_threads = cp.n_threads_batch = args.threads
    ctx = lc.llama_init_from_model(model, cp)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    mem = lc.llama_get_memory(ctx)
    steps = agree = 0
    worst = 0.0
    per_case = []
    for case in doc["cases"]:
        lc.llama_memory_clear(mem, True)
        toks = case["prompt_tokens"]
        gen = case["generated_tokens"]
        arr = (lc.llama_token * len(toks))(*toks)
        lc.llama_decode(ctx, lc.llama_batch_get_one(arr, len(toks)))
        cw = 0.0
        for i in range(len(gen)):
            if i > 0:
                one = (lc.llama_token * 1)(gen[i - 1])
                lc.llama_decode(ctx, lc.llama_batch_get_one(one, 1))
            lp = lc.llama_get_logits_ith(ctx, -1)
            logits = [lp[j] for j in range(n_vocab)]
            top1 = max(range(n_vocab), key=logits.__getitem__)
            steps += 1
            agree += top1 == gen[i]
            for tid, want in case["steps"][i]["top"]:
                cw = max(cw, abs(logits[tid] - want))
        per_case.append(round(cw, 4))
        worst = max(worst, cw)
    print(json.dumps({"model": args.model, "steps": steps, "top1_eq_reference": agree,
                      "max_abs_reference_minus_llamacpp_top10": round(worst, 4), "per_case": per_case}))


def _run_child(argv):
    """Runs argv; returns (stdout, ru_maxrss KiB of that child)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = p.stdout.read()
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({p.returncode}): {err.decode(errors='replace')[-2000:]}")
    return out.decode(), ru.ru_maxrss


def run_llama_graph(binary, model, threads, extra):
    out, maxrss = _run_child(
        [binary, "bench", "-m", str(model), "-t", str(threads), "-p", "16,128,512", "-n", "16,128",
         "-r", "1", "--no-warmup", "-o", "json"] + extra
    )
    rows = json.loads(out)
    res = {r["test"]: r["avg_ts"] for r in rows}
    res["load_s"] = rows[0]["load_s"]
    res["peak_rss_mib"] = maxrss / 1024
    res["model_size"] = rows[0]["model_size"]
    return res


def run_llama_cpp(model, threads):
    out, _ = _run_child(
        [sys.executable, str(Path(__file__).resolve()), "llamacpp-worker", "--model", str(model),
         "--threads", str(threads)]
    )
    return json.loads(out.strip().splitlines()[-1])


def stream_bandwidth(threads):
    r = subprocess.run(["cargo", "run", "-q", "--release", "--example", "stream", "--", "256", ",".join(map(str, threads))],
                       cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        return None
    out = r.stdout
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


METRICS = [("pp128", "t/s"), ("pp512", "t/s"), ("tg128", "t/s"), ("load_s", "s"), ("peak_rss_mib", "MiB")]


def cmd_run(args):
    binary = args.llama_graph or str(REPO / "target" / "release" / "llama-graph")
    threads = [int(t) for t in args.threads.split(",")]
    variants = args.variants.split(",")
    extra = ["--exact"] if args.exact else []
    samples = {}
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for v in variants:
        mp = model_path(v)
        if not mp.exists():
            sys.exit(f"{mp} is missing: run `compare.py prepare` first")
        for t in threads:
            key = f"{v}/t{t}"
            s = samples.setdefault(key, {"llama-graph": [], "llama.cpp": []})
            for r in range(args.warmup_rounds + args.reps):
                a = run_llama_graph(binary, mp, t, extra)
                b = run_llama_cpp(mp, t)
                tag = "warm-up" if r < args.warmup_rounds else f"run {r - args.warmup_rounds + 1}"
                print(f"{key} {tag}: llama-graph tg128 {a['tg128']:.1f} pp512 {a['pp512']:.1f} | "
                      f"llama.cpp tg128 {b['tg128']:.1f} pp512 {b['pp512']:.1f}", file=sys.stderr, flush=True)
                if r >= args.warmup_rounds:
                    s["llama-graph"].append(a)
                    s["llama.cpp"].append(b)
    rows = []
    for key, s in samples.items():
        for m, unit in METRICS:
            lg = statistics.median(x[m] for x in s["llama-graph"])
            lc = statistics.median(x[m] for x in s["llama.cpp"])
            rows.append({"variant": key.split("/")[0], "threads": int(key.split("/t")[1]), "metric": m,
                         "unit": unit, "llama_graph": lg, "llama_cpp": lc,
                         "ratio": lg / lc if lc else None})
    bw = stream_bandwidth(threads)
    bound = []
    if bw:
        for key, s in samples.items():
            size = s["llama-graph"][0]["model_size"]
            t = int(key.split("/t")[1])
            read = next((b["read_gbs"] for b in bw if b["threads"] == t), None)
            if read:
                bound.append({"variant": key.split("/")[0], "threads": t, "weight_bytes_per_token": size,
                              "read_gbs": read, "decode_bound_tps": read * 1e9 / size})
    print(f"\nmedians of {args.reps} interleaved runs per row; ratio = llama-graph / llama.cpp"
          f" (tokens/s: higher is better; load, RSS: lower is better){' [--exact]' if args.exact else ''}")
    print(f"{'variant':8} {'thr':>3} {'metric':13} {'llama-graph':>12} {'llama.cpp':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['variant']:8} {r['threads']:>3} {r['metric']:13} {r['llama_graph']:>12.2f} "
              f"{r['llama_cpp']:>10.2f} {r['ratio']:>6.2f}")
    if bw:
        print("\nSTREAM-style bandwidth (GB/s):", json.dumps(bw))
        for b in bound:
            print(f"decode bound {b['variant']} t{b['threads']}: {b['weight_bytes_per_token'] / 1e6:.1f} MB/token "
                  f"/ {b['read_gbs']:.1f} GB/s = {b['decode_bound_tps']:.0f} tokens/s")
    doc = {"started": started, "reps": args.reps, "exact": args.exact, "rows": rows, "stream": bw,
           "decode_bound": bound, "samples": samples,
           "machine": {"cpu": harness.cpu_name(), "nproc": os.cpu_count()},
           "cpu_class": harness.cpu_class(), "llama_graph": harness.git_rev(),
           "command": "$PY benches/compare/compare.py " + shlex.join(sys.argv[1:])}
    out = Path(args.out) if args.out else harness.result_path("compare")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {out}")


def cmd_table(args):
    """Prints a results JSON (default: this host's) as a markdown table."""
    print("\n".join(table(harness.load("compare", args.results))))


def table(doc):
    """The markdown table of one results JSON, as lines."""
    cells = {}
    for r in doc["rows"]:
        cells[(r["variant"].lower(), r["threads"], r["metric"])] = r
    names = {"q4_1": "Q4_1 (as shipped)", "q8_0": "Q8_0", "f16": "F16", "f32": "F32"}
    lines = [f"CPU: {doc['machine']['cpu']}; medians of {doc['reps']} interleaved runs; tokens/s and peak RSS "
             "in MiB, llama-graph / llama.cpp = ratio (tokens/s: higher is better; RSS: lower is better)", "",
             "| variant | threads | pp128 | pp512 | tg128 | peak RSS |",
             "| --- | --- | --- | --- | --- | --- |"]
    order = list(names)
    keys = sorted({(v, t) for v, t, _ in cells},
                  key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k[0], k[1]))
    for v, t in keys:
        out = []
        for m in ("pp128", "pp512", "tg128", "peak_rss_mib"):
            r = cells.get((v, t, m))
            if r is None:
                out.append("-")
            elif m == "peak_rss_mib":
                out.append(f"{r['llama_graph']:.1f} / {r['llama_cpp']:.1f} = {r['ratio']:.3f}")
            else:
                out.append(f"{r['llama_graph']:.0f} / {r['llama_cpp']:.0f} = {r['ratio']:.2f}")
        lines.append(f"| {names.get(v, v)} | {t} | " + " | ".join(out) + " |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="make the Q4_1/Q8_0/F16/F32 variants")
    p.add_argument("--force", action="store_true")
    p = sub.add_parser("run", help="interleaved measurement")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup-rounds", type=int, default=0,
                   help="discarded interleaved rounds before the measured ones (each run also warms up in-process)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--llama-graph", help="path of the llama-graph binary (default target/release/llama-graph)")
    p.add_argument("--exact", action="store_true", help="llama-graph with exact (f32-activation) quantized matmuls")
    p.add_argument("--out", default="",
                   help="results JSON (default: benches/results/<this host's CPU class>/compare.json)")
    p = sub.add_parser("llamacpp-logits", help="llama.cpp's logits vs the f32 reference fixture")
    p.add_argument("--model", default=str(SHIPPED))
    p.add_argument("--threads", type=int, default=1)
    p = sub.add_parser("table", help="print a results JSON as a markdown table")
    p.add_argument("results", nargs="?", help="default: benches/results/<this host's CPU class>/compare.json")
    p = sub.add_parser("llamacpp-worker", help=argparse.SUPPRESS)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, required=True)
    args = ap.parse_args()
    {"prepare": cmd_prepare, "run": cmd_run, "llamacpp-worker": cmd_llamacpp_worker,
     "llamacpp-logits": cmd_llamacpp_logits, "table": cmd_table}[args.cmd](args)


if __name__ == "__main__":
    main()
