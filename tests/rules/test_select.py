"""Selections (``edatalog.rules.select``): ``argmax=``, ``argmin=``, ``top=`` and ``argtop=``
against numpy (ties to the lower index, as a stable sort orders them), as printed, in every
dtype, and under plans that split the chosen index across logical devices (interpreted and
replayed as a recorded graph)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import edatalog
from edatalog.errors import EdlError, EdlWarning

SELECT = """
dim T = 5, E = 6, K = 2.
input x[T, E] : f32.
output best, worst, gate, route.

best[t] argmax= x[t, e].
worst[t] argmin= x[t, e].
gate[t, k:K] top= x[t, e].
route[t, k:K] argtop= x[t, e].
"""


def _compile(text: str, **kw: object) -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.compile_string(text, **kw)  # type: ignore[arg-type]


def _expected(x: np.ndarray, k: int) -> dict[str, np.ndarray]:
    order = np.argsort(-x, axis=1, kind="stable")  # descending, ties to the lower index
    return {
        "best": np.argmax(x, axis=1),
        "worst": np.argmin(x, axis=1),
        "route": order[:, :k],
        "gate": np.take_along_axis(x, order[:, :k], axis=1),
    }


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 7),
    st.data(),
)
def test_selections_equal_numpy_with_ties_to_the_lower_index(t: int, e: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, e))
    # Values from a handful of integers: most rows have ties.
    x = np.array(data.draw(st.lists(st.integers(-2, 2), min_size=t * e, max_size=t * e)), np.float32).reshape(t, e)
    out = _compile(SELECT, dims={"T": t, "E": e, "K": k}).run({"x": x})
    for name, want in _expected(x, k).items():
        assert out[name].dtype == want.dtype if name != "gate" else out[name].dtype == np.float32
        np.testing.assert_array_equal(out[name], want, err_msg=name)


def test_torch_sort_orders_ties_as_argtop_does() -> None:
    x = torch.tensor([[0.5, 2.0, 0.5, 2.0, 1.0]])
    out = _compile(SELECT, dims={"T": 1, "E": 5, "K": 4}).run({"x": x.numpy()})
    want = torch.sort(x, descending=True, stable=True).indices[:, :4]
    np.testing.assert_array_equal(out["route"], want.numpy())
    assert int(out["best"][0]) == int(torch.argmax(x)) == 1


def test_selections_compile_to_core_rules_as_printed() -> None:
    text = str(_compile(SELECT))
    for line in (
        "best.max[t] max= x[t,e]",
        "best.first[t] min= where(x[t,e] == best.max[t], e, inf)",
        "route.beaten[t,e] += where(x[t,e2] > x[t,e] or x[t,e2] == x[t,e] and e2 < e, 1, 0)",
        "route[t,k] += where(route.rank[t,e] == k, e, 0)",
        "gate[t,k] += where(gate.rank[t,e] == k, x[t,e], 0)",
    ):
        assert line in text, text


def test_a_computed_and_guarded_score_is_chosen_where_it_exists() -> None:
    prog = _compile(
        """
        dim T = 4, E = 6.
        input x[T, E] : f32.
        param w[E] : f32.
        best[t] argmax= x[t, e] * w[e] where e >= 2.
        top2[t, k:2] argtop= x[t, e] * w[e] where e >= 2.
        """
    )
    vals = prog.random_inputs(seed=3)
    out = prog.run(vals)
    score = (vals["x"] * vals["w"])[:, 2:]
    np.testing.assert_array_equal(out["best"], 2 + np.argmax(score, axis=1))
    np.testing.assert_array_equal(out["top2"], 2 + np.argsort(-score, axis=1, kind="stable")[:, :2])


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32", "f64"])
def test_indices_are_exact_i64_in_every_float_type(dtype: str) -> None:
    """Past 256 places a bf16 index would round; the selection counts in f64 and stores i64."""
    prog = _compile("dim T = 3, V = 3000.\ninput x[T, V] : f32.\nbest[t] argmax= x[t, v].\n", dtype=dtype)
    assert prog.graph.relation("best").dtype == "i64"
    x = np.zeros((3, 3000), np.float32)
    x[0, 2999] = x[1, 1001] = x[2, 257] = 1.0
    np.testing.assert_array_equal(prog.run({"x": x})["best"], [2999, 1001, 257])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("y[t] argmax= x[t, e] + x[t, f].", "but it leaves out 'e', 'f'"),
        ("y[t, e] argmax= x[t, e].", "every index of the body is in the head"),
        ("y[t, k:2] argmax= x[t, e].", "index 'k' in the head of an argmax= rule is not read by its body"),
        ("y[t] top= x[t, e].", "top= needs one rank index in its head"),
        ("y[t, (k:2, j:2)] argtop= x[t, e].", "the body does not read, but 'k', 'j'"),
        ("y[t] argmax= x[t, e].\ny[t] max= x[t, e].", "'y' is chosen by argmax=, so it has one rule"),
        ("y[t, k:7] top= x[t, e].", "top= asks for the 7 best places of index 'e', which has only 6"),
    ],
)
def test_selection_mistakes_are_errors(text: str, message: str) -> None:
    with pytest.raises(EdlError) as info:
        _compile("dim T = 5, E = 6.\ninput x[T, E] : f32.\n" + text)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize(("n", "machine"), [(2, "cpux2"), (4, "a100x4")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_selections_under_random_plans_equal_the_reference(n: int, machine: str, seed: int) -> None:
    """Random plans split the chosen index (partial maxima, minima and counts cross devices)."""
    prog = _compile(SELECT, dims={"T": 7, "E": 8, "K": 3})
    x = np.random.default_rng(seed).integers(-3, 3, (7, 8)).astype(np.float32)  # ties
    want = prog.run({"x": x})
    plan = edatalog.plan(prog, topology=machine, strategy="random", seed=seed)
    exe = edatalog.executable(prog, plan, backend="torch")
    for call in ("interpreted", "recorded", "replayed"):
        out = exe({"x": torch.tensor(x)})
        for name in want:
            np.testing.assert_array_equal(out[name].numpy(), want[name], err_msg=f"{name}, {call}")
