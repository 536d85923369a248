"""The lowered plan: the one artifact every consumer of a plan takes.

Exchange synthesis (:mod:`edatalog.backend.lowering.exchange`) makes point-to-point programs of
separate kernels.  :func:`lower` then runs the lowering passes on them, once, each a small
rewrite of :class:`~edatalog.ir.program.Programs` checked by ``verify()`` after it runs:

1. ``fusion``: each device's attention blocks, and each param block's AdamW update, become one
   fused kernel (:func:`edatalog.backend.lowering.fusion.fuse_programs`);
2. ``presence``: every buffer that supports and guards make full is marked so, decided
   symbolically (:func:`edatalog.backend.lowering.presence.mark_full`): no runtime decides it
   again, and no presence mask travels for it;
3. ``collectives``: exchanges that are whole collectives of the kinds the options ask for run
   as one collective (:func:`edatalog.backend.lowering.collectives.use_collectives`).

The result, :class:`Lowered`, holds the programs as they run, what each op costs (the side table
the timeline reads), where each output ends, and the options that made it.  The timeline
(:mod:`edatalog.backend.predicting.timeline`), every runtime, calibration and every rank of an
SPMD job consume it; ranks receive it as JSON (:meth:`Lowered.to_json`) and never synthesize.
Options are fields of the artifact, never the environment: a plan's report and its run agree
because they read the same object.

What ops cost (:func:`op_costs`):

- a kernel, load, send, receive or combine costs what synthesis priced;
- a fused attention block costs as flash attention: the flops of its five rules, counted over
  the ``FLASH_TILE x FLASH_TILE`` tiles of queries and keys that hold a point of the guard
  (a causal block skips whole tiles above the diagonal, and computes whole tiles on it), and
  the bytes of its inputs and output only: scores and probabilities never leave the chip;
- a fused AdamW block costs what torch's fused kernel moves as the torch runtime calls it: the
  gradient scaled (under clipping; inside the kernel where it may overwrite an f32 gradient),
  then one pass reading the param, gradient and moments and writing the three results; a block
  of the param or a moment that it does not overwrite (``Fused.overwrites``) is copied into its
  result first.  (The rules' own cost counts each
  rule's inputs and output once, as if a rule were one kernel: eleven operators.)  Runtimes
  overwrite only the blocks a call owns, the carried state of a training step on the SPMD
  runtime: elsewhere (one process) the copies are made, and predicted as not made;
- a collective moves its whole region (its cost model is
  :func:`edatalog.solver.costmodel.collective_seconds`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

from edatalog.backend.lowering.collectives import use_collectives
from edatalog.backend.lowering.exchange import Schedule
from edatalog.backend.lowering.fusion import KIND_ADAMW, fuse_programs
from edatalog.backend.lowering.presence import mark_full
from edatalog.backend.lowering.tasks import Entry
from edatalog.ir import dtypes
from edatalog.ir import program as ir
from edatalog.ir.cost import ONE_ATTENTION, Launches
from edatalog.ir.graph import Graph, JoinAgg, VerifyError
from edatalog.ir.program import CollectiveKind, OpCost
from edatalog.ir.regions import Region
from edatalog.solver.blocks import tighten
from edatalog.solver.costmodel import tiled_points
from edatalog.solver.topology import Library, Topology
from edatalog.solver.topology import from_dict as topology_from_dict

FORMAT = 3  # of Lowered.to_json (3: launches by kernel class)


class Collectives(StrEnum):
    """Which exchanges that are whole collectives run as one collective call."""

    AUTO = "auto"  # the kinds the topology's library runs faster so (Library.collectives)
    ON = "on"  # every kind
    OFF = "off"  # none: point-to-point messages only

    def kinds(self, library: Library) -> frozenset[CollectiveKind]:
        if self is Collectives.ON:
            return frozenset(CollectiveKind)
        if self is Collectives.OFF:
            return frozenset()
        return library.collectives


@dataclass(frozen=True)
class Options:
    """How a plan is lowered (fields of the artifact: nothing is read from the environment)."""

    collectives: Collectives = Collectives.AUTO
    fuse: bool = True  # attention chains as one fused kernel where their blocks line up

    def __post_init__(self) -> None:
        object.__setattr__(self, "collectives", Collectives(self.collectives))


AS_SYNTHESIZED = Options(Collectives.OFF, fuse=False)  # the point-to-point programs, kernel by kernel


@dataclass(frozen=True, eq=False)
class Lowered:
    """A plan lowered for running (see the module docstring): the device programs as every
    runtime runs them, each op's cost, and how they were made."""

    graph: Graph
    topology: Topology
    options: Options
    kinds: frozenset[CollectiveKind]  # the collective kinds the options asked for, on this topology
    programs: ir.Programs
    costs: Mapping[tuple[int, int], OpCost]  # (device, position) -> what the op costs
    passes: tuple[str, ...]  # the passes that ran, in order
    outputs: Mapping[str, list[Entry]]  # where each output ends: its pieces, each with its buffer per device
    synthesized: Schedule | None = field(default=None, repr=False)  # what synthesis made (not serialized)
    _checked: bool = field(default=False, repr=False, compare=False)  # programs verified (see verified)

    @property
    def n_devices(self) -> int:
        return self.programs.n_devices

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the program, the programs and the options: ranks compare it before running."""
        blob = f"{self.graph.fingerprint()}/{self.programs.fingerprint()}/{self.options}"
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def verified(self) -> Lowered:
        """This lowered plan, its programs checked (:meth:`ir.Programs.verify`) once: every
        runtime calls it before running them.  A :class:`VerifyError` is a bug in a pass."""
        if not self._checked:
            _verified(self.programs, self.passes[-1])
            object.__setattr__(self, "_checked", True)
        return self

    def kernels(self, node: str) -> list[tuple[int, ir.Kernel]]:
        """The kernels of one rule (inside fused ops too), with their devices."""
        out = []
        for device, _, op in self.programs.ops():
            for k in op.body if isinstance(op, ir.Fused) else (op,):
                if isinstance(k, ir.Kernel) and k.node == node:
                    out.append((device, k))
        return out

    def __str__(self) -> str:
        head = f"lowered for {self.topology.name}: {', '.join(self.passes)}; collectives {self.options.collectives}"
        return f"{head}\n{self.programs}"

    # -- JSON -----------------------------------------------------------------------------------

    def to_json(self) -> str:
        """Everything a rank needs to run its device's program: the graph, the programs, the
        machine, the options and the costs."""
        costs = [
            [d, k, c.flops, c.nbytes, c.dtype, c.gemm, c.general, c.launches.to_json()]
            for (d, k), c in sorted(self.costs.items())
        ]
        data = {
            "kind": "edatalog-lowered",
            "format": FORMAT,
            "options": {"collectives": self.options.collectives.value, "fuse": self.options.fuse},
            "kinds": sorted(k.value for k in self.kinds),
            "passes": list(self.passes),
            "machine": self.topology.to_dict(),
            "graph": json.loads(self.graph.to_json()),
            "programs": json.loads(self.programs.to_json()),
            "costs": costs,
            "outputs": {
                name: [[[list(map(list, ax)) for ax in e.region.axes], sorted(e.holders.items())] for e in entries]
                for name, entries in self.outputs.items()
            },
        }
        return json.dumps(data, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> Lowered:
        """A lowered plan written by :meth:`to_json`, verified; ValueError for anything else."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a lowered plan (not JSON: {exc})") from None
        if not isinstance(data, dict) or data.get("kind") != "edatalog-lowered":
            raise ValueError("not a lowered plan written by edatalog")
        if data.get("format") != FORMAT:
            raise ValueError(f"lowered plan format {data.get('format')!r}, but this edatalog reads {FORMAT}")
        graph = Graph.from_json(json.dumps(data["graph"]))
        programs = ir.Programs.from_json(json.dumps(data["programs"]))  # verified
        if programs.graph != graph.fingerprint():
            raise ValueError("the lowered programs were made for another program than the one they carry")
        options = Options(Collectives(data["options"]["collectives"]), bool(data["options"]["fuse"]))
        costs = {
            (int(d), int(k)): OpCost(
                int(f), int(b), str(dt), None if g is None else tuple(g), bool(gen), Launches.from_json(n)
            )
            for d, k, f, b, dt, g, gen, n in data["costs"]
        }
        outputs = {
            str(name): [
                Entry(
                    Region(tuple(tuple((int(lo), int(hi)) for lo, hi in ax) for ax in axes)),
                    {int(d): int(b) for d, b in held},
                )
                for axes, held in entries
            ]
            for name, entries in data["outputs"].items()
        }
        return Lowered(
            graph,
            topology_from_dict(data["machine"]),
            options,
            frozenset(CollectiveKind(k) for k in data["kinds"]),
            programs,
            costs,
            tuple(data["passes"]),
            outputs,
            None,
            True,
        )


