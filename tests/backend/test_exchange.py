"""Exchange synthesis and the simulator on the shipped programs: every plan runs correctly, and
traffic is exactly what the plan implies."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edatalog
from edatalog.backend.lowering.exchange import synthesize
from edatalog.backend.lowering.lowered import AS_SYNTHESIZED, lower
from edatalog.backend.predicting.timeline import analyze, chrome_trace
from edatalog.backend.running import sim
from edatalog.ir import program as ir
from edatalog.solver.blocks import Layout
from edatalog.solver.costmodel import transfer_seconds
from edatalog.solver.costs import Costs
from edatalog.solver.plan import NodePlan, Placement, Plan, Split, Tile
from edatalog.solver.strategies import build, place_by_consumers
from edatalog.solver.topology import from_dict, preset

ROOT = Path(__file__).resolve().parents[2]
LLAMA = (ROOT / "programs" / "llama_block.edl").read_text()


def _llama(dtype: str = "f64", **dims: int) -> edatalog.Program:
    return edatalog.compile_string(LLAMA.replace(": f32", f": {dtype}"), name="llama_block.edl", dims=dims)


def _check_sim(prog: edatalog.Program, plan: Plan, n: int, reduction: str = "auto") -> None:
    topo = preset("2x4") if n == 8 and plan.topology == "2x4" else preset(f"a100x{n}")
    values = prog.prepare(prog.random_inputs(seed=n))
    expected = prog.evaluate(values)
    got = sim.run(lower(synthesize(prog.graph, plan, topo, reduction), AS_SYNTHESIZED), values)
    for name in prog.outputs:
        np.testing.assert_allclose(got[name].data, expected[name].data, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("strategy", ["megatron", "data", "random"])
def test_llama_block_under_every_plan_equals_the_reference(strategy: str, n: int) -> None:
    # H = 8 heads on 3 devices is uneven (3, 3, 2); B = 3 batch rows on 2, 4 or 8 devices too.
    prog = _llama(B=3, S=5, D=48, H=8, KVH=8, F=40)
    plan = build(prog.graph, preset(f"a100x{n}"), strategy, seed=n)
    plan.verify(prog.graph)
    _check_sim(prog, plan, n)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_grouped_query_attention_under_megatron(n: int) -> None:
    # Two key/value heads for eight query heads: with more devices than kv heads, the kv heads
    # are replicated on the devices whose query heads share them.
    prog = _llama(B=1, S=6, D=32, H=8, KVH=2, F=24)
    plan = build(prog.graph, preset(f"a100x{n}"), "megatron")
    _check_sim(prog, plan, n)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_megatron_moves_exactly_two_reduce_scatter_all_gather_rounds(n: int) -> None:
    b, s, d = 2, 6, 64
    prog = _llama("f32", B=b, S=s, D=d, H=8, KVH=8, F=40)
    topo = preset(f"a100x{n}")
    plan = build(prog.graph, topo, "megatron")
    x = next(p for p in plan.inputs if p.relation == "x")
    assert x.dtensor(n) == "R"  # x replicated on every device
    assert [p.dtensor(n) for p in plan.outputs] == ["R"]  # and so is y
    report = analyze(lower(synthesize(prog.graph, plan, topo)))
    itemsize = 4
    # Each of the two row-parallel projections (wo, w_down) leaves partial sums of B*S*D on every
    # device: a reduce-scatter and an all-gather move (N - 1) * B*S*D each.
    assert report.bytes_moved == 2 * 2 * (n - 1) * b * s * d * itemsize
    # An all-to-all of the partials would move N * (N - 1) * B*S*D per round instead.
    assert report.bytes_moved < 2 * n * (n - 1) * b * s * d * itemsize or n == 2


def test_causal_attention_skips_the_blocks_above_the_diagonal() -> None:
    text = (ROOT / "programs" / "attention.edl").read_text().replace(": f32", ": f64")
    prog = edatalog.compile_string(text, dims={"B": 1, "S": 8, "D": 16, "H": 2})
    g = prog.graph
    tiles = {}
    for node in g.nodes:
        splits = tuple(Split.even(i.name, i.extent, 4 if i.name in ("s", "t") else 1) for i in node.indices)
        count = Tile(splits, ()).n_blocks
        tiles[node.name] = Tile(splits, tuple((k % 4,) for k in range(count)))
    plan = Plan(
        g.fingerprint(),
        4,
        "a100x4",
        "test",
        tuple(NodePlan(n.name, tiles[n.name]) for n in g.nodes),
        tuple(Placement(r.name, place_by_consumers(g, tiles, r.name, 4)) for r in g.relations if r.kind != "derived"),
    )
    schedule = synthesize(g, plan, preset("a100x4"))
    blocks = analyze(lower(schedule)).computed_blocks
    assert tiles["sc"].n_blocks == 16
    assert blocks["sc"] == 10  # 4 + 3 + 2 + 1 blocks on or below the diagonal
    assert blocks["p"] == blocks["o"] == 10
    _check_sim(prog, plan, 4)


def _slow_bytes(n_nodes_of: dict[int, int], per_link: dict[tuple[int, int], int]) -> int:
    return sum(v for (a, b), v in per_link.items() if n_nodes_of[a] != n_nodes_of[b])


def test_hierarchical_reduction_crosses_the_slow_links_less() -> None:
    # A partial sum across all 8 devices of a 2x4 machine: every device sums a slice of j.
    prog = edatalog.compile_string("dim N = 64, M = 8.\ninput x[N, M] : f64.\ny[i] += x[i, j].\noutput y.")
    g = prog.graph
    topo = preset("2x4")
    node = g.nodes[0]
    tile = Tile((Split("i", (0, 64)), Split.even("j", 8, 8)), tuple((k,) for k in range(8)))
    plan = Plan(
        g.fingerprint(),
        8,
        "2x4",
        "test",
        (NodePlan(node.name, tile),),
        (Placement("x", place_by_consumers(g, {node.name: tile}, "x", 8)),),
    )
    node_of = {d.index: d.node for d in topo.devices}
    slow = {}
    for reduction in ("direct", "hierarchical"):
        report = analyze(lower(synthesize(g, plan, topo, reduction), AS_SYNTHESIZED))  # the exchanges as made
        slow[reduction] = _slow_bytes(node_of, report.bytes_per_link)
        _check_sim(prog, plan, 8, reduction)
    size = 64 * 8  # y in bytes
    assert slow["hierarchical"] == size  # each node sends half of its reduced y to the other
    assert slow["direct"] == 4 * size  # every device sends half of its partial across
    assert slow["hierarchical"] < slow["direct"]


@pytest.mark.parametrize(
    ("topology", "strategy", "kinds"),
    [
        ("a100x4", "megatron", {"compute", "collective"}),  # NCCL: every exchange of Megatron is a collective
        ("cpux4", "megatron-sp", {"compute", "send", "recv", "reduce"}),  # gloo: its reduce-scatters by messages
    ],
)
def test_trace_is_valid_chrome_trace_json(tmp_path: Path, topology: str, strategy: str, kinds: set[str]) -> None:
    prog = _llama("f32", B=1, S=4, D=32, H=4, KVH=4, F=16)
    plan = edatalog.plan(prog, topology=topology, strategy=strategy)
    path = tmp_path / "trace.json"
    plan.trace(str(path))
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all({"name", "ts", "dur", "pid", "tid"} <= e.keys() for e in spans)
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    assert {e["cat"] for e in spans} >= kinds
    names = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert len(names) == 4
    assert data == json.loads(json.dumps(chrome_trace(plan.report)))


def test_timeline_respects_dependencies_and_resources() -> None:
    prog = _llama("f32", B=1, S=4, D=32, H=4, KVH=4, F=16)
    plan = edatalog.plan(prog, topology="a100x4", strategy="megatron")
    times = plan.report.times
    ops = {(d, k): op for d, k, op in plan.report.lowered.programs.ops() if not isinstance(op, ir.Free)}
    maker = {op.buf: key for key, op in ops.items() if isinstance(op, ir.DEFINES)}
    send_at = {op.tag: key for key, op in ops.items() if isinstance(op, ir.Send)}
    members: dict[int, list[tuple[int, int]]] = {}
    for key, op in ops.items():
        if isinstance(op, ir.Collective):
            members.setdefault(op.tag, []).append(key)
    assert members  # Megatron's all-reduces run as collectives on NCCL
    for key, op in ops.items():
        waits = [maker[b] for b in ir.reads(op)] + ([send_at[op.tag]] if isinstance(op, ir.Recv) else [])
        if isinstance(op, ir.Collective):  # a meeting: it waits for every member's input
            waits = [maker[b] for m in members[op.tag] for b in ir.reads(ops[m])]
            assert {times[m] for m in members[op.tag]} == {times[key]}
        assert all(times[w].end <= times[key].start + 1e-15 for w in waits)
    compute = sorted(
        (times[key].start, times[key].end)
        for key, op in ops.items()
        if key[0] == 0 and isinstance(op, ir.Kernel | ir.Combine | ir.Fused)
    )
    assert all(a[1] <= b[0] + 1e-15 for a, b in itertools.pairwise(compute))  # one kernel at a time


def test_reading_data_a_device_does_not_hold_is_an_error() -> None:
    prog = _llama(B=1, S=4, D=32, H=4, KVH=4, F=16)
    plan = build(prog.graph, preset("a100x2"), "megatron")
    schedule = synthesize(prog.graph, plan, preset("a100x2"))
    progs = schedule.programs
    devices = tuple(  # drop every transfer
        dataclasses.replace(p, ops=tuple(op for op in p.ops if not isinstance(op, ir.Send | ir.Recv)))
        for p in progs.devices
    )
    broken = dataclasses.replace(lower(schedule, AS_SYNTHESIZED), programs=dataclasses.replace(progs, devices=devices))
    with pytest.raises(sim.SimError, match="does not hold"):
        sim.run(broken, prog.prepare(prog.random_inputs(0)))


def test_replicate_keeps_everything_on_device_zero() -> None:
    prog = _llama("f32", B=1, S=4, D=32, H=4, KVH=4, F=16)
    plan = edatalog.plan(prog, topology="a100x4", strategy="replicate")
    summary = plan.summary()
    assert summary["bytes_moved"] == 0
    assert summary["flops"][1] == summary["flops"][2] == summary["flops"][3] == 0
    params = sum(r.nbytes for r in prog.graph.relations if r.kind != "derived")
    assert summary["peak_memory"][0] >= params
    assert summary["peak_memory"][1] == 0


def test_a_plan_for_another_program_is_refused(tmp_path: Path) -> None:
    small = _llama("f32", B=1, S=4, D=32, H=4, KVH=4, F=16)
    other = _llama("f32", B=1, S=8, D=32, H=4, KVH=4, F=16)
    path = tmp_path / "plan.json"
    edatalog.plan(small, topology="a100x2", strategy="megatron").save(path)
    assert edatalog.load_plan(path, small).summary()["devices"] == 2
    with pytest.raises(edatalog.EdlError, match="made for another program"):
        edatalog.load_plan(path, other)
    with pytest.raises(edatalog.EdlError, match="another program"):
        other.run(other.random_inputs(0), plan=edatalog.load_plan(path), backend="sim")


def _sequence_parallel_mlp_norms(prog: edatalog.Program, n: int, reduce_axis: int | None) -> Plan:
    """Megatron, but the residual and the MLP norm split the sequence over the devices, and the
    two row-parallel outputs reduce-scatter their partials along ``reduce_axis``."""
    graph = prog.graph
    base = build(graph, preset(f"a100x{n}"), "megatron")
    nodes = []
    for p in base.nodes:
        node = graph.node(p.node)
        if p.node in ("h", "ss2", "hn", "y"):
            splits = tuple(Split.even(i.name, i.extent, n if i.name == "s" else 1) for i in node.indices)
            nodes.append(NodePlan(p.node, Tile(splits, tuple((k,) for k in range(n)))))
        elif p.node in ("attn", "down"):
            nodes.append(NodePlan(p.node, p.tile, reduce_axis))
        else:
            nodes.append(p)
    return Plan(base.program, n, base.topology, "sequence-parallel", tuple(nodes), base.inputs, base.outputs)


@pytest.mark.parametrize("n", [2, 4])
def test_reducing_along_the_readers_axis_moves_no_more_than_megatron(n: int) -> None:
    """Partials reduce-scattered along the sequence land where the sequence-parallel norms read
    them: the same bytes as Megatron's all-reduces.  Along the longest axis (D) they must be
    reshuffled first."""
    b, s, d = 1, 8, 64
    prog = _llama("f32", B=b, S=s, D=d, H=8, KVH=8, F=40)
    topo = preset(f"a100x{n}")
    megatron = analyze(lower(synthesize(prog.graph, build(prog.graph, topo, "megatron"), topo))).bytes_moved
    along_s = _sequence_parallel_mlp_norms(prog, n, reduce_axis=1)
    longest = _sequence_parallel_mlp_norms(prog, n, reduce_axis=None)
    assert analyze(lower(synthesize(prog.graph, along_s, topo))).bytes_moved == megatron
    assert analyze(lower(synthesize(prog.graph, longest, topo))).bytes_moved > megatron
    f64 = _llama(B=b, S=s, D=d, H=8, KVH=8, F=40)
    _check_sim(f64, _sequence_parallel_mlp_norms(f64, n, reduce_axis=1), n)


def test_plan_json_keeps_the_reduce_axis() -> None:
    prog = _llama("f32", B=1, S=8, D=32, H=4, KVH=4, F=24)
    plan = _sequence_parallel_mlp_norms(prog, 2, reduce_axis=1)
    again = Plan.from_json(plan.to_json(), prog.graph)
    assert again == plan
    assert again.node("attn").reduce_axis == 1
    assert "partials reduced along axis 1" in str(plan)
    bad = json.loads(plan.to_json())
    bad["nodes"][[p["node"] for p in bad["nodes"]].index("attn")]["reduce_axis"] = 7
    with pytest.raises(edatalog.EdlError, match="reduce axis 7"):
        Plan.from_json(json.dumps(bad), prog.graph)


# -- halos of index expressions -----------------------------------------------------------------------

CONV = """\
dim B = 2, C = 3, O = 2, L = {L}, K = {K}, T = {T}.
input x[B, C, T] : f64.
param w[O, C, K] : f64.
output conv.
conv[b, o, l:L] += x[b, c, l + k] * w[o, c, k].
"""

SHIFT = """\
dim B = 2, T = {T}.
input x[B, T] : f64.
output prev.
prev[b, t:T] = x[b, t - 1].
"""


def _split_along(prog: edatalog.Program, index: str, n: int, axis: int) -> Plan:
    """Every rule's ``index`` split evenly over ``n`` devices (block k on device k), and the input
    ``x`` cut the same way along its ``axis`` (its last piece reaching to the end), each piece on
    its block's device: what a block reads beyond its own piece is the halo, sent by a neighbour.
    Params are replicated."""
    g = prog.graph
    nodes = []
    for node in g.nodes:
        splits = tuple(Split.even(i.name, i.extent, n if i.name == index else 1) for i in node.indices)
        nodes.append(NodePlan(node.name, Tile(splits, tuple((k,) for k in range(n)))))
    own = Split.even(index, g.nodes[0].box[index], n)
    inputs = []
    for r in g.relations:
        if r.kind == "input":
            cuts = (*own.cuts[:-1], r.shape[axis])
            splits = tuple(Split(a, cuts if k == axis else (0, e)) for k, (a, e) in enumerate(r.box.items()))
            inputs.append(Placement(r.name, Tile(splits, tuple((k,) for k in range(n)))))
        elif r.kind == "param":
            inputs.append(Placement(r.name, Tile.whole(r.box, range(n))))
    return Plan(g.fingerprint(), n, f"a100x{n}", "test", tuple(nodes), tuple(inputs))


def _check_sends(prog: edatalog.Program, plan: Plan, n: int, halo: dict[int, tuple[int, int]], axis: int) -> int:
    """Every send is of ``x`` to a device in ``halo`` (device -> the places along ``axis`` it lacks),
    exactly those places and the whole of the other axes, and the simulator's result (values and
    which cells exist) equals the reference evaluator's.  The bytes moved, for the caller to check
    against its formula."""
    topo = preset(f"a100x{n}")
    schedule = synthesize(prog.graph, plan, topo)
    sends = [(d, op) for d, _, op in schedule.programs.ops() if isinstance(op, ir.Send)]
    assert sorted(op.peer for _, op in sends) == sorted(halo)
    shape = prog.graph.relation("x").shape
    loads = {op.buf: op.relation for _, _, op in schedule.programs.ops() if isinstance(op, ir.Load)}
    for d, op in sends:
        assert loads.get(op.buf) == "x" and d != op.peer
        want = tuple(((halo[op.peer]),) if k == axis else ((0, e),) for k, e in enumerate(shape))
        assert op.region.axes == want, (op.peer, op.region)
    values = prog.prepare(prog.random_inputs(seed=n))
    expected = prog.evaluate(values)
    got = sim.run(lower(schedule, AS_SYNTHESIZED), values)
    for name in prog.outputs:
        np.testing.assert_allclose(got[name].data, expected[name].data, rtol=1e-12, atol=1e-12)
        mine, theirs = got[name].present, expected[name].present
        assert (mine is None) == (theirs is None)
        if mine is not None and theirs is not None:
            assert np.array_equal(mine, theirs)
    return analyze(lower(schedule)).bytes_moved


@pytest.mark.parametrize(("n", "length", "width"), [(2, 10, 3), (3, 10, 3), (4, 12, 2), (4, 16, 5)])
def test_a_convolution_split_along_l_receives_exactly_its_halo(n: int, length: int, width: int) -> None:
    """``conv[b, o, l] += x[b, c, l + k] * w[o, c, k]``: the block of ``l`` in ``lo .. hi - 1``
    reads ``x`` at ``lo .. hi + K - 2``.  With ``x`` cut like ``l``, every device but the last
    lacks the first ``K - 1`` places of the next device's piece and receives exactly those."""
    prog = edatalog.compile_string(CONV.format(L=length, K=width, T=length + width - 1))
    plan = _split_along(prog, "l", n, axis=2)
    ranges = Split.even("l", length, n).ranges
    assert all(hi - lo >= width - 1 for lo, hi in ranges)  # each halo lies in the next piece alone
    halo = {d: (hi, hi + width - 1) for d, (_, hi) in enumerate(ranges[:-1])}
    moved = _check_sends(prog, plan, n, halo, axis=2)
    # (N - 1) halos of B * C * (K - 1) cells of 8 bytes: with B = 2, C = 3.
    assert moved == (n - 1) * 2 * 3 * (width - 1) * 8


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_shifted_access_split_along_t_receives_one_place_from_the_left(n: int) -> None:
    """``prev[b, t] = x[b, t - 1]``: the block of ``t`` in ``lo .. hi - 1`` reads ``x`` at
    ``lo - 1 .. hi - 2``, so every device but the first receives the last place of the previous
    device's piece, and nothing else moves; ``prev[b, 0]`` reads nothing and does not exist."""
    t = 11
    prog = edatalog.compile_string(SHIFT.format(T=t))
    plan = _split_along(prog, "t", n, axis=1)
    ranges = Split.even("t", t, n).ranges
    halo = {d: (lo - 1, lo) for d, (lo, _) in enumerate(ranges) if d > 0}
    moved = _check_sends(prog, plan, n, halo, axis=1)
    assert moved == (n - 1) * 2 * 1 * 8  # (N - 1) places of B = 2 rows, 8 bytes each


