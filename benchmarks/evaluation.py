"""Evaluation cost against the work: the reference evaluator on programs a new user writes.

Each case runs one program at a base size and at doubled (or larger) sizes, in one process, one
after the other, and reports the measured wall time of ``Program.run`` (the median of
``--repeat`` runs, inputs drawn beforehand), the peak memory numpy allocated during the run
beyond its inputs (``tracemalloc``: numpy reports its buffers to it), the work (FLOPs counted
over the points that exist) and the time ratio to the case's first size.  Every figure here is
*measured* on this machine, not predicted.

  conv       a 1-D convolution written with an equality guard (t == l + k), C = 128 and 256
  slide      a sliding max-pool with a band guard (u >= t, u <= t + 2), B=16 T=512 C=1024
  ln_linear  LayerNorm then a linear layer, S doubling
  causal     causal single-head attention, S doubling (the work grows as S^2)

  .venv/bin/python benchmarks/evaluation.py
  .venv/bin/python benchmarks/evaluation.py --cases conv --repeat 5 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any

import edatalog

CONV = """
dim B = 8, C = 128, O = 128, T = 1024, K = 3, L = T - K + 1.
input x[B, C, T] : f32.
param w[O, C, K] : f32.
conv[b, o, l:L] += x[b, c, t] * w[o, c, k] where t == l + k.
"""

SLIDE = """
dim B = 16, T = 512, C = 1024.
input x[B, T, C] : f32.
slide[b, t:T-2, c] max= x[b, u, c] where u >= t, u <= t + 2.
"""

LN_LINEAR = """
dim B = 1, S = 1024, D = 1024, F = 1024.
input x[B, S, D] : f32.
param g[D] : f32.
param w[F, D] : f32.
output y.
mu[b, s] += x[b, s, d] / D.
xc[b, s, d] = x[b, s, d] - mu[b, s].
var[b, s] += xc[b, s, d] * xc[b, s, d] / D.
xn[b, s, d] = xc[b, s, d] * rsqrt(var[b, s] + 0.00001) * g[d].
y[b, s, f] += xn[b, s, d] * w[f, d].
"""

CAUSAL = """
dim S = 512, E = 64.
input q[S, E] : f32.
input k[S, E] : f32.
input v[S, E] : f32.
output o.
sc[s, t] += q[s, e] * k[t, e] / sqrt(E) where t <= s.
m[s] max= sc[s, t].
p[s, t] = exp(sc[s, t] - m[s]).
l[s] += p[s, t].
o[s, e] += p[s, t] * v[t, e] / l[s].
"""


@dataclass(frozen=True)
class Case:
    name: str
    text: str
    sizes: tuple[dict[str, int], ...]


CASES = (
    Case("conv", CONV, ({"C": 128}, {"C": 256})),
    Case("slide", SLIDE, ({},)),
    Case("ln_linear", LN_LINEAR, ({"S": 1024}, {"S": 2048}, {"S": 4096})),
    Case("causal", CAUSAL, ({"S": 512}, {"S": 1024}, {"S": 2048})),
)


def measure(case: Case, dims: dict[str, int], repeat: int) -> dict[str, Any]:
    prog = edatalog.compile_string(case.text, name=f"{case.name}.edl", dims=dims)
    inputs = prog.random_inputs(0)
    flops = sum(c.flops for c in prog.graph.costs.values())
    prog.run(inputs)  # warm: imports, caches
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        prog.run(inputs)
        times.append(time.perf_counter() - start)
    gc.collect()
    tracemalloc.start()
    prog.run(inputs)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "case": case.name,
        "dims": dims,
        "seconds": statistics.median(times),
        "gflop": flops / 1e9,
        "working_mib": peak / 2**20,
        "inputs_mib": sum(a.nbytes for a in inputs.values()) / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=[c.name for c in CASES], help="cases to run (default: all)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per size; the median is reported")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    rows = []
    for case in CASES:
        if args.cases and case.name not in args.cases:
            continue
        first = None
        for dims in case.sizes:
            row = measure(case, dims, args.repeat)
            first = first or row["seconds"]
            row["ratio"] = row["seconds"] / first
            rows.append(row)
            if not args.json:
                print(f"  {case.name} {dims or ''}: {row['seconds']:.3f} s", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    header = (
        f"{'case':<10} {'dims':<10} {'GFLOP':>8} {'seconds':>8} {'x first':>8} {'working MiB':>12} {'inputs MiB':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        dims = ",".join(f"{k}={v}" for k, v in r["dims"].items()) or "-"
        print(
            f"{r['case']:<10} {dims:<10} {r['gflop']:>8.3f} {r['seconds']:>8.3f} {r['ratio']:>8.2f} "
            f"{r['working_mib']:>12.1f} {r['inputs_mib']:>11.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
