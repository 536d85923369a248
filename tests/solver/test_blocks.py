"""The solver's building blocks against brute force: guard tightening, interval coordinates,
candidate tiles, and transfer costs."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace
from typing import cast
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import edatalog
from edatalog.ir import affine
from edatalog.ir.affine import Affine, Constraint, Guard
from edatalog.ir.graph import JoinAgg
from edatalog.ir.regions import Region
from edatalog.solver import blocks
from edatalog.solver.blocks import Layout, candidates, dim_order, through
from edatalog.solver.costmodel import port_seconds, transfer_seconds
from edatalog.solver.costs import Costs, Held, Need
from edatalog.solver.topology import preset
from tests.strategies import example_settings

LLAMA = "programs/llama_block.edl"
SMALL = {"S": 16, "D": 32, "H": 4, "KVH": 2, "F": 48}


def _random_guard(rng: random.Random) -> Guard:
    cons = []
    for _ in range(rng.randint(1, 3)):
        a, b, k = rng.randint(-3, 3), rng.randint(-3, 3), rng.randint(-6, 6)
        cons.append(Constraint(Affine.of({"s": a, "t": b}, k), rng.random() < 0.2))
    return Guard.of(cons)


def test_two_variable_tightening_matches_brute_force() -> None:
    rng = random.Random(7)
    checked = 0
    while checked < 1500:
        g = _random_guard(rng)
        gvars = sorted(g.vars)
        if g.is_true or g.is_false or len(g.conjs) != 1 or not gvars:
            continue
        ranges = {}
        for v in gvars:
            lo = rng.randint(0, 5)
            ranges[v] = (lo, lo + rng.randint(1, 7))
        found = blocks._tighten_conj(g.conjs[0].constraints, gvars, ranges)
        assert found is not None
        tight, count = found
        points = [
            p
            for p in itertools.product(*(range(*ranges[v]) for v in gvars))
            if all(c.holds(dict(zip(gvars, p, strict=True))) for c in g.conjs[0].constraints)
        ]
        assert count == len(points), (str(g), ranges)
        if points:
            for k, v in enumerate(gvars):
                assert tight[v] == (min(p[k] for p in points), max(p[k] for p in points) + 1), (str(g), ranges)
        checked += 1


VARS = ("i", "j", "k")


@st.composite
def guarded_blocks(draw: st.DrawFn) -> tuple[Guard, dict[str, tuple[int, int]]]:
    """A union of up to three conjunctions over one to three of i, j, k (coefficients in [-3, 3],
    equalities too, constants in [-10, 10]) and a block of at most 12 values per index, away
    from the origin, with an index ``h`` the guard does not mention."""
    names = sorted(draw(st.sets(st.sampled_from(VARS), min_size=1, max_size=3)))
    g = Guard.false()
    for _ in range(draw(st.integers(1, 3))):
        cons = []
        for _ in range(draw(st.integers(1, 4))):
            used = sorted(draw(st.sets(st.sampled_from(names), min_size=1, max_size=3)))
            coefs = {v: draw(st.integers(-3, 3)) for v in used}
            cons.append(Constraint(Affine.of(coefs, draw(st.integers(-10, 10))), eq=draw(st.integers(0, 4)) == 0))
        g = g | Guard.of(cons)
    ranges = {}
    for v in (*VARS, "h"):
        lo = draw(st.integers(0, 6))
        ranges[v] = (lo, lo + draw(st.integers(1, 12)))
    return g, ranges


def _node(guard: Guard) -> JoinAgg:
    return cast(JoinAgg, SimpleNamespace(guard=guard))  # tighten reads the node's guard alone


def _truth(g: Guard, ranges: dict[str, tuple[int, int]]) -> tuple[dict[str, tuple[int, int]], int]:
    """The bounding box of the guard's points in the block and their number, point by point."""
    names = sorted(ranges)
    inside = [
        p
        for p in itertools.product(*(range(*ranges[v]) for v in names))
        if any(all(bool(c.holds(dict(zip(names, p, strict=True)))) for c in conj.constraints) for conj in g.conjs)
    ]
    if not inside:
        return {}, 0
    return {v: (min(p[k] for p in inside), max(p[k] for p in inside) + 1) for k, v in enumerate(names)}, len(inside)


@pytest.mark.parametrize("limit", [blocks._MASK_LIMIT, 0])
@example_settings("EDL_TIGHTEN_EXAMPLES", 200)
@given(guarded_blocks())
def test_tightening_matches_brute_force(limit: int, case: tuple[Guard, dict[str, tuple[int, int]]]) -> None:
    """Exact in closed form for groups of at most two variables; beyond that exact point by point
    in small blocks, and else untightened with an upper bound (a limit of 0 forces that)."""
    g, ranges = case
    want_box, want = _truth(g, ranges)
    with mock.patch.object(blocks, "_MASK_LIMIT", limit):
        tight, points = blocks.tighten(_node(g), ranges)
        assert blocks.tighten(_node(g), ranges) == (tight, points)  # cached
    blocks._TIGHTEN_CACHE.clear()  # the other limit must compute afresh
    closed = all(len(vs) <= 2 for conj in g.conjs for vs, _ in affine._groups(conj.constraints))
    assert tight["h"] == ranges["h"]
    exact = points == want and (tight == want_box or not want)
    if closed or limit:
        assert exact
    else:
        assert exact or (tight == ranges and points >= want)


