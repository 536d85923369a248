"""The cost model against hand computations: GEMM tiles and waves, collectives as NCCL runs them."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

import edatalog
from edatalog.errors import EdlError
from edatalog.ir.cost import ONE_ATTENTION, KernelClass, Launches, flops_per_point, gemm_roles, gemm_shape, launches
from edatalog.ir.program import CollectiveKind
from edatalog.solver.blocks import Layout, candidates, dim_order
from edatalog.solver.costmodel import (
    EXCHANGE_ALL_REDUCE_MAX_BYTES,
    SHARED_MEMORY_SLOT_BYTES,
    AllReduceRoute,
    all_reduce_route,
    collective_bytes,
    collective_seconds,
    compute_seconds,
    gemm_shape_efficiency,
    group_collective_seconds,
    transfer_seconds,
)
from edatalog.solver.costs import Costs
from edatalog.solver.topology import SHARED_MEMORY_LATENCY, Library, Link, from_dict, preset

ROOT = Path(__file__).resolve().parents[2]

AR, RS, AG = CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_GATHER


@pytest.mark.parametrize(
    ("shape", "sms", "want"),
    [
        # 32 x 32 = 1024 tiles of 128^2 on 108 SMs: 10 waves, the last of 52 tiles.
        ((1, 4096, 4096, 4096), 108, 1024 / 1080),
        # 8 x 8 = 64 tiles fill 64 of 108 SMs; k = 128 is too shallow to split (< 2 x 256).
        ((1, 1024, 1024, 128), 108, 64 / 108),
        # 9 tiles of which 300^2 / 384^2 is useful; k = 4096 split 12 ways (108 // 9): one full wave.
        ((1, 300, 300, 4096), 108, 300**2 / 384**2),
        # a batch of 32 heads of 2048 x 2048 (by 128): 32 x 256 tiles in ceil(8192 / 132) = 63 waves on an H100.
        ((32, 2048, 2048, 128), 132, 8192 / (63 * 132)),
        # no SMs (a CPU): no quantization.
        ((1, 3, 5, 7), 0, 1.0),
    ],
)
def test_gemm_efficiency_counts_tiles_and_waves(shape: tuple[int, int, int, int], sms: int, want: float) -> None:
    assert gemm_shape_efficiency(shape, sms) == pytest.approx(want)


def test_a_gemm_kernel_is_slower_by_its_wasted_tiles() -> None:
    """1024^2 outputs of depth 128 on an A100: 64 of 108 SMs busy, so 2 * 1024^2 * 128 flops take
    (108 / 64) x as long as at 0.7 of peak; the same flops with no shape stay at 0.7 of peak."""
    topo = preset("a100x1")
    dev = topo.devices[0]
    flops = 2 * 1024 * 1024 * 128
    plain = compute_seconds(flops, 0, dev, topo, "bf16")
    assert plain == pytest.approx(max(topo.kernel_floor, flops / (0.7 * 312e12)))
    shaped = compute_seconds(flops * 64, 0, dev, topo, "bf16", (64, 1024, 1024, 128))  # 64 such GEMMs at once
    assert shaped == pytest.approx(64 * flops / (0.7 * (4096 / 4104) * 312e12))  # 4096 tiles in 38 waves


def test_gemm_roles_of_the_llama_rules() -> None:
    prog = edatalog.compile("programs/llama_block.edl", dims={"S": 256})
    g = prog.graph
    roles = {n.name: gemm_roles(n) for n in g.nodes}
    # sc[b,s,h,t] += q[b,s,h,e] * k[b,t,kv,e] ...: heads and batch batch, s by t, summing e.
    sc = roles["sc"]
    assert sc is not None and set(sc[3]) == {"e"} and "s" in sc[1] and "t" in sc[2]
    assert roles["act"] is None  # elementwise
    extents = {i.name: i.extent for i in g.node("sc").indices}
    batch, m, n, k = gemm_shape(sc, extents) or (0, 0, 0, 0)
    assert (m, n, k) == (256, 256, extents["e"])
    assert batch == math.prod(extents[i] for i in sc[0])


NVLINK = Link("nvlink", 230e9, 3e-6)


def test_a_ring_all_reduce_moves_twice_n_minus_one_nth_of_the_bytes() -> None:
    """64 MiB over 8 A100s: 14 steps, 14 * 3 us + 14 / 8 * 2^26 / 230e9 = 0.5526 ms; the tree would
    take 6 * 3 us + 2 * 2^26 / 230e9 = 0.6015 ms."""
    nbytes = 2**26
    ring = 14 * 3e-6 + 14 / 8 * nbytes / 230e9
    assert collective_seconds(AR, nbytes, 8, NVLINK) == pytest.approx(ring)
    assert ring == pytest.approx(0.5526e-3, rel=1e-3)
    assert collective_bytes(AR, nbytes, 8) == round(14 / 8 * nbytes)


def test_a_small_all_reduce_takes_the_tree() -> None:
    """1 KiB over 8: the ring's 14 latencies (42 us) lose to the tree's 6 (18 us + 2 KiB / 230e9)."""
    tree = 6 * 3e-6 + 2 * 1024 / 230e9
    assert collective_seconds(AR, 1024, 8, NVLINK) == pytest.approx(tree)


@pytest.mark.parametrize("kind", [RS, AG])
def test_reduce_scatter_and_all_gather_are_half_an_all_reduce(kind: CollectiveKind) -> None:
    nbytes = 2**26
    assert collective_seconds(kind, nbytes, 4, NVLINK) == pytest.approx(3 * 3e-6 + 3 / 4 * nbytes / 230e9)
    assert collective_bytes(kind, nbytes, 4) == 3 * nbytes // 4


def test_a_collective_steps_at_its_own_latency_where_the_library_has_one() -> None:
    """gloo's all-reduce of a few KiB between busy CPU ranks costs several ping-pongs: a link with
    ``collective_latency`` prices each step of a collective at it, point-to-point transfers still
    at ``latency``."""
    gloo = Link("gloo", 1.5e9, 150e-6, collective_latency=500e-6)
    assert gloo.step_latency == 500e-6 and Link("gloo", 1.5e9, 150e-6).step_latency == 150e-6
    assert collective_seconds(AR, 4096, 2, gloo) == pytest.approx(2 * 500e-6 + 4096 / 1.5e9)  # the ring
    assert collective_seconds(AG, 4096, 2, gloo) == pytest.approx(500e-6 + 4096 / 2 / 1.5e9)
    assert transfer_seconds(4096, gloo) == pytest.approx(150e-6 + 4096 / 1.5e9)


SHM, EXCH, LIB = AllReduceRoute.SHARED_MEMORY, AllReduceRoute.EXCHANGES, AllReduceRoute.LIBRARY


@pytest.mark.parametrize(
    ("library", "nbytes", "members", "one_node", "route"),
    [
        (Library.GLOO, 2048, 2, True, SHM),  # ranks of one machine: shared memory, any size
        (Library.GLOO, 1 << 30, 3, True, SHM),
        (Library.GLOO, 2048, 2, False, EXCH),  # across machines: small ones as pairwise exchanges
        (Library.GLOO, EXCHANGE_ALL_REDUCE_MAX_BYTES, 4, False, EXCH),
        (Library.GLOO, EXCHANGE_ALL_REDUCE_MAX_BYTES + 1, 2, False, LIB),  # gloo's ring
        (Library.GLOO, 2048, 3, False, LIB),  # not a power of two
        (Library.GLOO, 2048, 1, True, LIB),
        (Library.NCCL, 2048, 2, True, LIB),
        (Library.NCCL, 2048, 2, False, LIB),
    ],
)
def test_the_route_of_an_all_reduce(
    library: Library, nbytes: int, members: int, one_node: bool, route: AllReduceRoute
) -> None:
    assert all_reduce_route(library, nbytes, members, one_node) is route
    # Where the node's ranks cannot share memory: as if they were on several nodes.
    assert all_reduce_route(library, nbytes, members, one_node, shared_memory=False) is all_reduce_route(
        library, nbytes, members, False
    )


def test_a_node_without_shared_memory_exchanges_its_small_all_reduces_on_its_own_link() -> None:
    link = Link("gloo", 2e9, 400e-6, collective_latency=600e-6, exchange_latency=250e-6)
    gloo = dataclasses.replace(preset("cpux4"), intra=link, library=Library.GLOO, shared_memory=False)
    seconds, used = group_collective_seconds(AR, 4096, range(4), gloo)
    assert used == link and seconds == pytest.approx(2 * (250e-6 + 2 * 4096 / 2e9))
    big = EXCHANGE_ALL_REDUCE_MAX_BYTES * 4
    assert group_collective_seconds(AR, big, range(4), gloo)[0] == collective_seconds(AR, big, 4, link)


def test_a_gloo_all_reduce_in_a_node_costs_its_shared_memory_meetings_and_bytes() -> None:
    """Per chunk of a slot, the link's shared-memory latency; each member's memory traffic,
    (members + 3) times the bytes, at the devices' bandwidth; bytes "sent": each member's own."""
    link = Link("gloo", 2e9, 400e-6, collective_latency=600e-6, shared_memory_latency=30e-6)
    gloo = dataclasses.replace(preset("cpux4"), intra=link, library=Library.GLOO, efficiency=1.0)
    bandwidth = min(d.bandwidth for d in gloo.devices)
    seconds, used = group_collective_seconds(AR, 4096, range(4), gloo)
    assert used == link and seconds == pytest.approx(30e-6 + 7 * 4096 / bandwidth)
    big = 3 * SHARED_MEMORY_SLOT_BYTES + 1  # four chunks
    assert group_collective_seconds(AR, big, range(2), gloo)[0] == pytest.approx(4 * 30e-6 + 5 * big / bandwidth)
    assert collective_bytes(AR, 4096, 4, Library.GLOO) == 4096
    # Other collectives keep gloo's ring; NCCL its own all-reduce.
    assert group_collective_seconds(AG, 4096, range(4), gloo)[0] == collective_seconds(AG, 4096, 4, link)
    nccl = dataclasses.replace(gloo, library=Library.NCCL)
    assert group_collective_seconds(AR, 4096, range(4), nccl)[0] == collective_seconds(AR, 4096, 4, link)
    # Where the machine file has no shared-memory latency: the default.
    plain = dataclasses.replace(gloo, intra=dataclasses.replace(link, shared_memory_latency=None))
    assert group_collective_seconds(AR, 8, range(2), plain)[0] == pytest.approx(
        SHARED_MEMORY_LATENCY + 5 * 8 / bandwidth
    )


def test_a_small_gloo_all_reduce_across_nodes_costs_its_pairwise_exchanges() -> None:
    """log2 n steps, each the inter-node link's exchange step latency and the bytes one way, then
    back; the ring's price stays for the large ones."""
    inter = Link("tcp", 1e9, 500e-6, collective_latency=700e-6, exchange_latency=250e-6)
    gloo = from_dict({"nodes": [2, 2], "library": "gloo", "links": {"inter": {"bandwidth": 1e9, "latency": 500e-6}}})
    gloo = dataclasses.replace(gloo, inter=inter)
    seconds, used = group_collective_seconds(AR, 4096, [0, 2], gloo)
    assert used == inter and seconds == pytest.approx(250e-6 + 2 * 4096 / 1e9)
    assert collective_bytes(AR, 4096, 4, Library.GLOO, one_node=False) == 2 * 4096  # each step all of it
    big = EXCHANGE_ALL_REDUCE_MAX_BYTES * 4
    assert group_collective_seconds(AR, big, [0, 2], gloo)[0] != pytest.approx(
        250e-6 + 2 * big / 1e9
    )  # gloo's ring, flat or hierarchical
    # Where the machine file has no exchange latency: a message each way per step.
    plain = dataclasses.replace(gloo, inter=dataclasses.replace(inter, exchange_latency=None))
    assert group_collective_seconds(AR, 8, [0, 2], plain)[0] == pytest.approx(2 * 500e-6 + 2 * 8 / 1e9)


