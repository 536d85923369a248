"""Hand-written plans: the baselines the solver must beat, and random plans for tests.

- ``replicate``: device 0 computes everything.
- ``data``: split the batch index (the first axis of the first input) across devices.
- ``zero``: ``data``, with a training step's optimizer update and its state sharded across the
  devices (ZeRO/FSDP: gradients reduce-scattered, params gathered where read).
- ``megatron``: Megatron-LM tensor parallelism for transformer programs, recognized by structure
  (:mod:`edatalog.solver.structure`), never by dim names: attention heads split
  for q, k, v and attention (key/value heads replicated on the devices whose query heads share
  them), the FFN dimension split (column-parallel ``w_gate``/``w_up``, row-parallel ``w_down``), the
  output projection row-parallel, norms and residuals replicated; partial sums are reduced, and
  outputs end replicated on every device.
- ``megatron-sp``: Megatron with sequence parallelism (Korthikanti et al. 2022): the same
  head and FFN splits, but the rules between them (norms, residuals, rotary tables) split along
  the sequence over every device instead of replicated, so the row-parallel outputs (``attn``,
  ``down``) are reduce-scattered along the sequence and the column-parallel inputs all-gathered
  (the exchanges the plan implies); the output stays split along the sequence.
- ``megatron-dp`` and ``megatron-sp-dp``, on machines of several nodes: ``megatron`` (or
  ``megatron-sp``) inside each node, and the batch split across the nodes (data parallelism
  between them), as practitioners run tensor parallelism on NVLink and data parallelism over
  InfiniBand.  With fewer batch rows than nodes, the nodes beyond them stay idle.  Outputs stay
  on the node that made them (data parallelism's outputs are each replica's own): gathered onto
  the node's devices (megatron-dp) or split along the sequence (megatron-sp-dp).
- ``random``: seeded random uneven partitions and random devices, replication included.

Inputs and params are placed where their consumers' blocks need them (:func:`place_by_consumers`),
so the baselines move only activations.
"""

from __future__ import annotations

import dataclasses
import random as _random
from collections.abc import Mapping, Sequence

from edatalog.errors import EdlError, did_you_mean
from edatalog.ir.forms import plain_index, route_lookup
from edatalog.ir.graph import Access, Graph, JoinAgg
from edatalog.ir.regions import Region
from edatalog.solver.plan import NodePlan, Placement, Plan, Split, Tile
from edatalog.solver.structure import transformer_dims
from edatalog.solver.topology import Topology

STRATEGIES = (
    "replicate",
    "data",
    "zero",
    "megatron",
    "megatron-sp",
    "megatron-dp",
    "megatron-sp-dp",
    "expert",
    "random",
)
MULTI_NODE = ("megatron-dp", "megatron-sp-dp")  # the baselines of machines of several nodes
# Whole models across nodes: layers in stages, one node each, microbatched.  Their time is
# composed from one node's timelines by a later stage; no whole plan of them is built.
PIPELINED = ("megatron-pp", "megatron-sp-pp")


def baseline_names(topology: Topology, carries: bool = False) -> tuple[str, ...]:
    """The hand-written plans a solve starts from and must beat on ``topology``: megatron,
    megatron-sp and data, those across nodes on a machine of several, and zero for a program
    that carries state (a training step).  Those a program has no shape for fail to build."""
    several = len(topology.nodes) > 1
    return ("megatron", "megatron-sp", "data", *(MULTI_NODE if several else ()), *(("zero",) if carries else ()))


def compared_with(topology: Topology, layered: bool = False) -> tuple[str, ...]:
    """What ``edl plan`` shows an auto plan against: megatron on one node; across nodes,
    tensor parallelism inside the nodes and data parallelism between them, and for a model of
    repeated layers (``layered``) pipeline stages across the nodes too; never tensor parallelism
    over the links between nodes, which no one would run."""
    if len(topology.nodes) < 2:
        return ("megatron",)
    return (*MULTI_NODE, *PIPELINED) if layered else MULTI_NODE