def test_the_solver_prices_the_halo_it_sends() -> None:
    """The solver's estimate of bringing ``x`` to a convolution split along ``l`` is one halo per
    device on the busiest port: what exchange synthesis sends (the same :func:`through`)."""
    n, length, width = 4, 12, 3
    prog = edatalog.compile_string(CONV.format(L=length, K=width, T=length + width - 1))
    plan = _split_along(prog, "l", n, axis=2)
    topo = preset(f"a100x{n}")
    node = prog.graph.nodes[0]
    costs = Costs(prog.graph, topo)
    option = costs.option(node, Layout.of_tile(node, plan.node(node.name).tile))
    ((_, need),) = [(a, need) for a, need in option.needs if a.relation == "x"]
    ranges = Split.even("l", length, n).ranges
    assert [box[2] for _, box in need] == [((lo, min(hi + width - 1, length + width - 1)),) for lo, hi in ranges]
    x = next(p for p in plan.inputs if p.relation == "x").tile
    along = prog.graph.relation("x").axis_names[2]
    held = tuple((block.devices[0], ((((0, 2),), ((0, 3),), (block.ranges[along],)),)) for block in x.blocks())
    halo_bytes = 2 * 3 * (width - 1) * 8
    assert costs.transfer("x", held, need) == pytest.approx(transfer_seconds(halo_bytes, topo.link(0, 1)))


