"""What the benchmark harnesses share: where results live and which CPU class a host is.

Every harness writes the latest run of this host to
`benches/results/<cpu-class>/<harness>.json` (the llama-graph commit is inside
the JSON, under `llama_graph`) and its `table` command reads from there. A new
run replaces the file; older runs live in git history.

A CPU class is the instruction-set level llama-graph's kernels use on the host
(`scalar`, `avx2`, `avx512`, `avx512vnni`, detected as `src/kernels/isa.rs`
does) followed by the CPU's model name in lower case without trademarks and
clock, e.g. `avx2-amd-epyc` or `avx512vnni-intel-xeon`.
"""

import re
import subprocess
from pathlib import Path

BENCHES = Path(__file__).resolve().parent
REPO = BENCHES.parent
RESULTS = BENCHES / "results"


def cpu_name():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def isa_level():
    """The level `Isa::detect` picks (src/kernels/isa.rs), from /proc/cpuinfo's flags."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if not {"avx2", "fma", "f16c"} <= flags:
        return "scalar"
    if not {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx2"
    return "avx512vnni" if "avx512_vnni" in flags else "avx512"


def class_of(isa, cpu):
    """`avx2` and "AMD EPYC 7B13" -> `avx2-amd-epyc-7b13`."""
    name = re.sub(r"\((r|tm)\)", " ", cpu.lower())
    name = re.sub(r"@.*$", " ", name)
    name = re.sub(r"\b(processor|cpu|\d+-core)\b", " ", name)
    slug = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return f"{isa}-{slug}" if slug else isa


def cpu_class():
    return class_of(isa_level(), cpu_name())


def result_path(harness, cls=None):
    """benches/results/<cpu-class>/<harness>.json for this host (or `cls`)."""
    return RESULTS / (cls or cpu_class()) / f"{harness}.json"


def load(harness, path=None):
    """A results JSON: `path`, or this host's latest run of `harness`. Exits
    with a message naming the file and the command to make it when it is
    missing."""
    import json
    import sys
    p = Path(path) if path else result_path(harness)
    if not p.exists():
        sys.exit(f"{p} does not exist: no {harness} run on this CPU class ({cpu_class()}) yet; "
                 f"pass a results file (one of {', '.join(str(x.relative_to(REPO)) for x in sorted(RESULTS.glob('*/' + harness + '.json'))) or 'none'}) "
                 "or make a run with the harness's `run` command")
    return json.loads(p.read_text())


def git_rev(where=REPO):
    """`git describe --always --dirty` of the repository holding `where`
    (default: this checkout)."""
    r = subprocess.run(["git", "-C", str(where), "describe", "--always", "--dirty"],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return r.stdout.strip() or "unknown"


def classes():
    """Every CPU class with at least one result, sorted."""
    if not RESULTS.is_dir():
        return []
    return sorted(p.name for p in RESULTS.iterdir() if p.is_dir() and any(p.glob("*.json")))
