"""Conversions to integers (``edatalog.rules.convert``) and the rounding functions: exact, as
numpy rounds (halves to even), on the reference and the torch runtime, and refused where a
value might not be whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import edatalog
from edatalog.errors import EdlError

PROGRAM = """
dim N = 7, W = 4.
input x[N] : f32.
input k[N] : i32.
input m[N] : bool.
fl[i] = i64(floor(x[i] * W)).
ce[i] = i64(ceil(x[i])).
ro[i] = i32(round(x[i])).
tr[i] = i64(trunc(x[i])).
twice[i] = i64(k[i] * 2).
clamped[i] = i64(min(max(floor(x[i] * W), 0), N - 1)).
flag[i] = i32(m[i]).
grid[i, j:3] = i64(floor(x[i] + j)).
"""
X = np.array([0.1, -0.5, 0.5, 1.5, 2.5, -2.7, 7.0], np.float32)


def _values() -> dict[str, np.ndarray]:
    return {"x": X, "k": np.arange(7, dtype=np.int32) - 3, "m": X > 0}


def _expected() -> dict[str, np.ndarray]:
    v = _values()
    return {
        "fl": np.floor(X * 4).astype(np.int64),
        "ce": np.ceil(X).astype(np.int64),
        "ro": np.rint(X).astype(np.int32),
        "tr": np.trunc(X).astype(np.int64),
        "twice": v["k"].astype(np.int64) * 2,
        "clamped": np.clip(np.floor(X * 4), 0, 6).astype(np.int64),
        "flag": v["m"].astype(np.int32),
        "grid": np.floor(X[:, None] + np.arange(3)).astype(np.int64),
    }


def test_conversions_equal_numpy_with_halves_to_even() -> None:
    out = edatalog.compile_string(PROGRAM).run(_values())
    for name, want in _expected().items():
        assert out[name].dtype == want.dtype, name
        np.testing.assert_array_equal(out[name], want, err_msg=name)


@pytest.mark.parametrize("machine", ["cpux1", "cpux2"])
def test_conversions_on_the_torch_runtime(machine: str) -> None:
    prog = edatalog.compile_string(PROGRAM)
    plan = edatalog.plan(prog, topology=machine, strategy="random", seed=1)
    exe = edatalog.executable(prog, plan, backend="torch")
    for call in ("interpreted", "recorded", "replayed"):
        out = exe({k: torch.tensor(v) for k, v in _values().items()})
        for name, want in _expected().items():
            np.testing.assert_array_equal(out[name].numpy(), want, err_msg=f"{name}, {call}")


def test_a_computed_index_is_looked_up() -> None:
    """The use conversions exist for: a value computed in floats names a place."""
    prog = edatalog.compile_string(
        """
        dim N = 5, V = 8.
        input x[N] : f32.
        param table[V] : f32.
        slot[i] = i64(floor(x[i] * 2)).
        y[i] = table[v] where slot[i] = v.
        """
    )
    x = np.array([0.0, 0.6, 1.2, 3.9, 2.5], np.float32)
    table = np.arange(8, dtype=np.float32) * 10
    np.testing.assert_array_equal(prog.run({"x": x, "table": table})["y"], table[np.floor(x * 2).astype(int)])


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("y[i] = i64(x[i] / 2).", "i64() needs a whole number, but 'x[i] / 2' is f32"),
        ("y[i] = i64(x[i]).", "i64() needs a whole number, but 'x[i]' is f32"),
        ("y[] = i32(2.5).", "i32() needs a whole number, but '2.5' is f32"),
        ("y[i] = 1 + i64(round(x[i])).", "i64(...) inside an expression"),
        ("y[i] = i64(x[i], x[i]).", "i64() takes 1 argument, but 2 are given"),
        ("y[i] = i64(max(floor(x[i]), 0.5)).", "needs a whole number"),
        ("y[i] = i64(where(x[i] > 0, round(x[i]), x[i])).", "needs a whole number"),
    ],
)
def test_inexact_or_misplaced_conversions_are_errors(rule: str, message: str) -> None:
    with pytest.raises(EdlError) as info:
        edatalog.compile_string("dim N = 4.\ninput x[N] : f32.\n" + rule)
    assert message in str(info.value), str(info.value)


def test_rounding_has_no_gradient() -> None:
    prog = edatalog.compile_string(
        """
        dim N = 4.
        param w[N] : f64.
        y[i] = floor(w[i]) + round(w[i]) * w[i].
        loss[] += y[i].
        output loss.
        """
    )
    g = edatalog.grad(prog, "loss")
    w = np.array([0.4, 1.6, -2.5, 3.0])
    out = g.run({"w": w})
    grads = [k for k in out if k != "loss"]
    np.testing.assert_allclose(out[grads[0]], np.rint(w))  # d(round(w) * w)/dw = round(w); floor adds 0
