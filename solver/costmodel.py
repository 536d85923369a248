"""The cost model: what a kernel, a transfer and a collective cost on a machine.  The backend's
timeline uses it to predict a schedule's time and the planner its estimates, so plans are
chosen by the cost they are then measured with.

- A kernel takes max(flops / (efficiency * shape * peak), bytes / (efficiency * HBM bandwidth)),
  and at least the topology's floor for each kernel launch it makes, by the launch's class (an
  unfused runtime launches one per operator of a rule, a matmul, a fold, a gather:
  :func:`edatalog.ir.cost.launches`).  The peak is the
  device's for the dtype the kernel computes in (an A100 multiplies bf16 at 312 TFLOP/s, f32
  at 19.5).  ``shape`` is 1 except for a GEMM on a device with SMs, where it is the share of
  the work its tiles and waves do that is useful (:func:`gemm_shape_efficiency`).  A kernel the
  runtime evaluates on its general path (masks, several passes over its arrays) takes bytes /
  the device's general bandwidth more, where ``edl calibrate`` measured one.
- A point-to-point transfer takes latency + bytes / the link's pair bandwidth, and holds each
  end's port for latency + bytes / the port's bandwidth: one pair cannot fill an NVLink port,
  several at once can.  On a link with ``interference`` f, each end's compute engine loses f
  times the transfer's time (applied by the timeline).
- A collective over a group takes NCCL's time at the port's ("bus") bandwidth: a ring, or for an
  all-reduce a tree when that is faster (:func:`collective_seconds`); across nodes, the faster of
  one ring through every member and the hierarchical form (inside each node, across, inside
  again: :func:`group_collective_seconds`).  On gloo an all-reduce among the ranks of one node
  goes through shared memory, and a small one elsewhere as pairwise exchanges
  (:func:`all_reduce_route`, :func:`shared_memory_all_reduce_seconds`,
  :func:`exchange_all_reduce_seconds`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from enum import StrEnum

from edatalog.ir.cost import Launches
from edatalog.ir.graph import JoinAgg
from edatalog.ir.program import CollectiveKind
from edatalog.solver.blocks import tighten
from edatalog.solver.topology import Device, Library, Link, Topology

TILE = 128  # output tile edge of a tensor-core GEMM kernel (cuBLAS/CUTLASS's common 128 x 128)
SPLIT_K_DEPTH = 256  # the least depth of one split-K slice
FLASH_TILE = 128  # query and key tile edge of flash attention's kernels
# The largest all-reduce the runtime runs as pairwise exchanges on gloo.  Larger ones run as
# gloo's own (a ring moves (n - 1) / n of the bytes each way per phase where recursive
# doubling moves all of them log2 n times, each way one after the other).
EXCHANGE_ALL_REDUCE_MAX_BYTES = 128 << 10
# One member's slot of a shared-memory all-reduce: a larger tensor goes by chunks of it, each
# chunk a meeting of the members (edatalog.backend.running.shm_all_reduce).
SHARED_MEMORY_SLOT_BYTES = 1 << 20
MOST_TILES = 4096  # tiles looked at per block; beyond, the guard's exact points are counted

GemmShape = tuple[int, int, int, int]  # (batch, m, n, k): a batch of (m x k)(k x n) products


def gemm_shape_efficiency(shape: GemmShape, sms: int) -> float:
    """The share of the tensor cores' work that is useful for a GEMM of ``shape`` on ``sms`` SMs.

    The output is cut into ``TILE x TILE`` tiles, ``batch * ceil(m / TILE) * ceil(n / TILE)`` of
    them; when they leave SMs idle, the depth is split too (split-K) into up to
    ``sms // tiles`` slices of at least ``SPLIT_K_DEPTH``.  Each SM takes one work unit at a
    time, so the units run in ``waves = ceil(units / sms)``, each as long as a full tile's:

        useful = batch * m * n * k
        done   = waves * sms * TILE * TILE * (k / splits)

    A GEMM of 4096 x 4096 outputs on an A100's 108 SMs: 1024 tiles in 10 waves, 1024 / 1080 =
    0.948; of 300 x 300: 9 tiles of which 300^2 / (3 * 128)^2 is useful, k = 4096 split 12 ways,
    108 units in one wave: 0.61."""
    batch, m, n, k = shape
    if sms <= 0 or min(shape) <= 0:
        return 1.0
    tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE)
    splits = max(1, min(sms // tiles, k // SPLIT_K_DEPTH)) if tiles < sms else 1
    waves = math.ceil(tiles * splits / sms)
    return (batch * m * n * k) / (waves * sms * TILE * TILE * (k / splits))


def compute_seconds(
    flops: int,
    nbytes: int,
    device: Device,
    topo: Topology,
    dtype: str,
    gemm: GemmShape | None = None,
    floor: bool = True,
    general: bool = False,
    launches: Launches | int = 1,
) -> float:
    """Roofline time of one kernel computing in ``dtype`` on ``device`` (a GEMM of ``gemm``'s
    shape when given; a fused attention, whose ``launches`` are attention kernels, at the
    device's attention rate), at least the floor of each kernel it ``launches`` (by class, see
    :meth:`Topology.launch_seconds`) unless ``floor`` is False (a part of a fused kernel, whose
    floor another part pays).  A ``general`` kernel (one the runtime evaluates on its general
    path) takes ``nbytes / device.general_bandwidth`` more, where measured."""
    if flops == 0 and nbytes == 0:
        return 0.0
    eff = topo.efficiency
    shape = 1.0 if gemm is None else gemm_shape_efficiency(gemm, device.sms)
    least = topo.launch_seconds(launches) if floor else 0.0
    attention = isinstance(launches, Launches) and launches.attention > 0
    rate = device.attention_peak(dtype) if attention else device.peak(dtype)
    roof = max(least, flops / (eff * shape * rate), nbytes / (eff * device.bandwidth))
    if general and device.general_bandwidth > 0:
        return roof + nbytes / device.general_bandwidth
    return roof


def transfer_seconds(nbytes: int, link: Link) -> float:
    """A point-to-point transfer's time, start to end."""
    return link.latency + nbytes / link.pair_bandwidth


