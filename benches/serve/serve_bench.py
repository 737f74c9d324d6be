#!/usr/bin/env python3
"""Serving throughput: `llama-graph serve` against llama.cpp's `llama-server`,
same GGUF file, same threads, -np and context, same prompts, interleaved.

    cargo build --release
    bash tools/llamacpp/build.sh native llama-server        # once (minutes)
    python3 benches/compare/bench.py prepare --python PY    # the 1B-shaped GGUF files
    python3 benches/serve/serve_bench.py run --models q4_1,1b_q4_k_m --clients 1,4,16 --rounds 3
    python3 benches/serve/serve_bench.py table      # this host's latest run

Per round and model, the two servers run back to back in alternating order
(llama-graph first in even rounds). Each is started fresh (`-t T -np P -c C`
on 127.0.0.1), warmed up with one request, then measured at each client
count: N clients at once, each sending its requests one after another
(`--requests-per-client`), every request a streaming chat completion with
`temperature: 0`, `ignore_eos: true` and `max_tokens` (128 for SmolLM2, 64
for the 1B files), so that every answer has exactly that many tokens. The
chat prompts are the fixed list below, client i starting at prompt i.

Measured per client count:
* aggregate generated tokens/s: all completion tokens (the servers' own
  `usage`) over the wall time from the first request sent to the last
  answer complete;
* time to first token: from sending a request to receiving its first
  content chunk (median and 90th percentile over the requests);
* per-stream decode rate: (tokens - 1) / (last chunk - first chunk),
  median over requests.
And for llama-graph, right before and right after its 1-client level (the
server started and idle): `llama-graph run --chat --temp 0 -n M
--ignore-eos` on the first prompt (M tokens, like every streamed answer;
decode tokens/s from `--stats-json`), the single-stream reference. The
1-client stream's decode rate over the mean of those two runs is one
paired ratio per round; the table gives their median and each of them,
since on a shared host the rate drifts between minutes.

The HTTP client is plain asyncio sockets (stdlib only), so that the client
costs both servers the same little CPU. Results: a table, and the JSON in
`benches/results/<cpu-class>/serve.json` (see `benches/harness.py`), which
holds this host's latest run only, with the llama-graph commit it measured.
"""

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
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
LG = REPO / "target" / "release" / "llama-graph"

PROMPTS = [
    "Write a long story about a dragon who learns to bake bread.",
    "Explain how a steam engine works, step by step.",
    "Describe the city of Paris to someone who has never been there.",
    "What are the rules of chess? Explain them in detail.",
    "Write a letter to a friend about your summer holidays.",
    "Explain photosynthesis to a ten-year-old.",
    "List twenty animals and say one thing about each.",
    "Tell me about the history of the printing press.",
    "How do I plant a vegetable garden? Give detailed advice.",
    "Write a poem about the sea, then explain its images.",
    "Describe a day in the life of a lighthouse keeper.",
    "What makes a good cup of coffee? Discuss beans, water and brewing.",
    "Explain the water cycle and why it matters.",
    "Write a short mystery story set on a train.",
    "Compare cats and dogs as pets, point by point.",
    "Describe how bridges are built, from design to opening day.",
]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def model_path(name):
    if name == "q4_1":
        return SHIPPED
    return MODELS / f"{name}.gguf"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_bin():
    out = subprocess.run(["bash", str(REPO / "tools/llamacpp/build.sh"), "native", "llama-server"],
                         check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip()) / "llama-server"


class Server:
    """A server process on 127.0.0.1:port, killed on exit."""

    def __init__(self, who, model, args, lc_bin, lc_flags=()):
        self.port = free_port()
        common = ["-m", str(model), "-t", str(args.threads), "-np", str(args.parallel),
                  "-c", str(args.ctx), "--host", "127.0.0.1", "--port", str(self.port)]
        if who == "lg":
            cmd = [str(LG), "serve", *common]
        else:
            cmd = [str(lc_bin), *common, *lc_flags]
        self.log = tempfile.TemporaryFile()
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{who} exited {self.p.returncode}: {self.tail()}")
            try:
                status, _ = asyncio.run(request(self.port, "GET", "/health", None))
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{who} never became ready: {self.tail()}")

    def tail(self):
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


