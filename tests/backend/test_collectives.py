"""Exchanges run as collectives (:mod:`edatalog.backend.lowering.collectives`).

The pass finds, in the programs of a plan, the exchanges that are all-reduces, reduce-scatters
and all-gathers over a group of devices, and rewrites each member's sends, receives and combines
into one :class:`~edatalog.ir.program.Collective`.  Checked here: Megatron's two all-reduces per
LLaMA block (one per MLP) are found on every device count; the rewritten programs verify, round
trip through JSON and compute the reference's values (run in this process, each collective
folded in numpy, on Megatron, random and hierarchical plans); partials that may lack cells stay
point-to-point, and so does a collective that would make the devices wait forever; ``verify``
rejects collectives whose members disagree, are missing, or meet in different orders.  Then the
SPMD runtime runs them with torch.distributed on 2 and 3 gloo ranks.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edatalog
from edatalog.backend.lowering.collectives import collectives_of, use_collectives
from edatalog.backend.lowering.exchange import synthesize
from edatalog.backend.lowering.fusion import fuse_programs
from edatalog.backend.lowering.lowered import Collectives, Options
from edatalog.backend.lowering.presence import mark_full
from edatalog.backend.lowering.tasks import Entry
from edatalog.backend.running.interpreter import Device, Kernels, Mailbox, gather, run_devices, slicer
from edatalog.errors import EdlWarning
from edatalog.ir import program as ir
from edatalog.ir.graph import Graph, VerifyError
from edatalog.ir.regions import Region
from edatalog.solver.plan import NodePlan, Placement, Plan, Split, Tile
from edatalog.solver.strategies import place_by_consumers
from edatalog.solver.topology import Library, preset

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "programs" / "llama_block.edl"
MLP = ROOT / "programs" / "mlp.edl"
# 12 heads: Megatron gives every one of 2, 3 or 4 devices heads (and F = 96 a third of the MLP).
DIMS = {"B": 1, "S": 16, "D": 96, "H": 12, "KVH": 12, "F": 96}
MACHINES = {2: "cpux2", 3: "cpux3", 4: "a100x4"}
AR = ir.CollectiveKind.ALL_REDUCE


@functools.cache
def _llama(heads: int = 12) -> edatalog.Program:
    return edatalog.compile(LLAMA, dims={**DIMS, "KVH": heads})


def _compile(text: str) -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.compile_string(text)


def _rewritten(prog: edatalog.Program, plan: edatalog.Plan) -> ir.Programs:
    """The plan lowered with every kind of collective (each pass verified as it runs)."""
    lowered = plan.lowering(Options(Collectives.ON))
    assert lowered.passes == ("synthesis", "fusion", "presence", "collectives")
    programs = lowered.programs
    assert ir.Programs.from_json(programs.to_json()) == programs
    return programs


def _kinds(programs: ir.Programs) -> Counter[tuple[str, str, int]]:
    """(kind, relation, group size) of every collective, counted once however many members."""
    found = collectives_of(programs)
    return Counter((m[0][1].kind.value, m[0][1].relation, len(m[0][1].group)) for m in found.values())


# -- running rewritten programs in this process -------------------------------------------------------


def _run_in_process(programs: ir.Programs, graph: Graph, values: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every device's program in turns on numpy, as the simulator runs them; a collective runs
    once every member has come to it (its sources folded with the aggregation, or its pieces
    put together)."""
    kernels = Kernels(graph)
    devices = [Device(p, graph, kernels, slicer(values)) for p in programs.devices]
    run_devices(devices, Mailbox())
    out = {}
    for name in graph.outputs:
        pieces = [(p.region, devices[p.device].get(p.buf)) for p in programs.outputs if p.relation == name]
        out[name], _ = gather(graph, name, pieces)  # absent cells read 0, as the reference's
    return out


def _check_values(prog: edatalog.Program, programs: ir.Programs, seed: int = 0) -> None:
    values = prog.random_inputs(seed=seed)
    want = prog.run(values)
    got = _run_in_process(programs, prog.graph, values)
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-5 * float(np.abs(w).max()))


