"""A 2-d convolution written with affine indices, on one CPU device, against ``F.conv2d``.

    y[b, o, i:H, j:W] += x[b, c, i + p - 1, j + q - 1] * w[o, c, p, q].

In one process, with the same torch thread count for both (--threads, default torch's), each
round calls, in turn, ``torch.nn.functional.conv2d(x, w, padding=1)`` and edatalog's torch
executable of the rule once per --modes ("none": the interpreter; "graph": recorded once and
replayed, the default; "inductor": that graph compiled by inductor).  edatalog must first give
F.conv2d's result (largest difference relative to the largest |value| at most 1e-5) or the
script exits 1 without timing.  The table shows each contender's median over --repeat rounds
and its ratio to F.conv2d's median of the same run.

  .venv/bin/python benchmarks/conv.py                        # B=8, C=32, O=64, 32 x 32, 3 x 3
  .venv/bin/python benchmarks/conv.py --dims B=1,C=64,O=64 --modes graph --json

Times are measured on this machine: close everything else first.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

DIMS = {"B": 8, "C": 32, "O": 64, "H": 32, "W": 32}
MODES = ("none", "graph", "inductor")


def source(dims: dict[str, int]) -> str:
    given = ", ".join(f"{k} = {v}" for k, v in dims.items())
    return (
        f"dim {given}, K = 3.\n"
        "input x[B, C, H, W] : f32.\n"
        "param w[O, C, K, K] : f32.\n"
        "output y.\n"
        "y[b, o, i:H, j:W] += x[b, c, i + p - 1, j + q - 1] * w[o, c, p, q].\n"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", default="", help=f"override dims, e.g. B=1,C=64 (default: {DIMS})")
    p.add_argument("--modes", default="none,graph", help=f"comma-separated, of {', '.join(MODES)} (default none,graph)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeat", type=int, default=30, help="timed rounds (default 30)")
    p.add_argument("--calls", type=int, default=5, help="calls per contender per round (default 5)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    import edatalog

    if args.threads:
        torch.set_num_threads(args.threads)
    dims = dict(DIMS)
    for item in filter(None, args.dims.split(",")):
        key, _, value = item.partition("=")
        dims[key.strip()] = int(value)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        print(f"error: unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    prog = edatalog.compile_string(source(dims))
    values = prog.random_inputs(0)
    x, w = torch.from_numpy(values["x"]), torch.from_numpy(values["w"])
    conv = torch.nn.functional.conv2d
    want = conv(x, w, padding=1)
    contenders: dict[str, Callable[[], Any]] = {"F.conv2d": lambda: conv(x, w, padding=1)}
    compile_s: dict[str, float] = {}
    for mode in modes:
        exe = prog.executable(backend="torch", compile=mode)
        exe.load({"w": w})
        start = time.perf_counter()
        for _ in range(3):  # interpreted, recorded (compiled), replayed
            got = exe({"x": x})["y"]
        compile_s[mode] = time.perf_counter() - start
        error = float((got - want).abs().max() / want.abs().max())
        if error > 1e-5:
            print(f"error: edatalog ({mode}) differs from F.conv2d: {error:.2e} of the largest value", file=sys.stderr)
            return 1
        contenders[f"edatalog {mode}"] = lambda exe=exe: exe({"x": x})
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.repeat):
        for name, call in contenders.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            times[name].append((time.perf_counter() - start) / args.calls)
    base = statistics.median(times["F.conv2d"])
    rows = [
        {"contender": k, "median_ms": statistics.median(v) * 1e3, "ratio": statistics.median(v) / base}
        for k, v in times.items()
    ]
    if args.json:
        report = {
            "dims": dims,
            "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(),
            "rows": rows,
            "first_three_calls_s": compile_s,
        }
        print(json.dumps(report, indent=1))
        return 0
    print(f"conv2d {dims}, 3 x 3, padding 1; {torch.get_num_threads()} threads; measured, median of {args.repeat}")
    print(f"{'contender':<20} {'ms':>9} {'x F.conv2d':>11}")
    for r in rows:
        print(f"{r['contender']:<20} {r['median_ms']:>9.3f} {r['ratio']:>11.2f}")
    for mode, seconds in compile_s.items():
        print(f"edatalog {mode}: first three calls (interpret, record, replay) took {seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
