"""AdamW's update of each param block as one fused op (backend/lowering/fusion.py), run by
torch's fused AdamW kernel (backend/kernels/optimizer.py): the same params and moments as the
rules, the blocks overwritten only where the call owns them."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

import edatalog
from edatalog.backend.lowering.fusion import KIND_ADAMW
from edatalog.backend.lowering.lowered import Lowered
from edatalog.ir import program as ir
from edatalog.ir.graph import VerifyError
from tests.backend.test_carry import _reference, _step
from tests.edatalog.test_training import SGD_MLP


def _fused(lowered: Lowered) -> list[tuple[int, ir.Fused]]:
    return [
        (p.device, op)
        for p in lowered.programs.devices
        for op in p.ops
        if isinstance(op, ir.Fused) and op.kind == KIND_ADAMW
    ]


@pytest.mark.parametrize(("strategy", "blocks"), [("data", 1), ("zero", 2)])
def test_each_block_of_each_update_is_one_fused_op(strategy: str, blocks: int) -> None:
    """Under ``data`` each device updates every param whole, under ``zero`` its half of each;
    each fused op makes p' and exports m' and v', and may overwrite the param's and moments'
    blocks, and the gradient's (nothing reads them after the update; the gradient is made in
    the step, the others are loaded)."""
    step, names, *_ = _step()
    plan = edatalog.plan(step, topology="cpux2", strategy=strategy)
    fused = _fused(plan.lowered)
    for d in (0, 1):
        assert sorted(op.relation for dd, op in fused if dd == d) == sorted(f"next_{p}" for p in names.params)
    for _, op in fused:
        assert [k.node for k in op.kernels][:2] == [f"next_adam_m_{op.relation[5:]}", f"next_adam_v_{op.relation[5:]}"]
        assert len(op.exports) == 2 and len(op.overwrites) == 4
    again = Lowered.from_json(plan.lowered.to_json())
    assert _fused(again) == fused
    assert blocks == len({op.region for _, op in fused if op.relation == "next_w1"})


def test_an_op_overwriting_what_it_does_not_read_fails_verify() -> None:
    step, *_ = _step()
    programs = edatalog.plan(step, topology="cpux1", strategy="data").lowered.programs
    device = programs.devices[0]
    k, op = next((k, op) for k, op in enumerate(device.ops) if isinstance(op, ir.Fused) and op.kind == KIND_ADAMW)
    wrong = dataclasses.replace(op, overwrites=(op.buf,))
    ops = (*device.ops[:k], wrong, *device.ops[k + 1 :])
    broken = dataclasses.replace(programs, devices=(dataclasses.replace(device, ops=ops),))
    with pytest.raises(VerifyError, match="overwrites a buffer it does not read"):
        broken.verify()


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Each call of torch's fused AdamW kernel: how many params it updates, whether it scales
    the gradients."""
    calls: list[tuple[int, bool]] = []
    real = torch._fused_adamw_

    def spy(params: list[Any], *args: Any, **kwargs: Any) -> Any:
        calls.append((len(params), kwargs.get("grad_scale") is not None))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    return calls


@pytest.mark.parametrize("compile", ["none", "graph"])
def test_the_torch_runtime_updates_by_the_fused_kernel_to_the_rules_values(
    compile: str, kernel_calls: list[tuple[int, bool]]
) -> None:
    """f64: the kernel computes the rules' formula in another order, to rounding."""
    want_losses, want = _reference(3)
    step, _, params, state, batch = _step()
    exe = step.executable(None, backend="torch", compile=compile)
    exe.load({**params, **state})
    losses = [float(exe.step({**batch, "step": np.float64(k + 1)})["loss"]) for k in range(3)]
    assert kernel_calls and not any(scaled for _, scaled in kernel_calls)  # f64: scaled before
    np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
    for name, value in exe.state().items():
        np.testing.assert_allclose(value.numpy(), want[name], rtol=1e-11, atol=1e-15, err_msg=name)


def test_the_simulator_runs_the_rules(kernel_calls: list[tuple[int, bool]]) -> None:
    """numpy has no fused kernel: the fused op runs its three rules, to the reference's values."""
    step, _, params, state, batch = _step()
    values: dict[str, np.ndarray] = {**params, **state, **batch, "step": np.array(1.0)}
    plan = edatalog.plan(step, topology="cpux2", strategy="zero")
    got, want = plan.execute(values, backend="sim"), step.run(values)
    assert kernel_calls == []
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-12, atol=1e-15, err_msg=name)


def test_an_f32_gradient_is_scaled_by_the_kernel(kernel_calls: list[tuple[int, bool]]) -> None:
    """Under clipping an f32 gradient made in the step is scaled as the kernel reads it (its
    grad_scale, the factor's reciprocal): the rules' values to f32 rounding."""
    prog = edatalog.compile_string(SGD_MLP.replace(": f64", ": f32"), name="mlp.edl")
    # A norm far above 0.01: the factor scales every gradient.
    step, names = edatalog.step_program(prog, optimizer=edatalog.AdamW(lr=0.05, weight_decay=0.1), clip=0.01)
    values = prog.random_inputs(seed=1)
    state = {s: np.zeros_like(values[p]) for s, p in names.state}
    inputs = {**values, **state, "step": np.array(1.0)}
    want = step.run(inputs)
    exe = step.executable(None, backend="torch", compile="none")
    exe.load({p: values[p] for p in names.params})
    got = exe({k: v for k, v in inputs.items() if k not in names.params})
    assert kernel_calls and all(scaled for _, scaled in kernel_calls)
    for name, value in want.items():
        np.testing.assert_allclose(got[name].numpy(), value, rtol=2e-5, atol=1e-7, err_msg=name)