async def read_head(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return status, headers


async def body_chunks(reader, headers):
    """The body's bytes as they arrive (chunked or delimited by close)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data


async def request(port, method, path, body):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode() if body is not None else b""
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                 + payload)
    await writer.drain()
    status, headers = await read_head(reader)
    data = b"".join([c async for c in body_chunks(reader, headers)])
    writer.close()
    return status, data


async def stream_chat(port, prompt, max_tokens):
    """One streaming chat completion; its timings and token count."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    payload = json.dumps(body).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                 + payload)
    await writer.drain()
    status, headers = await read_head(reader)
    if status != 200:
        data = b"".join([c async for c in body_chunks(reader, headers)])
        raise RuntimeError(f"HTTP {status}: {data[:300]!r}")
    first = last = None
    chunks, usage, buf = 0, None, b""
    async for data in body_chunks(reader, headers):
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            line = event.strip()
            if not line.startswith(b"data:"):
                continue
            line = line[5:].strip()
            if line == b"[DONE]":
                continue
            v = json.loads(line)
            if v.get("usage"):
                usage = v["usage"]
            for ch in v.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
    writer.close()
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else chunks
    return {"start": t0, "first": first, "last": last, "end": end, "tokens": tokens,
            "chunks": chunks, "prompt_tokens": usage["prompt_tokens"] if usage else None}


async def level(port, clients, per_client, max_tokens):
    async def client(i):
        out = []
        for r in range(per_client):
            out.append(await stream_chat(port, PROMPTS[(i + r * clients) % len(PROMPTS)], max_tokens))
        return out

    results = [x for xs in await asyncio.gather(*(client(i) for i in range(clients))) for x in xs]
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    ttft = sorted(r["first"] - r["start"] for r in results)
    decode = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in results
              if r["last"] and r["last"] > r["first"]]
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_median_s": statistics.median(ttft),
            "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "stream_decode_median": statistics.median(decode) if decode else None,
            "short_answers": sum(r["tokens"] != max_tokens for r in results)}


