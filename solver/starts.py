"""Starting plans for the solver, built without search: a greedy pass, one dim split everywhere,
the hand-written baselines, and two-level plans.  The search starts from the cheapest that fits,
recombines them all, and shortlists the best for the exact timeline check."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from edatalog.errors import EdlError
from edatalog.ir.graph import Graph, JoinAgg
from edatalog.solver import strategies
from edatalog.solver.blocks import Candidate, Layout
from edatalog.solver.costs import Costs, Held, Option
from edatalog.solver.plan import Plan, Tile
from edatalog.solver.topology import Topology


class Model(Protocol):
    """What the starts read of the solver's model (:class:`edatalog.solver.auto.Model`): every
    node's options, which relations' producers are tied to one pick, the costs, and layouts.  A
    protocol, so that this module, which :mod:`edatalog.solver.auto` imports, does not import it
    back."""

    @property
    def options(self) -> Mapping[str, Sequence[Option]]: ...

    @property
    def tied(self) -> Mapping[str, bool]: ...

    @property
    def costs(self) -> Costs: ...

    def held_of(self, relation: str, k: int) -> Held: ...


Start = tuple[str, dict[str, int]]  # what a starting plan is ("greedy", "megatron", ...), its picks
Built = tuple[str, Plan]  # a baseline's name and its plan, as the strategy builds it


def simple(graph: Graph, model: Model, hand: list[Start]) -> list[Start]:
    """A greedy pass, one dim split everywhere, and ``hand`` (the baselines' picks)."""
    dims = [dim for dim, _ in graph.dims]
    along = [(f"{dim} split everywhere", c) for dim, c in zip(dims, _along_each_dim(graph, model), strict=True)]
    return [("greedy", _greedy(graph, model)), *along, *hand]


def two_level(
    graph: Graph,
    topo: Topology,
    rank: dict[str, int],
    tiles: dict[str, dict[Tile, int]],
    balance: frozenset[str],
) -> list[Start]:
    """Two-level starts, as on a 2D device mesh: the N devices form ``a`` groups of ``b``, one dim
    is split ``a`` ways across the groups (zigzag too, for a dim in ``balance``), and
    Megatron-style tensor parallelism runs inside each group.  With long sequences these move
    far less than Megatron over all N devices (each all-reduce spans b devices and 1/a of the
    rows), and no single-node move leads there."""
    n = topo.n
    out: list[Start] = []
    for a in (d for d in range(2, n) if n % d == 0):
        try:
            inner = strategies.megatron_tiles(graph, n // a)
        except EdlError:
            return out
        for dim, _ in graph.dims:
            for zigzag in (False, True) if dim in balance else (False,):
                choice = _lifted(graph, rank, tiles, inner, dim, a, zigzag)
                if choice is not None:
                    how = f"{dim} across {a} groups{' zigzag' if zigzag else ''}, megatron in each"
                    out.append((f"two-level: {how}", choice))
    return out


def _lifted(
    graph: Graph,
    rank: dict[str, int],
    tiles: dict[str, dict[Tile, int]],
    inner: dict[str, Tile],
    dim: str,
    a: int,
    zigzag: bool,
) -> dict[str, int] | None:
    """The inner tiles with ``dim`` split ``a`` ways on top, when the space has every one of them
    and some rule has ``dim``."""
    choice: dict[str, int] = {}
    split = False
    for node in graph.nodes:
        tile = inner[node.name]
        parts = [s.parts for s in tile.splits]
        replicas = len(tile.devices[0]) if tile.devices else 1
        k = next(
            (j for j, i in enumerate(node.indices) if i.symbol == dim and parts[j] == 1 and i.extent >= 2 * a),
            None,
        )
        if k is None:
            replicas *= a
        else:
            parts[k], split = a, True
        zig = (k,) if zigzag and k is not None else ()
        pick = tiles[node.name].get(Layout(node, Candidate(tuple(parts), replicas, balanced=zig), rank).tile)
        if pick is None:
            return None
        choice[node.name] = pick
    return choice if split else None


def baselines(graph: Graph, topo: Topology, tiles: dict[str, dict[Tile, int]]) -> tuple[list[Start], list[Built]]:
    """The hand-written plans (:func:`strategies.baseline_names`: megatron, megatron-sp, data,
    those across nodes, zero for programs that carry state): as
    picks where the space can express them (the search starts from them), and as built (the
    exact plans the caller checks too, so that a solved plan is never slower than a baseline:
    the picks place inputs by their consumers, and may differ from the hand-written
    placements)."""
    out: list[Start] = []
    built: list[Built] = []
    for name in strategies.baseline_names(topo, bool(graph.carries)):
        try:
            hint = strategies.build(graph, topo, name)
        except EdlError:
            continue
        built.append((name, hint))
        choice = {p.node: tiles[p.node].get(p.tile) for p in hint.nodes}
        if all(i is not None for i in choice.values()):
            out.append((name, {k: i for k, i in choice.items() if i is not None}))
    return out, built


def _along_each_dim(graph: Graph, model: Model) -> list[dict[str, int]]:
    """For every dim, the plan that splits it everywhere (its first index in each rule, over all
    devices) and replicates rules without it: data parallelism along any dim."""
    out = []
    for dim, _ in graph.dims:
        choice: dict[str, int] = {}
        for node in graph.nodes:
            opts = model.options[node.name]
            first = next((k for k, i in enumerate(node.indices) if i.symbol == dim), None)

            def fit(o: Option, first: int | None = first) -> tuple[int, float]:
                parts = o.cand.parts
                split = first is not None and parts[first] == o.cand.blocks and o.cand.replicas == 1
                whole = o.cand.blocks == 1
                return (0 if split else 1 if whole else 2, o.compute)

            choice[node.name] = min(range(len(opts)), key=lambda k: fit(opts[k]))
        for rel in graph.relations:  # tied producers share one pick
            producers = graph.producers(rel.name) if model.tied.get(rel.name) else ()
            for p in producers[1:]:
                choice[p.name] = choice[producers[0].name]
        out.append(choice)
    return out


def _greedy(graph: Graph, model: Model) -> dict[str, int]:
    """Each node in order takes the candidate cheapest given what came before it; of equally
    cheap ones (small rules all cost the kernel floor) the one with the fewest copies of each
    block: replicated work is never cheaper, only sometimes no dearer."""
    choice: dict[str, int] = {}
    costs = model.costs
    for node in graph.nodes:

        def price(k: int, node: JoinAgg = node) -> float:
            o = model.options[node.name][k]
            total = o.compute + o.reduce
            for (acc, need), share in zip(o.needs, o.shares, strict=True):
                producers = graph.producers(acc.relation)
                if producers and producers[0].name in choice:
                    held = model.held_of(acc.relation, choice[producers[0].name])
                    total += costs.transfer(acc.relation, held, need, share)
            return total

        together = model.tied.get(node.out, False)
        tied = next((choice[p.name] for p in graph.producers(node.out) if p.name in choice), None) if together else None
        if tied is None:
            opts = model.options[node.name]

            def rank(k: int, opts: Sequence[Option] = opts) -> tuple[float, int]:
                return price(k), opts[k].cand.replicas

            tied = min(range(len(opts)), key=rank)
        choice[node.name] = tied
    return choice
