"""A Mixtral-shaped mixture-of-experts layer on one CPU device, against transformers'
``MixtralSparseMoeBlock`` (its loop over the experts that some token picked).

edatalog's program (docs/language.md, section 16.1) routes each token to its top-K experts with
``argtop=`` and looks the experts' weights up by the route; the torch backend runs each expert
rule as dispatch, one ``torch._grouped_mm``, combine.  In one process, with the same torch thread
count for both, each round calls the transformers block and edatalog's executable (a recorded
graph, replayed) --calls times each, alternating.  edatalog must first give the block's result
(largest difference relative to the largest |value| at most 1e-4 in f32) or the script exits 1
without timing.  The table shows each contender's median over --repeat rounds and the ratio to
transformers' median of the same run.

  .venv/bin/python benchmarks/moe.py                                  # T=512, D=1024, F=2816, E=8, K=2
  .venv/bin/python benchmarks/moe.py --dims T=64,D=128,F=256 --json

Times are measured on this machine: close everything else first.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

DIMS = {"T": 512, "D": 1024, "F": 2816, "E": 8, "K": 2}

RULES = """
input x[T, D] : f32.
param wg[E, D] : f32.
param w1[E, F, D] : f32.
param w3[E, F, D] : f32.
param w2[E, D, F] : f32.
output y.

router[t, e] += x[t, d] * wg[e, d].
route[t, k:K] argtop= router[t, e].
chosen[t, k:K] top= router[t, e].
m[t] max= chosen[t, k].
p[t, k] = exp(chosen[t, k] - m[t]).
z[t] += p[t, k].
h1[t, k, f] += x[t, d] * w1[e, f, d] where route[t, k] = e.
h3[t, k, f] += x[t, d] * w3[e, f, d] where route[t, k] = e.
a[t, k, f] = silu(h1[t, k, f]) * h3[t, k, f] * p[t, k] / z[t].
y[t, d] += a[t, k, f] * w2[e, d, f] where route[t, k] = e.
"""


def source(dims: dict[str, int]) -> str:
    return "dim " + ", ".join(f"{k} = {v}" for k, v in dims.items()) + ".\n" + RULES


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", default="", help=f"override dims, e.g. T=64,D=128 (default: {DIMS})")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeat", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument("--calls", type=int, default=2, help="calls per contender per round (default 2)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    import edatalog

    dims = dict(DIMS)
    for item in filter(None, args.dims.split(",")):
        name, value = item.split("=")
        dims[name.strip()] = int(value)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = MixtralConfig(
        hidden_size=dims["D"],
        intermediate_size=dims["F"],
        num_local_experts=dims["E"],
        num_experts_per_tok=dims["K"],
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = MixtralSparseMoeBlock(cfg).eval()  # type: ignore[no-untyped-call]
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.05)
    f = dims["F"]
    gate_up = block.experts.gate_up_proj.detach()
    params = {
        "wg": block.gate.weight.detach(),
        "w1": gate_up[:, :f].contiguous(),
        "w3": gate_up[:, f:].contiguous(),
        "w2": block.experts.down_proj.detach(),
    }
    x = torch.randn(dims["T"], dims["D"])
    exe = edatalog.executable(edatalog.compile_string(source(dims)), None, backend="torch")
    exe.load(params)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = block(x[None])[0]
        for _ in range(3):  # interpreted, recorded, replayed
            got = exe({"x": x})["y"]
        err = float((got - want).abs().max() / want.abs().max())
        if err > 1e-4:
            print(f"edatalog differs from MixtralSparseMoeBlock: {err:.2e}", file=sys.stderr)
            return 1
        contenders: dict[str, Callable[[], Any]] = {
            "transformers MixtralSparseMoeBlock": lambda: block(x[None]),
            "edatalog (graph)": lambda: exe({"x": x}),
        }
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.repeat):
            for name, call in contenders.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times[name].append((time.perf_counter() - start) / args.calls * 1e3)
    base = statistics.median(times["transformers MixtralSparseMoeBlock"])
    rows = [
        {
            "contender": name,
            "median_ms": statistics.median(ts),
            "min_ms": min(ts),
            "max_ms": max(ts),
            "ratio": statistics.median(ts) / base,
        }
        for name, ts in times.items()
    ]
    report = {
        "dims": dims,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "max_rel_diff": err,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(
        f"MoE layer {dims}, {report['threads']} threads, torch {torch.__version__}; measured, median of {args.repeat}"
    )
    print(f"{'contender':<36} {'median ms':>10} {'min':>9} {'max':>9} {'ratio':>7}")
    for r in rows:
        print(
            f"{r['contender']:<36} {r['median_ms']:>10.1f} {r['min_ms']:>9.1f} {r['max_ms']:>9.1f} {r['ratio']:>7.2f}"
        )
    print(f"edatalog equals the block to {err:.1e} (relative to its largest |value|)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