def run_single(model, args, max_tokens):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([str(LG), "run", "-m", str(model), "-t", str(args.threads), "-c", str(args.ctx),
                        "--chat", "--temp", "0", "-n", str(max_tokens), "--ignore-eos", "-p", PROMPTS[0],
                        "--stats-json", f.name], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        s = json.loads(Path(f.name).read_text())
    if s["generated_tokens"] != max_tokens:
        raise RuntimeError(f"run generated {s['generated_tokens']} tokens, not {max_tokens}")
    return {"decode_tokens_per_s": s["decode_tokens_per_s"], "generated_tokens": s["generated_tokens"]}


def start_server(who, path, args, lc_bin, lc_flags):
    """A started and warmed-up server, and the llama-server flags in use.

    llama.cpp's native build uses AMX tiles for these weight types where the
    CPU lists AMX; on VMs that trap AMX the process dies (SIGILL) on its first
    decode. Without repacking (no extra buffer types) it runs: that is tried
    once, and the table says so."""
    try:
        srv = Server(who, path, args, lc_bin, lc_flags)
        asyncio.run(stream_chat(srv.port, PROMPTS[0], 8))
        return srv, lc_flags
    except (OSError, asyncio.IncompleteReadError, RuntimeError) as e:
        if who != "lc" or lc_flags:
            raise
        log(f"llama-server failed ({str(e).splitlines()[0]}); retrying with --no-repack")
        lc_flags = ["--no-repack"]
        srv = Server(who, path, args, lc_bin, lc_flags)
        asyncio.run(stream_chat(srv.port, PROMPTS[0], 8))
        return srv, lc_flags


def run(args):
    models = args.models.split(",")
    clients = [int(c) for c in args.clients.split(",")]
    servers = args.servers.split(",")
    lc_bin = None
    if "lc" in servers:
        lc_bin = Path(args.llama_server) if args.llama_server else llama_server_bin()
    lc_flags = args.lc_flags.split() if args.lc_flags else []
    samples = {}
    for rnd in range(args.rounds):
        for m in models:
            path = model_path(m)
            if not path.exists():
                sys.exit(f"{path} is missing: run benches/compare/bench.py prepare (see this script's help)")
            max_tokens = args.max_tokens or (64 if m.startswith("1b_") else 128)
            order = [w for w in (["lg", "lc"] if rnd % 2 == 0 else ["lc", "lg"]) if w in servers]
            for who in order:
                srv, lc_flags = start_server(who, path, args, lc_bin, lc_flags)
                try:
                    for c in clients:
                        paired = who == "lg" and c == 1
                        if paired:
                            before = run_single(path, args, max_tokens)
                        r = asyncio.run(level(srv.port, c, args.requests_per_client, max_tokens))
                        samples.setdefault(f"{m}|{who}|{c}", []).append(r)
                        if paired:
                            after = run_single(path, args, max_tokens)
                            pair = {"stream_decode": r["stream_decode_median"],
                                    "run_before": before["decode_tokens_per_s"],
                                    "run_after": after["decode_tokens_per_s"]}
                            pair["ratio"] = pair["stream_decode"] / statistics.mean(
                                [pair["run_before"], pair["run_after"]])
                            samples.setdefault(f"{m}|pair", []).append(pair)
                            samples.setdefault(f"{m}|run", []).extend([before, after])
                            log(f"round {rnd} {m} run before/after the 1-client stream: "
                                f"{pair['run_before']:.1f} / {pair['run_after']:.1f} tok/s decode, "
                                f"stream {pair['stream_decode']:.1f} = {pair['ratio']:.2f}")
                        log(f"round {rnd} {m} {who} {c} clients: {r['tokens_per_s']:.1f} tok/s, "
                            f"TTFT {r['ttft_median_s'] * 1000:.0f} ms, stream {r['stream_decode_median'] or 0:.1f} tok/s"
                            + (f", {r['short_answers']} short answers" if r["short_answers"] else ""))
                finally:
                    srv.stop()
            if "lg" in servers and 1 not in clients:
                s = run_single(path, args, max_tokens)
                samples.setdefault(f"{m}|run", []).append(s)
                log(f"round {rnd} {m} run: {s['decode_tokens_per_s']:.1f} tok/s decode")
    res = {"llama_server_extra_flags": lc_flags, "rounds": args.rounds, "threads": args.threads, "parallel": args.parallel, "ctx": args.ctx,
           "requests_per_client": args.requests_per_client, "cpu": harness.cpu_name(),
           "cpu_class": harness.cpu_class(), "llama_graph": harness.git_rev(),
           "command": "python3 benches/serve/serve_bench.py " + shlex.join(sys.argv[1:]),
           "models": models, "clients": clients, "samples": samples}
    out = Path(args.out) if args.out else harness.result_path("serve")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print("\n".join(table(res)))


def med(xs, key):
    return statistics.median(x[key] for x in xs)


def table(res):
    """The markdown table of one results JSON, as lines."""
    s = res["samples"]
    extra = " ".join(res.get("llama_server_extra_flags") or [])
    lines = [f"CPU: {res['cpu']}; {res['threads']} threads, -np {res['parallel']}, -c {res['ctx']}"
             + (f" (llama-server {extra})" if extra else "") + "; "
             f"medians of {res['rounds']} interleaved rounds; llama-graph / llama-server = ratio", "",
             "| model | clients | generated tokens/s | vs our 1 client | TTFT median ms | per-stream tokens/s |",
             "|---|---|---|---|---|---|"]
    for m in res["models"]:
        one = s.get(f"{m}|lg|1")
        for c in res["clients"]:
            lg, lc = s.get(f"{m}|lg|{c}"), s.get(f"{m}|lc|{c}")
            if not lg:
                continue
            if not lc:
                lc = lg  # one server measured: ratios of 1
            a, b = med(lg, "tokens_per_s"), med(lc, "tokens_per_s")
            vs1 = f"{a / med(one, 'tokens_per_s'):.2f}x" if one else "-"
            ta, tb = med(lg, "ttft_median_s") * 1000, med(lc, "ttft_median_s") * 1000
            da = statistics.median(x["stream_decode_median"] for x in lg)
            db = statistics.median(x["stream_decode_median"] for x in lc)
            lines.append(f"| {m} | {c} | {a:.1f} / {b:.1f} = **{a / b:.2f}** | {vs1} | "
                  f"{ta:.0f} / {tb:.0f} | {da:.1f} / {db:.1f} |")
        pairs = s.get(f"{m}|pair")
        if pairs:
            ratios = sorted(p["ratio"] for p in pairs)
            r = statistics.median(statistics.mean([p["run_before"], p["run_after"]]) for p in pairs)
            d = statistics.median(p["stream_decode"] for p in pairs)
            lines.append(f"| {m} | `run` | decode {r:.1f} tokens/s; 1-client stream decode {d:.1f}; "
                  f"stream / `run` paired per round: median {statistics.median(ratios):.2f} "
                  f"({', '.join(f'{x:.2f}' for x in ratios)}) | | | |")
            continue
        runs = s.get(f"{m}|run")
        if runs and one:
            r = med(runs, "decode_tokens_per_s")
            d = statistics.median(x["stream_decode_median"] for x in one)
            lines.append(f"| {m} | `run` | decode {r:.1f} tokens/s; 1-client stream decode {d:.1f} = "
                         f"{d / r:.2f} of `run` | | | |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--models", default="q4_1,1b_q4_k_m",
                   help="q4_1 (shipped SmolLM2) or variants in ~/.cache/llama-graph/compare/models")
    r.add_argument("--clients", default="1,4,16")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--parallel", type=int, default=16, help="-np for both servers")
    r.add_argument("--ctx", type=int, default=4096, help="-c for both servers (the total KV)")
    r.add_argument("--requests-per-client", type=int, default=2)
    r.add_argument("--max-tokens", type=int, default=0, help="default: 128, 64 for the 1B files")
    r.add_argument("--llama-server", default="",
                   help="the llama-server binary (default: tools/llamacpp/build.sh native llama-server)")
    r.add_argument("--lc-flags", default="", help="extra llama-server flags, e.g. --no-repack")
    r.add_argument("--servers", default="lg,lc", help="lg (llama-graph), lc (llama-server) or both")
    r.add_argument("--out", default="",
                   help="results JSON (default: benches/results/<this host's CPU class>/serve.json)")
    t = sub.add_parser("table", help="print a results JSON as a markdown table")
    t.add_argument("json", nargs="?", help="default: benches/results/<this host's CPU class>/serve.json")
    a = ap.parse_args()
    if a.cmd == "run":
        run(a)
    else:
        print("\n".join(table(harness.load("serve", a.json))))


if __name__ == "__main__":
    main()