# -- the pipeline -----------------------------------------------------------------------------------

Pass = Callable[[ir.Programs, Graph], ir.Programs]


def lower(schedule: Schedule, options: Options = Options(), *, check: bool = True) -> Lowered:
    """The schedule's programs through the lowering passes (see the module docstring), each
    verified after it runs (``check``: a pass's bug is a :class:`VerifyError` naming it)."""
    graph = schedule.graph
    programs = schedule.programs
    kinds = options.collectives.kinds(schedule.topology.library)
    outputs = schedule.outputs

    def collectives(programs: ir.Programs, graph: Graph) -> ir.Programs:
        nonlocal outputs
        rewritten = use_collectives(programs, graph, kinds)
        outputs = rewritten.outputs(outputs)
        return rewritten.programs

    passes: list[tuple[str, Pass]] = []
    if options.fuse:
        passes.append(("fusion", fuse_programs))
    passes.append(("presence", mark_full))
    if kinds:
        passes.append(("collectives", collectives))
    ran = ["synthesis"]
    for name, run in passes:
        after = run(programs, graph)
        if after is not programs and check:
            _verified(after, name)
        programs = after
        ran.append(name)
    costs = schedule.costs if programs is schedule.programs else op_costs(schedule, programs)
    return Lowered(graph, schedule.topology, options, kinds, programs, costs, tuple(ran), outputs, schedule, check)