def port_seconds(nbytes: int, link: Link) -> float:
    """How long a point-to-point transfer holds each end's port of the link."""
    return link.latency + nbytes / link.bandwidth


class AllReduceRoute(StrEnum):
    """How the runtime runs an all-reduce (:func:`all_reduce_route`)."""

    LIBRARY = "library"  # the communication library's own (NCCL's, gloo's)
    SHARED_MEMORY = "shared_memory"  # CPU ranks of one node meet in shared memory
    EXCHANGES = "exchanges"  # pairwise exchanges, recursive doubling over blocking messages


def all_reduce_route(
    library: Library, nbytes: int, members: int, one_node: bool, shared_memory: bool = True
) -> AllReduceRoute:
    """How the runtime runs an all-reduce of ``nbytes`` (the region, in its dtype) over
    ``members`` ranks, ``one_node`` when they share a machine, whose ranks can share memory
    (``shared_memory``: x86-64 with ``/dev/shm``).  On gloo (CPU tensors): through shared memory
    inside such a node (:mod:`edatalog.backend.running.shm_all_reduce`); else as pairwise
    exchanges for a power-of-two group and at most :data:`EXCHANGE_ALL_REDUCE_MAX_BYTES`
    (:mod:`edatalog.backend.running.exchange_all_reduce`); otherwise, and on NCCL, the
    library's own.  The one rule, for the runtime (which knows whether its group's segment was
    made) and the cost model (which reads the machine: :attr:`Topology.shared_memory`)."""
    if library is not Library.GLOO or members < 2:
        return AllReduceRoute.LIBRARY
    if one_node and shared_memory:
        return AllReduceRoute.SHARED_MEMORY
    if members & (members - 1) == 0 and nbytes <= EXCHANGE_ALL_REDUCE_MAX_BYTES:
        return AllReduceRoute.EXCHANGES
    return AllReduceRoute.LIBRARY


