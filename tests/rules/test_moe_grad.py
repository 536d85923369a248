"""Routing differentiates (the training issue's side of mixtures of experts): gradients of a
Mixtral MoE layer by ``edatalog.grad`` equal torch autograd's through transformers'
``MixtralSparseMoeBlock`` (through the gates; the selection itself is piecewise constant), and
the router's load-balancing loss written in the language equals transformers'
``load_balancing_loss_func``, gradient included."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import edatalog
from edatalog.errors import EdlWarning
from tests.backend.test_routed import mixtral_layer_params

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

T, D, F, X, K = 16, 32, 48, 8, 2
MOE = Path(__file__).resolve().parents[2] / "programs" / "moe_layer.edl"
# The layer's loss against a given output gradient, and Switch Transformer's load-balancing loss
# as transformers' Mixtral computes it: the share of the tokens' choices each expert gets, times
# its mean router probability, summed, times X.
LOSSES = """
input gy[T, D] : f64.
output loss, aux.
loss[] += y[t, d] * gy[t, d].
rm[t] max= router[t, e].
re[t, e] = exp(router[t, e] - rm[t]).
rz[t] += re[t, e].
share[e] += where(route[t, k] == e, 1.0, 0.0) / T.
prob[e] += re[t, e] / rz[t] / T.
aux[] += share[e] * prob[e] * X.
"""


def _block() -> Any:
    cfg = transformers.MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=X, num_experts_per_tok=K)
    cfg._experts_implementation = "eager"  # transformers' grouped_mm takes no f64
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = modeling_mixtral.MixtralSparseMoeBlock(cfg).double()  # type: ignore[no-untyped-call]
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block


def _values(block: Any, x: torch.Tensor, gy: torch.Tensor) -> dict[str, np.ndarray]:
    params = mixtral_layer_params(block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)
    return {"x": x.detach().numpy(), "gy": gy.numpy(), **{k: v.numpy() for k, v in params.items()}}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _grads(loss: str, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        text = MOE.read_text(encoding="utf-8").replace("output y.", "") + LOSSES
        prog = edatalog.compile_string(text, dims={"T": T, "D": D, "F": F, "X": X, "K": K}, dtype="f64")
    return edatalog.grad(prog, loss).run(values)


def test_gradients_of_the_moe_layer_equal_torch_autograd_through_mixtral() -> None:
    block = _block()
    x = torch.randn(T, D, dtype=torch.float64)
    gy = torch.randn(T, D, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (block(x[None])[0] * gy).sum().backward()
    out = _grads("loss", _values(block, x, gy))
    want = mixtral_layer_params(block.gate.weight.grad, block.experts.gate_up_proj.grad, block.experts.down_proj.grad)
    # transformers' router softmax runs in f32: agreement to ~1e-7, not to rounding.
    assert _rel(out["grad_wg"], want["wg"].numpy()) < 1e-6  # through the gates
    assert _rel(out["grad_w1"], want["w1"].numpy()) < 1e-6
    assert _rel(out["grad_w3"], want["w3"].numpy()) < 1e-6
    assert _rel(out["grad_w2"], want["w2"].numpy()) < 1e-6


def test_the_load_balancing_loss_and_its_gradient_equal_transformers() -> None:
    block = _block()
    x = torch.randn(T, D, dtype=torch.float64)
    logits = x @ block.gate.weight.T
    want = modeling_mixtral.load_balancing_loss_func((logits,), X, K)
    assert isinstance(want, torch.Tensor)
    want.backward()  # type: ignore[no-untyped-call]
    out = _grads("aux", _values(block, x, torch.zeros(T, D, dtype=torch.float64)))
    # transformers accumulates the loss in f32.
    assert abs(float(out["aux"]) - want.item()) <= 1e-6 * abs(want.item())
    assert _rel(out["grad_wg"], block.gate.weight.grad.numpy()) < 1e-5
