"""Evaluation whose cost follows the work: index expressions, equality guards, bands, pairwise
contractions, chunks and memory estimates, each checked against numpy or torch.

Timings are not asserted here (no test may depend on a machine's speed): that the cost follows
the work is shown structurally, by the join spaces and intermediates the evaluator builds, and
measured in ``benchmarks/evaluation.py``.
"""

from __future__ import annotations

import math
import tracemalloc
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given

import edatalog
from edatalog import EdlError
from edatalog.backend.kernels import joinagg, memory
from edatalog.backend.kernels.contract import contract, peak_elements
from edatalog.backend.kernels.joinagg import prepare
from edatalog.errors import EdlWarning
from tests.strategies import GeneratedProgram, example_settings, programs

_SETTINGS = example_settings("EDL_PROPERTY_EXAMPLES", 60)


def _compile(text: str, **dims: int) -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.compile_string(text, dims=dims)


CONV = """
dim B = 2, C = 3, O = 4, T = 41, K = 3, L = T - K + 1.
input x[B, C, T] : f64.
param w[O, C, K] : f64.
output guarded, direct, same, strided, dilated.
guarded[b, o, l:L] += x[b, c, t] * w[o, c, k] where t == l + k.
direct[b, o, l:L] += x[b, c, l + k] * w[o, c, k].
same[b, o, l:T] += x[b, c, l + k - 1] * w[o, c, k].
strided[b, o, l:(T - K) / 2 + 1] += x[b, c, 2 * l + k] * w[o, c, k].
dilated[b, o, l:T - 2 * (K - 1)] += x[b, c, l + 2 * k] * w[o, c, k].
"""