@pytest.mark.parametrize("interference", [0.0, 0.2, 1.0])
def test_a_transfer_on_an_interfering_link_holds_back_compute_at_both_ends(interference: float) -> None:
    """Device 1 computes ``z`` from its own ``w`` (ready at once) and ``y`` from ``x``, which
    device 0 holds: one transfer of tx = latency + bytes / bandwidth, and two kernels of the
    floor k each (they are tiny).  Beside a link that does not interfere, the transfer runs
    while ``z`` computes: seconds = max(tx, k) + k.  A link with interference f takes f * tx
    of device 1's compute, so ``y`` starts at max(tx, k + f * tx): with tx = 2.001 ms and
    k = 2 ms, 4.001 ms at f = 0, 4.400 ms at f = 0.2 (the GPU presets'), 6.001 ms at f = 1
    (CPU ranks whose cores copy the bytes)."""
    prog = edatalog.compile_string(
        "dim N = 1024.\ninput x[N] : f32.\nparam w[N] : f32.\ny[i] = x[i] * 2.\nz[i] = w[i] * 3.\n"
    )
    g = prog.graph
    link = {"bandwidth": "4GB/s", "latency": "2ms", "interference": interference}
    topo = from_dict({"nodes": [2], "kernel_floor": "2ms", "links": {"intra": link}})

    def on(device: int, name: str) -> Tile:
        return Tile.whole(g.relation(name).box, (device,))

    nodes = tuple(
        NodePlan(n.name, Tile(tuple(Split.even(i.name, i.extent, 1) for i in n.indices), ((1,),))) for n in g.nodes
    )
    plan = Plan(g.fingerprint(), 2, "test", "test", nodes, (Placement("x", on(0, "x")), Placement("w", on(1, "w"))))
    schedule = synthesize(g, plan, topo)
    tx, k = transfer_seconds(1024 * 4, topo.intra), topo.kernel_floor
    assert tx == pytest.approx(2e-3 + 4096 / 4e9)
    want = max(tx, k + interference * tx) + k
    assert analyze(lower(schedule)).seconds == pytest.approx(want)
    assert want == pytest.approx({0.0: 4.001e-3, 0.2: 4.4002e-3, 1.0: 6.001e-3}[interference], rel=1e-4)