def build(graph: Graph, topology: Topology, strategy: str, seed: int = 0) -> Plan:
    n = topology.n
    if strategy == "replicate":
        tiles = {node.name: Tile.whole(node.box, [0]) for node in graph.nodes}
        return plan_of(graph, topology, strategy, tiles, outputs=False)
    if strategy == "data":
        return plan_of(graph, topology, strategy, _data_tiles(graph, n), outputs=False)
    if strategy == "zero":
        return plan_of(graph, topology, strategy, zero_tiles(graph, n), outputs=False)
    if strategy == "megatron":
        return plan_of(graph, topology, strategy, megatron_tiles(graph, n), outputs=True)
    if strategy == "megatron-sp":
        tiles, reduce_axes = sequence_parallel(graph, megatron_tiles(graph, n), n)
        return plan_of(graph, topology, strategy, tiles, outputs=False, reduce_axes=reduce_axes)
    if strategy in MULTI_NODE:
        g = node_size(topology, strategy)
        inner = megatron_tiles(graph, g)
        axes: dict[str, int] = {}
        if strategy == "megatron-sp-dp":
            inner, axes = sequence_parallel(graph, inner, g)
        tiles = across_nodes(graph, inner, g, len(topology.nodes))
        plan = plan_of(graph, topology, strategy, tiles, outputs=False, reduce_axes=axes)
        if strategy == "megatron-sp-dp":
            return plan  # outputs split along the sequence inside each node, as megatron-sp leaves them
        return per_node_outputs(graph, plan, g, len(topology.nodes))
    if strategy == "expert":
        return plan_of(graph, topology, strategy, expert_tiles(graph, n), outputs=False)
    if strategy == "random":
        return random_plan(graph, topology, seed)
    close = did_you_mean(strategy, STRATEGIES)
    known = f"strategies: {', '.join(STRATEGIES)}"
    raise EdlError(f"unknown strategy '{strategy}'", help=f"{close} {known}" if close else known)


def plan_of(
    graph: Graph,
    topology: Topology,
    strategy: str,
    tiles: Mapping[str, Tile],
    outputs: bool = True,
    reduce_axes: Mapping[str, int | None] | None = None,
) -> Plan:
    """The plan of these node tiles: inputs and params placed where their readers are
    (:func:`place_by_consumers`), and with ``outputs``, the outputs gathered onto every device.
    State carried from call to call (``graph.carries``) lives where its next value is made
    (:func:`made_tile`), and that output stays there: a call leaves it where the next one reads it."""
    axes = reduce_axes or {}
    nodes = tuple(NodePlan(node.name, tiles[node.name], axes.get(node.name)) for node in graph.nodes)
    readers = readers_of(graph)
    carried = {target: made_tile(graph, tiles, out) for out, target in graph.carries}
    placed = {
        r.name: carried.get(r.name) or place_by_consumers(graph, tiles, r.name, topology.n, readers)
        for r in graph.relations
        if r.kind != "derived"
    }
    inputs = tuple(Placement(name, tile) for name, tile in placed.items())
    every = list(range(topology.n))
    ends = {out: Placement(out, placed[target]) for out, target in graph.carries}
    if outputs:
        outs = tuple(ends.get(o) or Placement(o, Tile.whole(graph.relation(o).box, every)) for o in graph.outputs)
    else:
        outs = tuple(ends.values())
    return Plan(graph.fingerprint(), topology.n, topology.name, strategy, nodes, inputs, outs)


