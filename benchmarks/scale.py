"""Solve time against device count: a 70B-shaped block and a whole 80-layer 70B model planned by
``edl plan`` on nodes of 8 H100s, from one node to 64.

Each case runs the ``edl plan`` command a user would, in its own process, and reads what it
prints: the predicted times of auto and of the best baseline it compares with (on several nodes
the fastest of Megatron inside each node with data parallelism across, with and without sequence
parallelism, and for the model pipeline stages across the nodes too), the ratio, the peak
memory, how the solve nested, and for the model on several nodes the fastest pipeline
(``edatalog.pipelined``) with its shape.  ``wall s`` is the command's **measured** wall time
(``--time-limit`` is meant to bound it), ``RSS`` its measured peak resident memory; every ms
figure is **predicted** by the cost model (no GPU is used).

  .venv/bin/python benchmarks/scale.py                          # every case, a table
  .venv/bin/python benchmarks/scale.py --gpus 16,64 --what block  # some of them
  .venv/bin/python benchmarks/scale.py --json
  .venv/bin/python benchmarks/scale.py --small --gpus 8,16 --time-limit 3   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EDL = Path(sys.executable).parent / "edl"
# LLaMA-3-70B (Meta's config.json): hidden 8192, 64 heads sharing 8 key/value heads, FFN 28672,
# 80 layers, vocabulary 128256.  S=4096, B=8, bf16: the block of issue 20.
DIMS = {"D": 8192, "H": 64, "KVH": 8, "F": 28672, "S": 4096, "B": 8}
MODEL_DIMS = {**DIMS, "L": 80, "V": 128256}
SMALL = {"D": 64, "H": 4, "KVH": 2, "F": 128, "S": 16, "B": 4}  # --small: a quick check of the script
SMALL_MODEL = {**SMALL, "L": 2, "V": 64}
GPUS = (8, 16, 64, 256, 512)
# --time-limit per machine: the 60 s up to 64 GPUs, 300 s beyond.
LIMITS = {8: 60, 16: 60, 64: 60, 256: 300, 512: 300}


@dataclass
class Row:
    what: str  # "block" or "model"
    gpus: int
    machine: str
    time_limit: float
    wall_s: float  # measured
    rss_mb: float  # measured
    auto_ms: float | None  # predicted
    baseline: str
    baseline_ms: float | None  # predicted
    ratio: float | None
    peak: str  # predicted peak memory per device (the model: the composed bound)
    nested: str
    origin: str
    error: str = ""
    pipeline: str = ""  # the model on several nodes: the fastest pipeline baseline, predicted ms and shape


def machine(gpus: int) -> str:
    return "h100x8" if gpus == 8 else f"h100x8x{gpus // 8}"


def run(what: str, gpus: int, small: bool = False, time_limit: float | None = None) -> Row:
    program = ROOT / "programs" / ("llama_block.edl" if what == "block" else "llama.edl")
    if small:
        dims = SMALL if what == "block" else SMALL_MODEL
    else:
        dims = DIMS if what == "block" else MODEL_DIMS
    limit = time_limit if time_limit is not None else LIMITS[gpus]
    cmd = [str(EDL), "plan", str(program), "--dtype", "bf16", "-t", machine(gpus), "--time-limit", str(limit)]
    cmd += [f"--dim={k}={v}" for k, v in dims.items()]
    with tempfile.TemporaryFile("w+") as log:
        began = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak memory, as it ends
        wall = time.monotonic() - began
        log.seek(0)
        out = log.read()
    row = Row(what, gpus, machine(gpus), limit, wall, usage.ru_maxrss / 1024, None, "", None, None, "", "", "")
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        said = [ln.strip() for ln in out.splitlines() if ln.startswith("error:")]
        row.error = (said[-1][:120] if said else out.strip().splitlines()[-1]) if out.strip() else f"exit {code}"
        return row
    return _parse(out, row)


def _parse(out: str, row: Row) -> Row:
    lines = out.splitlines()
    for line in lines:
        cells = line.split()
        if cells[:1] == ["auto"] and len(cells) >= 2 and row.auto_ms is None:
            row.auto_ms = float(cells[1])
            if len(cells) >= 5:  # plan, predicted ms, moved, peak memory, solve s
                row.peak = cells[3]
        elif m := re.match(r"auto / (\S+): ([0-9.]+)", line):
            row.baseline, row.ratio = m.group(1), float(m.group(2))
        elif line.startswith("nested: "):
            row.nested = line.removeprefix("nested: ").split(";")[0]
        elif line.startswith("origin: "):
            row.origin = line.removeprefix("origin: ")
        elif m := re.search(r"predicted ([0-9.]+) ms on \S+: a layer", line):
            row.auto_ms = float(m.group(1))
        if m := re.search(r"peak memory at most (\S+) per device", line):
            row.peak = m.group(1)
    pipes = [ln.split() for ln in lines if ln.split()[:1] in (["megatron-pp"], ["megatron-sp-pp"])]
    if pipes:
        fastest = min(pipes, key=lambda cells: float(cells[1]))
        row.pipeline = f"{fastest[1]} ({fastest[0]}: {' '.join(fastest[3:])})"
    if row.baseline:
        base = next((ln.split() for ln in lines if ln.split()[:1] == [row.baseline]), None)
        if base is not None and len(base) >= 2:
            row.baseline_ms = float(base[1])
    return row


def table(rows: list[Row]) -> str:
    head = [
        "what",
        "GPUs",
        "limit s",
        "wall s",
        "RSS",
        "auto ms",
        "best baseline ms",
        "auto/best",
        "peak",
        "nested",
        "best pipeline ms",
    ]
    body = []
    for r in rows:
        if r.error:
            body.append([r.what, str(r.gpus), f"{r.time_limit:g}", f"{r.wall_s:.1f}", f"{r.rss_mb:.0f}MB"])
            body[-1].append(r.error if len(r.error) <= 48 else r.error[:45] + "...")
            continue
        base = f"{r.baseline_ms:.4g} ({r.baseline})" if r.baseline_ms is not None else "-"
        body.append(
            [
                r.what,
                str(r.gpus),
                f"{r.time_limit:g}",
                f"{r.wall_s:.1f}",
                f"{r.rss_mb:.0f}MB",
                f"{r.auto_ms:.4g}" if r.auto_ms is not None else "-",
                base,
                f"{r.ratio:.3f}" if r.ratio is not None else "-",
                r.peak or "-",
                r.nested or "-",
                r.pipeline or "-",
            ]
        )
    widths = [max(len(x[k]) for x in [head, *body] if k < len(x)) for k in range(len(head))]
    fmt = [" ".join(c.ljust(w) for c, w in zip(x, widths, strict=False)).rstrip() for x in [head, *body]]
    return "\n".join([fmt[0], " ".join("-" * w for w in widths), *fmt[1:]])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default=",".join(map(str, GPUS)), help="device counts, multiples of 8")
    parser.add_argument("--what", choices=("block", "model", "both"), default="both")
    parser.add_argument("--json", action="store_true", help="one JSON object per case instead of a table")
    parser.add_argument("--small", action="store_true", help="tiny dims (a check of the script, not a benchmark)")
    parser.add_argument(
        "--time-limit", type=float, help="--time-limit for every case (default: 60 s to 64 GPUs, then 300)"
    )
    args = parser.parse_args(argv)
    args.gpu_counts = [int(g) for g in args.gpus.split(",")]
    if any(g % 8 or g not in LIMITS for g in args.gpu_counts):
        parser.error(f"--gpus takes some of {','.join(map(str, GPUS))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpus = args.gpu_counts
    whats = ("block", "model") if args.what == "both" else (args.what,)
    rows = []
    for what in whats:
        for g in gpus:
            print(f"planning the {what} on {g} GPUs ...", file=sys.stderr, flush=True)
            rows.append(run(what, g, args.small, args.time_limit))
            if args.json:
                print(json.dumps(asdict(rows[-1])), flush=True)
    if not args.json:
        print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
