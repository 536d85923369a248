"""Gradients as rules (:mod:`edatalog.rules.grad`), against central finite differences of the
reference evaluator and against torch autograd through transformers' ``LlamaForCausalLM``."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given

import edatalog
from edatalog import EdlError
from edatalog.checkpoint import configured
from edatalog.errors import EdlWarning
from edatalog.ir.scalar import Const, Load, Op, ScalarExpr
from edatalog.lang.parser import parse_file
from edatalog.rules.derivative import Builder, NotDifferentiable, copy_into, vjp
from tests.programs.test_llama_model import LLAMA, _model
from tests.strategies import GeneratedProgram, example_settings, programs

STEP = 1e-6


def _numeric(prog: edatalog.Program, values: dict[str, np.ndarray], name: str, step: float = STEP) -> np.ndarray:
    """d loss / d ``name`` by central differences of the reference evaluator."""
    return _differences(prog, values, name, step)[0]


def _differences(
    prog: edatalog.Program, values: dict[str, np.ndarray], name: str, step: float
) -> tuple[np.ndarray, bool]:
    """Central differences, and whether the function is smooth at ``values`` along every cell
    of ``name`` (its one-sided differences agree: not at a tie of a maximum, nor abs at 0)."""
    out = np.zeros_like(values[name], dtype=np.float64)
    at = float(prog.run(values)["loss"])
    smooth = True
    for idx in np.ndindex(out.shape):
        plus, minus = values[name].copy(), values[name].copy()
        plus[idx] += step
        minus[idx] -= step
        hi = float(prog.run({**values, name: plus})["loss"])
        lo = float(prog.run({**values, name: minus})["loss"])
        out[idx] = (hi - lo) / (2 * step)
        right, left = (hi - at) / step, (at - lo) / step
        smooth = smooth and abs(right - left) <= 1e-3 * max(1.0, abs(float(out[idx])))
    return out, smooth


def _check(source: str, wrt: list[str] | None = None, seed: int = 0, rtol: float = 1e-6) -> edatalog.Program:
    prog = edatalog.compile_string(source, name="grad.edl")
    values = prog.random_inputs(seed=seed)
    grads = edatalog.grad(prog, wrt=wrt)
    got = grads.run(values)
    assert float(got["loss"]) == pytest.approx(float(prog.run(values)["loss"]), rel=1e-12)
    names = wrt or [r.name for r in prog.graph.relations if r.kind == "param"]
    for name in names:
        want = _numeric(prog, values, name)
        scale = max(1.0, float(np.max(np.abs(want))))
        np.testing.assert_allclose(got[f"grad_{name}"], want, rtol=0, atol=rtol * scale * 100, err_msg=name)
    return grads


# -- rule kinds, by hand -----------------------------------------------------------------------------


def test_a_contraction_differentiates_to_contractions() -> None:
    grads = _check(
        """dim I = 4, J = 3, K = 5.
        input x[I, J] : f64.
        param w[K, J] : f64.
        output loss.
        h[i, k] += x[i, j] * w[k, j].
        loss[] += h[i, k] * h[i, k] / 2.0.
        """,
        wrt=["x", "w"],
    )
    text = str(grads.graph)
    assert "grad_w[k,j] += grad_h[i,k] * x[i,j]" in text and "sum i" in text
    # A factor's gradient does not read the factor: a block of it neither fetches nor holds w.
    (rule,) = [n for n in grads.graph.nodes if n.out == "grad_w"]
    assert [a.relation for a in rule.inputs] == ["x", "grad_h"]
    assert grads.outputs == ("loss", "grad_x", "grad_w")


def test_elementwise_bodies_differentiate_symbolically() -> None:
    _check(
        """dim I = 3, J = 4.
        param a[I, J] : f64.
        param b[J] : f64.
        output loss.
        u[i, j] = tanh(a[i, j]) * sigmoid(b[j]) + silu(a[i, j]) / (2.0 + exp(b[j])).
        v[i, j] = gelu(u[i, j]) + gelu_tanh(a[i, j]) - erf(u[i, j]) * cos(b[j]) + sin(a[i, j]).
        z[i, j] = sqrt(1.5 + a[i, j] * a[i, j]) * rsqrt(2.0 + b[j] * b[j]) + log(3.0 + v[i, j])
            + (1.25 + b[j] * b[j]) ^ 1.5.
        loss[] += z[i, j] * v[i, j] + max(a[i, j], b[j]) - min(a[i, j], 0.5 * b[j]) + relu(u[i, j]) + abs(v[i, j]).
        """
    )


ATTENTION = """dim S = 5, D = 3.
input x[S, D] : f64.
param wq[D, D] : f64.
param wk[D, D] : f64.
output loss.
q[s, e] += x[s, d] * wq[e, d].
k[t, e] += x[t, d] * wk[e, d].
sc[s, t] += q[s, e] * k[t, e] where t <= s.
m[s] max= sc[s, t].
p[s, t] = exp(sc[s, t] - m[s]).
l[s] += p[s, t].
o[s, e] += p[s, t] / l[s] * x[t, e].
loss[] += o[s, e] * o[s, e].
"""


def test_a_causal_softmax_with_max_keeps_its_guard_in_the_backward() -> None:
    grads = _check(ATTENTION)
    text = str(grads.graph)
    # Masked points cost nothing in the backward either: the gradients of the scores are causal.
    assert re.search(r"grad_sc\[s,t\] \+= .* where t <= s", text), text
    # The maximum only shifts the scores: no gradient reaches it, no winners are counted.  As in
    # flash attention's backward, the rows' log-sum-exp is kept from the forward (the maximum and
    # sums are read by it and their own chain only), the scores and normalized probabilities are
    # made again from it, the sums' gradient reads the output instead of summing over the keys
    # again, and the scores' gradient takes the sums' share where it uses it (no broadcast of
    # grad_l over the keys, one rule for grad_p).
    names = {r.name for r in grads.graph.relations}
    assert "grad_m" not in names and not any("winners" in n for n in names)
    assert {"bwd_sc", "bwd_p", "lse_l"} <= names and not {"bwd_m", "bwd_l"} & names
    readers = {
        rel: {n.name for n in grads.graph.nodes if any(a.relation == rel for a in n.inputs)}
        for rel in ("sc", "m", "p", "l", "lse_l")
    }
    assert readers == {"sc": {"m", "p"}, "m": {"p", "lse_l"}, "p": {"l", "o"}, "l": {"o", "lse_l"}, "lse_l": {"bwd_p"}}
    assert str(grads.graph.node("lse_l")).startswith("lse_l[s] = m[s] + log(l[s])"), grads.graph.node("lse_l")
    (sums,) = [n for n in grads.graph.nodes if n.out == "grad_l"]
    assert [a.relation for a in sums.inputs] == ["grad_o", "o"] and sums.agg_indices == ("e",)
    assert len([n for n in grads.graph.nodes if n.out == "grad_p"]) == 1
    (scores,) = [n for n in grads.graph.nodes if n.out == "grad_sc"]
    assert "exp" not in str(scores) and {a.relation for a in scores.inputs} == {"grad_p", "grad_l", "bwd_p"}


def test_a_gradient_program_is_planned_and_run_as_any_program() -> None:
    """The forward and backward rules form one graph: a plan splits them over two devices and
    the simulator and the torch runtime compute the reference's loss and gradients."""
    prog = edatalog.compile_string(ATTENTION, name="attention.edl")
    grads = edatalog.grad(prog)
    values = prog.random_inputs(seed=0)
    want = grads.run(values)
    plan = edatalog.plan(grads, topology="cpux2", strategy="random", seed=1)
    assert any(n.tile.n_blocks > 1 for n in plan.ir.nodes)
    for got in (plan.execute(values), grads.run(values, plan=plan, backend="torch")):
        for name, value in want.items():
            np.testing.assert_allclose(np.asarray(got[name]), value, rtol=1e-10, atol=1e-12, err_msg=name)