def test_causal_block_near_a_trillion() -> None:
    s, t = Affine.var("s"), Affine.var("t")
    n = 10**12
    causal = _node(Guard.of([Constraint(s - t)]))
    ranges = {"s": (n, n + 1000), "t": (n + 500, n + 2000), "h": (0, 32)}
    tight, points = blocks.tighten(causal, ranges)
    assert tight == {"s": (n + 500, n + 1000), "t": (n + 500, n + 1000), "h": (0, 32)}
    assert points == 32 * 500 * 501 // 2
    assert blocks.tighten(causal, {"s": (n, n + 10), "t": (n + 10, 2 * n), "h": (0, 32)})[1] == 0
    # A whole triangle of 10**12 rows, and a block of it 10**11 on a side.
    assert blocks.tighten(causal, {"s": (0, n), "t": (0, n), "h": (0, 1)})[1] == n * (n + 1) // 2
    tight, points = blocks.tighten(causal, {"s": (n // 2, n), "t": (n // 4, n // 4 + n // 10), "h": (0, 1)})
    assert tight == {"s": (n // 2, n), "t": (n // 4, n // 4 + n // 10), "h": (0, 1)}
    assert points == (n // 2) * (n // 10)


def test_band_and_union_blocks_at_a_billion() -> None:
    t, u = Affine.var("t"), Affine.var("u")
    big = 10**9
    band = _node(Guard.of([Constraint(u - t), Constraint(t + 2 - u)]))  # t <= u <= t + 2
    tight, points = blocks.tighten(band, {"t": (big, 2 * big), "u": (big - 7, big + 5)})
    assert tight == {"t": (big, big + 5), "u": (big, big + 5)}
    assert points == 3 + 3 + 3 + 2 + 1
    # u == t or u >= t + 10**8: the hull of the pieces' boxes, the points counted by the union.
    apart = _node(Guard.of([Constraint(u - t, eq=True)]) | Guard.of([Constraint(u - t - 10**8)]))
    tight, points = blocks.tighten(apart, {"t": (big, 2 * big), "u": (0, big + 10**8 + 3)})
    assert tight == {"t": (big, big + 10**8 + 3), "u": (big, big + 10**8 + 3)}
    assert points == 10**8 + 3 + (3 + 2 + 1)  # the diagonal, then the corner of the wedge


def test_interval_accesses_equal_regions() -> None:
    """``through`` covers exactly the coordinates the access reaches, point by point (what the
    solver prices is what exchange synthesis sends: both use this one function)."""
    prog = edatalog.compile(LLAMA, dims=SMALL)
    rank = dim_order(prog.graph)
    for node in prog.graph.nodes:
        for cand in candidates(node, 4)[:12]:
            for b in Layout(node, cand, rank).per_device:
                for acc in node.inputs:
                    ivs = through(acc.axes, b.ranges)
                    assert Region.through(acc.axes, b.ranges).axes == ivs
                    grids = np.meshgrid(*(np.arange(*b.ranges[v]) for v in acc.indices), indexing="ij")
                    at = dict(zip(acc.indices, grids, strict=True))
                    for axis, amap in zip(ivs, acc.axes, strict=True):
                        coords = np.broadcast_to(amap.affine().evaluate(at), grids[0].shape if grids else ())
                        got = np.concatenate([np.arange(lo, hi) for lo, hi in axis]) if axis else np.zeros(0)
                        assert np.array_equal(got, np.unique(coords))


@pytest.mark.parametrize("n", [1, 3, 6, 8])
def test_candidates_tile_every_join_space(n: int) -> None:
    prog = edatalog.compile(LLAMA, dims={**SMALL, "S": 24})
    rank = dim_order(prog.graph)
    for node in prog.graph.nodes:
        for cand in candidates(node, n):
            tile = Layout(node, cand, rank).tile
            tile.verify(node.box, n, node.name)
            assert tile.used_devices() <= set(range(n))


def test_causal_chunks_skip_empty_blocks() -> None:
    """Chunking s and t of the scores 4 ways leaves 10 of 16 chunks on a device."""
    prog = edatalog.compile(LLAMA, dims={**SMALL, "S": 32})
    node = prog.graph.node("sc")
    cand = next(c for c in candidates(node, 2) if c.chunk == 4 and c.parts == (1, 2, 1, 1, 1, 1))
    layout = Layout(node, cand, dim_order(prog.graph))
    per_device = {d: sum(1 for b in layout.per_device if b.device == d) for d in range(2)}
    assert per_device == {0: 10, 1: 10}


def test_zigzag_splits_give_every_device_as_much_causal_work() -> None:
    """Split along s, causal scores give the last device most of the work; dealt out zigzag
    (parts j and 2p-1-j together) every device gets as many unmasked scores."""
    prog = edatalog.compile(LLAMA, dims={**SMALL, "S": 32})
    graph = prog.graph
    assert blocks.guarded_dims(graph) == {"S"}
    node = graph.node("sc")
    k = [i.name for i in node.indices].index("s")
    parts = tuple(4 if j == k else 1 for j in range(len(node.indices)))
    found = candidates(node, 4, balance=blocks.guarded_dims(graph))
    plain = next(c for c in found if c.parts == parts and not c.balanced and c.chunk == 1)
    zigzag = next(c for c in found if c.parts == parts and c.balanced == (k,))

    def points(cand: blocks.Candidate) -> list[int]:
        layout = Layout(node, cand, dim_order(graph))
        return [sum(b.points for b in layout.per_device if b.device == d) for d in range(4)]

    per_row = 2 * 2 * 8  # g, r, e
    assert points(plain) == [per_row * p for p in (36, 100, 164, 228)]  # (s, t) pairs with t <= s
    assert sum(points(zigzag)) == sum(points(plain))
    assert len(set(points(zigzag))) == 1
    tile = Layout(node, zigzag, dim_order(graph)).tile
    assert tile.devices == ((0,), (1,), (2,), (3,), (3,), (2,), (1,), (0,))
    # Every rule with an S index has the variant; none without (or in the mesh space).
    assert any(c.balanced for c in candidates(graph.node("q"), 4, balance={"S"}))
    assert not any(c.balanced for c in candidates(node, 4, mesh=True, balance={"S"}))


def _slow_transfer(costs: Costs, item: int, held: Held, need: Need) -> float:
    """Transfer cost, one cell set at a time: each receiver waits for the larger of its port (every
    transfer's latency + bytes / port rate) and its busiest pair (latency + bytes / pair rate,
    per source), each sender for its port.  A piece's k-th reader fetches it from the k-th of
    the piece's holders on the reader's node (cycling), or from its first holder elsewhere."""
    topo = costs.topo
    holders: dict[blocks.Box, list[int]] = {}
    for d, boxes in held:
        for box in boxes:
            holders.setdefault(box, []).append(d)
    sent = dict.fromkeys(range(topo.n), 0.0)
    readers = dict.fromkeys(holders, 0)
    worst = 0.0
    for d, want in need:
        port = 0.0
        pairs: dict[int, float] = {}
        for box, devs in holders.items():
            if d in devs or blocks.box_meet(want, box) == 0:
                continue
            near = [s for s in sorted(devs) if topo.devices[s].node == topo.devices[d].node]
            senders = near or sorted(devs)[:1]
            src = senders[readers[box] % len(senders)]
            readers[box] += 1
            nbytes = blocks.box_meet(want, box) * item
            t = port_seconds(nbytes, topo.link(src, d))
            port += t
            sent[src] += t
            pairs[src] = pairs.get(src, 0.0) + transfer_seconds(nbytes, topo.link(src, d))
        worst = max(worst, port, *pairs.values())
    return max(worst, *sent.values())


@pytest.mark.parametrize("machine", ["a100x8", "2x4", "a100x3"])
def test_transfer_costs_match_a_direct_count(machine: str) -> None:
    prog = edatalog.compile(LLAMA, dims=SMALL)
    graph = prog.graph
    topo = preset(machine)
    costs = Costs(graph, topo)
    rank = dim_order(graph)
    helds: dict[str, list[Held]] = {}
    needs: dict[str, list[Need]] = {}
    for node in graph.nodes:
        for cand in candidates(node, topo.n, balance=blocks.guarded_dims(graph)):  # zigzag: 2 intervals
            o = costs.option(node, Layout(node, cand, rank))
            helds.setdefault(node.out, []).append(o.held)
            for acc, need in o.needs:
                needs.setdefault(acc.relation, []).append(need)
    rng = random.Random(0)
    for rel, hs in helds.items():
        for _ in range(40 if rel in needs else 0):
            held, need = rng.choice(hs), rng.choice(needs[rel])
            want = _slow_transfer(costs, costs.itemsize(rel), held, need)
            assert costs.transfer(rel, held, need) == pytest.approx(want, rel=1e-12, abs=1e-15)
        # Many needs of one layout at once (as the model is built), fresh and cached alike.
        if rel in needs:
            held, batch = rng.choice(hs), rng.sample(needs[rel], min(12, len(needs[rel])))
            want_all = [_slow_transfer(costs, costs.itemsize(rel), held, need) for need in batch]
            assert Costs(graph, topo).transfers(rel, held, batch) == pytest.approx(want_all, rel=1e-12, abs=1e-15)
            assert costs.transfers(rel, held, batch) == pytest.approx(want_all, rel=1e-12, abs=1e-15)
