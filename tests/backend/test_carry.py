"""State carried from call to call (``Graph.carries``, :mod:`edatalog.backend.running.carry`):
a training step's params and optimizer state stay where each step leaves them, on every
runtime, and equal what the reference computes when it is handed them back every step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import edatalog
from edatalog import EdlError
from edatalog.backend.running.carry import all_local, carried_loads
from edatalog.solver.strategies import made_tile
from tests.edatalog.test_training import SGD_MLP

STEPS = 3


def _step() -> tuple[edatalog.Program, Any, dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The MLP's AdamW step (clipped), its params, fresh state and a batch."""
    prog = edatalog.compile_string(SGD_MLP, name="mlp.edl")
    step, names = edatalog.step_program(prog, optimizer=edatalog.AdamW(lr=0.05, weight_decay=0.1), clip=0.5)
    values = prog.random_inputs(seed=1)
    params = {p: values[p] for p in names.params}
    state = {s: np.zeros_like(params[p]) for s, p in names.state}
    return step, names, params, state, {"x": values["x"], "y": values["y"]}


def _reference(steps: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """Each step on the reference evaluator, its params and state handed back as inputs."""
    step, _, params, state, batch = _step()
    carried = {**params, **state}
    losses = []
    for k in range(steps):
        out = step.run({**batch, **carried, "step": np.float64(k + 1)})
        losses.append(float(out["loss"]))
        carried = {target: out[output] for output, target in step.graph.carries}
    return losses, carried


def _numpy(v: Any) -> np.ndarray:
    return v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)


@pytest.mark.parametrize(
    ("backend", "strategy", "compile"),
    [
        ("reference", None, None),
        ("sim", "zero", None),
        ("torch", None, "none"),
        ("torch", None, "graph"),
        ("torch", "data", "none"),
        ("torch", "zero", "none"),
        ("torch", "zero", "graph"),
        ("torch", "random", "graph"),
    ],
)
def test_steps_keep_their_state_and_equal_the_reference(
    backend: str, strategy: str | None, compile: str | None
) -> None:
    want_losses, want = _reference(STEPS)
    step, _, params, state, batch = _step()
    plan = None if strategy is None else edatalog.plan(step, topology="cpux2", strategy=strategy, seed=4)
    exe = step.executable(plan, backend=backend, compile=compile)
    exe.load({**params, **state})
    losses = []
    for k in range(STEPS):
        out = exe.step({**batch, "step": np.float64(k + 1)})
        assert set(out) == {"loss"}  # the carried outputs stay where they are
        losses.append(float(_numpy(out["loss"])))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
    got = exe.state()
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(_numpy(got[name]), value, rtol=1e-12, atol=1e-15, err_msg=name)


def test_a_carried_input_given_to_a_call_replaces_what_is_held() -> None:
    """Calls may still hand the state in (the way a step was run before it was carried)."""
    step, _, params, state, batch = _step()
    exe = step.executable(edatalog.plan(step, topology="cpux2", strategy="zero"), compile="none")
    exe.load(params)  # no state loaded: every call must give it
    with pytest.raises(EdlError, match="holds no value of the carried input 'adam_m_w1'"):
        exe.step({**batch, "step": np.float64(1)})
    values = dict(params)
    for _ in range(2):  # the state handed in both times, the params carried
        exe.step({**batch, **state, "step": np.float64(1)})
        out = step.run({**batch, **state, **values, "step": np.float64(1)})
        values = {p: out[f"next_{p}"] for p in params}
    want = {**values, **{s: out[f"next_{s}"] for s in state}}
    for name, value in exe.state().items():
        np.testing.assert_allclose(_numpy(value), want[name], rtol=1e-12, err_msg=name)


def test_a_failed_call_asks_for_the_state_again() -> None:
    step, _, params, state, batch = _step()
    exe = step.executable(compile="none")
    exe.load({**params, **state})
    with pytest.raises(EdlError, match="not an input"):  # refused before it runs: nothing is lost
        exe.step({**batch, "step": np.float64(1), "z": np.zeros(3)})
    exe.step({**batch, "step": np.float64(1)})
    exe._impl.kernels = None  # type: ignore[attr-defined]  # breaks the run after the state is taken
    with pytest.raises(AttributeError):
        exe.step({**batch, "step": np.float64(2)})
    with pytest.raises(EdlError, match="a call failed after it took the state"):
        exe.step({**batch, "step": np.float64(2)})
    with pytest.raises(EdlError, match="is not carried from call to call"):
        exe.state(["x"])