@pytest.mark.parametrize(("c", "t"), [(3, 41), (6, 41), (128, 41), (256, 41), (2, 20_001)])
def test_convolutions_equal_torch(c: int, t: int) -> None:
    """Valid, same (zero-padded), strided and dilated 1-D convolutions, written with an index
    expression or an equality guard, against ``torch.nn.functional.conv1d``; both channel counts
    and a long sequence."""
    prog = _compile(CONV, C=c, T=t)
    inputs = prog.random_inputs(0)
    out = prog.run(inputs)
    x, w = torch.from_numpy(inputs["x"]), torch.from_numpy(inputs["w"])
    conv = torch.nn.functional.conv1d
    np.testing.assert_allclose(out["direct"], conv(x, w).numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(out["guarded"], out["direct"])
    np.testing.assert_allclose(out["same"], conv(x, w, padding=1).numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["strided"], conv(x, w, stride=2).numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["dilated"], conv(x, w, dilation=2).numpy(), rtol=1e-10, atol=1e-12)


def test_an_equality_guard_and_an_index_expression_compile_to_the_same_rule() -> None:
    graph = _compile(CONV).graph
    guarded, direct = graph.node("guarded"), graph.node("direct")
    assert [i.name for i in guarded.indices] == [i.name for i in direct.indices] == ["b", "o", "l", "c", "k"]
    assert guarded.inputs == direct.inputs
    assert guarded.guard == direct.guard
    assert guarded.guard.is_true  # 0 <= l + k <= T - 1 follows from L = T - K + 1
    assert str(direct) == "direct[b,o,l] += x[b,c,l + k] * w[o,c,k]"


def test_flops_count_the_points_that_exist() -> None:
    """A valid convolution has 2·B·O·L·C·K FLOPs; a zero-padded one only its in-range points."""
    prog = _compile(CONV)
    b, c, o, t, k = 2, 3, 4, 41, 3
    assert prog.graph.costs["direct"].flops == 2 * b * o * (t - k + 1) * c * k
    # same: for each l of T, the taps k with 0 <= l + k - 1 <= T - 1: all but one at each end.
    assert prog.graph.costs["same"].points == b * o * c * (t * k - 2)
    assert prog.graph.costs["same"].exact


def test_a_shifted_read_is_absent_where_it_falls_outside() -> None:
    prog = _compile(
        "dim B = 2, T = 7.\ninput x[B, T] : f64.\noutput prev, diff.\n"
        "prev[b, t:T] = x[b, t - 1].\n"
        "diff[b, t] = x[b, t] - x[b, t - 1].\n"
    )
    x = np.random.default_rng(0).standard_normal((2, 7))
    env = prog.evaluate({"x": x})
    prev, diff = env["prev"], env["diff"]
    assert prev.present is not None and diff.present is not None
    assert prev.present[:, 0].tolist() == [False, False] and prev.present[:, 1:].all()
    np.testing.assert_array_equal(prev.data[:, 1:], x[:, :-1])
    np.testing.assert_allclose(diff.data[:, 1:], np.diff(x, axis=1), rtol=1e-12)
    assert str(prog.graph.node("prev")) == "prev[b,t] = x[b,t - 1] where t >= 1"


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_a_place_an_equality_guard_fixes_outside_its_axis_reads_nothing(backend: str) -> None:
    """``i == 0`` fixes ``x[i - 1, i]`` at ``x[-1, 0]``: no point reads a cell there, so the sum has
    no term and is absent (it once counted the place as a present 0, and before that did not
    compile)."""
    prog = _compile(
        "dim N = 3.\ninput x[N, N] : f32.\noutput r0, r1, r2.\n"
        "r0[] += (x[i, i] + x[i - 1, i]) where i == 0.\n"
        "r1[] += x[i - 1, i] where i == 0.\n"
        "r2[] += (x[i, i] + x[i - 1, i]) where i <= 1.\n"
    )
    x = np.arange(1, 10, dtype=np.float32).reshape(3, 3)
    if backend == "reference":
        env = prog.evaluate({"x": x})
        assert env["r0"].present is not None and not env["r0"].present.any()
        assert env["r1"].present is not None and not env["r1"].present.any()
        assert env["r2"].present is None and float(env["r2"].data) == x[1, 1] + x[0, 1]
    out = prog.run({"x": x}, backend=backend)
    assert [float(out[k]) for k in ("r0", "r1", "r2")] == [0.0, 0.0, x[1, 1] + x[0, 1]]


def test_a_band_is_evaluated_over_the_band() -> None:
    """``u >= t, u <= t + 2`` re-indexes ``u`` by its offset: the join space has 3 points per
    output cell, not T, and the result is numpy's sliding maximum."""
    prog = _compile(
        "dim B = 2, T = 50, C = 3.\ninput x[B, T, C] : f64.\n"
        "slide[b, t:T - 2, c] max= x[b, u, c] where u >= t, u <= t + 2.\n"
    )
    node = prog.graph.node("slide")
    assert math.prod(node.box.values()) == 2 * 48 * 3 * 50  # as written: dense t by u
    assert math.prod(prepare(node).box.values()) == 2 * 48 * 3 * 3  # as evaluated: the band
    x = np.random.default_rng(1).standard_normal((2, 50, 3))
    out = prog.run({"x": x})["slide"]
    np.testing.assert_array_equal(out, np.lib.stride_tricks.sliding_window_view(x, 3, axis=1).max(axis=-1))


def test_the_max_pool_of_the_trial_runs_in_little_memory() -> None:
    """The max-pool at the size the new-user trial used (B=16, T=512, C=1024): it asked for
    15.9 GiB; now it equals numpy's and numpy allocates well under 1 GiB beyond its 32 MiB input
    (tracemalloc counts numpy's buffers: a deterministic measure, not a timing)."""
    prog = _compile(
        "dim B = 16, T = 512, C = 1024.\ninput x[B, T, C] : f32.\n"
        "slide[b, t:T - 2, c] max= x[b, u, c] where u >= t, u <= t + 2.\n"
    )
    x = np.random.default_rng(4).standard_normal((16, 512, 1024), dtype=np.float32)
    tracemalloc.start()
    try:
        out = prog.run({"x": x})["slide"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 30, f"{peak / 2**20:.0f} MiB"
    np.testing.assert_array_equal(out, np.lib.stride_tricks.sliding_window_view(x, 3, axis=1).max(axis=-1))


def test_a_band_between_two_sums_of_indices() -> None:
    """A band whose bounds share a sum of indices (``i + j - 1 <= u <= i + j + 1``)."""
    prog = _compile(
        "dim N = 6, M = 20.\ninput x[M] : f64.\ny[i:N, j:N] += x[u] where u >= i + j - 1, u <= i + j + 1.\n"
    )
    assert prepare(prog.graph.node("y")).box["u_off"] == 3
    x = np.random.default_rng(2).standard_normal(20)
    want = [[sum(x[u] for u in range(max(0, i + j - 1), min(20, i + j + 2))) for j in range(6)] for i in range(6)]
    np.testing.assert_allclose(prog.run({"x": x})["y"], want, rtol=1e-12)


def test_contractions_go_pairwise_in_the_cheapest_order() -> None:
    """A matrix chain ``a[i,j] b[j,k] c[k,l]`` with a long ``k``: contracting a with b first would
    hold an i by k matrix; the cheap order never holds more than a few thousand elements."""
    ext = {"i": 4, "j": 5, "k": 10_000, "l": 3}
    peak, _ = peak_elements([("i", "j"), ("j", "k"), ("k", "l")], ["i", "l"], ext)
    assert peak <= 5 * 10_000 + 10_000 * 3 + 5 * 3  # b and c (the operands) and their product
    rng = np.random.default_rng(3)
    a, b, c = (rng.standard_normal((ext[p], ext[q])) for p, q in ("ij", "jk", "kl"))
    got, order = contract([(a, ("i", "j")), (b, ("j", "k")), (c, ("k", "l"))], ["i", "l"], ext)
    assert order == ("i", "l")
    np.testing.assert_allclose(got, a @ b @ c, rtol=1e-10)


@pytest.fixture
def tiny_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(joinagg, "CHUNK_POINTS", 5)


@pytest.mark.usefixtures("tiny_chunks")
@_SETTINGS
@given(programs())
def test_chunked_evaluation_matches_the_oracle(gen: GeneratedProgram) -> None:
    """With chunks of 5 points, every broadcast rule is evaluated in pieces along its longest
    index (output or aggregated): the results and presence still equal the oracle's."""
    env = gen.compile().evaluate(gen.inputs)
    for name in gen.derived:
        data, present = gen.expected[name]
        got = env[name]
        got_present = np.ones(data.shape, dtype=bool) if got.present is None else got.present
        assert np.array_equal(got_present, present), name
        np.testing.assert_allclose(
            np.where(present, got.data, 0.0), np.where(present, data, 0.0), rtol=1e-9, atol=1e-12
        )


LN_LINEAR = """
dim B = 1, S = 128, D = 256, F = 512.
input x[B, S, D] : f32.
param g[D] : f32.
param w[F, D] : f32.
output y.
mu[b, s] += x[b, s, d] / D.
xc[b, s, d] = x[b, s, d] - mu[b, s].
var[b, s] += xc[b, s, d] * xc[b, s, d] / D.
xn[b, s, d] = xc[b, s, d] * rsqrt(var[b, s] + 0.00001) * g[d].
y[b, s, f] += xn[b, s, d] * w[f, d].
"""


def test_too_big_is_an_error_before_anything_is_allocated() -> None:
    """S = 10^9 would need about a terabyte: drawing inputs, running and evaluating refuse with
    the input or rule, its shape and its bytes, before allocating."""
    prog = _compile(LN_LINEAR, S=10**9)
    with pytest.raises(EdlError, match=r"input 'x' needs a \[1, 1000000000, 256\] f32 buffer of 954 GiB"):
        prog.random_inputs(0)
    with pytest.raises(EdlError, match="input 'x'"):
        prog.check_memory(draw_inputs=True)
    with pytest.raises(EdlError, match=r"rule '\w+' needs a \[1, 1000000000(, \d+)?\] f32 buffer"):
        prog.check_memory()
    small = _compile(LN_LINEAR, S=4)
    small.check_memory(draw_inputs=True, keep_all=True)


def test_the_estimate_names_the_first_step_that_does_not_fit() -> None:
    prog = _compile(LN_LINEAR)
    steps = memory.input_steps(prog.graph) + memory.evaluation_steps(prog.graph, prog.outputs)
    inputs = sum(s.adds for s in steps[:3])
    assert inputs == (128 * 256 + 256 + 512 * 256) * 4
    with pytest.raises(EdlError, match="rule 'mu'"):  # the inputs fit, the first rule does not
        memory.check(steps, available=inputs + 1)
    memory.check(steps, available=1 << 40)


def test_intermediates_are_freed_when_only_outputs_are_kept() -> None:
    prog = _compile(LN_LINEAR, S=8)
    inputs = prog.random_inputs(0)
    everything = prog.evaluate(inputs)
    outputs_only = prog.evaluate(inputs, keep=prog.outputs)
    assert set(outputs_only) == {"y"}
    np.testing.assert_array_equal(outputs_only["y"].data, everything["y"].data)