def test_tied_maxima_split_the_gradient_as_torch_does() -> None:
    prog = edatalog.compile_string(
        """dim I = 2, J = 3.
        param a[I, J] : f64.
        output loss.
        m[i] max= a[i, j].
        loss[] += m[i] * 3.0.
        """,
        name="tie.edl",
    )
    a = np.array([[1.0, 2.0, 2.0], [0.5, -1.0, 0.25]])
    got = edatalog.grad(prog).run({"a": a})["grad_a"]
    want = torch.tensor(a, requires_grad=True)
    (want.amax(dim=1) * 3.0).sum().backward()  # type: ignore[no-untyped-call]
    assert want.grad is not None
    np.testing.assert_allclose(got, want.grad.numpy())  # [[0, 1.5, 1.5], [3, 0, 0]]


def test_a_lookup_scatters_its_gradient_into_the_table() -> None:
    grads = _check(
        """dim B = 2, S = 3, V = 5, D = 4.
        input ids[B, S] : i64.
        param tok[V, D] : f64.
        param w[D] : f64.
        output loss.
        e[b, s, d] = tok[v, d] * w[d] where ids[b, s] = v.
        loss[] += gelu_tanh(e[b, s, d]) * e[b, s, d].
        """
    )
    assert "where ids[b,s] = v" in str(grads.graph)  # the gradient by w keeps the lookup


