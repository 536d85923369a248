"""Property tests: the reference evaluator and the compiler's symbolic supports against a brute-force
oracle, on random programs (:mod:`tests.strategies`).

CI runs a fixed, derandomized set of examples.  For a longer, random run::

    EDL_PROPERTY_EXAMPLES=5000 .venv/bin/pytest tests/backend/test_reference_property.py

(add ``--hypothesis-seed=N`` to repeat one).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given

import edatalog
from edatalog.backend.kernels.reference import Value
from edatalog.errors import EdlWarning
from edatalog.ir.graph import Graph
from tests.strategies import GeneratedProgram, example_settings, programs

_SETTINGS = example_settings("EDL_PROPERTY_EXAMPLES", 200)
RTOL, ATOL = 1e-9, 1e-12


def _present(v: Value) -> np.ndarray:
    return np.ones(v.data.shape, dtype=bool) if v.present is None else np.asarray(v.present)


def _assert_matches(name: str, got: Value, data: np.ndarray, present: np.ndarray) -> None:
    assert got.data.shape == data.shape, f"{name}: shape {got.data.shape}, expected {data.shape}"
    got_present = _present(got)
    assert np.array_equal(got_present, present), (
        f"{name}: presence\n{got_present.astype(int)}\nexpected\n{present.astype(int)}"
    )
    values = np.asarray(got.data, dtype=np.float64)
    assert np.all(np.isfinite(data[present])), f"{name}: the oracle produced a non-finite value"
    np.testing.assert_allclose(values[present], data[present], rtol=RTOL, atol=ATOL, err_msg=f"{name}: values")
    assert np.all(values[~present] == 0), f"{name}: absent cells must hold 0"


def _support_mask(graph: Graph, name: str) -> np.ndarray:
    rel = graph.relation(name)
    return np.broadcast_to(rel.support.mask(rel.axis_names, rel.box), rel.shape)


@_SETTINGS
@given(programs())
def test_evaluate_matches_oracle(gen: GeneratedProgram) -> None:
    """Every derived relation: the same presence mask, the same values on present cells, 0 on absent
    ones; ``run`` returns exactly the outputs, with absent cells read as 0."""
    prog = gen.compile()
    env = prog.evaluate(gen.inputs)
    for name in gen.derived:
        data, present = gen.expected[name]
        _assert_matches(name, env[name], data, present)
    out = prog.run(gen.inputs)
    assert set(out) == set(gen.outputs)
    for name, arr in out.items():
        data, present = gen.expected[name]
        np.testing.assert_allclose(
            np.asarray(arr, dtype=np.float64), np.where(present, data, 0.0), rtol=RTOL, atol=ATOL, err_msg=name
        )


@_SETTINGS
@given(programs())
def test_supports_and_guards_match_presence(gen: GeneratedProgram) -> None:
    """The symbolic supports and effective guards against what the program actually derives.

    Inputs are always fully present, so absence comes only from guards, literal head positions and
    reads of absent cells: presence does not depend on values, and symbolic reasoning can be exact.
    A relation's support must contain its present cells; it must equal them when the projection
    that produced it was exact (``support_exact``) and the supports of everything its rules read
    equal their presence.  Likewise a node's effective guard must contain the points that
    contribute, and equal them when the supports of the relations it reads are exact.  The support's
    exact count must agree with its mask.
    """
    prog = gen.compile()
    graph = prog.graph
    exact: dict[str, bool] = {r.name: True for r in graph.relations if r.kind != "derived"}
    for name in gen.derived:
        rel = graph.relation(name)
        _, present = gen.expected[name]
        mask = _support_mask(graph, name)
        assert not np.any(present & ~mask), f"{name}: support {rel.support} misses present cells"
        exact[name] = bool(np.array_equal(mask, present))
        reads_exact = all(exact[a.relation] for node in graph.producers(name) for a in node.inputs)
        if rel.support_exact and reads_exact:
            assert exact[name], f"{name}: support {rel.support} is marked exact but has cells that are never derived"
        assert rel.support.count(rel.box) == int(mask.sum()), f"{name}: count of {rel.support}"
    for node in graph.nodes:
        order, contributing = gen.contributing[node.name]
        assert set(node.box) <= set(order), f"{node.name}: indices {node.box}, expected {order}"
        # An index an equality guard defines is substituted away (rules/eliminate.py): it is a
        # function of the others at every point that exists, so the points project one to one.
        gone = tuple(k for k, v in enumerate(order) if v not in node.box)
        order = tuple(v for v in order if v in node.box)
        contributing = np.asarray(contributing.any(axis=gone)) if gone else contributing
        mask = np.broadcast_to(node.guard.mask(list(order), node.box), contributing.shape)
        assert not np.any(contributing & ~mask), f"{node.name}: guard {node.guard} drops contributing points"
        if all(exact[a.relation] for a in node.inputs):
            assert np.array_equal(mask, contributing), f"{node.name}: guard {node.guard} admits dead points"


# -- regressions ---------------------------------------------------------------------------------


def _compile(text: str) -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.compile_string(text)


def test_erf_and_gelu_of_a_scalar_stay_scalar() -> None:
    """``erf`` went through ``np.ascontiguousarray``, which makes a 0-d array 1-d, so a rule with an
    empty join space (``r[] = erf(N)``) produced an array of the wrong shape."""
    prog = _compile("dim N = 2.\ninput x[N] : f64.\nr[] = erf(N) + gelu(N).\ns[1:2] = erf(x[0]).\n")
    env = prog.evaluate({"x": np.array([0.5, 1.0])})
    gelu = 0.5 * 2.0 * (1.0 + math.erf(2.0 / math.sqrt(2.0)))
    np.testing.assert_allclose(env["r"].data, math.erf(2.0) + gelu, rtol=1e-12)
    np.testing.assert_allclose(env["s"].data, [0.0, math.erf(0.5)], rtol=1e-12)
    assert env["s"].present is not None
    assert env["s"].present.tolist() == [False, True]


@pytest.mark.parametrize("seed", range(3))
def test_oracle_agrees_on_a_fixed_chain(seed: int) -> None:
    """A hand-written chain through every aggregation operator, composite and literal positions, and
    a guard that leaves cells absent, checked against values computed here with plain loops."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, (3, 4))
    prog = _compile(
        "dim N = 3, M = 2.\n"
        "input x[N, M*M] : f64.\n"
        "h[(0, i)] = x[i, (0, 0:M)].\n"
        "h[(1, i)] = x[i, (1:M, 1)].\n"
        "s[i] += x[i, k] * x[i, k] where k <= i.\n"
        "p[i] *= 1.0 + tanh(x[i, k]) where i + k < 4.\n"
        "mx[k] max= x[i, k] - h[(1, i)].\n"
        "mn[k] min= x[i, k] where i != 2, 2*i >= k.\n"
    )
    env = prog.evaluate({"x": x})
    np.testing.assert_allclose(env["h"].data, np.concatenate([x[:, 0], x[:, 3]]), rtol=1e-12)
    np.testing.assert_allclose(env["s"].data, [np.sum(x[i, : i + 1] ** 2) for i in range(3)], rtol=1e-12)
    np.testing.assert_allclose(env["p"].data, [np.prod(1 + np.tanh(x[i, : 4 - i])) for i in range(3)], rtol=1e-12)
    np.testing.assert_allclose(env["mx"].data, np.max(x - x[:, 3:4], axis=0), rtol=1e-12)
    mn = env["mn"]
    assert mn.present is not None
    assert mn.present.tolist() == [True, True, True, False]
    expect = [min(x[i, k] for i in (0, 1) if 2 * i >= k) for k in range(3)]
    np.testing.assert_allclose(mn.data, [*expect, 0.0], rtol=1e-12)


