"""Property tests: random programs (:mod:`tests.strategies`) under random plans, run by the simulated
multi-device executor, against the reference evaluator.

Each example draws a program, a device count N in 1..8, a machine (``cpuxN`` or ``a100xN``, and
``2x4`` when N is 8, whose two nodes make reductions hierarchical), a reduction schedule and a
seed for :func:`~edatalog.solver.strategies.random_plan` (uneven splits, random devices, replicated
blocks, sometimes placed outputs).  The synthesized schedule must

- compute every output exactly as the reference does, in f64: the same presence mask, values to
  rtol 1e-9 / atol 1e-12, absent cells 0; on every device that holds a piece of an output (each
  replica is gathered in turn), and covering every cell the plan places on a device;
- never let a task read a buffer on another device (the simulator raises ``SimError``; the
  schedule is also checked statically: reads on the task's device, inside the buffer, after it);
- send exactly its region: ``nbytes == region.size * itemsize``, never to itself, never nothing;
- never deliver a cell twice to a device from the same piece of a relation's final layout (or the
  same partial result), nor a piece the device already holds;
- time it sanely: :func:`~edatalog.backend.predicting.timeline.analyze` gives non-negative spans, every task
  starts after its dependencies end, a device's kernels do not overlap, traffic and flops add up,
  and peak memory is at least what stays resident.

CI runs a fixed, derandomized set of examples.  For a longer, random run::

    EDL_SIM_EXAMPLES=5000 .venv/bin/pytest tests/backend/test_sim_property.py

(add ``--hypothesis-seed=N`` to repeat one).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import warnings
from collections.abc import Mapping
from typing import TypeAlias

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import edatalog
from edatalog.backend.kernels.reference import Value
from edatalog.backend.lowering.exchange import REDUCTIONS, Schedule, synthesize
from edatalog.backend.lowering.lowered import AS_SYNTHESIZED, Lowered, lower
from edatalog.backend.lowering.tasks import Entry
from edatalog.backend.predicting.timeline import Report, analyze
from edatalog.backend.running import sim
from edatalog.errors import EdlWarning
from edatalog.ir import dtypes
from edatalog.ir import program as ir
from edatalog.ir.graph import VerifyError
from edatalog.ir.regions import Region
from edatalog.solver.costmodel import collective_bytes
from edatalog.solver.plan import NodePlan, Placement, Plan, Split, Tile
from edatalog.solver.strategies import random_plan
from edatalog.solver.topology import preset
from tests.strategies import GeneratedProgram, example_settings, programs

_SETTINGS = example_settings("EDL_SIM_EXAMPLES", 100)
RTOL, ATOL = 1e-9, 1e-12


@dataclasses.dataclass(frozen=True)
class Case:
    gen: GeneratedProgram
    topology: str
    reduction: str
    seed: int

    def __repr__(self) -> str:
        return f"Case(topology={self.topology!r}, reduction={self.reduction!r}, seed={self.seed}, {self.gen!r})"


# Hypothesis draws the first options of a choice most often (and shrinks towards them): machines
# with several devices come first, 2x4 (two nodes: hierarchical reductions) first among those of 8.
_DEVICES = (8, 3, 4, 5, 2, 6, 7, 1)


@st.composite
def machines(draw: st.DrawFn) -> tuple[str, str]:
    """A machine of N = 1..8 devices and a reduction schedule."""
    n = draw(st.sampled_from(_DEVICES))
    names = ["2x4", f"a100x{n}", f"cpux{n}"] if n == 8 else [f"a100x{n}", f"cpux{n}"]
    return draw(st.sampled_from(names)), draw(st.sampled_from(REDUCTIONS))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    gen = draw(programs())
    topology, reduction = draw(machines())
    return Case(gen, topology, reduction, draw(st.integers(0, 2**32 - 1)))


# -- comparing values ------------------------------------------------------------------------------


def _present(v: Value) -> np.ndarray:
    return np.ones(v.data.shape, dtype=bool) if v.present is None else np.asarray(v.present)


def _assert_matches(name: str, got: Value, want: Value) -> None:
    assert got.data.shape == want.data.shape, f"{name}: shape {got.data.shape}, expected {want.data.shape}"
    assert got.data.dtype == want.data.dtype, f"{name}: dtype {got.data.dtype}, expected {want.data.dtype}"
    got_present, want_present = _present(got), _present(want)
    assert np.array_equal(got_present, want_present), (
        f"{name}: presence\n{got_present.astype(int)}\nexpected\n{want_present.astype(int)}"
    )
    values = np.asarray(got.data, dtype=np.float64)
    expect = np.asarray(want.data, dtype=np.float64)
    np.testing.assert_allclose(
        values[want_present], expect[want_present], rtol=RTOL, atol=ATOL, err_msg=f"{name}: values"
    )
    assert np.all(values[~want_present] == 0), f"{name}: absent cells must hold 0"


# -- schedule invariants --------------------------------------------------------------------------


def _itemsize(s: Schedule | Lowered, relation: str) -> int:
    return dtypes.itemsize(s.graph.relation(relation).dtype)


def _cells(mask: np.ndarray, region: Region) -> np.ndarray:
    """The cells of ``region`` in a mask over a whole relation, as a new array."""
    return Region.whole(mask.shape).cut(mask, region)


def _mark(mask: np.ndarray, region: Region) -> None:
    mask[region.at(Region.whole(mask.shape))] = True


def _sends(s: Schedule) -> list[tuple[int, ir.Send]]:
    return [(d, op) for d, _, op in s.programs.ops() if isinstance(op, ir.Send)]


def _check_schedule(s: Schedule) -> None:
    """The programs' own invariants (reads defined and covered, sends and receives paired, no
    wait cycle), then what the IR cannot know: loads and transfers cost their cells' bytes,
    and nothing is received twice."""
    s.programs.verify()
    relation_of = {op.buf: op.relation for _, _, op in s.programs.ops() if isinstance(op, ir.DEFINES)}
    for d, k, op in s.programs.ops():
        cost = s.costs.get((d, k))
        if isinstance(op, ir.Free):
            assert cost is None, f"device {d}: a free has a cost"
            continue
        assert cost is not None, f"device {d}: {op} has no cost"
        if isinstance(op, ir.Load | ir.Recv | ir.Send):
            relation = op.relation if isinstance(op, ir.Load | ir.Recv) else relation_of[op.buf]
            expect = op.region.size * _itemsize(s, relation)
            assert cost.nbytes == expect, f"device {d}: {op} moves {cost.nbytes} bytes: expected {expect}"
        if isinstance(op, ir.Send):
            assert not op.region.empty, f"device {d}: {op} sends nothing"
    _check_no_double_receive(s, relation_of)


def _check_no_double_receive(s: Schedule, relation_of: Mapping[int, str]) -> None:
    """No device receives a cell twice from the same piece of a relation's final layout (or from
    the same partial result, for sends of a reduction), nor a piece it already holds."""
    pieces: dict[int, list[tuple[int, Entry]]] = {}  # buffer -> (piece number, entry) it holds
    for entries in s.layout.values():
        for k, e in enumerate(entries):
            for buf in e.holders.values():
                pieces.setdefault(buf, []).append((k, e))
    received: dict[tuple[int, str, str, int], np.ndarray] = {}
    for _, op in _sends(s):
        relation = relation_of[op.buf]
        shape = s.graph.relation(relation).shape
        piece = next(((k, e) for k, e in pieces.get(op.buf, []) if e.region.contains(op.region)), None)
        if piece is not None:
            k, e = piece
            assert op.peer not in e.holders, f"{op}: device {op.peer} already holds piece {k} of {relation}"
            key = (op.peer, relation, "piece", k)
        else:
            key = (op.peer, relation, "partial", op.buf)
        mask = received.setdefault(key, np.zeros(shape, dtype=bool))
        assert not _cells(mask, op.region).any(), (
            f"{op}: device {op.peer} receives cells of {relation} {op.region} from {key[2]} {key[3]} a second time"
        )
        _mark(mask, op.region)


def _check_report(r: Report) -> None:
    """The timeline of the programs it timed (``r.lowered``: as synthesized, or as the runtimes
    run them) respects every dependency, collectives' meetings included, and runs one kernel at
    a time per device."""
    s = r.lowered
    ops = {(d, k): op for d, k, op in s.programs.ops() if not isinstance(op, ir.Free)}
    assert set(r.times) == set(ops)
    maker = {op.buf: key for key, op in ops.items() if isinstance(op, ir.DEFINES)}
    send_at = {op.tag: key for key, op in ops.items() if isinstance(op, ir.Send)}
    members: dict[int, list[tuple[int, int]]] = {}
    for key, op in ops.items():
        if isinstance(op, ir.Collective):
            members.setdefault(op.tag, []).append(key)
    for key, op in ops.items():
        span = r.times[key]
        assert 0.0 <= span.start <= span.end, f"{op}: span {span}"
        waits = [maker[b] for b in ir.reads(op)] + ([send_at[op.tag]] if isinstance(op, ir.Recv) else [])
        if isinstance(op, ir.Collective):
            waits = [maker[b] for m in members[op.tag] for b in ir.reads(ops[m])]
            assert {r.times[m] for m in members[op.tag]} == {span}, f"{op}: members apart"
        for dep in waits:
            assert r.times[dep].end <= span.start + 1e-15, f"{op} starts at {span.start}, before {dep} ends"
    assert r.seconds == max((sp.end for sp in r.times.values()), default=0.0)
    for d in range(s.n_devices):
        kernels = sorted(
            (r.times[key].start, r.times[key].end)
            for key, op in ops.items()
            if key[0] == d and isinstance(op, ir.Kernel | ir.Combine | ir.Fused)
        )
        for a, b in itertools.pairwise(kernels):
            assert a[1] <= b[0], f"device {d}: kernels overlap"
    recvs = [(key, op) for key, op in ops.items() if isinstance(op, ir.Recv)]
    per_link: dict[tuple[int, int], int] = {}
    for (d, k), op in recvs:
        per_link[(op.peer, d)] = per_link.get((op.peer, d), 0) + s.costs[(d, k)].nbytes
    for keys in members.values():  # a ring: each member sends its successor its share
        op = ops[keys[0]]
        assert isinstance(op, ir.Collective)
        moved = collective_bytes(op.kind, s.costs[keys[0]].nbytes, len(op.group))
        for j, d in enumerate(op.group):
            succ = op.group[(j + 1) % len(op.group)]
            per_link[(d, succ)] = per_link.get((d, succ), 0) + moved
    assert r.bytes_per_link == per_link
    for d in range(s.n_devices):
        assert r.sent[d] == sum(v for (a, _), v in per_link.items() if a == d)
        assert r.received[d] == sum(v for (_, b), v in per_link.items() if b == d)
        kernel_flops = [
            s.costs[key].flops
            for key, op in ops.items()
            if key[0] == d and isinstance(op, ir.Kernel | ir.Combine | ir.Fused)
        ]
        assert r.flops[d] == sum(kernel_flops) and r.flops[d] >= 0
        resident = sum(s.costs[key].nbytes for key, op in ops.items() if key[0] == d and isinstance(op, ir.Load))
        largest = max(
            (
                op.region.size * _itemsize(s, op.relation)
                for key, op in ops.items()
                if key[0] == d and isinstance(op, ir.DEFINES)
            ),
            default=0,
        )
        assert r.peak_memory[d] >= max(resident, largest), f"device {d}: peak memory {r.peak_memory[d]}"


def _check_outputs(s: Schedule, inputs: dict[str, np.ndarray], want: dict[str, Value]) -> None:
    """Gather every output from each of its replicas in turn; and check that each device the plan
    places an output on holds every cell of its blocks."""
    graph = s.graph
    assert set(s.outputs) == set(graph.outputs)
    for p in s.plan.outputs:
        rel = graph.relation(p.relation)
        present = _present(want[p.relation])
        for block in p.tile.blocks():
            region = Region.of_box(rel.shape, tuple(block.ranges[a] for a in rel.axis_names))
            for d in block.devices:
                held = np.zeros(rel.shape, dtype=bool)
                for e in s.outputs[p.relation]:
                    if d in e.holders:
                        _mark(held, e.region)
                missing = _cells(present & ~held, region)
                assert not missing.any(), f"output {p.relation}: device {d} lacks cells of its block {region}"
    made = {op.buf: (d, op) for d, _, op in s.programs.ops() if isinstance(op, ir.DEFINES)}
    for name, entries in s.outputs.items():
        for e in entries:
            for d, buf in e.holders.items():
                device, op = made[buf]
                assert device == d and op.relation == name and op.region.contains(e.region), f"output {name}: {op}"
    replicas = max((len(e.holders) for entries in s.outputs.values() for e in entries), default=1)
    for turn in range(replicas):
        outputs = {
            name: [
                Entry(e.region, dict([list(e.holders.items())[turn % len(e.holders)]]) if e.holders else {})
                for e in entries
            ]
            for name, entries in s.outputs.items()
        }
        got = sim.run(lower(_with_outputs(s, outputs), AS_SYNTHESIZED), inputs)
        assert set(got) == set(graph.outputs)
        for name in graph.outputs:
            _assert_matches(f"{name} (replica {turn})" if replicas > 1 else name, got[name], want[name])


def _with_outputs(s: Schedule, outputs: dict[str, list[Entry]]) -> Schedule:
    """``s`` with its outputs ending in ``outputs`` (one holder of several, say)."""
    pieces = tuple(
        ir.OutputPiece(name, e.region, d, b)
        for name, entries in outputs.items()
        for e in entries
        for d, b in sorted(e.holders.items())
    )
    return dataclasses.replace(s, programs=dataclasses.replace(s.programs, outputs=pieces), outputs=outputs)


def _check(prog: edatalog.Program, values: dict[str, np.ndarray], topology: str, reduction: str, seed: int) -> None:
    graph = prog.graph
    machine = preset(topology)
    plan = random_plan(graph, machine, seed)
    schedule = synthesize(graph, plan, machine, reduction)
    _check_schedule(schedule)
    _check_report(analyze(lower(schedule)))
    _check_report(analyze(lower(schedule, AS_SYNTHESIZED)))
    inputs = prog.prepare(values)
    _check_outputs(schedule, inputs, prog.evaluate(inputs))


@_SETTINGS
@given(cases())
def test_sim_matches_reference(case: Case) -> None:
    _check(case.gen.compile(), case.gen.inputs, case.topology, case.reduction, case.seed)


@example_settings("EDL_SIM_EXAMPLES", 100)
@given(cases(), st.integers(0, 2**32 - 1))
def test_any_interleaving_of_the_devices_gives_the_reference(case: Case, order: int) -> None:
    """Devices take turns one op at a time in a random order (a receive waits for its send):
    the programs must not rely on one global order, as real devices and ranks do not."""
    prog = case.gen.compile()
    machine = preset(case.topology)
    schedule = synthesize(prog.graph, random_plan(prog.graph, machine, case.seed), machine, case.reduction)
    inputs = prog.prepare(case.gen.inputs)
    want = prog.evaluate(inputs)
    got = sim.run(lower(schedule, AS_SYNTHESIZED), inputs, interleave=random.Random(order))
    for name in prog.graph.outputs:
        _assert_matches(name, got[name], want[name])


def test_programs_that_wait_for_each_other_are_refused() -> None:
    """Device 0 receives before it sends, and so does device 1: each waits for the other forever.
    ``verify`` finds the cycle, and the simulator reports where the devices are stuck."""
    region = Region.whole((2,))
    progs = ir.Programs(
        "none",
        (("x", (2,), "f64"),),
        (
            ir.DeviceProgram(
                0,
                (
                    ir.Load(0, "x", region, "f64"),
                    ir.Recv(2, 1, 11, "x", region, "f64", True),
                    ir.Send(0, 1, 10, region),
                ),
            ),
            ir.DeviceProgram(
                1,
                (
                    ir.Load(1, "x", region, "f64"),
                    ir.Recv(3, 0, 10, "x", region, "f64", True),
                    ir.Send(1, 0, 11, region),
                ),
            ),
        ),
        (),
    )
    with pytest.raises(VerifyError, match="deadlock"):
        progs.verify()
    prog = _compile("dim N = 2.\ninput x[N] : f64.\ny[i] = x[i].\n")
    schedule = synthesize(prog.graph, random_plan(prog.graph, preset("a100x2"), 0), preset("a100x2"))
    with pytest.raises(sim.SimError, match="wait forever"):
        sim.run(dataclasses.replace(lower(schedule, AS_SYNTHESIZED), programs=progs), {"x": np.zeros(2)})


def test_device_programs_round_trip_through_json() -> None:
    prog = _compile("dim N = 6.\ninput x[N, N] : f64.\ns[i] += x[i, j] * x[j, i] where j <= i.\n")
    machine = preset("a100x3")
    schedule = synthesize(prog.graph, random_plan(prog.graph, machine, 3), machine)
    text = schedule.programs.to_json()
    again = ir.Programs.from_json(text)
    assert again == schedule.programs and again.fingerprint() == schedule.programs.fingerprint()
    with pytest.raises(ValueError, match="unknown IR object type"):
        ir.Programs.from_json(text.replace('"Recv"', '"os.system"', 1))


# -- '=' rules whose blocks overlap ------------------------------------------------------------------

# Disjoint guards whose blocks, tightened to bounding boxes, still overlap: each block is present
# only on its own cells.  (The generator makes such groups rarely; they need every layer to respect
# presence: reads, gathers, placements and the receive cache.)
_EQ_GUARDS = (
    ("i == {c}", "i != {c}"),
    ("j == {c}", "j != {c}"),
    ("i < j", "i >= j"),
    ("i <= j", "i > j"),
    ("i < j", "i > j"),  # the diagonal is absent
    ("i == j", "i != j"),
    ("i + j < {c}", "i + j >= {c}"),
)
_EQ_BODIES = ("x[i, j]", "2.0 * y[i, j]", "x[i, j] + y[i, j]", "tanh(x[i, j]) - z[j]")
_EQ_READERS = (
    "s[i] += r[i, j] * z[j].",
    "t[j] max= r[i, j] - x[i, j].",
    "u[i, j] = r[i, j] + 1.0.",
    "v[j, i] = r[i, j].",
    "w[] += r[i, j].",
)


@dataclasses.dataclass(frozen=True)
class EqCase:
    source: str
    values: dict[str, np.ndarray]
    topology: str
    reduction: str
    seed: int

    def __repr__(self) -> str:
        return f"EqCase(topology={self.topology!r}, reduction={self.reduction!r}, seed={self.seed})\n{self.source}"


@st.composite
def eq_cases(draw: st.DrawFn) -> EqCase:
    n, m = draw(st.integers(2, 5)), draw(st.integers(2, 5))
    first, second = draw(st.sampled_from(_EQ_GUARDS))
    c = draw(st.integers(0, 7))
    # The constant of a guard: a row for i, a column for j, a diagonal inside the box for i + j.
    const = {"i": c % n, "j": c % m, "+": 1 + c % (n + m - 2)}
    rules = []
    for g in (first, second):
        guard = g.format(c=const["+" if "+" in g else g[0]])
        rules.append(f"r[i, j] = {draw(st.sampled_from(_EQ_BODIES))} where {guard}.")
    if draw(st.booleans()):
        rules.reverse()
    readers = draw(st.lists(st.sampled_from(_EQ_READERS), max_size=3, unique=True))
    heads = [line.split("[")[0] for line in readers]
    outputs = draw(st.lists(st.sampled_from(["r", *heads]), min_size=1, unique=True))
    lines = [
        f"dim N = {n}, M = {m}.",
        "input x[N, M] : f64.",
        "input y[N, M] : f64.",
        "input z[M] : f64.",
        f"output {', '.join(outputs)}.",
        *rules,
        *readers,
    ]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = {"x": rng.uniform(-2, 2, (n, m)), "y": rng.uniform(-2, 2, (n, m)), "z": rng.uniform(-2, 2, m)}
    topology, reduction = draw(machines())
    return EqCase("\n".join(lines) + "\n", values, topology, reduction, draw(st.integers(0, 2**32 - 1)))


@_SETTINGS
@given(eq_cases())
def test_sim_matches_reference_when_eq_blocks_overlap(case: EqCase) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        prog = edatalog.compile_string(case.source, name="<eq>")
    _check(prog, case.values, case.topology, case.reduction, case.seed)


# -- regressions: bugs the properties above found (all fixed) -------------------------------------


def _compile(source: str) -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.compile_string(source, name="<regression>")


_Blocks: TypeAlias = tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]  # cuts, devices per block


def _plan(
    prog: edatalog.Program,
    n: int,
    nodes: Mapping[str, _Blocks],
    outputs: Mapping[str, _Blocks] | None = None,
    inputs_on: tuple[int, ...] = (0,),
) -> Plan:
    """A plan for programs over one index ``i`` (relations of rank 1): ``nodes[name] = (cuts,
    devices per block)``; inputs whole on ``inputs_on``; ``outputs`` placed likewise."""
    graph = prog.graph

    def tile(cuts: tuple[int, ...], devices: tuple[tuple[int, ...], ...], index: str) -> Tile:
        return Tile((Split(index, cuts),), devices)

    plan_nodes = tuple(NodePlan(node.name, tile(*nodes[node.name], "i")) for node in graph.nodes)
    ins = tuple(Placement(r.name, Tile.whole(r.box, inputs_on)) for r in graph.relations if r.kind != "derived")
    outs = tuple(
        Placement(name, tile(cuts, devices, graph.relation(name).axis_names[0]))
        for name, (cuts, devices) in (outputs or {}).items()
    )
    return Plan(graph.fingerprint(), n, f"cpux{n}", "hand", plan_nodes, ins, outs)


def _run_hand(prog: edatalog.Program, plan: Plan, values: dict[str, np.ndarray]) -> Schedule:
    """Synthesize, check the schedule's invariants and its outputs against the reference."""
    schedule = synthesize(prog.graph, plan, preset(plan.topology))
    _check_schedule(schedule)
    _check_report(analyze(lower(schedule)))
    _check_report(analyze(lower(schedule, AS_SYNTHESIZED)))
    inputs = prog.prepare(values)
    _check_outputs(schedule, inputs, prog.evaluate(inputs))
    return schedule


