"""One LLaMA block on one device: edatalog's torch backend against transformers' layer.

In one process, on one torch device (--device: the CPU by default, or a CUDA GPU), with the same
torch thread count for both (--threads, default torch's), each case times one LLaMA-shaped
decoder block (default D=1024, H=16, F=2816, S=512, B=1) run by:

  transformers  LlamaDecoderLayer (sdpa attention) in the case's dtype, under torch.no_grad()
  edatalog      programs/llama_block.edl compiled with the case's dtype and run by
                edatalog.executable(prog, backend="torch", device=DEVICE, compile=MODE) (no plan:
                the one-device program, through the kernels and fusions every plan runs through),
                once per --modes: "none" (the interpreter, op by op), "graph" (traced once into a
                graph of torch calls, replayed: the default) and "inductor" (that graph compiled
                by torch.compile's inductor; its compile time is printed, not timed) and, on a
                GPU, "cudagraph" (the graph captured once as a CUDA graph and replayed)

On a CPU, f32 cases whose block has a GEMM large enough for oneDNN (as edatalog's torch runtime
decides: benchmarks/onednn_gemms.py) also time "transformers+onednn": the same layer with
ATen's f32 GEMMs routed to oneDNN by the same rule, since a baseline gets every trick edatalog
gets; "transformers" is the layer as it ships (MKL's sgemm).  Likewise bf16 cases whose
attention edatalog runs as blocks of GEMMs (edatalog.backend.kernels.attention.gemm_attention,
from 256 query rows on a CPU) also time "transformers+gemm-attn": the layer with that same
function as its attention (registered with transformers' AttentionInterface).  The "/ fair"
column divides by that baseline.

Cases: f32 with as many key/value heads as query heads (MHA), f32 with a quarter as many (GQA:
KVH=4 of H=16), and the same two in bf16.  Both contenders take the same weights (made once from --seed),
the same input in the case's dtype (transformers also gets its rotary cos and sin made outside
the timed call, as its model does once for all layers; edatalog makes its tables on the first
call and keeps them), and must first reproduce the f32 single-process transformers layer with
eager attention: the largest error relative to the largest |reference| at most 1e-4 in f32 and
3e-2 in bf16.  A contender that fails is not timed and the script exits 1.

Timing: --warmup calls each, then --repeat rounds, each round calling both in turn (drift in the
machine's load hits both alike); the table shows medians.  On a GPU each timed call starts and
ends with a device synchronization, so a time is the call's whole latency, kernels included.
Then, on the CPU, edatalog's share of the time by kernel class, from one recorded call:
contractions (sums of products: matmuls), reductions, elementwise rules, fused attention
(scaled_dot_product_attention), and the rest (loads, frees).  Classes come from each rule's
structure, never from its name.

  .venv/bin/python benchmarks/block_kernels.py                          # every case
  .venv/bin/python benchmarks/block_kernels.py --cases f32-mha --repeat 5
  .venv/bin/python benchmarks/block_kernels.py --dims D=256,F=704,S=128 --json
  python benchmarks/block_kernels.py --device cuda --cases bf16-mha --modes graph,cudagraph \
      --dims D=4096,H=32,KVH=32,F=11008,S=2048                       # a 7B block on a GPU

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import llama_weights as lw  # noqa: E402
import onednn_gemms  # noqa: E402

MODES = ("none", "graph", "inductor", "cudagraph")
CASES = {
    "f32-mha": ("f32", False),
    "f32-gqa": ("f32", True),
    "bf16-mha": ("bf16", False),
    "bf16-gqa": ("bf16", True),
}  # dtype, grouped
TOLERANCE = {"f32": 1e-4, "bf16": 3e-2}
FAIR_BASELINES = ("transformers+onednn", "transformers+gemm-attn")  # transformers given edatalog's kernels


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time one LLaMA block on one device: edatalog's torch backend against transformers.",
        epilog="example: .venv/bin/python benchmarks/block_kernels.py --cases f32-mha,bf16-mha --repeat 10",
    )
    p.add_argument("--dims", default="", help=f"override dims, e.g. D=256,F=704,S=128 (default: {lw.BlockDims()})")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--device", default="cpu", help="the torch device of both contenders (default cpu; e.g. cuda)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    p.add_argument("--repeat", type=int, default=15, help="timed rounds (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls of each first (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the input")
    p.add_argument(
        "--modes",
        default="graph,inductor",
        help="edatalog's compile modes to time, comma-separated, of none, graph, inductor, cudagraph (GPU only) "
        "(default graph,inductor)",
    )
    p.add_argument("--json", action="store_true", help="print every number as JSON instead of tables")
    args = p.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c and c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad or not args.modes:
        p.error(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(MODES)}")
    return args


@dataclass
class Row:
    case: str
    contender: str
    ms: float
    error: float
    ok: bool


def kernel_class(node: Any) -> str:
    """What kind of kernel a rule is, by its structure: a sum of products over aggregated
    indices is a contraction; another aggregation a reduction; the rest elementwise."""
    if node.agg_indices and node.aggop in ("+=",) and len(node.inputs) >= 2:
        return "contraction"
    if node.agg_indices:
        return "reduction"
    return "elementwise"


def run_case(name: str, args: argparse.Namespace, log: Callable[[str], None]) -> tuple[list[Row], dict[str, float]]:
    import torch

    import edatalog

    dtype, grouped = CASES[name]
    dims = lw.BlockDims().with_text(args.dims) if args.dims else lw.BlockDims()
    dims = dims.with_text(f"KVH={max(1, dims.H // 4) if grouped else dims.H}")
    consts = lw.program_consts(dims)
    dev = torch.device(args.device)
    weights = {k: w.to(dev) for k, w in lw.make_weights(dims, args.seed).items()}
    x = lw.make_input(dims, args.seed).to(dev)
    cos, sin = (t.to(dev) for t in lw.rope(dims, consts))
    want = lw.reference(lw.hf_layer(dims, consts, weights, attn_implementation="eager"), x, cos, sin)
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    layer = lw.hf_layer(dims, consts, weights, attn_implementation="sdpa").to(tdtype)
    xd, cosd, sind = x.to(tdtype), cos.to(tdtype), sin.to(tdtype)

    hf = _layer_caller(layer, xd, cosd, sind)
    prog = edatalog.compile(lw.PROGRAM, dims=dims.edl_dims(), dtype=dtype)
    contenders: dict[str, Callable[[], Any]] = {"transformers": hf}
    routing = None
    if gemm_attention_served(xd, dims):
        fair = lw.hf_layer(dims, consts, weights, attn_implementation=register_gemm_attention()).to(tdtype)
        contenders["transformers+gemm-attn"] = _layer_caller(fair, xd, cosd, sind)
    if dtype == "f32" and dev.type == "cpu" and onednn_gemms.any_routed(dims.B * dims.S, dims.D, dims.F):
        # The baseline given edatalog's f32 GEMMs too, where the block has any that large.
        routing = onednn_gemms.route()
        contenders["transformers"] = _switched(routing, False, hf)
        contenders["transformers+onednn"] = _switched(routing, True, hf)
    executables = {}
    for mode in args.modes.split(","):
        exe = edatalog.executable(prog, backend="torch", device=args.device, compile=mode)
        exe.load(dict(weights))
        executables[mode] = exe
        call = _caller(exe, xd)
        contenders[f"edatalog/{mode}"] = call if routing is None else _switched(routing, False, call)
    rows: dict[str, Row] = {}
    for who, call in contenders.items():
        call()  # the first call of a compiled executable runs the interpreter; the second compiles
        start = time.perf_counter()
        got = call().float()
        if who.startswith("edatalog/") and who != "edatalog/none":
            log(f"{name} {who}: compiled in {time.perf_counter() - start:.1f} s")
        err = float((got - want).abs().max() / want.abs().max())
        rows[who] = Row(name, who, float("nan"), err, err <= TOLERANCE[dtype])
        log(f"{name} {who}: max error {err:.2e} of max |y|: {'ok' if rows[who].ok else 'FAILED'}")
    ready = {who: call for who, call in contenders.items() if rows[who].ok}
    for _ in range(args.warmup):
        for call in ready.values():
            call()
    times: dict[str, list[float]] = {who: [] for who in ready}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(args.repeat):
        for who, call in ready.items():
            sync()
            start = time.perf_counter()
            call()
            sync()
            times[who].append(time.perf_counter() - start)
    for who, ts in times.items():
        rows[who].ms = statistics.median(ts) * 1e3
    if dev.type != "cpu":
        return list(rows.values()), {}  # the interpreter's per-op times would be launch times only
    exe = next(iter(executables.values()))
    exe.run({"x": xd}, record=True)  # per-op times: the interpreter's
    shares: dict[str, float] = {}
    for _, label, begin, end in exe.last_times:
        rule = label.split("#")[0]
        if label.startswith("attention"):
            kind = "fused attention"
        elif rule in {n.name for n in prog.graph.nodes}:
            kind = kernel_class(prog.graph.node(rule))
        else:
            kind = "other"
        shares[kind] = shares.get(kind, 0.0) + (end - begin) * 1e3
    return list(rows.values()), shares


def _layer_caller(layer: Any, x: Any, cos: Any, sin: Any) -> Callable[[], Any]:
    import torch

    def call() -> Any:
        with torch.no_grad():
            out = layer(x, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out

    return call


def gemm_attention_served(x: Any, dims: Any) -> bool:
    """Whether edatalog's torch runtime runs this block's attention as blocks of GEMMs."""
    import torch

    from edatalog.backend.kernels.attention import gemm_attention_takes

    probe = torch.empty(dims.B, dims.H, dims.S, 1, dtype=x.dtype, device=x.device)
    return gemm_attention_takes(probe, probe, True)


GEMM_ATTENTION = "edatalog_gemm"


def register_gemm_attention() -> str:
    """Register edatalog's GEMM attention with transformers under :data:`GEMM_ATTENTION`, as an
    ``attn_implementation`` a config can name, with sdpa's masks (so that a whole model gets its
    padding masks); where it does not take an attention (a mask, too few rows) or the call asks
    for what it lacks (a position bias, dropout, softcapping, the weights) the layer runs
    transformers' sdpa attention, as edatalog runs torch's."""
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    from edatalog.backend.kernels.attention import gemm_attention, gemm_attention_takes

    def forward(
        module: Any,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        position_bias: Any = None,
        **kwargs: Any,
    ) -> tuple[Any, None]:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(causal and attention_mask is None and query.shape[2] > 1)
        plain = position_bias is None and not dropout and kwargs.get("softcap") is None
        plain = plain and not kwargs.get("output_attentions")
        if not plain or not gemm_attention_takes(query, key, True if causal else attention_mask):
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout, scaling, is_causal, position_bias, **kwargs
            )
        groups = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = gemm_attention(torch, query, key, value, causal, scale)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(GEMM_ATTENTION, forward)
    AttentionMaskInterface.register(GEMM_ATTENTION, sdpa_mask)
    return GEMM_ATTENTION


def _switched(routing: onednn_gemms.Routing, enabled: bool, call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` with ATen's f32 GEMMs routed to oneDNN (``enabled``) or left to ATen's kernel."""

    def switched() -> Any:
        routing.enabled = enabled
        return call()

    return switched