def one_node(group: Sequence[int], topo: Topology) -> bool:
    """Whether the devices ``group`` of ``topo`` share a node."""
    return topo.inter is None or len({topo.devices[d].node for d in group}) == 1


def shared_memory_all_reduce_seconds(nbytes: int, members: int, link: Link, bandwidth: float) -> float:
    """An all-reduce through shared memory: per chunk of :data:`SHARED_MEMORY_SLOT_BYTES`, the
    members' meeting (the link's shared-memory latency), and each member's memory traffic at
    ``bandwidth`` (bytes read and written per second): its chunk copied into its slot (read and
    written), every member's slot read and the result written, ``members + 3`` times the bytes.
    (Half floats are reduced widened to f32 on gloo, as gloo's own reduces them: their bytes'
    term here is the region's, half what moves.)"""
    if members <= 1 or nbytes == 0:
        return 0.0
    chunks = -(-nbytes // SHARED_MEMORY_SLOT_BYTES)
    return chunks * link.shared_memory_step_latency + (members + 3) * nbytes / bandwidth


def exchange_all_reduce_seconds(nbytes: int, members: int, link: Link) -> float:
    """An all-reduce as pairwise exchanges: ``log2 members`` steps, each the link's exchange
    step latency and ``nbytes`` each way, one way after the other.  (Half floats travel widened
    to f32 on gloo; their bytes' term here is the region's.)"""
    if members <= 1 or nbytes == 0:
        return 0.0
    steps = int(math.log2(members))
    return steps * (link.exchange_step_latency + 2 * nbytes / link.pair_bandwidth)


def collective_seconds(kind: CollectiveKind, nbytes: int, members: int, link: Link) -> float:
    """NCCL's time for a collective over ``members`` devices on ``link``, where ``nbytes`` is the
    whole region (an all-gather's result, a reduction's input per member), ``L`` the latency of a
    step (:attr:`Link.step_latency`) and ``B`` the port's bandwidth:

    - ring: ``s`` steps, each a latency and ``1 / members`` of the bytes, ``s = members - 1`` for
      a reduce-scatter or all-gather and ``2 (members - 1)`` for an all-reduce:
      ``s * L + s / members * nbytes / B``;
    - tree (all-reduce only, NCCL's double binary tree): up and down ``ceil(log2 members)``
      levels, the bytes pipelined through each: ``2 ceil(log2 members) L + 2 nbytes / B``.

    An all-reduce takes the faster: the tree for small messages, the ring for large."""
    if members <= 1 or nbytes == 0:
        return 0.0
    latency = link.step_latency
    steps = 2 * (members - 1) if kind is CollectiveKind.ALL_REDUCE else members - 1
    ring = steps * latency + steps / members * nbytes / link.bandwidth
    if kind is not CollectiveKind.ALL_REDUCE:
        return ring
    tree = 2 * math.ceil(math.log2(members)) * latency + 2 * nbytes / link.bandwidth
    return min(ring, tree)


def group_collective_seconds(
    kind: CollectiveKind, nbytes: int, group: Sequence[int], topo: Topology
) -> tuple[float, Link]:
    """NCCL's time for a collective over the devices ``group`` of ``topo`` (``nbytes`` as for
    :func:`collective_seconds`), and the link class whose ports it holds: the one between nodes
    when the group spans them.  An all-reduce the runtime runs through shared memory or as
    pairwise exchanges (:func:`all_reduce_route`) costs those.  Inside a node,
    :func:`collective_seconds` on the node's link.
    Across nodes, where each GPU has its own NIC, the faster of:

    - flat: one ring (or tree) through every member, each step at the slower link's step
      latency; NCCL runs a ring per NIC, so with ``g`` members on each node the ``g`` rings
      cross between nodes side by side and the bytes move at ``min(intra, g * inter)`` per
      port;
    - hierarchical, with the same number ``g > 1`` of members on each node: a reduce-scatter
      inside each node, then the collective across nodes among the members of the same local
      rank on ``1 / g`` of the bytes (the ``g`` of them at once, each on its own NIC), then an
      all-gather inside each node (an all-reduce: all three; a reduce-scatter: the first two;
      an all-gather: the last two)."""
    per_node: dict[int, int] = {}
    for d in group:
        node = topo.devices[d].node
        per_node[node] = per_node.get(node, 0) + 1
    local = one_node(group, topo)
    route = all_reduce_route(topo.library, nbytes, len(group), local, topo.shared_memory)
    if kind is CollectiveKind.ALL_REDUCE and route is AllReduceRoute.SHARED_MEMORY:
        bandwidth = topo.efficiency * min(topo.devices[d].bandwidth for d in group)
        return shared_memory_all_reduce_seconds(nbytes, len(group), topo.intra, bandwidth), topo.intra
    if kind is CollectiveKind.ALL_REDUCE and route is AllReduceRoute.EXCHANGES:
        slowest = topo.intra if local or topo.inter is None else topo.inter
        return exchange_all_reduce_seconds(nbytes, len(group), slowest), slowest
    if len(per_node) == 1 or topo.inter is None:
        return collective_seconds(kind, nbytes, len(group), topo.intra), topo.intra
    intra, inter = topo.intra, topo.inter
    g, nodes = min(per_node.values()), len(per_node)
    ring = Link(
        inter.name,
        min(intra.bandwidth, g * inter.bandwidth),
        max(intra.latency, inter.latency),
        inter.interference,
        collective_latency=max(intra.step_latency, inter.step_latency),
    )
    flat = collective_seconds(kind, nbytes, len(group), ring)
    if g == 1 or any(count != g for count in per_node.values()):
        return flat, inter
    rs, ag = CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_GATHER
    inside = {
        CollectiveKind.ALL_REDUCE: collective_seconds(rs, nbytes, g, intra) + collective_seconds(ag, nbytes, g, intra),
        rs: collective_seconds(rs, nbytes, g, intra),
        ag: collective_seconds(ag, nbytes, g, intra),
    }[kind]
    across = collective_seconds(kind, nbytes // g, nodes, inter)
    return min(flat, inside + across), inter


def collective_bytes(
    kind: CollectiveKind,
    nbytes: int,
    members: int,
    library: Library = Library.NCCL,
    one_node: bool = True,
    shared_memory: bool = True,
) -> int:
    """What each member sends (and receives) in the ring: ``steps / members`` of ``nbytes``; as
    pairwise exchanges (:func:`all_reduce_route`), ``nbytes`` at each of ``log2 members`` steps;
    through shared memory, ``nbytes`` (its own, written once for the others to read)."""
    if kind is CollectiveKind.ALL_REDUCE and members > 1:
        route = all_reduce_route(library, nbytes, members, one_node, shared_memory)
        if route is AllReduceRoute.EXCHANGES:
            return int(math.log2(members)) * nbytes
        if route is AllReduceRoute.SHARED_MEMORY:
            return nbytes
    steps = 2 * (members - 1) if kind is CollectiveKind.ALL_REDUCE else members - 1
    return round(steps * nbytes / members) if members > 1 else 0


def tiled_points(node: JoinAgg, ranges: Mapping[str, tuple[int, int]]) -> int:
    """The points of the block's box in the tiles of its guard's indices that hold a point of
    the guard: what a tiled kernel computes (it skips empty tiles, and masks within the rest)."""
    dense = math.prod(hi - lo for lo, hi in ranges.values())
    gvars = sorted(node.guard.vars & set(ranges))
    if node.guard.is_true or not gvars:
        return dense
    starts = [range(ranges[v][0], ranges[v][1], FLASH_TILE) for v in gvars]
    if math.prod(len(r) for r in starts) > MOST_TILES:
        return tighten(node, ranges)[1]
    others = dense // max(1, math.prod(ranges[v][1] - ranges[v][0] for v in gvars))
    total = 0
    for corner in itertools.product(*starts):
        tile = {v: (lo, min(lo + FLASH_TILE, ranges[v][1])) for v, lo in zip(gvars, corner, strict=True)}
        if tighten(node, {**ranges, **tile})[1]:
            total += math.prod(hi - lo for lo, hi in tile.values())
    return total * others