# Two '=' rules for r, disjoint by guards, whose single blocks both span all of i: the block of
# ``i != 1`` holds cell 1 as absent, the block of ``i == 1`` holds only cell 1.
_EQ_PAIR = "dim N = 4.\ninput x[N] : f64.\ninput y[N] : f64.\n{first}\n{second}\n{rest}"
_EQ = "r[i] = y[i] where i == 1."
_NE = "r[i] = x[i] where i != 1."
_VALUES = {"x": np.arange(1.0, 5.0), "y": np.full(4, 10.0)}
_WHOLE: _Blocks = ((0, 4), ((0,),))


def test_peak_memory_counts_inputs_when_nothing_is_computed() -> None:
    """Every block is empty, so the schedule is only loads and ends at time 0.  Resident buffers
    were freed at the schedule's end, at the very time they were loaded, and frees sort first at
    equal times: peak memory came out as 0."""
    prog = _compile("dim N = 2.\ninput x[N] : f64.\nr[i] = x[i] where i < i.\n")
    schedule = _run_hand(prog, _plan(prog, 1, {"r": ((0, 2), ((0,),))}), {"x": np.ones(2)})
    assert all(isinstance(op, ir.Load) for _, _, op in schedule.programs.ops())
    assert analyze(lower(schedule)).peak_memory == {0: 16}