def _caller(exe: Any, x: Any) -> Callable[[], Any]:
    def call() -> Any:
        return exe({"x": x})["y"]  # the input in the case's dtype, as transformers gets it

    return call


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    warnings.simplefilter("ignore")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def log(text: str) -> None:
        print(f"[kernels] {text}", file=sys.stderr, flush=True)

    results: list[Row] = []
    profiles: dict[str, dict[str, float]] = {}
    for name in [c for c in args.cases.split(",") if c]:
        rows, shares = run_case(name, args, log)
        results += rows
        profiles[name] = shares
    machine = {
        "device": torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu",
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if args.json:
        print(json.dumps({"machine": machine, "results": [r.__dict__ for r in results], "profile": profiles}))
    else:
        print(f"kernels: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine}")
        dims = lw.BlockDims().with_text(args.dims) if args.dims else lw.BlockDims()
        print(f"block: {dims}; {args.warmup} warm-up calls, {args.repeat} rounds\n")
        head = f"{'case':<9}  {'contender':<22}  {'measured ms':>11}  {'/ transformers':>14}  {'/ fair':>9}"
        print(f"{head}  {'max error':>9}")
        print("-" * 84)
        base = {r.case: r.ms for r in results if r.contender == "transformers"}
        fair = {r.case: r.ms for r in results if r.contender in FAIR_BASELINES}
        for r in results:
            ratio = r.ms / base[r.case] if r.case in base and r.ok else float("nan")
            to_fair = f"{r.ms / fair[r.case]:.2f}" if r.case in fair and r.ok else ""
            print(f"{r.case:<9}  {r.contender:<22}  {r.ms:>11.2f}  {ratio:>14.2f}  {to_fair:>9}  {r.error:>9.1e}")
        if any(profiles.values()):
            print("\nedatalog's time by kernel class (one recorded call of the interpreter, ms):")
        for case, shares in profiles.items():
            if not shares:
                continue
            total = sum(shares.values())
            parts = ", ".join(
                f"{k} {v:.1f} ({v / total:.0%})" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])
            )
            print(f"  {case}: {parts}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