# -- what is found ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
def test_megatron_all_reduces_of_a_llama_block_are_found(n: int) -> None:
    prog = _llama()
    plan = edatalog.plan(prog, topology=MACHINES[n], strategy="megatron")
    programs = _rewritten(prog, plan)
    # Two per block: the attention output's and the MLP's partial sums, each over all devices.
    assert _kinds(programs) == {("all_reduce", "attn", n): 1, ("all_reduce", "down", n): 1}
    for members in collectives_of(programs).values():
        assert [d for d, _ in members] == list(range(n))
        assert all(op.reduce == "sum" and op.group == tuple(range(n)) and op.full for _, op in members)
    # Nothing else moves: no message, no combine is left.
    assert not [op for _, _, op in programs.ops() if isinstance(op, ir.Send | ir.Recv | ir.Combine)]
    text = str(programs.devices[0])
    assert "= all_reduce sum attn[0:1, 0:16, 0:96] (%" in text and f"group {{{','.join(map(str, range(n)))}}}" in text
    _check_values(prog, programs)


def test_megatron_mlp_has_one_all_reduce() -> None:
    prog = edatalog.compile(MLP, dims={"B": 8, "D": 64, "F": 96})
    for n in (2, 3, 4):
        programs = _rewritten(prog, edatalog.plan(prog, topology=MACHINES[n], strategy="megatron"))
        assert _kinds(programs) == {("all_reduce", "z", n): 1}
        _check_values(prog, programs)


def test_the_all_reduce_replaces_the_reduce_scatter_and_the_pulls() -> None:
    """Device 0 of the 2-device Megatron plan: the partial, one all-reduce, and the residual
    reading its buffer whole, where there were two sends, two receives and a combine."""
    prog = _llama()
    plan = edatalog.plan(prog, topology="cpux2", strategy="megatron")
    before = plan.lowering(Options(Collectives.OFF)).programs.devices[0].ops
    after = _rewritten(prog, plan).devices[0].ops
    assert sum(isinstance(op, ir.Send | ir.Recv | ir.Combine) for op in before) == 10
    k = next(k for k, op in enumerate(after) if isinstance(op, ir.Collective) and op.relation == "attn")
    ar = after[k]
    assert isinstance(ar, ir.Collective)
    partial = next(op for op in after if isinstance(op, ir.Kernel) and op.buf == ar.source)
    assert partial.node == "attn" and partial.full  # marked full: every query has a key
    assert ar.region == ar.whole == partial.region and ar.pieces == ()
    combined = next(op for op in before if isinstance(op, ir.Combine) and op.relation == "attn")
    assert ar.buf == combined.buf  # the combined piece's buffer, now holding the whole
    assert after[k + 1] == ir.Free(ar.source)
    h = next(op for op in after if isinstance(op, ir.Kernel) and op.node == "h")
    assert h.reads[1] == ((ar.buf, ar.whole),)  # one part: read as a view


def test_supports_mark_attention_and_what_follows_full() -> None:
    prog = _llama()
    programs = fuse_programs(edatalog.plan(prog, topology="cpux2", strategy="megatron").schedule.programs, prog.graph)
    marked = mark_full(programs, prog.graph)
    marked.verify()

    def full(p: ir.Programs, node: str) -> bool:
        return all(op.full for _, _, op in p.ops() if isinstance(op, ir.Kernel) and op.node == node)

    assert not full(programs, "attn") and full(marked, "attn") and full(marked, "down")
    assert all(op.full for _, _, op in marked.ops() if isinstance(op, ir.Recv | ir.Combine))
    _check_values(prog, marked)


@pytest.mark.parametrize(("topology", "strategy", "seed"), [
    ("cpux2", "random", 0),
    ("cpux3", "random", 1),
    ("a100x4", "random", 2),
    ("2x4", "megatron", 0),
    ("2x4", "random", 0),
])  # fmt: skip
def test_rewritten_plans_compute_the_reference(topology: str, strategy: str, seed: int) -> None:
    prog = _llama(6)  # grouped-query attention: 2 query heads per key/value head
    programs = _rewritten(prog, edatalog.plan(prog, topology=topology, strategy=strategy, seed=seed))
    assert collectives_of(programs)
    _check_values(prog, programs)