def test_overlapping_eq_pieces_do_not_hide_each_others_cells() -> None:
    """The simulator pasted every piece whole, absent cells included: the ``i != 1`` piece, written
    after the ``i == 1`` one, made cell 1 absent, both where a block reads r (s on device 0) and
    where the output is gathered."""
    prog = _compile(_EQ_PAIR.format(first=_EQ, second=_NE, rest="s[i] = r[i] + 0.5.\noutput r, s.\n"))
    nodes: dict[str, _Blocks] = {"r#1": _WHOLE, "r#2": ((0, 4), ((1,),)), "s": _WHOLE}
    _run_hand(prog, _plan(prog, 2, nodes), _VALUES)


def test_received_cells_are_reused_only_from_the_same_piece() -> None:
    """Device 2 received all of the ``i != 1`` piece, then reused that copy for cell 1 of the
    ``i == 1`` piece, where it is absent: s[1] went missing.  The receive cache is per piece."""
    prog = _compile(_EQ_PAIR.format(first=_NE, second=_EQ, rest="s[i] = r[i] + 0.5.\noutput s.\n"))
    nodes: dict[str, _Blocks] = {"r#1": _WHOLE, "r#2": ((0, 4), ((1,),)), "s": ((0, 4), ((2,),))}
    _run_hand(prog, _plan(prog, 3, nodes), _VALUES)