def made_tile(graph: Graph, tiles: Mapping[str, Tile], relation: str) -> Tile | None:
    """Where ``relation`` is made, as a tile of the relation: its one rule's blocks, when that
    rule splits only indices its head names plainly (no partial sums to reduce).  None
    otherwise (the caller places it by its readers)."""
    producers = graph.producers(relation)
    if len(producers) != 1:
        return None
    node = producers[0]
    tile = tiles[node.name]
    rel = graph.relation(relation)
    axis_of: dict[str, str] = {}  # node index -> the relation's axis it names
    for k, ax in enumerate(node.out_axes):
        if len(ax.parts) != 1 or ax.parts[0].index is None:
            return None
        axis_of[ax.parts[0].index] = rel.axis_names[k]
    if any(s.parts > 1 and s.index not in axis_of for s in tile.splits):
        return None
    split_of = {s.index: s for s in tile.splits}
    index_of = {a: i for i, a in axis_of.items()}
    splits = tuple(Split(a, split_of[index_of[a]].cuts) for a in rel.axis_names)
    by_ranges = {tuple(b.ranges[index_of[a]] for a in rel.axis_names): b.devices for b in tile.blocks()}
    devices = tuple(by_ranges[tuple(b.ranges[a] for a in rel.axis_names)] for b in Tile(splits, ()).blocks())
    return Tile(splits, devices)


# -- ZeRO: data parallel with the optimizer's state and update sharded ------------------------------


def zero_tiles(graph: Graph, n: int) -> dict[str, Tile]:
    """Data parallelism in ZeRO's shape (Rajbhandari et al. 2020; FSDP's): the rules of the
    batch are split by batch as in ``data``; the rules at the end of the program that have no
    batch index and feed only each other and the outputs (a training step's clipping and
    optimizer update) are split across the devices along their largest index instead of
    replicated.  The state they update then lives sharded (:func:`made_tile`): the gradients
    are reduce-scattered to the shards, each device updates its shard of the params and
    optimizer state, and the params are gathered where the batch's rules read them."""
    tiles = _data_tiles(graph, n)
    replicated = {name for name, t in tiles.items() if t.n_blocks == 1}
    readers: dict[str, list[str]] = {}
    for node in graph.nodes:
        for acc in node.inputs:
            readers.setdefault(acc.relation, []).append(node.name)
    tail: set[str] = set()
    for node in reversed(graph.nodes):
        if node.name in replicated and all(r in tail for r in readers.get(node.out, ())):
            tail.add(node.name)
    for node in graph.nodes:
        if node.name not in tail:
            continue
        heads = {p.index for ax in node.out_axes for p in ax.parts if p.index is not None}
        ranked = sorted(node.indices, key=lambda i: (i.name not in heads, -i.extent))
        best = next((i for i in ranked if i.extent >= n), None)
        if best is None:
            continue  # scalars: replicated
        splits = tuple(Split.even(i.name, i.extent, n if i is best else 1) for i in node.indices)
        tiles[node.name] = Tile(splits, tuple((k,) for k in range(n)))
    return tiles


# -- data parallel ------------------------------------------------------------------------------


def _data_tiles(graph: Graph, n: int) -> dict[str, Tile]:
    batch = batch_symbol(graph)
    tiles = {}
    for node in graph.nodes:
        # Split one index of the batch dim: a rule can have two (s and t of S in attention scores).
        chosen = next((i.name for i in node.indices if i.symbol == batch), None)
        splits = [Split.even(i.name, i.extent, n if i.name == chosen else 1) for i in node.indices]
        tile_parts = max((s.parts for s in splits), default=1)
        if tile_parts == 1:
            tiles[node.name] = Tile.whole(node.box, range(n))  # no batch index: replicate
        else:
            tiles[node.name] = Tile(tuple(splits), tuple((k,) for k in range(tile_parts)))
    return tiles


