"""The timeline prices what the runtimes run: pairs and ports, collectives, fused attention.
Each test states its hand computation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import edatalog
from edatalog.backend.lowering.exchange import synthesize
from edatalog.backend.lowering.lowered import lower
from edatalog.backend.predicting.timeline import analyze
from edatalog.ir import dtypes
from edatalog.ir import program as ir
from edatalog.solver.costmodel import FLASH_TILE, collective_bytes, collective_seconds, tiled_points
from edatalog.solver.plan import NodePlan, Placement, Plan, Split, Tile
from edatalog.solver.topology import from_dict, preset

ROOT = Path(__file__).resolve().parents[2]
LLAMA = (ROOT / "programs" / "llama_block.edl").read_text()


def _llama(dtype: str, **dims: int) -> edatalog.Program:
    return edatalog.compile_string(LLAMA.replace(": f32", f": {dtype}"), name="llama_block.edl", dims=dims)


@pytest.mark.parametrize("pair", ["1GB/s", "3GB/s"])
def test_one_device_fills_its_port_only_by_sending_to_several_peers(pair: str) -> None:
    """Device 0 holds x (B = 4 MB) and devices 1, 2 and 3 each read all of it.  With ports of
    P = 3 GB/s and pairs of Q, no latency: the three transfers start as device 0's port frees,
    at 0, B / P and 2 B / P, and each takes B / Q; then each reader's kernel takes the floor k.
    Q = 1 GB/s: 2 B / P + B / Q + k = 2.667 + 4 + k ms (serial pairs would take 12 ms);
    Q = P: 3 B / P + k = 4 ms + k."""
    prog = edatalog.compile_string("dim N = 1000000.\ninput x[N] : f32.\ny[i] = x[i] * 2.\noutput y.")
    g = prog.graph
    link = {"bandwidth": "3GB/s", "p2p_bandwidth": pair, "latency": 0}
    topo = from_dict({"nodes": [4], "kernel_floor": "1ms", "links": {"intra": link}})
    node = g.nodes[0]
    tile = Tile((Split.even("i", 1_000_000, 1),), ((1, 2, 3),))
    x = Placement("x", Tile.whole(g.relation("x").box, (0,)))
    plan = Plan(g.fingerprint(), 4, "test", "test", (NodePlan(node.name, tile),), (x,))
    b, p, q = 4e6, 3e9, float(pair.removesuffix("GB/s")) * 1e9
    want = 2 * b / p + b / q + 1e-3
    assert analyze(lower(synthesize(g, plan, topo))).seconds == pytest.approx(want)


def test_a_call_overhead_delays_every_device_by_itself() -> None:
    """A machine whose calls cost ``call_overhead`` runs the same timeline that much later: the
    makespan grows by exactly the overhead, every kernel starts that much later."""
    prog = _llama("f32", B=1, S=16, D=32, H=4, KVH=2, F=48)
    base = from_dict(
        {"nodes": [2], "kernel_floor": "5us", "links": {"intra": {"bandwidth": "2GB/s", "latency": "50us"}}}
    )
    slow = from_dict({**base.to_dict(), "call_overhead": "30us"})
    assert slow.call_overhead == pytest.approx(30e-6) and from_dict(slow.to_dict()) == slow
    plan = edatalog.plan(prog, topology=base, strategy="megatron")
    fast_report = analyze(plan.lowered)
    slow_report = analyze(lower(synthesize(prog.graph, plan.ir, slow)))
    assert slow_report.seconds == pytest.approx(fast_report.seconds + 30e-6)
    ops = {(d, k): op for d, k, op in plan.lowered.programs.ops()}
    for key, span in fast_report.times.items():
        if isinstance(ops[key], ir.Kernel | ir.Fused):  # what computes (a load takes no time)
            assert slow_report.times[key].start == pytest.approx(span.start + 30e-6)


def test_megatrons_all_reduces_are_priced_as_nccl_runs_them() -> None:
    """On NCCL the two row-parallel reductions of a Megatron block are all-reduces over the 4
    devices: each takes :func:`collective_seconds` of its whole region on every member, starts
    at once on all of them, and each member sends its ring successor 2 (n - 1) / n of it."""
    prog = _llama("bf16", B=1, S=256, D=256, H=4, KVH=4, F=512)
    topo = preset("a100x4")
    plan = edatalog.plan(prog, topology=topo, strategy="megatron")
    s = plan.report.lowered
    members: dict[int, list[tuple[int, int]]] = {}
    for d, k, op in s.programs.ops():
        if isinstance(op, ir.Collective):
            members.setdefault(op.tag, []).append((d, k))
    ops = {(d, k): op for d, k, op in s.programs.ops()}
    kinds = sorted(ops[keys[0]].kind.value for keys in members.values())  # type: ignore[union-attr]
    assert kinds == ["all_reduce", "all_reduce"]
    sent = 0
    for keys in members.values():
        op = ops[keys[0]]
        assert isinstance(op, ir.Collective) and op.group == (0, 1, 2, 3)
        nbytes = 256 * 256 * 4  # S x D partial sums, which are kept (and reduced) in f32
        assert s.costs[keys[0]].nbytes == nbytes
        spans = {plan.report.times[k] for k in keys}
        assert len(spans) == 1  # a meeting: every member's span is the same
        (span,) = spans
        assert span.end - span.start == pytest.approx(collective_seconds(op.kind, nbytes, 4, topo.intra))
        sent += collective_bytes(op.kind, nbytes, 4)
    assert plan.report.sent == dict.fromkeys(range(4), sent)
    assert plan.report.bytes_per_link == {(d, (d + 1) % 4): sent for d in range(4)}


def test_gloo_runs_reduce_scatters_by_messages() -> None:
    """gloo runs only all-reduces as one call: Megatron-SP's reduce-scatters stay messages."""
    prog = _llama("f32", B=1, S=8, D=32, H=4, KVH=4, F=16)
    plan = edatalog.plan(prog, topology="cpux2", strategy="megatron-sp")
    ops = [op for _, _, op in plan.report.lowered.programs.ops()]
    assert not any(isinstance(op, ir.Collective) for op in ops)
    assert any(isinstance(op, ir.Recv) for op in ops)