def test_placed_output_keeps_the_same_region_of_two_pieces() -> None:
    """Placing r's block ``1:2`` on device 2 pulls cell 1 from both pieces; the placement kept one
    entry per region, so the second piece's copy (absent there) replaced the first's."""
    prog = _compile(_EQ_PAIR.format(first=_EQ, second=_NE, rest="output r.\n"))
    nodes: dict[str, _Blocks] = {"r#1": _WHOLE, "r#2": ((0, 4), ((1,),))}
    outputs: dict[str, _Blocks] = {"r": ((0, 1, 2, 4), ((2,), (2,), (2,)))}
    _run_hand(prog, _plan(prog, 3, nodes, outputs), _VALUES)


def test_a_device_receives_each_cell_once() -> None:
    """Device 1 needs x[0:2] for a and then x[0:3] for b.  A received region was reused only when
    it contained the whole new part, so x[0:3] was sent whole, x[0:2] a second time; now only x[2]
    is sent."""
    prog = _compile("dim N = 4.\ninput x[N] : f64.\na[i] = x[i] + 1.0.\nb[i] = 2.0 * x[i].\n")
    nodes: dict[str, _Blocks] = {"a": ((0, 2, 4), ((1,), (0,))), "b": ((0, 3, 4), ((1,), (0,)))}
    schedule = _run_hand(prog, _plan(prog, 2, nodes), {"x": np.arange(4.0)})
    assert analyze(lower(schedule)).bytes_per_link == {(0, 1): 3 * 8}
