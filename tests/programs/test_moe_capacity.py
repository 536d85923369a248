"""programs/moe_capacity.edl: a mixture of experts with a capacity (GShard's and the Switch
Transformer's formulation), against a numpy loop that fills each expert's slots in GShard's
order and drops the rest, against the dropless layer where nothing is dropped, and under
expert parallelism, whose dispatch and combine must be the exchanges of an all-to-all."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import edatalog
from edatalog.errors import EdlWarning
from edatalog.ir import program as ir
from edatalog.ir.regions import Region

PROGRAMS = Path(__file__).resolve().parents[2] / "programs"
SMALL = {"G": 2, "S": 8, "D": 16, "F": 24, "X": 4, "K": 2}


def _compile(dims: dict[str, int], path: str = "moe_capacity.edl") -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.compile(PROGRAMS / path, dims=dims, dtype="f64")


def gshard(values: dict[str, np.ndarray], capacity: int) -> np.ndarray:
    """The layer as GShard's dispatch fills it, one choice at a time: per group, first choices
    before second ones, then by token; an expert takes a choice while it has fewer than
    ``capacity``, and a dropped choice adds nothing."""
    x, wg, w1, w3, w2 = (values[n] for n in ("x", "wg", "w1", "w3", "w2"))
    groups, tokens, _ = x.shape
    k_best = SMALL["K"]
    y = np.zeros_like(x)
    for g in range(groups):
        logits = x[g] @ wg.T
        route = np.argsort(-logits, axis=1, kind="stable")[:, :k_best]
        chosen = np.take_along_axis(logits, route, 1)
        gates = np.exp(chosen - chosen.max(axis=1, keepdims=True))
        gates /= gates.sum(axis=1, keepdims=True)
        taken = np.zeros(wg.shape[0], dtype=int)
        for k in range(k_best):
            for s in range(tokens):
                e = route[s, k]
                if taken[e] < capacity:
                    h = w1[e] @ x[g, s]
                    y[g, s] += gates[s, k] * (w2[e] @ (h / (1 + np.exp(-h)) * (w3[e] @ x[g, s])))
                taken[e] += 1
    return y


@pytest.mark.parametrize("capacity", [1, 3, 16])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_choices_beyond_the_capacity_are_dropped_as_gshard_drops_them(capacity: int, backend: str) -> None:
    prog = _compile({**SMALL, "C": capacity})
    values = prog.random_inputs(seed=capacity)
    want = gshard(values, capacity)
    got = np.asarray(prog.run(values, backend=backend)["y"])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    dropless = gshard(values, SMALL["S"] * SMALL["K"])
    # Below the mean load (S x K / X = 4 choices per group and expert) some expert must drop.
    assert (np.abs(want - dropless).max() > 1e-6) == (capacity < 4)


def test_with_room_for_every_choice_it_equals_the_dropless_layer() -> None:
    prog = _compile({**SMALL, "C": SMALL["S"] * SMALL["K"]})
    values = prog.random_inputs(seed=5)
    t = SMALL["G"] * SMALL["S"]
    dropless = _compile({"T": t, **{k: SMALL[k] for k in ("D", "F", "X", "K")}}, "moe_layer.edl")
    flat = {**values, "x": values["x"].reshape(t, -1)}
    want = dropless.run(flat)["y"].reshape(values["x"].shape)
    np.testing.assert_allclose(prog.run(values)["y"], want, rtol=1e-12, atol=1e-12)


def _recv(plan: Any, relation: str) -> list[tuple[int, Region]]:
    return [
        (device, op.region)
        for device, _, op in plan.schedule.programs.ops()
        if isinstance(op, ir.Recv) and op.relation == relation
    ]


def test_expert_parallelism_dispatches_and_combines_as_an_all_to_all() -> None:
    """Groups split over the 2 devices for the tokens' rules, experts for the experts': each
    device receives, of the dispatched slots, the other's group at its own experts (and of
    the experts' results, its own group at the other's experts) and nothing else that large.
    The run (2 logical torch devices) equals the reference, interpreted and replayed."""
    prog = _compile({**SMALL, "C": 3})
    plan = edatalog.plan(prog, topology="cpux2", strategy="expert")
    c1, d = 3 + 1, SMALL["D"]
    half = SMALL["X"] // 2
    for relation in ("xe", "ye"):
        got = sorted((dev, r.shape) for dev, r in _recv(plan, relation))
        assert got == [(0, (1, half, c1, d)), (1, (1, half, c1, d))], (relation, got)
    xe = dict(_recv(plan, "xe"))
    ye = dict(_recv(plan, "ye"))
    for dev in (0, 1):  # xe: the other device's group, this device's experts; ye: the reverse
        other = 1 - dev
        assert xe[dev].bounds()[:2] == ((other, other + 1), (dev * half, dev * half + half))
        assert ye[dev].bounds()[:2] == ((dev, dev + 1), (other * half, other * half + half))
    largest = max(r.size for _, r in _recv(plan, "xe"))
    others = list({op.relation for _, _, op in plan.schedule.programs.ops() if isinstance(op, ir.Recv)})
    assert all(max(r.size for _, r in _recv(plan, rel)) <= largest for rel in others)
    values = prog.random_inputs(seed=6)
    want = prog.run(values)["y"]
    params = {r.name for r in prog.arguments if r.kind == "param"}
    exe = edatalog.executable(prog, plan, backend="torch", device=["cpu", "cpu"])
    exe.load({k: torch.tensor(v) for k, v in values.items() if k in params})
    inputs = {k: torch.tensor(v) for k, v in values.items() if k not in params}
    for call in ("interpreted", "recorded", "replayed"):
        np.testing.assert_allclose(exe(inputs)["y"].numpy(), want, rtol=1e-12, atol=1e-12, err_msg=call)


def test_gradients_through_dispatch_and_combine_equal_autograd() -> None:
    """``edatalog.grad`` of a squared-sum loss of the layer with drops (C = 3) against torch
    autograd through GShard's loop: the dispatch's scatter turns into a gather and the
    combine's gather into a scatter; the routes and slots are piecewise constant."""
    text = (PROGRAMS / "moe_capacity.edl").read_text().replace("output y.", "output loss.")
    prog = edatalog.compile_string(text + "\nloss[] += y[g, s, d] * y[g, s, d].\n", dims={**SMALL, "C": 3}, dtype="f64")
    values = prog.random_inputs(seed=2)
    got = edatalog.grad(prog, loss="loss").run(values)
    params = {n: torch.tensor(values[n], requires_grad=True) for n in ("wg", "w1", "w3", "w2")}
    y = _gshard_torch(torch.tensor(values["x"]), params, capacity=3)
    (y * y).sum().backward()  # type: ignore[no-untyped-call]
    for name, p in params.items():
        want = p.grad.numpy()  # type: ignore[union-attr]
        np.testing.assert_allclose(got[f"grad_{name}"], want, rtol=1e-10, atol=1e-12 * np.abs(want).max())


def _gshard_torch(x: torch.Tensor, w: dict[str, torch.Tensor], capacity: int) -> torch.Tensor:
    """:func:`gshard` in torch, differentiable through the gates and the experts."""
    rows = []
    for g in range(x.shape[0]):
        logits = x[g] @ w["wg"].T
        route = torch.argsort(-logits.detach(), dim=1, stable=True)[:, : SMALL["K"]]
        gates = torch.softmax(torch.gather(logits, 1, route), dim=1)
        taken = [0] * w["wg"].shape[0]
        out = [torch.zeros(x.shape[-1], dtype=x.dtype) for _ in range(x.shape[1])]
        for k in range(SMALL["K"]):
            for s in range(x.shape[1]):
                e = int(route[s, k])
                if taken[e] < capacity:
                    h = torch.nn.functional.silu(w["w1"][e] @ x[g, s]) * (w["w3"][e] @ x[g, s])
                    out[s] = out[s] + gates[s, k] * (w["w2"][e] @ h)
                taken[e] += 1
        rows.append(torch.stack(out))
    return torch.stack(rows)