def test_a_convolution_with_index_expressions_transposes() -> None:
    _check(
        """dim B = 1, C = 2, O = 3, N = 6, P = 3.
        input x[B, C, N] : f64.
        param w[O, C, P] : f64.
        output loss.
        y[b, o, i:N] += x[b, c, i + p - 1] * w[o, c, p].
        loss[] += y[b, o, i] * y[b, o, i].
        """,
        wrt=["x", "w"],
    )


def test_positions_fewer_than_the_table_s_rows_and_rank_zero_relations() -> None:
    _check(
        """dim S = 3, P = 8, D = 2.
        param wpe[P, D] : f64.
        param scale[] : f64.
        output loss.
        h[s, d] = wpe[s, d] * scale[].
        r[] += h[s, d] * h[s, d].
        loss[] = sqrt(r[] + 1.0).
        """
    )


def test_an_unused_param_has_a_zero_gradient() -> None:
    prog = edatalog.compile_string(
        """dim I = 3.
        param a[I] : f64.
        param b[I] : f64.
        output loss, c.
        c[i] = b[i] * 2.0.
        loss[] += a[i] * a[i].
        """,
        name="unused.edl",
    )
    values = prog.random_inputs(seed=0)
    got = edatalog.grad(prog, loss="loss").run(values)
    np.testing.assert_allclose(got["grad_a"], 2 * values["a"])
    np.testing.assert_array_equal(got["grad_b"], np.zeros(3))


def test_the_gradient_by_an_intermediate_relation() -> None:
    prog = edatalog.compile_string(
        "dim I = 3.\nparam a[I] : f64.\noutput loss.\nh[i] = a[i] * 2.0.\nloss[] += h[i] * h[i].\n", name="mid.edl"
    )
    got = edatalog.grad(prog, wrt=["h", "a"]).run({"a": np.array([1.0, 2.0, 3.0])})
    np.testing.assert_allclose(got["grad_h"], [4.0, 8.0, 12.0])
    np.testing.assert_allclose(got["grad_a"], [8.0, 16.0, 24.0])


# -- errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("loss[i] += a[i] * a[i].", "the loss must be a scalar"),
        ("loss[] *= a[i].", "multiplies into its head (*=)"),
    ],
)
def test_what_cannot_be_differentiated_is_an_error_at_its_rule(body: str, message: str) -> None:
    dims = "dim I = 3.\nparam a[I] : f64.\n"
    head = "loss[I]" if body.startswith("loss[i]") else "loss"
    prog = edatalog.compile_string(f"{dims}output {head.split('[')[0]}.\n{body}\n", name="bad.edl")
    with pytest.raises(EdlError, match=re.escape(message)) as info:
        edatalog.grad(prog)
    if "scalar" not in message:
        assert "bad.edl:4" in str(info.value)  # the rule's location


def test_a_condition_used_as_a_number_has_no_derivative() -> None:
    """The language keeps comparisons inside where(...); the derivative refuses one used as a
    number all the same (an IR built otherwise), saying what to write."""
    expr = ScalarExpr((Load(0), Const(0.0), Op("gt", (0, 1)), Op("mul", (0, 2))), 3)
    bld = Builder()
    new = copy_into(bld, expr, lambda k: bld.node(Load(k)))
    with pytest.raises(NotDifferentiable, match=re.escape("write where(condition, a, b)")):
        vjp(bld, expr, new, bld.node(Load(1)), [0])