def test_a_hierarchical_reduction_is_reduce_scatters_inside_nodes_then_all_reduces_across() -> None:
    prog = _llama()
    programs = _rewritten(prog, edatalog.plan(prog, topology="2x4", strategy="megatron", reduction="hierarchical"))
    kinds = _kinds(programs)
    for relation in ("attn", "down"):
        assert kinds[("reduce_scatter", relation, 4)] == 2  # one per node of four
        assert kinds[("all_reduce", relation, 2)] == 4  # then each piece across the two nodes
    for members in collectives_of(programs).values():
        op = members[0][1]
        assert op.kind is not ir.CollectiveKind.REDUCE_SCATTER or len({d // 4 for d in op.group}) == 1
        assert op.kind is not AR or len({d // 4 for d in op.group}) == 2


def test_auto_reduces_directly_where_the_library_runs_collectives() -> None:
    """On NCCL a direct reduction across nodes becomes one collective, which the library (and
    the cost model) runs hierarchically where that is faster; the hierarchical exchange stays
    messages.  So ``auto`` reduces directly there, and hierarchically where exchanges are
    messages."""
    prog = _llama()
    auto = edatalog.plan(prog, topology="2x4", strategy="megatron")
    direct = edatalog.plan(prog, topology="2x4", strategy="megatron", reduction="direct")
    hierarchical = edatalog.plan(prog, topology="2x4", strategy="megatron", reduction="hierarchical")
    assert auto.report.seconds == direct.report.seconds < hierarchical.report.seconds
    kinds = _kinds(_rewritten(prog, auto))
    assert kinds[("all_reduce", "attn", 8)] >= 1 and not kinds[("reduce_scatter", "attn", 4)]
    messages = Options(Collectives.OFF)
    as_messages = edatalog.Plan(auto.ir, prog.graph, auto.topology, options=messages)
    as_hierarchical = edatalog.Plan(auto.ir, prog.graph, auto.topology, "hierarchical", options=messages)
    assert as_messages.report.bytes_moved == as_hierarchical.report.bytes_moved


# -- what stays point-to-point ------------------------------------------------------------------------


def _split_sum(text: str, n: int) -> tuple[edatalog.Program, Plan]:
    """``y[..] += x[i, j] ...`` with the summed index ``j`` split over ``n`` devices, and ``y``
    whole on every device at the end."""
    prog = _compile(text)
    g = prog.graph
    node = g.nodes[0]
    splits = tuple(Split.even(i.name, i.extent, n if i.name == "j" else 1) for i in node.indices)
    tile = Tile(splits, tuple((k,) for k in range(n)))
    x = place_by_consumers(g, {node.name: tile}, "x", n)
    y = Tile.whole(g.relation("y").box, range(n))
    every = (NodePlan(node.name, tile),)
    return prog, Plan(g.fingerprint(), n, f"cpux{n}", "test", every, (Placement("x", x),), (Placement("y", y),))


def test_partials_that_may_lack_cells_stay_point_to_point() -> None:
    # The cells (i, k) of a partial are where its j reach i + k - 1 or i + k: a diagonal band of
    # its box, whose other cells are absent; its mask travels with it.
    text = "dim N = 8.\ninput x[N, N] : f32.\noutput y.\ny[i, k:N] += x[i, j] where j <= i + k, j + 1 >= i + k."
    prog, plan = _split_sum(text, 2)
    programs = synthesize(prog.graph, plan, preset("cpux2")).programs
    marked = mark_full(programs, prog.graph)
    rewritten = use_collectives(marked, prog.graph)
    assert not collectives_of(rewritten.programs)
    assert rewritten.programs == marked and not rewritten.moved
    assert any(isinstance(op, ir.Combine) and not op.full for _, _, op in rewritten.programs.ops())
    _check_values(prog, rewritten.programs)


def test_the_same_sum_without_the_guard_is_an_all_reduce_whose_pieces_are_outputs() -> None:
    prog, plan = _split_sum("dim N = 8.\ninput x[N, N] : f32.\noutput y.\ny[i] += x[i, j].", 2)
    schedule = synthesize(prog.graph, plan, preset("cpux2"))
    rewritten = use_collectives(schedule.programs, prog.graph)
    rewritten.programs.verify()
    assert _kinds(rewritten.programs) == {("all_reduce", "y", 2): 1}
    # y ends whole on both devices: the received pieces held it, now the all-reduce's buffer does.
    assert rewritten.moved
    held = {p.buf for p in rewritten.programs.outputs}
    assert held == {op.buf for _, _, op in rewritten.programs.ops() if isinstance(op, ir.Collective)}
    outputs = rewritten.outputs(schedule.outputs)
    assert {b for e in outputs["y"] for b in e.holders.values()} == held
    assert all(isinstance(e, Entry) for e in outputs["y"])
    _check_values(prog, rewritten.programs)


def test_a_collective_that_would_wait_forever_stays_point_to_point() -> None:
    """Device 1 sends ``t`` only after its all-reduce would meet; device 0 receives ``t`` before
    its own would.  As messages the programs run through; as one collective they would not."""
    prog = _compile("dim N = 4.\ninput a[N] : f32.\ninput t[N] : f32.\noutput s.\ns[i] += a[i].")
    lo, hi, whole = Region((((0, 2),),)), Region((((2, 4),),)), Region((((0, 4),),))
    relations = (("a", (4,), "f32"), ("t", (4,), "f32"), ("s", (4,), "f32"))
    dev0 = (
        ir.Load(0, "s", whole, "f32"),
        ir.Send(0, 1, 10, hi),
        ir.Recv(20, 1, 20, "t", whole, "f32", True),
        ir.Recv(11, 1, 11, "s", lo, "f32", True),
        ir.Combine(12, "s", lo, (0, 11), "f32", True),
        ir.Send(12, 1, 13, lo),
        ir.Recv(14, 1, 14, "s", hi, "f32", True),
    )
    dev1 = (
        ir.Load(1, "s", whole, "f32"),
        ir.Load(2, "t", whole, "f32"),
        ir.Send(1, 0, 11, lo),
        ir.Recv(10, 0, 10, "s", hi, "f32", True),
        ir.Combine(15, "s", hi, (1, 10), "f32", True),
        ir.Send(15, 0, 14, hi),
        ir.Send(2, 0, 20, whole),
        ir.Recv(13, 0, 13, "s", lo, "f32", True),
    )
    outputs = (ir.OutputPiece("s", lo, 0, 12), ir.OutputPiece("s", hi, 0, 14))
    programs = ir.Programs("test", relations, (ir.DeviceProgram(0, dev0), ir.DeviceProgram(1, dev1)), outputs)
    programs.verify()
    assert not collectives_of(use_collectives(programs, prog.graph).programs)
    # Without the message in the way, the same exchange is an all-reduce.
    dev0_free = tuple(op for op in dev0 if not (isinstance(op, ir.Recv) and op.tag == 20))
    dev1_free = tuple(op for op in dev1 if not (isinstance(op, ir.Send) and op.tag == 20))
    free = ir.Programs("test", relations, (ir.DeviceProgram(0, dev0_free), ir.DeviceProgram(1, dev1_free)), outputs)
    rewritten = use_collectives(free, prog.graph)
    rewritten.programs.verify()
    assert _kinds(rewritten.programs) == {("all_reduce", "s", 2): 1}


# -- the IR op ----------------------------------------------------------------------------------------


def _two_all_reduces(order1: tuple[int, int] = (0, 1), **change: Any) -> ir.Programs:
    """Two devices, each all-reducing its partials of ``s`` (#10) and then ``t`` (#11); device 1
    in ``order1``, its ``s`` op with ``change``."""
    whole = Region((((0, 4),),))
    relations = (("s", (4,), "f32"), ("t", (4,), "f32"))

    def member(d: int, base: int) -> list[ir.Op]:
        ops: list[ir.Op] = [ir.Load(base, "s", whole, "f32"), ir.Load(base + 1, "t", whole, "f32")]
        colls = [
            ir.Collective(base + 2, AR, (0, 1), 10, "s", whole, (), base, "sum", whole, "f32"),
            ir.Collective(base + 3, AR, (0, 1), 11, "t", whole, (), base + 1, "max", whole, "f32"),
        ]
        if d == 1 and change:
            colls[0] = ir.Collective(**{**colls[0].__dict__, **change})
        return ops + [colls[k] for k in (order1 if d == 1 else (0, 1))]

    devices = (ir.DeviceProgram(0, tuple(member(0, 0))), ir.DeviceProgram(1, tuple(member(1, 10))))
    return ir.Programs("test", relations, devices, ())


def test_collectives_verify_and_round_trip() -> None:
    programs = _two_all_reduces()
    programs.verify()
    back = ir.Programs.from_json(programs.to_json())
    assert back == programs
    op = back.devices[0].ops[2]
    assert isinstance(op, ir.Collective) and op.kind is AR
    assert str(op) == "%2 = all_reduce sum s[0:4] (%0) group {0,1} #10"
    assert ir.run_order(programs)[-1] in {(0, 3), (1, 3)}


@pytest.mark.parametrize(
    ("order1", "change", "message"),
    [
        ((1, 0), {}, "come in different orders"),
        ((0, 1), {"dtype": "f64"}, "is s in f32"),
        ((0, 1), {"whole": Region((((0, 2),),)), "region": Region((((0, 2),),))}, "disagrees with device 0"),
        ((0, 1), {"reduce": "max"}, "disagrees with device 0"),
        ((0, 1), {"group": (0, 1, 2)}, "a group of unknown devices"),
        ((0, 1), {"group": (1, 0)}, "bad group [1, 0]"),
        ((0, 1), {"full": False}, "cells that may be absent"),
        ((0, 1), {"reduce": None}, "reduces with None"),
        ((0, 1), {"region": Region((((0, 2),),))}, "makes [0:2], not [0:4]"),
    ],
)
def test_verify_rejects_collectives_whose_members_do_not_agree(
    order1: tuple[int, int], change: dict[str, Any], message: str
) -> None:
    with pytest.raises(VerifyError, match=message.replace("[", r"\[")):
        _two_all_reduces(order1, **change).verify()


def test_verify_rejects_a_collective_on_one_member_only() -> None:
    programs = _two_all_reduces()
    one = ir.DeviceProgram(1, programs.devices[1].ops[:2] + programs.devices[1].ops[3:])
    with pytest.raises(VerifyError, match=r"collective #10 is on devices \[0\], not \[0, 1\]"):
        ir.Programs("test", programs.relations, (programs.devices[0], one), ()).verify()


def test_whether_to_use_them(monkeypatch: pytest.MonkeyPatch) -> None:
    every, reduce_only = set(ir.CollectiveKind), {ir.CollectiveKind.ALL_REDUCE}
    assert Collectives.AUTO.kinds(Library.NCCL) == every and Collectives.AUTO.kinds(Library.GLOO) == reduce_only
    assert Collectives.ON.kinds(Library.GLOO) == every and not Collectives.OFF.kinds(Library.NCCL)
    # The choice is the lowered plan's, never the environment's: the old variable changes nothing.
    prog = _llama()
    plan = edatalog.plan(prog, topology="cpux2", strategy="megatron")
    monkeypatch.setenv("EDL_COLLECTIVES", "0")
    assert plan.lowered.kinds == reduce_only and collectives_of(plan.lowered.programs)
    assert plan.report.seconds == edatalog.plan(prog, topology="cpux2", strategy="megatron").report.seconds


def test_only_the_kinds_asked_for_are_rewritten() -> None:
    """On gloo the runtime asks for all-reduces only: the rest stays point-to-point."""
    prog = _llama()
    plan = edatalog.plan(prog, topology="cpux2", strategy="megatron")
    programs = mark_full(fuse_programs(plan.schedule.programs, prog.graph), prog.graph)
    kinds = {c[0][1].kind for c in collectives_of(use_collectives(programs, prog.graph).programs).values()}
    assert kinds == {AR}
    assert not collectives_of(use_collectives(programs, prog.graph, {ir.CollectiveKind.ALL_GATHER}).programs)
    mixed = mark_full(
        fuse_programs(edatalog.plan(prog, topology="cpux2", strategy="random", seed=1).schedule.programs, prog.graph),
        prog.graph,
    )
    every = use_collectives(mixed, prog.graph).programs
    only = use_collectives(mixed, prog.graph, {AR}).programs
    assert {c[0][1].kind for c in collectives_of(every).values()} == set(ir.CollectiveKind)
    assert {c[0][1].kind for c in collectives_of(only).values()} == {AR}
    only.verify()
    _check_values(prog, only)


# -- across processes ---------------------------------------------------------------------------------


def collective_rank(
    plans: list[str], kvh: int, shared: bool = True
) -> dict[str, tuple[list[dict[str, np.ndarray]], int, int]]:
    """One rank (spawned): each plan run with collectives forced on, three times (interpreted,
    recorded, replayed as graphs whose collectives are torch's functional ones); the outputs of
    the first and the last call, how many collectives this rank's program has, and how many
    all-reduce chunks went through shared memory.  Without ``shared``, the ranks behave as if
    they could not share memory: all-reduces take the next route (pairwise exchanges, gloo's)."""
    import torch

    from edatalog.backend.running import shm_all_reduce as shm
    from edatalog.backend.running.segments import CompiledSpmdExecutable
    from edatalog.backend.running.spmd import init_group

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    init_group("cpu")
    if not shared:
        shm.register = lambda group, timeout, slot_bytes=0: False
    prog = edatalog.compile(LLAMA, dims={**DIMS, "KVH": kvh})
    values = prog.random_inputs(seed=0)
    params = {r.name: values[r.name] for r in prog.arguments if r.kind == "param"}
    inputs = {k: v for k, v in values.items() if k not in params}
    out = {}
    for path in plans:
        plan = edatalog.load_plan(path, prog)
        exe = CompiledSpmdExecutable(prog.graph, plan.lowering(Options(Collectives.ON)), "cpu")
        exe.load(params)
        calls = [exe(inputs) for _ in range(3)]
        assert exe._replayed
        count = sum(isinstance(op, ir.Collective) for op in exe.program.ops)
        chunks = sum({id(seg): seg.sequence for seg in shm._GROUPS.values()}.values())
        out[Path(path).stem] = ([{k: v.numpy() for k, v in calls[k].values.items()} for k in (0, 2)], count, chunks)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(("n", "shared"), [(2, True), (3, True), (2, False)])
def test_spmd_ranks_run_collectives_to_the_reference(
    n: int, shared: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edatalog.backend.running.launch import spawn

    monkeypatch.setenv("EDL_DIST_TIMEOUT", "30")
    kvh = 6
    prog = _llama(kvh)
    paths = []
    for strategy in ("megatron", "random"):
        path = tmp_path / f"{strategy}.json"
        edatalog.plan(prog, topology=MACHINES[n], strategy=strategy, seed=n).save(path)
        paths.append(str(path))
    want = prog.run(prog.random_inputs(seed=0))
    got = spawn(n, collective_rank, (paths, kvh, shared))
    assert sorted(got) == list(range(n))
    for strategy in ("megatron", "random"):
        assert sum(got[r][strategy][1] for r in got) > 0, strategy  # collectives did run
        # Through shared memory where the ranks share it (ranks of one machine); not otherwise.
        assert (got[0]["megatron"][2] > 0) is shared
        for rank, results in got.items():
            for call, outputs in zip(("interpreted", "replayed"), results[strategy][0], strict=True):
                for name, w in want.items():
                    scale = float(np.abs(w).max())
                    assert np.abs(outputs[name] - w).max() <= 1e-4 * scale, (strategy, rank, name, call)