def _verified(programs: ir.Programs, name: str) -> None:
    try:
        programs.verify()
    except VerifyError as exc:
        raise VerifyError(f"after the {name} pass: {exc}") from None


def op_costs(s: Schedule, programs: ir.Programs) -> dict[tuple[int, int], OpCost]:
    """What each op of ``programs`` (the schedule's, through the passes) costs: see the module
    docstring."""
    made: dict[tuple[int, int], OpCost] = {}  # (device, buffer) -> the cost of the op making it
    sent: dict[tuple[int, int], OpCost] = {}  # (device, tag) -> the cost of the send
    for (device, k), cost in s.costs.items():
        op = s.programs.devices[device].ops[k]
        if isinstance(op, ir.DEFINES):
            made[(device, op.buf)] = cost
        elif isinstance(op, ir.Send):
            sent[(device, op.tag)] = cost
    out: dict[tuple[int, int], OpCost] = {}
    for prog in programs.devices:
        device = prog.device
        dtype_of: dict[int, str] | None = None
        for k, op in enumerate(prog.ops):
            if isinstance(op, ir.Fused):
                if dtype_of is None:
                    dtype_of = {m.buf: m.dtype for o in prog.ops for m in ir.made(o)}
                inner = {part.buf: made[(device, part.buf)] for part in op.body}
                priced = adamw_cost if op.kind == KIND_ADAMW else flash_cost
                out[(device, k)] = priced(s.graph, op, inner, dtype_of)
            elif isinstance(op, ir.Collective):
                out[(device, k)] = OpCost(0, op.whole.size * dtypes.itemsize(op.dtype), op.dtype)
            elif isinstance(op, ir.Send):
                out[(device, k)] = sent[(device, op.tag)]
            elif isinstance(op, ir.DEFINES):
                out[(device, k)] = made[(device, op.buf)]
            else:
                out[(device, k)] = OpCost(0, 0)
    return out


