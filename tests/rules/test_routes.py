"""Rules that carry a route (:mod:`edatalog.rules.routes`): the elementwise rules between a
mixture of experts' routed rules look the route up as a filter, which changes no value and
gives plans an expert index to split."""

from __future__ import annotations

import numpy as np
import pytest

import edatalog
from edatalog.ir.forms import filter_lookups, routed_partition, without_full_filters

LAYER = """
dim T = 12, D = 8, F = 10, X = 4, K = 2.
input x[T, D] : f64.
param wg[X, D] : f64.
param w1[X, F, D] : f64.
param w2[X, D, F] : f64.
output y, s.
router[t, e] += x[t, d] * wg[e, d].
route[t, k:K] argtop= router[t, e].
h1[t, k, f] += x[t, d] * w1[e, f, d] where route[t, k] = e.
a[t, k, f] = silu(h1[t, k, f]).
b[t, k, f] = a[t, k, f] * 2.0.
s[t] += a[t, k, f].
y[t, d] += b[t, k, f] * w2[e, d, f] where route[t, k] = e.
"""


def _graph(text: str = LAYER) -> edatalog.Program:
    return edatalog.compile_string(text)


def test_elementwise_rules_after_a_routed_rule_carry_its_route() -> None:
    g = _graph().graph
    for name in ("a", "b"):  # b reads a, which carries the route: it follows too
        node = g.node(name)
        assert len(filter_lookups(node)) == 1, name
        found = routed_partition(node)
        assert found is not None and found[1].relation == "route" and found[1].axes == (0, 1)
        assert str(node).endswith("where route[t,k] = e:X")
    assert not g.node("s").lookups  # a sum over k and f: it does not follow
    assert not g.node("router").lookups


def test_a_rule_reading_the_routed_index_through_an_expression_does_not_follow() -> None:
    text = LAYER.replace("b[t, k, f] = a[t, k, f] * 2.0.", "b[t, k, f] = a[t, K - 1 - k, f] * 2.0.")
    g = _graph(text).graph
    assert filter_lookups(g.node("a")) and not g.node("b").lookups


def test_a_filter_over_its_whole_range_is_dropped_before_evaluation() -> None:
    node = _graph().graph.node("a")
    bare = without_full_filters(node)
    assert not bare.lookups and "e" not in bare.box and not bare.agg_indices
    assert bare.inputs == node.inputs


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_carrying_the_route_changes_no_value(backend: str) -> None:
    """Against the same program with the rules' route written out by hand as a mask of the
    dense form (every expert, zero where not routed)."""
    prog = _graph()
    values = prog.random_inputs(seed=3)
    got = prog.run(values, backend=backend)
    x, w1, w2, wg = values["x"], values["w1"], values["w2"], values["wg"]
    order = np.argsort(-(x @ wg.T), axis=1, kind="stable")[:, :2]
    h1 = np.einsum("td,tkfd->tkf", x, w1[order])
    a = h1 / (1 + np.exp(-h1))
    y = np.einsum("tkf,tkdf->td", 2 * a, w2[order])
    np.testing.assert_allclose(np.asarray(got["y"]), y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(got["s"]), a.sum(axis=(1, 2)), rtol=1e-12, atol=1e-12)