def expert_tiles(graph: Graph, n: int) -> dict[str, Tile]:
    """Expert parallelism with data parallelism (DeepSpeed-MoE's and Megatron's EP): each
    expert rule splits the expert index evenly over the devices, so each holds its experts'
    weights and computes the tokens routed to them; every other rule is as ``data`` has it.
    Exchanges carry the tokens to the experts' devices and the results back.  Expert rules
    (:func:`expert_indices`) are the routed ones of a dropless layer and the rules that carry
    their route, or, where tokens are dispatched into per-expert slots (a layer with a
    capacity, as GShard writes it), the batched GEMMs of the experts' stacked weights and the
    rules that read their results per expert: then the dispatch into the slots and the combine
    out of them are the all-to-all exchanges."""
    tiles = _data_tiles(graph, n)
    experts = expert_indices(graph)
    if not experts:
        raise EdlError(
            "the expert strategy needs a mixture of experts: a rule that looks its weight up by a "
            "routed value ('h[t, k, f] += x[t, d] * w[e, f, d] where route[t, k] = e.'), or one that "
            "multiplies tokens dispatched per expert by the experts' stacked weights "
            "('h[g, e, c, f] += xe[g, e, c, d] * w[e, f, d].')",
            help="plan it with -s auto, data or megatron",
        )
    for node in graph.nodes:
        expert = experts.get(node.name)
        if expert is None:
            continue
        count = min(n, node.box[expert])
        splits = tuple(Split.even(i.name, i.extent, count if i.name == expert else 1) for i in node.indices)
        tiles[node.name] = Tile(splits, tuple((k,) for k in range(count)))
    return tiles


def expert_indices(graph: Graph) -> dict[str, str]:
    """The expert rules and their expert index: the routed rules (their looked-up index) and
    the rules that carry their route (:mod:`edatalog.rules.routes`); a product of an activation
    and a param that share an index the head keeps (the experts' stacked weights, ``w1[e, f,
    d]`` times ``xe[g, e, c, d]``); and a rule that reads such a rule's result at its expert axis
    and keeps that index (``a[g, e, c, f] = silu(h1[g, e, c, f]) * ...``)."""
    params = {r.name for r in graph.relations if r.kind == "param"}
    axis: dict[str, int] = {}  # relation made per expert -> its expert axis
    out: dict[str, str] = {}
    for node in graph.nodes:
        expert = _expert_index(node, params, axis)
        if expert is None:
            continue
        out[node.name] = expert
        head = [plain_index(ax) for ax in node.out_axes]
        if expert in head:
            axis[node.out] = head.index(expert)
    return out


def _expert_index(node: JoinAgg, params: set[str], axis: Mapping[str, int]) -> str | None:
    """``node``'s expert index (see :func:`expert_indices`), given the relations made per
    expert so far and their expert axes; None for a rule of the tokens."""
    lk = route_lookup(node) if node.lookups else None
    if lk is not None:
        return lk.index
    head = set(node.out_indices) - node.looked_up
    if node.agg_indices:
        for w in node.inputs:
            # A stack of matrices (``w1[e, f, d]``), one of whose other indices is summed.
            if w.relation not in params or len(w.axes) < 3 or not set(w.indices) & set(node.agg_indices):
                continue
            for ax in w.axes:
                v = plain_index(ax)
                shared = v is not None and v in head
                if shared and any(v in a.indices for a in node.inputs if a.relation not in params):
                    return v
    for acc in node.inputs:
        if acc.relation in axis:
            v = plain_index(acc.axes[axis[acc.relation]])
            if v is not None and v in head:
                return v
    return None


# -- across nodes: a plan in each node, data parallel between them ---------------------------------


def node_size(topology: Topology, strategy: str) -> int:
    """The devices of each node, for ``strategy``, which needs several nodes of the same size."""
    sizes = {len(g) for g in topology.nodes}
    if len(topology.nodes) < 2 or len(sizes) != 1:
        raise EdlError(
            f"the {strategy} strategy needs several nodes of the same size; {topology.name} has "
            + ("one node" if len(topology.nodes) < 2 else f"nodes of {', '.join(map(str, sorted(sizes)))} devices"),
            help="plan one node with megatron or megatron-sp, or use a machine of several nodes (h100x8x4, ...)",
        )
    return sizes.pop()