def flash_cost(graph: Graph, op: ir.Fused, inner: Mapping[int, OpCost], dtype_of: Mapping[int, str]) -> OpCost:
    """A fused attention block's cost as flash attention runs it (see the module docstring):
    ``inner`` holds the cost of each of its ops as a separate kernel, ``dtype_of`` the dtype of
    every buffer of its device."""
    scores = op.body[0]
    assert isinstance(scores, ir.Kernel), "a fused block starts with its scores kernel"
    ratio = _tiled_share(graph.node(scores.node).anonymous, scores.ranges)
    flops = math.ceil(sum(c.flops for c in inner.values()) * ratio)
    inside = {k.buf for k in op.body}
    read = {(b, region) for k in op.body for parts in _reads(k) for b, region in parts if b not in inside}
    nbytes = sum(region.size * dtypes.itemsize(dtype_of[b]) for b, region in read)
    nbytes += sum(m.region.size * dtypes.itemsize(m.dtype) for m in ir.made(op))
    return OpCost(flops, nbytes, inner[scores.buf].dtype, launches=ONE_ATTENTION)


def adamw_cost(graph: Graph, op: ir.Fused, inner: Mapping[int, OpCost], dtype_of: Mapping[int, str]) -> OpCost:
    """A fused AdamW block's cost (see the module docstring; ``inner`` and ``dtype_of`` as for
    :func:`flash_cost`): with ``A`` the bytes of one block, the scaling of the gradient moves
    ``2A`` (under clipping), the kernel ``7A``, and each copy of a block it does not overwrite
    ``2A``."""
    first, second, update = op.kernels
    block = op.region.size * dtypes.itemsize(op.dtype)
    scaled = any(not region.shape for parts in first.reads for _, region in parts)  # the factor s
    grad = _read_bufs(first) & _read_bufs(second)  # the gradient: what both moments' rules read
    copies = 3 - len(set(op.overwrites) - grad)  # the blocks of the param and moments it may overwrite
    # An f32 gradient it may overwrite is scaled inside the kernel (its grad_scale).
    scaled = scaled and not (op.dtype == "f32" and grad and grad <= set(op.overwrites))
    passes = (2 if scaled else 0) + 7 + 2 * copies
    launches = Launches(elementwise=copies + (1 if scaled else 0) + 1)
    flops = sum(c.flops for c in inner.values())
    return OpCost(flops, passes * block, inner[update.buf].dtype, launches=launches)


@functools.lru_cache(maxsize=1 << 14)
def _tiled_share(node: JoinAgg, ranges: ir.Ranges) -> float:
    """The points a tiled kernel computes over the scores block's guard points (by the rule's
    structure: every layer's blocks alike)."""
    box = {i: (lo, hi) for i, lo, hi in ranges}
    _, points = tighten(node, box)
    return tiled_points(node, box) / points if points else 1.0


def _read_bufs(kernel: ir.Kernel) -> set[int]:
    return {b for parts in kernel.reads for b, region in parts if region.shape}


def _reads(op: ir.Kernel | ir.Combine) -> tuple[tuple[tuple[int, Region], ...], ...]:
    if isinstance(op, ir.Kernel):
        return op.reads
    return tuple(((b, op.region),) for b in op.sources)