# Regressions: compiler bugs the properties above found (both fixed).


def test_head_literal_default_before_declared_split() -> None:
    """``r[0, i]`` gives axis 0 of ``r`` the default extent 1, so ``i`` in the second rule has extent
    1 and ``(i, 15)`` spans 16.  Splitting the declared ``M*N`` axis among the two unknown parts of
    ``(i, 15)`` (4 and 4) would put the literal 15 out of range, so that split is not taken."""
    prog = _compile("dim N = 4, M = 4.\ninput w[M*N] : f64.\nr[0, i] = w[i].\ns[i] = r[i, (i, 15)].\n")
    env = prog.evaluate({"w": np.arange(16.0)})
    np.testing.assert_array_equal(env["s"].data, [15.0])


def test_support_exact_accounts_for_inexact_reads() -> None:
    """``r``'s support is a projection through the composite head ``(j, i)`` that cannot be exact
    (cell 3 is a hole), so it is marked inexact; ``s`` copies ``r``, so its support ``k >= 2``, which
    includes the never-derived cell 3, must be marked inexact too."""
    prog = _compile("dim N = 4.\ninput x[N] : f64.\nr[(j, i:2)] = x[j] where i < j.\ns[k] = r[k].\n")
    present = prog.evaluate({"x": np.ones(4)})["s"].present
    assert present is not None
    assert not prog.graph.relation("r").support_exact
    rel = prog.graph.relation("s")
    assert not rel.support_exact or np.array_equal(_support_mask(prog.graph, "s"), present)