# -- repeated layers synthesized once ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("topology", "strategy", "copied"),
    [("cpux2", "megatron", True), ("2x4", "megatron-sp", True), ("a100x4", "random", False), ("a100x4", "auto", True)],
)
def test_copied_layers_give_the_programs_that_synthesizing_every_layer_gives(
    topology: str, strategy: str, copied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once two layers in a row are copies of the one before, the rest are copied, not
    synthesized; the programs and costs are exactly those of synthesizing each layer (random
    plans tile each layer otherwise: nothing is copied)."""
    from edatalog.backend.lowering import instances

    prog = edatalog.compile(
        ROOT / "programs" / "llama.edl", dims={"S": 16, "D": 32, "H": 4, "KVH": 2, "F": 48, "L": 8, "V": 40}
    )
    plan = edatalog.plan(prog, topology=topology, strategy=strategy, seed=2, time_limit=2)
    count: list[int] = []
    copy = instances.InstanceCopier.copy

    def counting(self: instances.InstanceCopier, synth: Any, k: int) -> None:
        count.append(k)
        copy(self, synth, k)

    monkeypatch.setattr(instances.InstanceCopier, "copy", counting)
    fast = synthesize(prog.graph, plan.ir, plan.topology)
    monkeypatch.setattr(instances.InstanceCopier, "of", staticmethod(lambda graph, plan: None))
    slow = synthesize(prog.graph, plan.ir, plan.topology)
    assert fast.programs == slow.programs and fast.costs == slow.costs
    assert {k: [str(e.region) for e in v] for k, v in fast.layout.items()} == {
        k: [str(e.region) for e in v] for k, v in slow.layout.items()
    }
    assert bool(count) == copied
    if copied:
        assert count == list(range(count[0], 7))  # every layer after the first copies, but the last
