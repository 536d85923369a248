"""Selective messages (:mod:`edatalog.backend.running.selection`): under expert parallelism only
the rows a device's experts read travel to it (a token's row where the token routes to one of
them), and only the rows its partial sums have come back: the dispatch and combine of a mixture
of experts as an all-to-all whose sizes the route decides."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import edatalog
from edatalog.backend.kernels.arrays import NUMPY, TORCH
from edatalog.backend.running import selection, sim
from edatalog.backend.running.compiled import CompiledExecutable
from edatalog.backend.running.interpreter import Buffer, Mailbox
from edatalog.errors import EdlWarning
from edatalog.ir import program as ir
from edatalog.ir.graph import VerifyError
from edatalog.ir.regions import Region

MOE = Path(__file__).resolve().parents[2] / "programs" / "moe_layer.edl"
DIMS = {"T": 24, "D": 16, "F": 32, "X": 8, "K": 2}


def _select(axes: tuple[int | None, ...], lo: int, hi: int, shape: tuple[int, ...]) -> ir.Select:
    return ir.Select("route", ((0, Region.whole(shape)),), Region.whole(shape), axes, lo, hi, True)


@pytest.mark.parametrize("xp", [NUMPY, TORCH], ids=["numpy", "torch"])
def test_rows_travel_where_any_of_their_routes_falls_in_the_part(xp: Any) -> None:
    rng = np.random.default_rng(0)
    route = rng.integers(0, 8, size=(10, 2))
    x = rng.standard_normal((10, 6))
    select = _select((0, None), 2, 5, route.shape)  # x[t, d]: along t, any over k
    rows = selection.rows(xp, xp.asarray(route), select)
    want = np.asarray(((route >= 2) & (route < 5)).any(axis=1))
    np.testing.assert_array_equal(np.asarray(rows.mask), want)
    data, present = selection.pack(xp, xp.asarray(x), None, rows)
    assert present is None and tuple(data.shape) == (int(want.sum()), 6)
    back, there = selection.unpack(xp, data, None, rows, x.shape, None)
    np.testing.assert_array_equal(np.asarray(there), np.broadcast_to(want[:, None], x.shape))
    np.testing.assert_array_equal(np.asarray(back), np.where(want[:, None], x, 0))
    whole, kept = selection.masked(xp, xp.asarray(x), None, rows)  # while recording: the same buffer
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(back))
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(there))


def test_rows_of_a_message_along_several_route_axes_in_another_order() -> None:
    """``h[k, f, t]`` runs along both route axes, in the other order, with its own presence."""
    rng = np.random.default_rng(1)
    route = rng.integers(0, 8, size=(5, 3))  # route[t, k]
    h = rng.standard_normal((3, 4, 5))  # h[k, f, t]
    present = rng.random((3, 4, 5)) < 0.7
    rows = selection.rows(NUMPY, route, _select((2, 0), 0, 4, route.shape))
    want = (route < 4).T  # over (k, t): the message's row axes, ascending
    assert rows.axes == (0, 2)
    np.testing.assert_array_equal(rows.mask, want)
    data, there = selection.pack(NUMPY, h, present, rows)
    assert there is not None and data.shape == (int(want.sum()), 4)
    back, kept = selection.unpack(NUMPY, data, there, rows, h.shape, None)
    expect = present & want[:, None, :]
    np.testing.assert_array_equal(kept, expect)
    np.testing.assert_array_equal(np.where(expect, back, 0), np.where(expect, h, 0))


def _layer() -> edatalog.Program:
    """The MoE layer with its tokens made on the devices (``x`` a rule, split by tokens): under
    the expert plan they travel to the experts, as inside a model."""
    text = MOE.read_text().replace("input x[T, D] : f32.", "input x0[T, D] : f32.\nx[t, d] = 2.0 * x0[t, d].")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.compile_string(text, dims=DIMS)


class _Counting(Mailbox):
    """A mailbox that counts the cells of every message."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[int, int] = {}

    def send(self, device: int, op: ir.Send, piece: Buffer) -> None:
        self.cells[op.tag] = int(np.prod(piece.data.shape))
        super().send(device, op, piece)


