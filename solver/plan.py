"""Plans: how every join space is split into blocks, and which devices hold each block.

A :class:`Tile` cuts a box (a join space, or a relation's axes) into blocks, one range per index,
uneven allowed (100 into 3 is 34, 33, 33), and gives each block a set of devices: one device, or
several to replicate the block.  A :class:`Plan` has a tile for every join-agg node, one for every
input and param (where it lives at the start), and optionally one for outputs (where they must
end).  Splitting an aggregated index makes each block a partial result; the backend combines
partials with the node's aggregation.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from edatalog.errors import EdlError
from edatalog.ir.graph import Graph
from edatalog.ir.printer import runs

FORMAT = 1


@dataclass(frozen=True)
class Split:
    """A partition of ``0 .. extent`` into consecutive ranges: ``cuts`` are their boundaries."""

    index: str
    cuts: tuple[int, ...]

    @staticmethod
    def even(index: str, extent: int, parts: int) -> Split:
        """``parts`` ranges as equal as can be, the larger ones first: 100 into 3 is 34, 33, 33."""
        parts = max(1, min(parts, extent))
        base, extra = divmod(extent, parts)
        cuts = [0]
        for k in range(parts):
            cuts.append(cuts[-1] + base + (1 if k < extra else 0))
        return Split(index, tuple(cuts))

    @property
    def parts(self) -> int:
        return len(self.cuts) - 1

    @property
    def extent(self) -> int:
        return self.cuts[-1]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.cuts, self.cuts[1:], strict=False))

    def __str__(self) -> str:
        if self == Split.even(self.index, self.extent, self.parts):
            return f"{self.index}:{self.parts}"
        return f"{self.index}:{self.parts}[{','.join(str(b - a) for a, b in self.ranges)}]"


@dataclass(frozen=True)
class Block:
    index: int  # row-major position among the tile's blocks
    ranges: dict[str, tuple[int, int]]  # index -> [lo, hi)
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Tile:
    """Blocks of a box (row-major over ``splits``) and the devices holding each."""

    splits: tuple[Split, ...]
    devices: tuple[tuple[int, ...], ...]

    @staticmethod
    def whole(indices: Mapping[str, int], devices: Sequence[int]) -> Tile:
        """One block, on every device in ``devices`` (replicated when several)."""
        return Tile(tuple(Split(k, (0, n)) for k, n in indices.items()), (tuple(sorted(devices)),))

    @property
    def n_blocks(self) -> int:
        return math.prod(s.parts for s in self.splits)

    def blocks(self) -> Iterator[Block]:
        for k, combo in enumerate(itertools.product(*(s.ranges for s in self.splits))):
            devices = self.devices[k] if self.devices else ()  # a tile being built has no devices yet
            yield Block(k, {s.index: r for s, r in zip(self.splits, combo, strict=True)}, devices)

    def used_devices(self) -> set[int]:
        return {d for ds in self.devices for d in ds}

    def describe(self, n_devices: int) -> str:
        """``b:1 s:1 h:4 -> devices 0..3``, ``-> {0..3}`` (replicated) or an explicit list."""
        shape = " ".join(str(s) for s in self.splits)
        return f"{shape} -> {_devices_text(self.devices, n_devices)}"

    def verify(self, extents: Mapping[str, int], n_devices: int, what: str) -> None:
        names = [s.index for s in self.splits]
        if names != list(extents):
            raise EdlError(f"plan for {what} splits {names}, but its indices are {list(extents)}")
        for s in self.splits:
            if s.cuts[0] != 0 or s.extent != extents[s.index] or any(b <= a for a, b in s.ranges):
                raise EdlError(
                    f"plan for {what}: the split of {s.index} must cut 0..{extents[s.index]} into non-empty ranges, "
                    f"not {list(s.cuts)}"
                )
        if len(self.devices) != self.n_blocks:
            raise EdlError(f"plan for {what} has {self.n_blocks} blocks but devices for {len(self.devices)}")
        for ds in self.devices:
            if not ds or any(not 0 <= d < n_devices for d in ds) or len(set(ds)) != len(ds):
                raise EdlError(f"plan for {what}: a block's devices must be distinct, in 0..{n_devices - 1}, not {ds}")


def _devices_text(devices: tuple[tuple[int, ...], ...], n: int) -> str:
    every = tuple(range(n))
    if all(ds == every for ds in devices):
        return f"{{0..{n - 1}}}" if n > 1 else "device 0"
    if all(len(ds) == 1 for ds in devices):
        flat = [ds[0] for ds in devices]
        if len(flat) > 1 and flat == list(range(flat[0], flat[0] + len(flat))):
            return f"devices {flat[0]}..{flat[-1]}"
        if len(set(flat)) == 1:
            return f"device {flat[0]}"
        each = len(flat) // len(set(flat))
        if each > 1 and flat == [d for d in range(len(set(flat))) for _ in range(each)]:
            return f"devices 0..{len(set(flat)) - 1}, {each} blocks each"
        return "devices [" + ",".join(str(d) for d in flat) + "]"
    return "devices [" + ",".join("{" + ",".join(map(str, ds)) + "}" for ds in devices) + "]"


@dataclass(frozen=True)
class NodePlan:
    """A rule's tile; with partial results, ``reduce_axis`` is the output axis along which they
    are reduce-scattered (None: the longest), so the reduced pieces can land where readers want."""

    node: str
    tile: Tile
    reduce_axis: int | None = None


@dataclass(frozen=True)
class Placement:
    relation: str
    tile: Tile

    def dtensor(self, n: int) -> str:
        """DTensor-style summary: ``R`` replicated, ``S(k)`` sharded on axis k, else the blocks."""
        split_axes = [k for k, s in enumerate(self.tile.splits) if s.parts > 1]
        every = tuple(range(n))
        if not split_axes and self.tile.devices == (every,):
            return "R"
        if len(split_axes) == 1 and all(len(ds) == 1 for ds in self.tile.devices):
            flat = [ds[0] for ds in self.tile.devices]
            if sorted(flat) == list(range(len(flat))) and len(flat) == n:
                return f"S({split_axes[0]})"
        return self.tile.describe(n)


@dataclass(frozen=True)
class Plan:
    program: str  # fingerprint of the graph the plan is for
    n_devices: int
    topology: str
    strategy: str
    nodes: tuple[NodePlan, ...]
    inputs: tuple[Placement, ...]  # every input and param, where it lives at the start
    outputs: tuple[Placement, ...] = ()  # where outputs must end (outputs not listed stay put)

    @cached_property
    def _by_node(self) -> dict[str, NodePlan]:
        return {p.node: p for p in self.nodes}

    def node(self, name: str) -> NodePlan:
        """The tile of rule ``name`` (KeyError: none such)."""
        return self._by_node[name]

    def verify(self, graph: Graph) -> None:
        """Check that the plan fits the graph: every node, input and param tiled exactly."""
        if self.program != graph.fingerprint():
            raise EdlError(
                f"this plan was made for another program (fingerprint {self.program}, "
                f"this program is {graph.fingerprint()})",
                help="make a new plan for this program: edl plan FILE ...",
            )
        planned = {p.node: p for p in self.nodes}
        for n in graph.nodes:
            if n.name not in planned:
                raise EdlError(f"the plan has no tiling for rule {n.name}")
            planned[n.name].tile.verify(n.box, self.n_devices, f"rule {n.name}")
            axis = planned[n.name].reduce_axis
            if axis is not None and not 0 <= axis < len(n.out_axes):
                raise EdlError(f"plan for rule {n.name}: reduce axis {axis} is not an axis of {n.out}")
        if set(planned) - {n.name for n in graph.nodes}:
            raise EdlError(f"the plan tiles unknown rules: {sorted(set(planned) - {n.name for n in graph.nodes})}")
        placed = {p.relation: p for p in self.inputs}
        for rel in graph.relations:
            if rel.kind != "derived":
                if rel.name not in placed:
                    raise EdlError(f"the plan does not say where {rel.kind} {rel.name} lives")
                placed[rel.name].tile.verify(rel.box, self.n_devices, f"{rel.kind} {rel.name}")
        for p in self.outputs:
            if p.relation not in graph.outputs:
                raise EdlError(f"the plan places '{p.relation}', which is not an output")
            p.tile.verify(graph.relation(p.relation).box, self.n_devices, f"output {p.relation}")

    def __str__(self) -> str:
        return _render(self, set(), "")

    def describe(self, graph: Graph | None = None) -> str:
        """The plan as ``str`` prints it, but with the instances of a repeated module of
        ``graph`` that are tiled and placed exactly as its first instance said once (a 32-layer
        model prints one layer, and which layers take its plan)."""
        reps = [r for r in (graph.repeats if graph is not None else ()) if r.count > 1]
        if not reps:
            return str(self)
        rep = max(reps, key=lambda r: r.count * len(r.nodes))
        n = self.n_devices
        placed = {p.relation: p.dtensor(n) for p in self.inputs}
        tiled = {p.node: (p.tile.describe(n), p.reduce_axis) for p in self.nodes}
        alike = []
        for k in range(1, rep.count):
            own = f"{rep.prefix}.{k}."

            def first(name: str, own: str = own) -> str:
                return f"{rep.prefix}.0.{name[len(own) :]}"

            params = [r for r in placed if r.startswith(own)]
            same_params = all(first(r) in placed and placed[r] == placed[first(r)] for r in params)
            if same_params and all(tiled[name] == tiled[first(name)] for name in rep.instance(k)):
                alike.append(k)
        if not alike:
            return str(self)
        skip = {f"{rep.prefix}.{k}." for k in alike}
        return _render(self, skip, f"  ({_ranges(alike, rep.prefix)}: as {rep.prefix}.0)")

    # -- JSON ----------------------------------------------------------------------------------

    def to_json(self) -> str:
        def tile(t: Tile) -> dict[str, Any]:
            return {
                "splits": [{"index": s.index, "cuts": list(s.cuts)} for s in t.splits],
                "devices": [list(ds) for ds in t.devices],
            }

        data = {
            "format": FORMAT,
            "kind": "edatalog-plan",
            "program": self.program,
            "devices": self.n_devices,
            "topology": self.topology,
            "strategy": self.strategy,
            "nodes": [
                {
                    "node": p.node,
                    **tile(p.tile),
                    **({"reduce_axis": p.reduce_axis} if p.reduce_axis is not None else {}),
                }
                for p in self.nodes
            ],
            "inputs": [{"relation": p.relation, **tile(p.tile)} for p in self.inputs],
            "outputs": [{"relation": p.relation, **tile(p.tile)} for p in self.outputs],
        }
        return json.dumps(data, indent=1)

    @staticmethod
    def from_json(text: str, graph: Graph | None = None, where: str = "plan") -> Plan:
        """Read a plan; with ``graph``, check that it was made for that program and fits it."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("kind") != "edatalog-plan":
                raise EdlError(f"{where} is not an edatalog plan")
            if data.get("format") != FORMAT:
                raise EdlError(f"{where} has plan format {data.get('format')!r}; this edatalog reads format {FORMAT}")

            def tile(d: dict[str, Any]) -> Tile:
                splits = tuple(Split(str(s["index"]), tuple(int(c) for c in s["cuts"])) for s in d["splits"])
                return Tile(splits, tuple(tuple(int(x) for x in ds) for ds in d["devices"]))

            plan = Plan(
                str(data["program"]),
                int(data["devices"]),
                str(data["topology"]),
                str(data["strategy"]),
                tuple(
                    NodePlan(str(p["node"]), tile(p), None if p.get("reduce_axis") is None else int(p["reduce_axis"]))
                    for p in data["nodes"]
                ),
                tuple(Placement(str(p["relation"]), tile(p)) for p in data["inputs"]),
                tuple(Placement(str(p["relation"]), tile(p)) for p in data.get("outputs", [])),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise EdlError(f"{where} is not a valid plan: {exc}") from None
        if graph is not None:
            plan.verify(graph)
        return plan


def _render(plan: Plan, skip: set[str], note: str) -> str:
    """The plan's lines, leaving out the relations and rules whose names start with a prefix in
    ``skip``, with ``note`` after the inputs and after the rules."""
    n = plan.n_devices

    def kept(name: str) -> bool:
        return not any(name.startswith(s) for s in skip)

    inputs = [p for p in plan.inputs if kept(p.relation)]
    nodes = [p for p in plan.nodes if kept(p.node)]
    lines = [f"plan '{plan.strategy}' for {n} device{'s' if n != 1 else ''} ({plan.topology}), program {plan.program}"]
    width = max([len(p.relation) for p in (*inputs, *plan.outputs)] + [len(p.node) for p in nodes] + [4])
    lines.append("inputs and params:")
    lines.extend(f"  {p.relation:<{width}}  {p.dtensor(n)}" for p in inputs)
    if note:
        lines.append(note)
    lines.append("rules:")
    lines.extend(
        f"  {p.node:<{width}}  {p.tile.describe(n)}"
        + (f", partials reduced along axis {p.reduce_axis}" if p.reduce_axis is not None else "")
        for p in nodes
    )
    if note:
        lines.append(note)
    if plan.outputs:
        lines.append("outputs:")
        lines.extend(f"  {p.relation:<{width}}  {p.dtensor(n)}" for p in plan.outputs)
    return "\n".join(lines)


def _ranges(ks: Sequence[int], prefix: str) -> str:
    """``[1, 2, 3, 5]`` as ``layers.1 .. layers.3, layers.5``."""
    return ", ".join(f"{prefix}.{a}" if a == b else f"{prefix}.{a} .. {prefix}.{b}" for a, b in runs(ks))
