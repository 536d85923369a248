"""Sums over affine indices that are convolutions run as torch's convolution
(backend/kernels/convolution.py), and compute what the reference computes.

The property test writes random convolutions as rules (1 to 3 spatial axes; strides, dilations,
kernels read backwards, padding on either side or none, reads that skip cells of ``x``; batch,
channel and output-channel indices or none; channels first or last), checks that each is
recognized, and compares the torch runtime's result, on one device and under a random plan on
two, with the numpy reference.  The unit tests pin the bar's case against ``F.conv2d`` and the
rules that must not be taken for convolutions.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import edatalog
from edatalog.backend.kernels.arrays import TORCH
from edatalog.backend.kernels.convolution import conv_form
from edatalog.backend.kernels.joinagg import known_presence, prepare
from edatalog.backend.kernels.prepared import _Convolution, general_path, layout_of, prepare_block
from edatalog.backend.running.torch_runtime import Outputs
from edatalog.errors import EdlWarning
from tests.strategies import example_settings

_SETTINGS = example_settings("EDL_PROPERTY_EXAMPLES", 40)

CONV2D = """
dim B = 2, C = 3, O = 4, H = 6, W = 5, K = 3.
input x[B, C, H, W] : f32.
param w[O, C, K, K] : f32.
output y.
y[b, o, i:H, j:W] += x[b, c, i + p - 1, j + q - 1] * w[o, c, p, q].
"""


def _compile(text: str) -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.compile_string(text)


def _run_torch(prog: edatalog.Program, values: dict[str, np.ndarray], plan: edatalog.Plan | None = None) -> Outputs:
    exe = prog.executable(plan, backend="torch", compile="none")
    params = {r.name for r in prog.arguments if r.kind == "param"}
    exe.load({k: v for k, v in values.items() if k in params})
    return exe.run({k: v for k, v in values.items() if k not in params})


def test_a_conv2d_written_with_affine_indices_is_torchs_conv2d() -> None:
    prog = _compile(CONV2D)
    node = prog.graph.node("y")
    assert conv_form(prepare(node)) is not None and not general_path(node)
    values = prog.random_inputs(0)
    x, w = torch.from_numpy(values["x"]), torch.from_numpy(values["w"])
    data = [x, w]
    known = known_presence(node, exact_inputs=True)
    assert isinstance(prepare_block(node, layout_of(data), TORCH, torch.device("cpu"), known), _Convolution)
    for mode in ("none", "graph"):
        exe = prog.executable(backend="torch", compile=mode)
        exe.load({"w": w})
        for _ in range(3):  # interpreted, recorded, replayed
            got = exe({"x": x})["y"]
            torch.testing.assert_close(got, torch.nn.functional.conv2d(x, w, padding=1), rtol=0, atol=0)


@dataclass(frozen=True)
class Axis:
    """One spatial pair: output size, kernel size, stride, signed dilation, start, x's extent."""

    size: int
    kernel: int
    stride: int
    dilation: int
    start: int
    extent: int


@st.composite
def convolutions(draw: st.DrawFn) -> str:
    """The source of a random convolution (see the module docstring)."""
    axes = []
    for _ in range(draw(st.integers(1, 3))):
        # Sizes of 1 the compiler folds into constants: at least 2, for a spatial pair.
        size, kernel = draw(st.integers(2, 4)), draw(st.integers(2, 3))
        stride, dilation = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, -1, -2]))
        reach = stride * (size - 1) + abs(dilation) * (kernel - 1) + 1
        extent = draw(st.integers(2, reach + 2))
        lowest = min(0, dilation * (kernel - 1))  # the least and greatest read, before the start
        highest = stride * (size - 1) + max(0, dilation * (kernel - 1))
        # Some reads land inside x; a few before or after it.
        start = draw(st.integers(max(-highest, -2 - lowest), min(extent - 1 - lowest, 2 - lowest)))
        axes.append(Axis(size, kernel, stride, dilation, start, extent))
    batches = draw(st.integers(0, 2))
    channels, outs = draw(st.booleans()), draw(st.booleans())
    last = draw(st.booleans())  # channels last
    scale = draw(st.sampled_from(["", "0.5 * ", "-"]))
    dims = [f"B{k} = {k + 2}" for k in range(batches)]
    dims += ["C = 3"] * channels + ["O = 2"] * outs
    for k, a in enumerate(axes):
        dims += [f"X{k} = {a.extent}", f"K{k} = {a.kernel}", f"I{k} = {a.size}"]
    b = [f"b{k}" for k in range(batches)]
    reads = [f"{a.stride} * i{k} + {a.dilation} * p{k} + {a.start}" for k, a in enumerate(axes)]
    x_ix = [*b, *(reads if last else []), *(["c"] if channels else []), *([] if last else reads)]
    x_shape = [f"B{k}" for k in range(batches)]
    sp = [f"X{k}" for k in range(len(axes))]
    x_shape += [*(sp if last else []), *(["C"] if channels else []), *([] if last else sp)]
    w_ix = [*(["o"] if outs else []), *(["c"] if channels else []), *(f"p{k}" for k in range(len(axes)))]
    w_shape = [*(["O"] if outs else []), *(["C"] if channels else []), *(f"K{k}" for k in range(len(axes)))]
    y_ix = [*b, *(["o"] if outs else []), *(f"i{k}:I{k}" for k in range(len(axes)))]
    return (
        f"dim {', '.join(dims)}.\n"
        f"input x[{', '.join(x_shape)}] : f64.\n"
        f"param w[{', '.join(w_shape)}] : f64.\n"
        "output y.\n"
        f"y[{', '.join(y_ix)}] += {scale}x[{', '.join(x_ix)}] * w[{', '.join(w_ix)}].\n"
    )


