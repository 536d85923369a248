"""Maxima that only shift a log-sum-exp (:mod:`edatalog.ir.logsumexp`).

- edl train's cross-entropy: its maximum is found by what the rules compute, whatever their
  names; its gradient gets no rule (no winners, no pass over the logits), and the gradients
  still equal torch's ``cross_entropy`` (f64, ties in the logits included).
- Near misses keep their maxima: a log-sum-exp weighing the maximum twice, a sum read without
  its log, a sum over other values than the maximum's, a maximum that is an output, a body that
  is invariant only where the maximum stays small.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import edatalog
from edatalog.ir.logsumexp import shift_only_maxima

CROSS_ENTROPY = """dim B = 3, V = 7, D = 4.
input x[B, D] : f64.
input labels[B] : i64.
param w[V, D] : f64.
output loss.
logits[b, v] += x[b, d] * w[v, d].
top[b] max= logits[b, v].
total[b] += exp(logits[b, v] - top[b]).
picked[b] += logits[b, v] where labels[b] = v.
loss[] += (log(total[b]) + top[b] - picked[b]) / B.
"""


def _edit(old: str, new: str, text: str = CROSS_ENTROPY) -> str:
    assert old in text, old
    return text.replace(old, new)


def test_the_cross_entropys_maximum_only_shifts_and_gets_no_gradient() -> None:
    prog = edatalog.compile_string(CROSS_ENTROPY, name="ce.edl")
    assert shift_only_maxima(prog.graph) == {"top"}
    grads = edatalog.grad(prog)
    names = {r.name for r in grads.graph.relations}
    assert "grad_top" not in names and not any("winners" in n for n in names)
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(3, 4)), rng.normal(size=(7, 4))
    w[3] = w[5]  # tied logits: the maximum's winners would split a gradient
    labels = np.array([2, 5, 3])
    got = grads.run({"x": x, "w": w, "labels": labels})
    wt = torch.tensor(w, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(torch.tensor(x) @ wt.T, torch.tensor(labels))
    (want,) = torch.autograd.grad(loss, [wt])
    assert float(got["loss"]) == pytest.approx(loss.item(), rel=1e-14)
    np.testing.assert_allclose(got["grad_w"], want.numpy(), rtol=1e-12, atol=1e-14)


def test_found_by_structure_not_names() -> None:
    text = CROSS_ENTROPY.replace("top", "zz").replace("total", "norm")
    assert shift_only_maxima(edatalog.compile_string(text, name="ce.edl").graph) == {"zz"}


NEAR_MISSES = {
    "the maximum weighed twice": _edit("+ top[b] -", "+ 2.0 * top[b] -"),
    "a sum read without its log": _edit("(log(total[b]) + top[b]", "(total[b] + top[b]"),
    "a sum over other values": _edit(
        "total[b] += exp(logits[b, v] - top[b]).", "total[b] += exp(2.0 * logits[b, v] - top[b])."
    ),
    "the maximum an output": _edit("output loss.", "output loss, top."),
    "a body that branches on the maximum": _edit(
        "(log(total[b]) + top[b] - picked[b])", "(where(top[b] > 30.0, top[b], log(total[b]) + top[b]) - picked[b])"
    ),
}


@pytest.mark.parametrize("case", sorted(NEAR_MISSES))
def test_near_misses_keep_their_maximum(case: str) -> None:
    prog = edatalog.compile_string(NEAR_MISSES[case], name="ce.edl")
    assert shift_only_maxima(prog.graph) == frozenset()