def test_integers_and_unrelated_losses_are_refused() -> None:
    prog = edatalog.compile_string(
        "dim I = 3.\ninput n[I] : i64.\nparam a[I] : f64.\noutput loss, m.\nloss[] += a[i].\nm[] += n[i].\n",
        name="int.edl",
    )
    with pytest.raises(EdlError, match="holds integers"):
        edatalog.grad(prog, loss="loss", wrt=["n"])
    with pytest.raises(EdlError, match="which is the loss"):
        edatalog.grad(prog)
    with pytest.raises(EdlError, match="no relation 'nope'"):
        edatalog.grad(prog, loss="nope")


# -- random programs against finite differences ---------------------------------------------------------


@example_settings("EDL_GRAD_EXAMPLES", 40)
@given(gen=programs())
def test_random_programs_match_finite_differences(gen: GeneratedProgram) -> None:
    """Every random program, its outputs squared and summed into a loss: the gradient by every
    float input and param equals central differences, or the rule that cannot be
    differentiated (a product, a condition as a number) is named.  Points where the function
    is not smooth (a tie in a maximum, abs at 0) are skipped: there two step sizes disagree."""
    lines = []
    for out in gen.outputs:
        rank = len(next(r for r in gen.spec.relations if r.name == out).shape)
        idx = ",".join(f"a{k}" for k in range(rank))
        lines.append(f"loss[] += {out}[{idx}] * {out}[{idx}] / 2.0.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        prog = edatalog.compile_string(gen.source + "\n".join(lines) + "\n", name="<generated>", outputs=["loss"])
    floats = [r.name for r in prog.graph.relations if r.kind in ("input", "param") and r.dtype == "f64"]
    assume(floats)
    try:
        grads = edatalog.grad(prog, wrt=floats)
    except EdlError as exc:
        text = str(exc)
        assume("does not depend on" not in text)
        assert "multiplies into its head" in text or "condition" in text, text
        return
    values = dict(gen.inputs)
    got = grads.run(values)
    for name in floats:
        want, smooth = _differences(prog, values, name, 1e-6)
        assume(smooth)
        np.testing.assert_allclose(got[f"grad_{name}"], want, rtol=1e-4, atol=1e-5, err_msg=f"{name}\n{gen.source}")


# -- a whole model against autograd ------------------------------------------------------------------------


CROSS_ENTROPY = """
lmax[b, s] max= logits[b, s, w].
lse[b, s] += exp(logits[b, s, w] - lmax[b, s]).
picked[b, s] += logits[b, s, w] where labels[b, s] = w.
loss[] += (log(lse[b, s]) + lmax[b, s] - picked[b, s]) / (B * S).
"""


def test_llama_gradients_equal_transformers_autograd(tmp_path: Path) -> None:
    """``programs/llama.edl`` with a cross-entropy loss (3 layers, 6 heads sharing 2, V=37, rope
    theta 5000, f64) against ``LlamaForCausalLM`` and ``loss.backward()``: every param's
    gradient, by the checkpoint name it loads from.  transformers computes RoPE's angles in
    float32 even in float64, which bounds the agreement near 1e-6 (the forward's near 1e-7)."""
    model = _model(layers=3)
    model.save_pretrained(tmp_path)
    seq = 7
    dims, consts = configured(parse_file(str(LLAMA)), tmp_path)
    text = LLAMA.read_text().replace("output logits.", "input labels[B, S] : i64.\noutput loss.") + CROSS_ENTROPY
    prog = edatalog.compile_string(text, name="llama_loss.edl", dims={**dims, "S": seq}, consts=consts, dtype="f64")
    rng = np.random.default_rng(0)
    ids, labels = rng.integers(0, 37, size=(1, seq)), rng.integers(0, 37, size=(1, seq))
    got = edatalog.grad(prog).run({**prog.load_checkpoint(tmp_path), "ids": ids, "labels": labels})

    model.zero_grad()
    logits = model(torch.tensor(ids)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 37), torch.tensor(labels).reshape(-1))
    loss.backward()  # type: ignore[no-untyped-call]
    assert float(got["loss"]) == pytest.approx(float(loss.detach()), rel=1e-6)
    named: dict[str, Any] = dict(model.named_parameters())
    checked = 0
    for rel in prog.graph.relations:
        if rel.kind != "param":
            continue
        source = next(s for s in rel.sources if s in named)
        want = named[source].grad.numpy()
        scale = float(np.max(np.abs(want)))
        np.testing.assert_allclose(got[f"grad_{rel.name}"], want, rtol=0, atol=1e-5 * scale, err_msg=source)
        checked += 1
    assert checked == len(named)  # every param of the model
