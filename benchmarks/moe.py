"""A Mixtral-shaped mixture-of-experts layer on one CPU device, against transformers'
``MixtralSparseMoeBlock``.

edatalog's program (``programs/moe_layer.edl``; docs/language.md, section 16.1) routes each
token to its top-K experts with ``argtop=`` and looks the experts' weights up by the route; the
torch backend runs each expert rule as dispatch, one ``torch._grouped_mm``, combine.  In one
process, with the same torch thread count for all, each round calls the transformers block
(with each of its expert kernels: the loop over the experts some token picked, and
``torch._grouped_mm``) and edatalog's executable (a recorded graph, replayed) --calls times
each, in turn.  edatalog must first give the block's result (largest difference relative to the
largest |value| at most 1e-4 in f32) or the script exits 1 without timing.  The table shows
each contender's median over --repeat rounds and the ratio to the faster transformers kernel's
median of the same run.

  .venv/bin/python benchmarks/moe.py                                  # T=512, D=1024, F=2816, X=8, K=2
  .venv/bin/python benchmarks/moe.py --dims T=64,D=128,F=256 --json
  .venv/bin/python benchmarks/moe.py --part model                     # the whole small model

``--part ranks`` runs on 2 gloo ranks (``edl run --nproc 2``, one thread each), at the layer's
dims: the MoE program under the ``expert`` plan (expert parallelism), ``megatron`` (tensor
parallelism of every expert) and ``auto``; the layer with a capacity (``programs/moe_capacity.edl``:
the T tokens as 2 groups, capacity factor 1.25, whose ``expert`` plan dispatches and combines
as an all-to-all) under ``expert``, ``data`` and ``auto``; against the dense program (every
expert computed for every token, the top-K applied as a mask: ``X/K`` times the expert FLOPs)
under ``megatron``, ``data`` and ``auto``; each output must equal its program's reference (edl
run --random 0) to 1e-5.

``--part model`` times a whole small ``MixtralForCausalLM`` (2 layers, 8 experts, top-2, GQA:
hidden 256, 8 heads, 4 key/value heads, intermediate 512, vocabulary 1000; --dims may change
S, the tokens, default 128), saved by ``save_pretrained`` and loaded by ``programs/mixtral.edl``
from that directory: the logits of one forward (transformers with ``use_cache=False``) against
edatalog's executable, which must agree to 1e-4 first.

Times are measured on this machine: close everything else first.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DIMS = {"T": 512, "D": 1024, "F": 2816, "X": 8, "K": 2}
IMPLEMENTATIONS = ("eager", "grouped_mm")  # transformers' experts: a loop over the experts hit, grouped GEMMs

LAYER = ROOT / "programs" / "moe_layer.edl"
CAPACITY = ROOT / "programs" / "moe_capacity.edl"
GROUPS = 2  # the capacity layer's token groups on 2 ranks: one per rank, as GShard has them


DENSE = """
input x[T, D] : f32.
param wg[X, D] : f32.
param w1[X, F, D] : f32.
param w3[X, F, D] : f32.
param w2[X, D, F] : f32.
output y.