@pytest.mark.parametrize("strategy", ["data", "zero", "megatron", "auto"])
def test_plans_leave_the_state_where_the_next_step_reads_it(strategy: str) -> None:
    """Solved and built plans place each carried relation where its next value is made, and end
    that output there: no device sends its state anywhere between steps."""
    step, names, *_ = _step()
    plan = edatalog.plan(step, topology="cpux2", strategy=strategy, time_limit=2.0)
    inputs = {p.relation: p.tile for p in plan.ir.inputs}
    ends = {p.relation: p.tile for p in plan.ir.outputs}
    tiles = {n.node: n.tile for n in plan.ir.nodes}
    for output, target in step.graph.carries:
        assert ends[output] == inputs[target], (output, target)
        made = made_tile(step.graph, tiles, output)
        assert made is None or made == inputs[target]
    assert all_local(carried_loads(step.graph, plan.lowered))
    if strategy == "zero":  # the params and moments live sharded, half on each device
        for s, p in names.state:
            for rel in (s, p):
                assert sorted(d for ds in inputs[rel].devices for d in ds) == [0, 1], rel
                assert inputs[rel].n_blocks == 2, rel


def test_zero_splits_the_update_and_needs_less_memory_than_data() -> None:
    """The zero baseline splits the rules with no batch index at the end of a step (clipping and
    the update) and keeps the batch's rules as data parallelism splits them; its predicted peak
    per device is below data parallelism's, which holds the whole state on each."""
    step, *_ = _step()
    data = edatalog.plan(step, topology="cpux2", strategy="data")
    zero = edatalog.plan(step, topology="cpux2", strategy="zero")
    data_tiles = {n.node: n.tile for n in data.ir.nodes}
    for n in zero.ir.nodes:
        node = step.graph.node(n.node)
        if any(i.symbol == "B" for i in node.indices):
            assert n.tile == data_tiles[n.node], n.node
        elif node.out.startswith("next_"):
            assert n.tile.n_blocks == 2, n.node
    assert max(zero.report.peak_memory.values()) < max(data.report.peak_memory.values())


def _in_place_rank() -> dict[str, Any]:
    """One rank of a one-device SPMD job (the compiled segments runtime): the step's AdamW
    updates write over the held params and moments, and over nothing anyone else holds."""
    import torch

    from edatalog.backend.running.spmd import init_group

    torch.set_num_threads(1)
    init_group("cpu")
    step, _, params, state, batch = _step()
    plan = edatalog.plan(step, topology="cpux1", strategy="data")
    exe = step.executable(plan, backend="torch")
    given = {k: torch.from_numpy(v.copy()) for k, v in {**params, **state}.items()}
    saved = {k: v.clone() for k, v in given.items()}
    exe.load(given)
    held = exe._impl.eager.blocks  # type: ignore[attr-defined]
    losses, storages = [], []
    for k in range(4):  # interpreted, recorded, replayed twice
        losses.append(float(exe.step({**batch, "step": np.float64(k + 1)})["loss"]))
        storages.append(sorted(t.untyped_storage().data_ptr() for t in held.values()))
    returned = exe.run({**batch, "step": np.float64(5)}).values  # carried outputs returned: shared
    kept = {k: v.clone() for k, v in returned.items()}
    exe.step({**batch, "step": np.float64(6)})
    return {
        "losses": losses,
        "in_place": storages[1] == storages[2] == storages[3],
        "given_unchanged": all(torch.equal(given[k], saved[k]) for k in given),
        "returned_unchanged": all(torch.equal(returned[k], kept[k]) for k in returned),
        "state": {k: v.numpy() for k, v in exe.state().items()},
    }


@pytest.mark.distributed
def test_spmd_updates_held_state_in_place_and_nothing_else() -> None:
    """The arrays a caller loads, and the outputs a call returns, are never written over; the
    blocks the runtime holds alone are, step after step (their memory stays the same)."""
    from edatalog.backend.running.launch import spawn

    got = spawn(1, _in_place_rank)[0]
    want_losses, _ = _reference(4)
    np.testing.assert_allclose(got["losses"], want_losses, rtol=1e-12)
    assert got["in_place"] and got["given_unchanged"] and got["returned_unchanged"]
    _, want = _reference(6)
    for name, value in want.items():
        np.testing.assert_allclose(got["state"][name], value, rtol=1e-11, atol=1e-15, err_msg=name)