def test_a_collective_inside_a_node_is_the_node_links() -> None:
    topo = preset("h100x8x2")
    seconds, link = group_collective_seconds(AR, 1 << 20, range(8, 16), topo)
    assert link == topo.intra and seconds == collective_seconds(AR, 1 << 20, 8, topo.intra)


def test_a_large_all_reduce_across_nodes_is_one_ring_through_every_nic() -> None:
    """16 H100s on 2 nodes, 1 GiB: 8 rings side by side, each crossing between nodes on its own
    400 Gb/s NIC, so the bytes move at min(NVLink 345, 8 x 50) GB/s per port; 30 steps of 10 µs
    (the slower link's).  The hierarchical form moves 7/8 of the bytes twice over NVLink and 1/8
    over the NICs: slower here."""
    topo = preset("h100x8x2")
    size = 1 << 30
    seconds, link = group_collective_seconds(AR, size, range(16), topo)
    ring = 30 * 10e-6 + 30 / 16 * size / 345e9
    inside = 2 * (7 * 3e-6 + 7 / 8 * size / 345e9)  # reduce-scatter, then all-gather, over 8 in a node
    across = 2 * 1 * 10e-6 + (size // 8) / 50e9  # the ring of 2 nodes on an eighth of the bytes
    assert seconds == pytest.approx(ring) and ring < inside + across and link.name == "ib"


def test_a_small_all_reduce_over_many_nodes_goes_hierarchically() -> None:
    """4 KiB over 512 A100s (64 nodes): one ring through them all takes 1022 steps; the flat
    tree 2 x 9 levels of 10 µs; reduce-scatter in each node (7 steps of 3 µs), a tree across the
    64 nodes on 512 bytes (2 x 6 levels), all-gather in each node: fewer slow steps."""
    topo = preset("a100x8x64")
    seconds, link = group_collective_seconds(AR, 4096, range(512), topo)
    tree = 2 * 9 * 10e-6 + 2 * 4096 / 200e9  # flat: min(230, 8 x 25) GB/s
    hierarchical = 2 * (7 * 3e-6 + 7 / 8 * 4096 / 230e9) + 2 * 6 * 10e-6 + 2 * 512 / 25e9
    assert seconds == pytest.approx(hierarchical) and hierarchical < tree and link.name == "ib"
    rs, _ = group_collective_seconds(RS, 4096, range(512), topo)
    assert rs == pytest.approx(
        min(511 * 10e-6 + 511 / 512 * 4096 / 200e9, 7 * 3e-6 + 7 / 8 * 4096 / 230e9 + 63 * 10e-6 + 63 / 64 * 512 / 25e9)
    )


def test_one_member_per_node_crosses_at_one_nic() -> None:
    """Data parallelism across 4 nodes, one GPU of each (a tensor-parallel group's rank 0): the
    ring has one NIC per crossing: 50 GB/s, and for 1 MiB the tree is faster."""
    topo = preset("h100x8x4")
    seconds, _ = group_collective_seconds(AR, 1 << 20, [0, 8, 16, 24], topo)
    assert seconds == pytest.approx(min(6 * 10e-6 + 6 / 4 * (1 << 20) / 50e9, 2 * 2 * 10e-6 + 2 * (1 << 20) / 50e9))


LAUNCH_RULES = """
dim I = 4, J = 6, V = 5.
input x[I, J] : f32.
input w[J, J] : f32.
input v[J] : f32.
input ids[I] : i64.
param emb[V, J] : f32.
output y, mm, ln, sq, gathered, copy.
y[i, j] = x[i, j] * 0.5 + v[j].
mm[i, k] += x[i, j] * w[j, k] / 3.0.
sq[i] += x[i, j] * x[i, j] / J.
ln[i, j] = v[j] * (x[i, j] * rsqrt(sq[i] + 1e-5)) + v[j].
gathered[i, j] = emb[t, j] + v[j] where ids[i] = t.
copy[i, j] = x[i, j].
"""


@pytest.mark.parametrize(
    ("rule", "want"),
    [
        ("y", Launches(elementwise=2)),  # mul, add
        ("mm", Launches(elementwise=1, gemm=1)),  # the GEMM (its product and sum), the scaling
        ("sq", Launches(elementwise=2, reduction=1)),  # mul, div, and the sum
        ("ln", Launches(elementwise=5)),  # add, rsqrt, mul, mul, add
        ("gathered", Launches(elementwise=1, gather=1)),  # the gather, the add
        ("copy", Launches(elementwise=1)),  # no operator: still one kernel
    ],
)
def test_a_rule_launches_a_kernel_per_operator_by_class(rule: str, want: Launches) -> None:
    graph = edatalog.compile_string(LAUNCH_RULES, name="launches.edl").graph
    assert launches(graph.node(rule)) == want


def test_the_kernel_floor_is_paid_per_launch() -> None:
    topo = preset("a100x1")
    dev = topo.devices[0]
    assert compute_seconds(10, 10, dev, topo, "f32", launches=5) == pytest.approx(5 * topo.kernel_floor)
    assert compute_seconds(10, 10, dev, topo, "f32", launches=5, floor=False) < topo.kernel_floor


def test_each_launch_pays_its_class_floor() -> None:
    """A machine with floors per kernel class prices a launch at its class's floor; a class it
    does not list at ``kernel_floor``."""
    topo = dataclasses.replace(
        preset("a100x1"), kernel_floor=2e-6, kernel_floors=((KernelClass.GEMM, 5e-6), (KernelClass.ATTENTION, 20e-6))
    )
    dev = topo.devices[0]
    assert topo.floor(KernelClass.GEMM) == 5e-6 and topo.floor(KernelClass.REDUCTION) == 2e-6
    mixed = Launches(elementwise=3, gemm=1, attention=1)
    assert compute_seconds(10, 10, dev, topo, "f32", launches=mixed) == pytest.approx(3 * 2e-6 + 5e-6 + 20e-6)
    assert topo.launch_seconds(4) == pytest.approx(8e-6)  # a bare count: kernel_floor each
    text = json.dumps(topo.to_dict())
    assert from_dict(json.loads(text)) == topo  # the floors travel with the machine
    assert json.loads(text)["kernel_floors"] == {"gemm": 5e-6, "attention": 20e-6}
    with pytest.raises(EdlError, match="unknown key 'matmul' in \\[kernel_floors\\]"):
        from_dict({"kernel_floors": {"matmul": "3us"}})


def test_launches_travel_as_json() -> None:
    mixed = Launches(elementwise=2, reduction=1, gather=3)
    assert Launches.from_json(mixed.to_json()) == mixed
    assert Launches.from_json(4) == Launches(elementwise=4)  # a bare count: no class
    assert mixed + Launches(gemm=1) == Launches(2, 1, 1, 3, 0) and (mixed + mixed).total == 12
    assert str(mixed) == "2 elementwise, 1 reduction, 3 gather"
    with pytest.raises(ValueError, match="launches must be 5 counts"):
        Launches.from_json([1, 2])


def test_a_group_of_one_moves_nothing() -> None:
    assert collective_seconds(AR, 2**20, 1, NVLINK) == 0.0 and collective_bytes(AR, 2**20, 1) == 0


def test_the_estimate_costs_attention_as_one_flash_kernel() -> None:
    """Causal attention on one A100 in bf16, (B, H, S, E) = (1, 32, 4096, 128): the solver's
    estimate of each rule of the softmax chain is its part of one flash kernel, as the timeline
    costs the fused block (edatalog.backend.lowering.lowered.flash_cost).

    Of the 32 x 32 flash tiles of 128 x 128 (s, t), the 528 on or below the diagonal hold
    points: 528 x 128^2 (s, t) pairs count, not the 4096 x 4097 / 2 the guard keeps.
    - The scores, sc[b,h,s,t] += q[b,s,h,e] * k[b,t,h,e] / sqrt(E): times H E = 4096, at 3 flops
      (multiply, divide, add): 106,300,440,576 flops at 0.7 x 312 TF/s = 486.7 us; its bytes
      are q and k only, 64 MiB at 0.7 x 2 TB/s = 47.9 us (the scores never leave the kernel).
    - The maxima, m[b,h,s] max= sc[b,h,s,t]: times H = 32, at 1 flop: 276,824,064 flops =
      1.27 us, with no kernel floor (the scores rule pays the kernel's) and no bytes (it reads
      the scores, writes maxima, both inside the kernel).  Costed as a kernel of its own it
      would read 512 MiB of scores: 383 us."""
    text = ROOT.joinpath("programs", "attention.edl").read_text()
    prog = edatalog.compile_string(text, dims={"B": 1, "S": 4096, "D": 4096, "H": 32}, dtype="bf16")
    graph, topo = prog.graph, preset("a100x1")
    costs = Costs(graph, topo)
    rank = dim_order(graph)

    def whole(name: str) -> float:
        node = graph.node(name)
        (cand,) = [c for c in candidates(node, 1) if c.reduce_axis is None and c.chunk == 1]
        return costs.option(node, Layout(node, cand, rank)).compute

    pairs = 528 * 128**2
    assert pairs * 4096 * flops_per_point(graph.node("sc")) == 106_300_440_576
    assert whole("sc") == pytest.approx(106_300_440_576 / (0.7 * 312e12))
    assert whole("m") == pytest.approx(pairs * 32 * 1 / (0.7 * 312e12))


def test_a_general_path_kernel_pays_its_bytes_at_the_general_bandwidth() -> None:
    """A kernel the runtime evaluates on its general path costs the roofline plus its bytes at
    the device's general bandwidth: 8 MB read and written by a maximum on a device of 20 GB/s
    memory and 1 GB/s general path (efficiency 1, floor 20 µs) takes max(20 µs, 8e6 / 20e9) +
    8e6 / 1e9 = 0.4 + 8 ms.  Where the general bandwidth is 0 (the presets) it costs the
    roofline alone; a kernel on the prepared path always does."""
    topo = preset("cpux1")
    cpu = dataclasses.replace(topo.devices[0], bandwidth=20e9, general_bandwidth=1e9)
    topo = dataclasses.replace(topo, devices=(cpu,), efficiency=1.0, kernel_floor=20e-6)
    nbytes = 8_000_000
    assert compute_seconds(0, nbytes, cpu, topo, "f32", general=True) == pytest.approx(8e6 / 20e9 + 8e6 / 1e9)
    assert compute_seconds(0, nbytes, cpu, topo, "f32") == pytest.approx(8e6 / 20e9)
    unmodeled = dataclasses.replace(cpu, general_bandwidth=0.0)
    assert compute_seconds(0, nbytes, unmodeled, topo, "f32", general=True) == pytest.approx(8e6 / 20e9)


def test_a_fused_attention_runs_at_the_attention_rate() -> None:
    """A kernel whose launches are an attention kernel's is priced at the device's attention
    rate for its dtype where the machine file gives one (a CPU's flash kernel runs far below its
    GEMMs), else at its flops; other kernels never take it: 1e9 FLOPs at 1e11 FLOP/s of
    attention take 10 ms, at the GEMMs' 4e11 2.5 ms."""
    topo = preset("cpux1")
    cpu = dataclasses.replace(topo.devices[0], flops=4e11, attention_peaks=(("f32", 1e11),))
    topo = dataclasses.replace(topo, devices=(cpu,), efficiency=1.0, kernel_floor=1e-6)
    assert compute_seconds(10**9, 0, cpu, topo, "f32", launches=ONE_ATTENTION) == pytest.approx(1e-2)
    assert compute_seconds(10**9, 0, cpu, topo, "f32", launches=Launches(gemm=1)) == pytest.approx(2.5e-3)
    assert compute_seconds(10**9, 0, cpu, topo, "bf16", launches=ONE_ATTENTION) == pytest.approx(2.5e-3)