def test_causal_flash_attention_computes_whole_tiles_on_and_below_the_diagonal() -> None:
    """S = 256 in tiles of 128: of the 2 x 2 query/key tiles, the one above the diagonal holds no
    point of ``t <= s``; the other three are computed whole: 3 * 128^2 of the 256^2 (s, t) pairs
    (against the 256 * 257 / 2 the guard keeps)."""
    assert FLASH_TILE == 128
    prog = _llama("bf16", B=1, S=256, D=64, H=2, KVH=2, F=64)
    sc = prog.graph.node("sc")
    ranges = {i.name: (0, i.extent) for i in sc.indices}
    others = math.prod(i.extent for i in sc.indices if i.name not in ("s", "t"))
    assert tiled_points(sc, ranges) == 3 * 128**2 * others
    on_diagonal = {**ranges, "s": (0, 128), "t": (0, 128)}
    assert tiled_points(sc, on_diagonal) == 128**2 * others


def test_a_fused_attention_block_costs_flash_style() -> None:
    """One device, S = 256: the fused block's flops are its five rules' flops scaled from the
    guard's points to the tiles' (3 * 128^2 / (256 * 257 / 2)), and its bytes only q, k, v and
    the output's: neither the S x S scores nor the probabilities leave the chip."""
    prog = _llama("bf16", B=1, S=256, D=64, H=2, KVH=2, F=64)
    s = synthesize(prog.graph, edatalog.plan(prog, topology="a100x1", strategy="replicate").ir, preset("a100x1"))
    run = lower(s)
    fused = [(d, k, op) for d, k, op in run.programs.ops() if isinstance(op, ir.Fused)]
    assert len(fused) == 1
    d, k, op = fused[0]
    before = {o.buf: s.costs[(dd, kk)] for dd, kk, o in s.programs.ops() if isinstance(o, ir.DEFINES)}
    body = sum(before[inner.buf].flops for inner in op.body)
    assert run.costs[(d, k)].flops == math.ceil(body * 3 * 128**2 / (256 * 257 / 2))
    made = {o.buf: o for _, _, o in s.programs.ops() if isinstance(o, ir.DEFINES)}
    outer = {(b, r) for inner in op.body if isinstance(inner, ir.Kernel) for parts in inner.reads for b, r in parts}
    outer = {(b, r) for b, r in outer if b not in op.internal}
    want = sum(r.size * dtypes.itemsize(made[b].dtype) for b, r in outer) + op.region.size * 2
    assert run.costs[(d, k)].nbytes == want
    unfused = sum(before[inner.buf].nbytes for inner in op.body)
    assert want < unfused / 4  # the scores and probabilities were most of the bytes