def across_nodes(graph: Graph, inner: Mapping[str, Tile], g: int, nodes: int) -> dict[str, Tile]:
    """``inner`` (tiles on one node's devices ``0..g-1``) on every node, the batch index split
    across the nodes: block ``p`` of the batch on node ``p``'s devices.  A rule without the
    batch index is replicated on every node that holds a part of the batch."""
    batch = batch_symbol(graph)
    extent = next(i.extent for node in graph.nodes for i in node.indices if i.symbol == batch)
    used = min(nodes, extent)
    tiles: dict[str, Tile] = {}
    for node in graph.nodes:
        tile = inner[node.name]
        b = next((i for i in node.indices if i.symbol == batch), None)
        split_of = {s.index: s for s in tile.splits}
        if b is None or split_of[b.name].parts > 1:  # no batch (or the inner plan splits it): on every node
            tiles[node.name] = Tile(tile.splits, tuple(_on_nodes(d, g, range(used)) for d in tile.devices))
            continue
        splits = tuple(Split.even(i.name, i.extent, used) if i is b else split_of[i.name] for i in node.indices)
        inside = {_key(blk.ranges, b.name): blk.devices for blk in tile.blocks()}
        devices = []
        for blk in Tile(splits, ()).blocks():
            part = _part_of(splits, b.name, blk.ranges)
            devices.append(_on_nodes(inside[_key(blk.ranges, b.name)], g, (part,)))
        tiles[node.name] = Tile(splits, tuple(devices))
    return tiles


def per_node_outputs(graph: Graph, plan: Plan, g: int, nodes: int, batch: str | None = None) -> Plan:
    """``plan`` with its outputs as data parallelism leaves them: each node's batch rows
    gathered onto that node's devices (megatron gathers onto every device of its one node), not
    onto every device across the network; outputs without the batch on every device.  ``batch``
    is the batch dim (default: the graph's, :func:`batch_symbol`; a part of a program, such as
    one layer, takes the whole program's)."""
    batch = batch or batch_symbol(graph)
    ends = {p.relation for p in plan.outputs}
    out = list(plan.outputs)
    for name in graph.outputs:
        if name in ends:
            continue
        rel = graph.relation(name)
        axis = next((k for k, s in enumerate(rel.symbols) if s == batch), None)
        if axis is None:
            out.append(Placement(name, Tile.whole(rel.box, range(g * nodes))))
            continue
        used = min(nodes, rel.shape[axis])
        splits = tuple(
            Split.even(a, e, used if k == axis else 1)
            for k, (a, e) in enumerate(zip(rel.axis_names, rel.shape, strict=True))
        )
        out.append(Placement(name, Tile(splits, tuple(tuple(range(p * g, (p + 1) * g)) for p in range(used)))))
    return dataclasses.replace(plan, outputs=tuple(out))


def batch_symbol(graph: Graph) -> str:
    """The batch dim: the first axis of an input, of the inputs' first axes the one that comes
    first among the program's dims, preferring those no param has.  (One layer of a model, as
    a graph of its own, reads the rotary tables ``rc[S, ...]`` before the hidden ``x[B, S, D]``:
    the first input's first axis would be the sequence.)"""
    leading = [r.symbols[0] for r in graph.relations if r.kind == "input" and r.shape]
    if not leading:
        raise EdlError("data parallelism needs an input with at least one axis to split")
    order = {name: k for k, (name, _) in enumerate(graph.dims)}
    in_params = {s for r in graph.relations if r.kind == "param" for s in r.symbols}
    return min(leading, key=lambda s: (s in in_params, order.get(s, len(order)), leading.index(s)))


def _on_nodes(devices: Sequence[int], g: int, nodes: Sequence[int] | range) -> tuple[int, ...]:
    return tuple(sorted(d + k * g for k in nodes for d in devices))


def _key(ranges: Mapping[str, tuple[int, int]], skip: str) -> tuple[tuple[str, tuple[int, int]], ...]:
    return tuple(sorted((i, r) for i, r in ranges.items() if i != skip))


# -- Megatron-LM tensor parallelism ---------------------------------------------------------------


