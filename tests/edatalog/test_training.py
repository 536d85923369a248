"""Training steps as rules (:mod:`edatalog.rules.optim`, :mod:`edatalog.training`) against
torch's optimizers: transformers' ``LlamaForCausalLM`` with ``torch.optim.AdamW`` and
``clip_grad_norm_``, and a small MLP with ``torch.optim.SGD``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import edatalog
from edatalog import EdlError
from edatalog.checkpoint import configured
from edatalog.lang.parser import parse_file
from tests.programs.test_llama_model import LLAMA, _model
from tests.rules.test_grad import CROSS_ENTROPY

STEPS = 20
BATCHES = 4  # fixed batches, taken in turn


def _llama_loss(weights: Path, batch: int, seq: int) -> edatalog.Program:
    dims, consts = configured(parse_file(str(LLAMA)), weights)
    text = LLAMA.read_text().replace("output logits.", "input labels[B, S] : i64.\noutput loss.") + CROSS_ENTROPY
    dims = {**dims, "S": seq, "B": batch}
    return edatalog.compile_string(text, name="llama_loss.edl", dims=dims, consts=consts, dtype="f64")


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_adamw_steps_of_llama_give_torch_s_losses(tmp_path: Path, backend: str) -> None:
    """20 AdamW steps (betas 0.9/0.95, weight decay 0.1, clipping 1.0, lr 1e-3) on fixed batches:
    the loss at every step is transformers' with torch.optim.AdamW, to 1e-6 relative in f64
    (transformers computes RoPE's angles in float32 even in float64: the first loss agrees to
    1e-8, the last to 2e-7)."""
    model: Any = _model(layers=3)
    model.save_pretrained(tmp_path)
    batch, seq = 2, 7
    prog = _llama_loss(tmp_path, batch, seq)
    opt = edatalog.AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    trainer = edatalog.Trainer(prog, optimizer=opt, clip=1.0, backend=backend)
    trainer.load(prog.load_checkpoint(tmp_path))
    ref = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 37, size=(batch, seq)), rng.integers(0, 37, size=(batch, seq))) for _ in range(BATCHES)]
    losses = []
    for k in range(STEPS):
        ids, labels = batches[k % BATCHES]
        ours = trainer.step({"ids": ids, "labels": labels})
        ref.zero_grad()
        logits = model(torch.tensor(ids)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 37), torch.tensor(labels).reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ref.step()
        assert ours == pytest.approx(loss.item(), rel=1e-6), f"step {k + 1}"
        losses.append(ours)
    assert trainer.steps == STEPS and losses[-1] < 0.6 * losses[0]  # it learns the four batches


SGD_MLP = """dim B = 4, D = 3, H = 5, C = 3.
input x[B, D] : f64.
input y[B] : i64.
param w1[H, D] : f64.
param w2[C, H] : f64.
output loss.
h2[b, k] += w1[k, d] * x[b, d].
a[b, k] = tanh(h2[b, k]).
z[b, c] += a[b, k] * w2[c, k].
m[b] max= z[b, c].
lse[b] += exp(z[b, c] - m[b]).
picked[b] += z[b, c] where y[b] = c.
loss[] += (log(lse[b]) + m[b] - picked[b]) / B.
"""


def test_sgd_with_momentum_and_weight_decay_gives_torch_s_params() -> None:
    prog = edatalog.compile_string(SGD_MLP, name="mlp.edl")
    values = prog.random_inputs(seed=3)
    params = {k: values[k] for k in ("w1", "w2")}
    trainer = edatalog.Trainer(prog, optimizer=edatalog.SGD(lr=0.1, momentum=0.9, weight_decay=0.01), clip=0.5)
    trainer.load(params)
    w1, w2 = (torch.tensor(params[k], requires_grad=True) for k in ("w1", "w2"))
    ref = torch.optim.SGD([w1, w2], lr=0.1, momentum=0.9, weight_decay=0.01)
    x, y = torch.tensor(values["x"]), torch.tensor(values["y"])
    for k in range(5):
        ours = trainer.step({"x": values["x"], "y": values["y"]})
        ref.zero_grad()
        loss = torch.nn.functional.cross_entropy(torch.tanh(x @ w1.T) @ w2.T, y)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_([w1, w2], 0.5)
        ref.step()
        assert ours == pytest.approx(loss.item(), rel=1e-12), f"step {k + 1}"
    np.testing.assert_allclose(trainer.params["w1"], w1.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(trainer.params["w2"], w2.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(trainer.state["momentum_w2"], ref.state[w2]["momentum_buffer"].numpy(), rtol=1e-12)


def test_a_training_step_is_one_program_that_a_plan_splits() -> None:
    """Forward, backward, clipping and update form one graph: a plan over two devices computes
    the reference's next params."""
    prog = edatalog.compile_string(SGD_MLP, name="mlp.edl")
    step, names = edatalog.step_program(prog, optimizer=edatalog.AdamW(lr=0.01), clip=1.0)
    assert step.outputs == (
        "loss",
        "next_w1",
        "next_w2",
        "next_adam_m_w1",
        "next_adam_v_w1",
        "next_adam_m_w2",
        "next_adam_v_w2",
    )
    assert names.step == "step" and dict(names.state)["adam_v_w2"] == "w2"
    values = step.random_inputs(seed=0)
    values["step"] = np.array(3.0)
    values["adam_v_w1"], values["adam_v_w2"] = np.abs(values["adam_v_w1"]), np.abs(values["adam_v_w2"])
    want = step.run(values)
    plan = edatalog.plan(step, topology="cpux2", strategy="random", seed=2)
    assert sum(n.tile.n_blocks > 1 for n in plan.ir.nodes) > len(plan.ir.nodes) // 2
    got = plan.execute(values)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