def _assert_same(got: Outputs, want: np.ndarray, present: np.ndarray | None, what: str) -> None:
    data = got.values["y"].numpy()
    mask = np.ones(want.shape, dtype=bool) if present is None else present
    got_mask = got.present.get("y")
    got_mask = np.ones(want.shape, dtype=bool) if got_mask is None else np.broadcast_to(got_mask.numpy(), want.shape)
    assert np.array_equal(got_mask, mask), f"{what}: presence"
    np.testing.assert_allclose(np.where(mask, data, 0), np.where(mask, want, 0), rtol=1e-10, atol=1e-12, err_msg=what)


@_SETTINGS
@given(convolutions(), st.integers(0, 3))
def test_random_convolutions_compute_the_reference(source: str, seed: int) -> None:
    prog = _compile(source)
    node = prog.graph.node("y")
    values = prog.random_inputs(seed)
    data = [torch.from_numpy(values[acc.relation]) for acc in node.inputs]
    assert conv_form(prepare(node)) is not None, source
    # Where the result's presence is decided statically (the guard's shadow is exact; with
    # strides and dilations it may not be), the runtime runs it as a convolution.
    known = known_presence(node, exact_inputs=True)
    if known is not None:
        prepared = prepare_block(node, layout_of(data), TORCH, torch.device("cpu"), known)
        assert isinstance(prepared, _Convolution), source
    reference = prog.evaluate(prog.prepare(values), keep={"y"})["y"]
    want, present = np.asarray(reference.data), reference.present
    _assert_same(_run_torch(prog, values), want, present, f"one device\n{source}")
    plan = edatalog.plan(prog, topology="cpux2", strategy="random", seed=seed)
    _assert_same(_run_torch(prog, values, plan), want, present, f"two devices ({plan.ir.strategy})\n{source}")


@pytest.mark.parametrize(
    "rule",
    [
        # A guard beyond keeping the reads inside x.
        "y[b, o, i:H] += x[b, c, i + p - 1] * w[o, c, p] where i != 2.",
        # Depthwise: c in x, w and the result (a group index).
        "y[b, c, i:H] += x[b, c, i + p - 1] * w[0, c, p].",
        # A sum over x alone (q).
        "y[b, o, i:H] += x[b, q, i + p - 1] * w[o, 0, p].",
        # Not a product of two loads.
        "y[b, o, i:H] += exp(x[b, c, i + p - 1]) * w[o, c, p].",
        # Output index read twice.
        "y[b, o, i:H] += x[b, c, i + p - 1] * w[o, c, p] * x[b, c, i].",
    ],
)
def test_rules_that_are_not_convolutions_are_not_taken_for_them(rule: str) -> None:
    prog = _compile(
        f"dim B = 2, C = 3, O = 2, H = 5, K = 3.\ninput x[B, C, H] : f64.\nparam w[O, C, K] : f64.\noutput y.\n{rule}\n"
    )
    node = prog.graph.node("y")
    assert conv_form(prepare(node)) is None
    values = prog.random_inputs(1)
    reference = prog.evaluate(prog.prepare(values), keep={"y"})["y"]
    _assert_same(_run_torch(prog, values), np.asarray(reference.data), reference.present, rule)