def megatron_tiles(graph: Graph, n: int) -> dict[str, Tile]:
    """Heads and FFN columns as the program's structure shows them
    (:func:`edatalog.solver.structure.transformer_dims`): the key/value heads are split first;
    when there are fewer than devices, the query heads that share a key/value head are split
    too; rules without heads but with an FFN column dim split it."""
    dims = transformer_dims(graph)
    major, minor = dims.major, dims.minor
    extent = {i.symbol: i.extent for node in graph.nodes for i in node.indices}
    if major is None and not dims.ffn:
        raise EdlError(
            "the megatron strategy needs a transformer: attention heads (an index that the attention's "
            "contractions keep apart and its projections' weights carry) or an FFN (a pair of weight "
            "contractions, one keeping an index that the next sums)",
            help="plan it with -s auto, data or replicate",
        )
    g_parts = min(n, extent[major]) if major else 1
    r_parts = min(max(1, n // g_parts), extent[minor]) if minor else 1
    tiles = {}
    for node in graph.nodes:
        by_symbol = {i.symbol: i for i in node.indices}
        g = by_symbol.get(major) if major else None
        r = by_symbol.get(minor) if minor else None
        if g is not None:
            parts = {g.name: g_parts, **({r.name: r_parts} if r is not None else {})}
            splits = tuple(Split.even(i.name, i.extent, parts.get(i.name, 1)) for i in node.indices)
            layout = Tile(splits, ())
            devices: list[tuple[int, ...]] = []
            for block in layout.blocks():
                gi = _part_of(splits, g.name, block.ranges)
                if r is not None:
                    devices.append((gi * r_parts + _part_of(splits, r.name, block.ranges),))
                else:  # key/value heads: on every device whose query heads use them
                    devices.append(tuple(gi * r_parts + k for k in range(r_parts)))
            tiles[node.name] = Tile(splits, tuple(devices))
        elif any(i.symbol in dims.ffn for i in node.indices):
            f = next(i for i in node.indices if i.symbol in dims.ffn)
            count = min(n, f.extent)
            splits = tuple(Split.even(i.name, i.extent, count if i is f else 1) for i in node.indices)
            tiles[node.name] = Tile(splits, tuple((k,) for k in range(count)))
        else:
            tiles[node.name] = Tile.whole(node.box, range(n))  # norms, residuals, softmax rows...
    return tiles


def sequence_parallel(graph: Graph, tiles: Mapping[str, Tile], n: int) -> tuple[dict[str, Tile], dict[str, int]]:
    """Megatron's tiles made sequence parallel: every rule Megatron replicates that has a
    sequence index (dim S) and reads a relation is split along it over the ``n`` devices, and every rule whose partial
    sums Megatron reduces (the row-parallel ``attn`` and ``down``) reduce-scatters them along its
    sequence axis, where those rules' readers now want them."""
    extent = {i.symbol: i.extent for node in graph.nodes for i in node.indices}
    if "S" not in extent:
        raise EdlError("the megatron-sp strategy needs a sequence index (dim S) to split norms and residuals along")
    count = min(n, extent["S"])
    out = dict(tiles)
    reduce_axes: dict[str, int] = {}
    for node in graph.nodes:
        seq = next((i for i in node.indices if i.symbol == "S"), None)
        if seq is None or not node.inputs:
            continue  # a rule that reads nothing (a rotary table) stays whole wherever it is read
        tile = tiles[node.name]
        if tile.devices and all(len(d) == n for d in tile.devices) and len(tile.devices) == 1:
            splits = tuple(Split.even(i.name, i.extent, count if i is seq else 1) for i in node.indices)
            out[node.name] = Tile(splits, tuple((k,) for k in range(count)))
        elif any(s.parts > 1 for s in tile.splits if s.index in node.agg_indices):
            axis = next((k for k, ax in enumerate(node.out_axes) if any(p.index == seq.name for p in ax.parts)), None)
            if axis is not None:
                reduce_axes[node.name] = axis
    return out, reduce_axes


def _part_of(splits: tuple[Split, ...], index: str, ranges: Mapping[str, tuple[int, int]]) -> int:
    split = next(s for s in splits if s.index == index)
    return split.ranges.index(ranges[index])


# -- random plans ---------------------------------------------------------------------------------


def _random_split(rng: _random.Random, name: str, extent: int, most: int) -> Split:
    parts = rng.randint(1, max(1, min(extent, most)))
    cuts = sorted(rng.sample(range(1, extent), parts - 1)) if parts > 1 else []
    return Split(name, (0, *cuts, extent))


def _random_tile(rng: _random.Random, box: Mapping[str, int], n: int, most: int = 3) -> Tile:
    splits = tuple(_random_split(rng, name, extent, most) for name, extent in box.items())
    count = 1
    for s in splits:
        count *= s.parts
    devices = []
    for _ in range(count):
        if n > 1 and rng.random() < 0.15:
            devices.append(tuple(sorted(rng.sample(range(n), 2))))
        else:
            devices.append((rng.randrange(n),))
    return Tile(splits, tuple(devices))


def _random_axis(rng: _random.Random, rank: int) -> int | None:
    """Sometimes, the axis partial results are reduce-scattered along."""
    return rng.randrange(rank) if rank and rng.random() < 0.3 else None


def random_plan(graph: Graph, topology: Topology, seed: int) -> Plan:
    """Random uneven partitions of every join space, inputs and (sometimes) outputs, on random
    devices; some blocks replicated."""
    rng = _random.Random(seed)
    n = topology.n
    nodes = tuple(
        NodePlan(node.name, _random_tile(rng, node.box, n), _random_axis(rng, len(node.out_axes)))
        for node in graph.nodes
    )
    inputs = tuple(Placement(r.name, _random_tile(rng, r.box, n)) for r in graph.relations if r.kind != "derived")
    outputs = tuple(
        Placement(o, _random_tile(rng, graph.relation(o).box, n)) for o in graph.outputs if rng.random() < 0.3
    )
    return Plan(graph.fingerprint(), n, topology.name, "random", nodes, inputs, outputs)


# -- placing inputs and params ----------------------------------------------------------------------


def place_by_consumers(
    graph: Graph,
    tiles: Mapping[str, Tile],
    relation: str,
    n: int,
    readers: Mapping[str, Sequence[tuple[str, Access]]] | None = None,
) -> Tile:
    """Where an input or param should live so that no block has to fetch it: its axes are cut at
    every boundary of what the consumer blocks read, and each piece lives on every device whose
    blocks read it (device 0 for what nobody reads).  ``readers`` (:func:`readers_of`) saves a
    walk over every rule per relation."""
    rel = graph.relation(relation)
    needs: list[tuple[Region, tuple[int, ...]]] = []
    reading = readers[relation] if readers is not None and relation in readers else None
    if reading is None:
        reading = [(node.name, acc) for node in graph.nodes for acc in node.inputs if acc.relation == relation]
    for name, acc in reading:
        for block in tiles[name].blocks():
            needs.append((Region.through(acc.axes, block.ranges), block.devices))
    cuts = []
    for k, extent in enumerate(rel.shape):
        bounds = {0, extent}
        for region, _ in needs:
            bounds.update(c for run in region.axes[k] for c in run)
        cuts.append(Split(rel.axis_names[k], tuple(sorted(bounds))))
    tile = Tile(tuple(cuts), ())
    devices = []
    for block in tile.blocks():
        piece = Region.of_box(rel.shape, tuple(block.ranges[a] for a in rel.axis_names))
        holders = sorted({d for region, ds in needs if not region.intersect(piece).empty for d in ds})
        devices.append(tuple(holders) if holders else (0,))
    return Tile(tuple(cuts), tuple(devices))


def readers_of(graph: Graph) -> dict[str, list[tuple[str, Access]]]:
    """Per relation, the rules that read it and how (for :func:`place_by_consumers`)."""
    out: dict[str, list[tuple[str, Access]]] = {}
    for node in graph.nodes:
        for acc in node.inputs:
            out.setdefault(acc.relation, []).append((node.name, acc))
    return out