def test_a_solved_training_step_is_predicted_no_slower_than_data_parallelism(tmp_path: Path) -> None:
    """A training step's layers are a small part of it (the backward and the update are outside
    them): the plan of its layers solved one at a time competes with the whole-program baselines
    as built, and the faster in the timeline is kept, saying why."""
    _model(layers=2).save_pretrained(tmp_path)
    step, _ = edatalog.step_program(_llama_loss(tmp_path, 4, 16), optimizer=edatalog.AdamW(), clip=1.0)
    plan = edatalog.plan(step, topology="a100x2", time_limit=3)
    data = edatalog.plan(step, topology="a100x2", strategy="data")
    assert plan.report.seconds <= data.report.seconds
    if plan.layered is None:
        assert plan.picked.startswith("the data baseline as built") and plan.summary()["picked"] == plan.picked


def _llama_loss_in(weights: Path, dtype: str) -> edatalog.Program:
    dims, consts = configured(parse_file(str(LLAMA)), weights)
    text = LLAMA.read_text().replace("output logits.", "input labels[B, S] : i64.\noutput loss.") + CROSS_ENTROPY
    dims = {**dims, "S": 7, "B": 2}
    return edatalog.compile_string(text, name="llama_loss.edl", dims=dims, consts=consts, dtype=dtype)


def test_bf16_training_keeps_f32_master_weights(tmp_path: Path) -> None:
    """A bf16 program trains with f32 master weights: params, gradients, AdamW's moments, the
    update and the loss's sum are f32, the rules of the model compute in bf16 on a bf16 copy
    of each param.  With a learning rate whose steps are below bf16's resolution at the
    weights' size, the masters move as f32 training moves them; updated in bf16 itself
    (``master=None``) most weights do not move at all."""
    model: Any = _model(layers=2)
    model.float().save_pretrained(tmp_path)
    f32, bf16 = _llama_loss_in(tmp_path, "f32"), _llama_loss_in(tmp_path, "bf16")
    start = f32.load_checkpoint(tmp_path)  # f32, as masters load
    step, names = edatalog.step_program(bf16, optimizer=edatalog.AdamW(), clip=1.0)
    dtype = {r.name: r.dtype for r in step.graph.relations}
    assert {dtype[p] for p in names.params} == {"f32"} and {dtype[s] for s, _ in names.state} == {"f32"}
    assert dtype["half_layers.0.wq"] == "bf16" and dtype["grad_layers.0.wq"] == "f32" and dtype["loss"] == "f32"
    readers = [n for n in step.graph.nodes if any(a.relation == "layers.0.wq" for a in n.inputs)]
    assert {n.out for n in readers} == {"half_layers.0.wq", "next_layers.0.wq"}  # the copy and the update

    rng = np.random.default_rng(0)
    batch = {"ids": rng.integers(0, 37, size=(2, 7)), "labels": rng.integers(0, 37, size=(2, 7))}
    opt = edatalog.AdamW(lr=2e-5, weight_decay=0.0)
    moved = {}
    for name, prog, master in (("f32", f32, "f32"), ("master", bf16, "f32"), ("bf16", bf16, None)):
        trainer = edatalog.Trainer(prog, optimizer=opt, backend="torch", master=master)
        trainer.load(start)
        losses = [trainer.step(batch) for _ in range(8)]
        w = trainer.params["layers.0.wq"]
        begun = torch.tensor(start["layers.0.wq"]).to(w.dtype).float()  # as loaded: rounded in bf16
        moved[name] = ((w.float() - begun).numpy(), losses)
    want, want_losses = moved["f32"]
    got, got_losses = moved["master"]
    np.testing.assert_allclose(got_losses, want_losses, rtol=2e-2)
    cosine = float(np.sum(got * want) / np.linalg.norm(got) / np.linalg.norm(want))
    stuck = float(np.mean(moved["bf16"][0] == 0))
    assert cosine > 0.9, cosine  # the masters follow f32's path
    assert stuck > 0.5 and np.mean(got == 0) < 0.01, stuck


def test_bad_settings_are_errors() -> None:
    prog = edatalog.compile_string(SGD_MLP, name="mlp.edl")
    with pytest.raises(EdlError, match="clipping norm"):
        edatalog.Trainer(prog, clip=-1.0)
    with pytest.raises(EdlError, match="learning rate must be positive"):
        edatalog.Trainer(prog, optimizer=edatalog.SGD(lr=0.0))
    trainer = edatalog.Trainer(prog)
    with pytest.raises(EdlError, match=r"call trainer\.load"):
        trainer.step({})
    with pytest.raises(EdlError, match="missing value for param 'w2'"):
        trainer.load({"w1": np.zeros((5, 3))})