def test_expert_dispatch_and_combine_send_only_the_routed_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each device's tokens go to the other device only where they route to its experts, and
    its partial sums of ``y`` come back only for those tokens: the counts the route gives, and
    the run equals the reference."""
    prog = _layer()
    plan = edatalog.plan(prog, topology="cpux2", strategy="expert")
    sends = [op for _, _, op in plan.schedule.programs.ops() if isinstance(op, ir.Send)]
    relation = {op.tag: op.relation for _, _, op in plan.schedule.programs.ops() if isinstance(op, ir.Recv)}
    selective = {relation[op.tag] for op in sends if op.select is not None}
    assert selective == {"x", "p", "z", "y"}, selective  # the route itself travels whole
    values = prog.random_inputs(seed=3)
    mailbox = _Counting()
    monkeypatch.setattr(sim, "Mailbox", lambda: mailbox)
    got = sim.run(plan.lowered, prog.prepare(values))["y"]
    want = prog.run(values)["y"]
    np.testing.assert_allclose(got.data, want, rtol=1e-5, atol=1e-5)
    route = prog.evaluate(values, keep=["route"])["route"].data
    for op in sends:
        if op.select is None or relation[op.tag] != "x":
            continue
        ((lo, hi),) = op.region.axes[0]
        rows = route[lo:hi]
        hit = ((rows >= op.select.lo) & (rows < op.select.hi)).any(axis=1)
        assert mailbox.cells[op.tag] == int(hit.sum()) * DIMS["D"] < op.region.size


def test_predicted_bytes_of_a_selective_transfer_are_its_expected_share() -> None:
    """A token routes to K=2 of X=8 experts: it reaches a device holding 4 of them with
    probability 1 - C(4, 2) / C(8, 2) = 22/28; a (token, choice) cell with 4/8."""
    prog = _layer()
    plan = edatalog.plan(prog, topology="cpux2", strategy="expert")
    programs, costs = plan.schedule.programs, plan.schedule.costs
    relation = {op.tag: op.relation for _, _, op in programs.ops() if isinstance(op, ir.Recv)}
    seen = set()
    for d, k, op in programs.ops():
        if isinstance(op, ir.Send) and op.select is not None:
            whole = op.region.size * 4
            share = 0.5 if relation[op.tag] == "p" else 22 / 28
            assert costs[(d, k)].nbytes == pytest.approx(whole * share, abs=1)
            seen.add(relation[op.tag])
    assert seen == {"x", "p", "z", "y"}


def test_ends_of_a_selective_message_must_agree() -> None:
    prog = _layer()
    programs = edatalog.plan(prog, topology="cpux2", strategy="expert").schedule.programs
    assert ir.Programs.from_json(programs.to_json()) == programs  # selections survive JSON
    d, k, op = next((d, k, op) for d, k, op in programs.ops() if isinstance(op, ir.Recv) and op.select is not None)
    assert op.select is not None
    wrong = dataclasses.replace(op, select=dataclasses.replace(op.select, lo=op.select.lo + 1))
    ops = list(programs.devices[d].ops)
    ops[k] = wrong
    devices = list(programs.devices)
    devices[d] = ir.DeviceProgram(d, tuple(ops))
    with pytest.raises(VerifyError, match="select different cells"):
        dataclasses.replace(programs, devices=tuple(devices)).verify()


def test_torch_runs_of_the_expert_plan_equal_the_reference() -> None:
    """Interpreted (rows packed), recorded and replayed (whole messages, masked)."""
    prog = _layer()
    plan = edatalog.plan(prog, topology="cpux2", strategy="expert")
    values = prog.random_inputs(seed=5)
    want = prog.run(values)["y"]
    exe = edatalog.executable(prog, plan, backend="torch")
    exe.load({n: torch.from_numpy(np.asarray(v)) for n, v in values.items() if n.startswith("w")})
    for call in ("interpreted", "recorded", "replayed"):
        got = exe({"x0": torch.from_numpy(np.asarray(values["x0"]))})["y"].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=call)
    assert isinstance(exe._impl, CompiledExecutable) and exe._impl.replays


@pytest.mark.distributed
def test_two_ranks_send_the_routed_rows_and_equal_the_reference(tmp_path: Path) -> None:
    """The expert plan on 2 gloo ranks (``edl run --nproc 2``): each rank counts the rows it
    receives from its own copy of the route, and the output equals the reference."""
    from tests.backend.test_spmd import EDL, _env, _run

    prog = _layer()
    src = tmp_path / "layer.edl"
    src.write_text(MOE.read_text().replace("input x[T, D] : f32.", "input x0[T, D] : f32.\nx[t, d] = 2.0 * x0[t, d]."))
    plan_file, out = tmp_path / "plan.json", tmp_path / "out.npz"
    edatalog.plan(prog, topology="cpux2", strategy="expert").save(plan_file)
    dims = [f"--dim={k}={v}" for k, v in DIMS.items()]
    cmd = [*EDL, "run", str(src), *dims, "--plan", str(plan_file), "--backend", "torch", "--nproc", "2"]
    done = _run([*cmd, "--random", "0", "-o", str(out)], 120, _env())
    assert done.returncode == 0, done.stderr[-4000:]
    want = prog.run(prog.random_inputs(0))["y"]
    np.testing.assert_allclose(np.load(out)["y"], want, rtol=1e-5, atol=1e-5)
