"""Value-to-index joins (``where ids[b, s] = v``) against numpy: an embedding, a masked
position lookup and a scatter-add (the looked-up index in the head: an embedding's gradient),
evaluated whole by the reference, and under random plans (vocabulary or position split across
devices included) by the simulator and the torch runtime."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import edatalog
from edatalog.solver import strategies
from edatalog.solver.plan import NodePlan, Split, Tile
from edatalog.solver.topology import preset
from tests.strategies import example_settings

# b, s, v, d of a table lookup, devices, seed
TABLE_SIZES = (
    st.integers(1, 2),
    st.integers(1, 4),
    st.integers(1, 9),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(0, 2**31),
)

EMBED = """
dim B = {B}, S = {S}, V = {V}, D = {D}.
input ids[B, S] : i64.
param table[V, D] : f64.
output emb, scaled.
emb[b, s, d] = table[v, d] where ids[b, s] = v.
scaled[b, s, d] += table[v, d] * v where ids[b, s] = v.
"""

POSITIONS = """
dim T = {T}, E = 3.
input pos[] : i64.
input sc[T, E] : f64.
output m, top.
m[t, e] = where(t < p, sc[t, e], -inf) where pos[] = p:T.
top[e] max= m[t, e].
"""


@example_settings("EDL_LOOKUP_EXAMPLES", 25)
@given(*TABLE_SIZES)
def test_an_embedding_under_random_plans_equals_numpy(b: int, s: int, v: int, d: int, n: int, seed: int) -> None:
    prog = edatalog.compile_string(EMBED.format(B=b, S=s, V=v, D=d))
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, v, size=(b, s))
    table = rng.standard_normal((v, d))
    want = {"emb": table[ids], "scaled": table[ids] * ids[..., None]}
    np.testing.assert_array_equal(prog.run({"ids": ids, "table": table})["emb"], want["emb"])
    topo = preset(f"cpux{n}")
    plan = edatalog.Plan(strategies.build(prog.graph, topo, "random", seed=seed), prog.graph, topo)
    for backend in ("sim", "torch"):
        out = prog.run({"ids": ids, "table": table}, plan=plan, backend=backend)
        for name, value in want.items():
            got = np.asarray(out[name]) if backend == "sim" else out[name].numpy()
            np.testing.assert_allclose(got, value, rtol=1e-12, atol=1e-12, err_msg=f"{name} on {backend}")


SCATTER = """
dim B = {B}, S = {S}, V = {V}, D = {D}.
input ids[B, S] : i64.
input g[B, S, D] : f64.
param table[V, D] : f64.
output grad, early, moved.
grad[v, d] += g[b, s, d] where ids[b, s] = v:V.
early[v, d] += g[b, s, d] * v where ids[b, s] = v:V, s <= b.
moved[v, d] += g[b, s, d] * table[v, d] where ids[b, s] = v:V.
"""


def _scattered(ids: np.ndarray, values: np.ndarray, v: int) -> np.ndarray:
    out = np.zeros((v, values.shape[-1]))
    np.add.at(out, ids, values)
    return out


@example_settings("EDL_LOOKUP_EXAMPLES", 25)
@given(*TABLE_SIZES)
def test_a_scatter_add_under_random_plans_equals_numpy(b: int, s: int, v: int, d: int, n: int, seed: int) -> None:
    """Each point adds to the row its id names (repeated ids sum; rows no id names are 0),
    under a guard, times the looked-up value, and reading the table at the same row."""
    prog = edatalog.compile_string(SCATTER.format(B=b, S=s, V=v, D=d))
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, v, size=(b, s))
    g = rng.standard_normal((b, s, d))
    table = rng.standard_normal((v, d))
    keep = (np.arange(s)[None, :] <= np.arange(b)[:, None])[..., None]
    want = {
        "grad": _scattered(ids, g, v),
        "early": _scattered(ids, np.where(keep, g * ids[..., None], 0.0), v),
        "moved": _scattered(ids, g, v) * table,
    }
    given_ = {"ids": ids, "g": g, "table": table}
    ref = prog.run(given_)
    for name, value in want.items():
        np.testing.assert_allclose(ref[name], value, rtol=1e-12, atol=1e-12, err_msg=name)
    topo = preset(f"cpux{n}")
    plan = edatalog.Plan(strategies.build(prog.graph, topo, "random", seed=seed), prog.graph, topo)
    for backend in ("sim", "torch"):
        out = prog.run(given_, plan=plan, backend=backend)
        for name, value in want.items():
            got = np.asarray(out[name]) if backend == "sim" else out[name].numpy()
            np.testing.assert_allclose(got, value, rtol=1e-12, atol=1e-12, err_msg=f"{name} on {backend}")


def test_a_scatter_over_part_of_the_vocabulary_adds_only_its_rows() -> None:
    """The scatter split along the looked-up index: each device writes its third of the rows,
    adding the points whose ids fall there; the parts together are every row."""
    prog = edatalog.compile_string(SCATTER.format(B=1, S=5, V=9, D=4))
    topo = preset("cpux3")
    base = strategies.build(prog.graph, topo, "replicate")
    splits = (Split("v", (0, 3, 6, 9)), Split("d", (0, 4)), Split("b", (0, 1)), Split("s", (0, 5)))
    vocab = Tile(splits, ((0,), (1,), (2,)))
    nodes = tuple(NodePlan(p.node, vocab) if p.node == "grad" else p for p in base.nodes)
    plan = edatalog.Plan(dataclasses.replace(base, nodes=nodes, strategy="vocab"), prog.graph, topo)
    ids = np.array([[0, 4, 8, 4, 5]])
    g = np.arange(20.0).reshape(1, 5, 4)
    given_ = {"ids": ids, "g": g, "table": np.zeros((9, 4))}
    for backend in ("sim", "torch"):
        got = np.asarray(prog.run(given_, plan=plan, backend=backend)["grad"])
        np.testing.assert_array_equal(got, _scattered(ids, g, 9))


def test_a_scatter_is_a_sum_only() -> None:
    with pytest.raises(edatalog.EdlError, match=r"looked-up index 'v' in the head of a 'max=' rule"):
        edatalog.compile_string(SCATTER.format(B=1, S=2, V=3, D=2).replace("grad[v, d] +=", "grad[v, d] max="))


@example_settings("EDL_LOOKUP_EXAMPLES", 25)
@given(st.integers(1, 7), st.data(), st.integers(1, 3), st.integers(0, 2**31))
def test_a_position_lookup_under_random_plans_equals_numpy(t: int, data: st.DataObject, n: int, seed: int) -> None:
    p = data.draw(st.integers(0, t - 1))
    prog = edatalog.compile_string(POSITIONS.format(T=t))
    sc = np.random.default_rng(seed).standard_normal((t, 3))
    m = np.where(np.arange(t)[:, None] < p, sc, -np.inf)
    topo = preset(f"cpux{n}")
    plan = edatalog.Plan(strategies.build(prog.graph, topo, "random", seed=seed), prog.graph, topo)
    for run in (prog.run({"pos": p, "sc": sc}), prog.run({"pos": p, "sc": sc}, plan=plan, backend="sim")):
        np.testing.assert_array_equal(run["m"], m)
        np.testing.assert_array_equal(run["top"], m.max(axis=0))


def test_a_vocabulary_sharded_embedding_is_a_plan() -> None:
    """Megatron's vocabulary-parallel embedding, as a tile: each device holds a third of the
    table and contributes the rows its part has; the sum of the parts is every row."""
    prog = edatalog.compile_string(EMBED.format(B=1, S=5, V=9, D=4))
    topo = preset("cpux3")
    base = strategies.build(prog.graph, topo, "replicate")
    splits = (Split("b", (0, 1)), Split("s", (0, 5)), Split("d", (0, 4)), Split("v", (0, 3, 6, 9)))
    vocab = Tile(splits, ((0,), (1,), (2,)))
    nodes = tuple(NodePlan(p.node, vocab) if p.node == "emb" else p for p in base.nodes)
    plan = edatalog.Plan(dataclasses.replace(base, nodes=nodes, strategy="vocab"), prog.graph, topo)
    ids = np.array([[0, 4, 8, 3, 5]])
    table = np.arange(36.0).reshape(9, 4)
    np.testing.assert_array_equal(prog.run({"ids": ids, "table": table}, plan=plan, backend="sim")["emb"], table[ids])
    np.testing.assert_array_equal(prog.run({"ids": ids, "table": table}, plan=plan, backend="torch")["emb"], table[ids])
    assert plan.report.flops[1] > 0  # every device takes part


def test_an_id_out_of_range_is_an_error_naming_the_cell() -> None:
    prog = edatalog.compile_string(EMBED.format(B=1, S=3, V=5, D=2))
    with pytest.raises(edatalog.EdlError, match=r"ids\[0, 1\] = 5 is out of range: rule 'emb' .* runs 0 \.\. 4"):
        prog.run({"ids": np.array([[0, 5, 1]]), "table": np.zeros((5, 2))})
    with pytest.raises(edatalog.EdlError, match=r"ids\[0, 2\] = -1 is out of range"):
        prog.run({"ids": np.array([[0, 1, -1]]), "table": np.zeros((5, 2))})