router[t, e] += x[t, d] * wg[e, d].
route[t, k:K] argtop= router[t, e].
chosen[t, k:K] top= router[t, e].
m[t] max= chosen[t, k].
p[t, k] = exp(chosen[t, k] - m[t]).
z[t] += p[t, k].
gate[t, e] += where(route[t, k] == e, p[t, k] / z[t], 0.0).
hd1[t, e, f] += x[t, d] * w1[e, f, d].
hd3[t, e, f] += x[t, d] * w3[e, f, d].
ad[t, e, f] = silu(hd1[t, e, f]) * hd3[t, e, f] * gate[t, e].
y[t, d] += ad[t, e, f] * w2[e, d, f].
"""
RANKED = {
    "moe": ("expert", "megatron", "auto"),
    "capacity": ("expert", "data", "auto"),
    "dense": ("megatron", "data", "auto"),
}


def dense_source(dims: dict[str, int]) -> str:
    """The dense program at ``dims``."""
    return "dim " + ", ".join(f"{k} = {v}" for k, v in dims.items()) + ".\n" + DENSE


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--part", choices=("layer", "model", "ranks"), default="layer", help="the MoE layer (default) or a whole model"
    )
    p.add_argument("--dims", default="", help=f"override dims, e.g. T=64,D=128 (default: {DIMS}; model: S=128)")
    p.add_argument("--time-limit", type=float, default=20.0, help="ranks: seconds for each auto plan (default 20)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeat", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument("--calls", type=int, default=2, help="calls per contender per round (default 2)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    dims = dict(DIMS) if args.part != "model" else {"S": 128}
    for item in filter(None, args.dims.split(",")):
        name, value = item.split("=")
        dims[name.strip()] = int(value)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part == "ranks":
        return ranks_part(args, dims)
    contenders, err = (layer_contenders if args.part == "layer" else model_contenders)(dims)
    if err > 1e-4:
        print(f"edatalog differs from transformers: {err:.2e}", file=sys.stderr)
        return 1
    with torch.no_grad():
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.repeat):
            for name, call in contenders.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times[name].append((time.perf_counter() - start) / args.calls * 1e3)
    base = min(statistics.median(times[f"transformers ({impl})"]) for impl in IMPLEMENTATIONS)
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
    what = "MoE layer" if args.part == "layer" else "small MixtralForCausalLM (2 layers, 8 experts, top-2)"
    print(f"{what} {dims}, {report['threads']} threads, torch {torch.__version__}")
    print(f"measured: median of {args.repeat} rounds of {args.calls} calls; ratio to the faster transformers kernel")
    print(f"{'contender':<36} {'median ms':>10} {'min':>9} {'max':>9} {'ratio':>7}")
    for r in rows:
        print(
            f"{r['contender']:<36} {r['median_ms']:>10.1f} {r['min_ms']:>9.1f} {r['max_ms']:>9.1f} {r['ratio']:>7.2f}"
        )
    print(f"edatalog equals transformers to {err:.1e} (relative to its largest |value|)")
    return 0


def ranks_part(args: argparse.Namespace, dims: dict[str, int]) -> int:
    """Each program under each plan on 2 gloo ranks, by ``edl run --nproc 2``: measured and
    predicted times, checked against the reference's output."""
    import numpy as np

    import edatalog

    where = Path(tempfile.mkdtemp(prefix="edl-moe-ranks-"))
    rows = []
    for name, strategies in RANKED.items():
        # Every edl command takes the layer's dims as --dim flags: the plan is made for the
        # program those give.  The capacity layer takes the T tokens as groups of S.
        given = dims
        if name == "capacity":
            given = {"G": GROUPS, "S": dims["T"] // GROUPS, **{k: v for k, v in dims.items() if k != "T"}}
            given["C"] = -(-5 * given["S"] * given["K"] // (4 * given["X"]))  # capacity factor 1.25, rounded up
        flags = [f"--dim={k}={v}" for k, v in given.items()]
        if name == "moe":
            path = LAYER
        elif name == "capacity":
            path = CAPACITY
        else:
            path = where / f"{name}.edl"
            path.write_text(dense_source(dims), encoding="utf-8")
        ref = where / f"{name}.ref.npz"
        _edl("run", str(path), *flags, "--random", "0", "-o", str(ref))
        want = np.load(ref)["y"]
        prog = edatalog.compile(path, dims=given)
        for strategy in strategies:
            plan_path = where / f"{name}.{strategy}.json"
            edatalog.plan(prog, topology="cpux2", strategy=strategy, time_limit=args.time_limit).save(plan_path)
            out = where / f"{name}.{strategy}.npz"
            run = ["run", str(path), *flags, "--plan", str(plan_path), "--backend", "torch", "--nproc", "2"]
            report = json.loads(_edl(*run, "--random", "0", "--repeat", str(args.repeat), "-o", str(out), "--json"))
            got = np.load(out)["y"]
            err = float(np.abs(got - want).max() / np.abs(want).max())
            if err > 1e-5:
                print(f"{name} under {strategy} differs from the reference: {err:.2e}", file=sys.stderr)
                return 1
            rows.append(
                {
                    "program": name,
                    "plan": strategy,
                    "measured_ms": report["measured_ms"],
                    "predicted_ms": report["predicted_ms"],
                    "max_rel_diff": err,
                }
            )
    best_dense = min(r["measured_ms"] for r in rows if r["program"] == "dense")
    for r in rows:
        r["ratio"] = r["measured_ms"] / best_dense
    if args.json:
        print(json.dumps({"dims": dims, "ranks": 2, "rows": rows}, indent=1))
        return 0
    print(f"MoE layer {dims} on 2 gloo ranks (cpux2), 1 thread each; measured: median of {args.repeat} calls")
    print(f"{'program':<9} {'plan':<10} {'measured ms':>12} {'predicted ms':>13} {'vs best dense':>14}")
    for r in rows:
        times = f"{r['measured_ms']:>12.1f} {r['predicted_ms']:>13.1f}"
        print(f"{r['program']:<9} {r['plan']:<10} {times} {r['ratio']:>14.2f}")
    return 0


def _edl(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "edatalog.cli", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"edl {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def layer_contenders(dims: dict[str, int]) -> tuple[dict[str, Callable[[], Any]], float]:
    """transformers' MoE block with each of its expert kernels, and edatalog's program of it; the
    largest difference of their results relative to the largest |value|."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    import edatalog

    torch.manual_seed(0)
    blocks = {}
    for impl in IMPLEMENTATIONS:  # transformers' own expert kernels: the loop, and grouped GEMMs
        cfg = MixtralConfig(
            hidden_size=dims["D"],
            intermediate_size=dims["F"],
            num_local_experts=dims["X"],
            num_experts_per_tok=dims["K"],
        )
        cfg._experts_implementation = impl
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            blocks[impl] = MixtralSparseMoeBlock(cfg).eval()  # type: ignore[no-untyped-call]
    block = _same_random_weights(blocks)
    f = dims["F"]
    gate_up = block.experts.gate_up_proj.detach()
    params = {
        "wg": block.gate.weight.detach(),
        "w1": gate_up[:, :f].contiguous(),
        "w3": gate_up[:, f:].contiguous(),
        "w2": block.experts.down_proj.detach(),
    }
    x = torch.randn(dims["T"], dims["D"])
    exe = edatalog.executable(edatalog.compile(LAYER, dims=dims), None, backend="torch")
    exe.load(params)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = block(x[None])[0]
        for _ in range(3):  # interpreted, recorded, replayed
            got = exe({"x": x})["y"]
    contenders: dict[str, Callable[[], Any]] = {}
    for impl, b in blocks.items():
        contenders[f"transformers ({impl})"] = functools.partial(b, x[None])
    contenders["edatalog (graph)"] = lambda: exe({"x": x})
    return contenders, float((got - want).abs().max() / want.abs().max())


def _same_random_weights(modules: dict[str, Any]) -> Any:
    """The first of ``modules`` with weights ~ N(0, 0.05^2), copied into the others (one
    module per transformers expert kernel, the same weights); that first module."""
    import torch

    first = next(iter(modules.values()))
    for param in first.parameters():
        torch.nn.init.normal_(param, std=0.05)
    for other in modules.values():
        other.load_state_dict(first.state_dict())
    return first


def model_contenders(dims: dict[str, int]) -> tuple[dict[str, Callable[[], Any]], float]:
    """A small MixtralForCausalLM's forward with each expert kernel, and programs/mixtral.edl
    loading its save_pretrained directory."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    import edatalog
    from edatalog.checkpoint import configured
    from edatalog.lang.parser import parse_file

    seq = dims.get("S", 128)
    small: dict[str, Any] = {
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 1000,
    }
    torch.manual_seed(0)
    models = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for impl in IMPLEMENTATIONS:
            cfg = MixtralConfig(**small)
            cfg._experts_implementation = impl
            models[impl] = MixtralForCausalLM(cfg).eval()  # type: ignore[no-untyped-call]
    first = _same_random_weights(models)
    ids = torch.randint(0, small["vocab_size"], (1, seq))
    where = Path(tempfile.mkdtemp(prefix="edl-moe-"))
    first.save_pretrained(where)
    program = ROOT / "programs" / "mixtral.edl"
    found, consts = configured(parse_file(str(program)), where)
    exe = edatalog.executable(edatalog.compile(program, dims={**found, "S": seq}, consts=consts), None, backend="torch")
    exe.load(where)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = first(ids, use_cache=False).logits
        for _ in range(3):  # interpreted, recorded, replayed
            got = exe({"ids": ids})["logits"]
    contenders: dict[str, Callable[[], Any]] = {}
    for impl, m in models.items():
        contenders[f"transformers ({impl})"] = functools.partial(m, ids, use_cache=False)
    contenders["edatalog (graph)"] = lambda: exe({"ids": ids})
    return contenders, float((got - want).abs().max() / want.abs().max())


if __name__ == "__main__":
    sys.exit(main())
