"""Recomputing activations in the backward (:mod:`edatalog.rules.recompute`): the same step,
the forward's intermediates read by the forward only, and less memory held, predicted and
measured; ``edl train --memory`` turns it on when nothing fits without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edatalog
from edatalog import EdlError
from edatalog.rules.recompute import PREFIX, recompute_layers
from edatalog.train_job import Request, loss_program, solved_plan
from tests.edatalog.test_training import SGD_MLP
from tests.programs.test_llama_model import LLAMA, _model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("recompute")
    net: Any = _model(layers=2)
    net.save_pretrained(where)
    return where


def _request(model: Path) -> Request:
    return Request(str(LLAMA), str(model), "unused", 1, batch=8, seq=16, clip=1.0, dtype="f64")


def _steps(model: Path) -> tuple[edatalog.Program, edatalog.Program, edatalog.Program]:
    prog = loss_program(_request(model))
    kept, _ = edatalog.step_program(prog, clip=1.0)
    again, _ = edatalog.step_program(prog, clip=1.0, recompute=True)
    return prog, kept, again


def test_the_backward_reads_the_layers_made_again_and_computes_the_same(model: Path) -> None:
    prog, kept, again = _steps(model)
    forward = prog.graph.nodes
    rep = next(r for r in prog.graph.repeats if r.count > 1)
    layer_of = {name: k for k in range(rep.count) for name in rep.instance(k)}
    made_in = {n.out: layer_of[n.name] for n in forward if n.name in layer_of}
    # A layer's results: what the forward reads of it outside it (the next layer's input).
    results = {
        a.relation
        for n in forward
        for a in n.inputs
        if made_in.get(a.relation, layer_of.get(n.name)) != layer_of.get(n.name)
    }
    later = again.graph.nodes[len(forward) :]
    read = {a.relation for n in later if not n.name.startswith("re.") for a in n.inputs if a.relation in made_in}
    assert read and read <= results, read - results  # of the layers, the backward reads their results only
    copies = [n for n in later if n.name.startswith("re.")]
    assert copies and all(n.out.startswith(PREFIX) for n in copies)
    # Each layer's copies come just before the first rule that reads one: the last layer's first.
    first = next(k for k, n in enumerate(later) if n.name.startswith("re."))
    assert later[first].name.startswith(f"re.layers.{rep.count - 1}.")

    values = kept.random_inputs(seed=0)
    values["step"] = np.array(1.0)
    for name in values:
        if name.startswith("adam_v"):
            values[name] = np.abs(values[name])
    want, got = kept.run(values), again.run(values)
    assert set(want) == set(got)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.slow
def test_recomputing_holds_less_predicted_and_measured(model: Path) -> None:
    """A data-parallel step on 2 devices, run on torch in one process: the peak each device
    holds, predicted (the timeline counts buffers in program order, as the devices run) and
    measured (the interpreter's count), drops when the layers are made again."""
    prog, kept, again = _steps(model)
    rng = np.random.default_rng(0)
    batch = {"ids": rng.integers(0, 37, size=(8, 16)), "labels": rng.integers(0, 37, size=(8, 16))}
    peaks, losses = {}, {}
    for recompute, step in ((False, kept), (True, again)):
        plan = edatalog.plan(step, topology="cpux2", strategy="data")
        trainer = edatalog.Trainer(prog, clip=1.0, backend="torch", plan=plan, recompute=recompute)
        trainer.load(prog.load_checkpoint(model))
        losses[recompute] = [trainer.step(batch)]  # interpreted: the op-by-op count of what is held
        measured = max(trainer.last_peak.values())
        predicted = max(plan.report.peak_memory.values())
        assert measured == pytest.approx(predicted, rel=0.01)
        peaks[recompute] = measured
    assert losses[True] == losses[False]
    assert peaks[True] < 0.9 * peaks[False], peaks


@pytest.mark.slow
def test_edl_train_recomputes_when_nothing_fits_the_memory_without(model: Path, tmp_path: Path) -> None:
    req = _request(model)
    _, kept, again = _steps(model)
    lean = min(max(edatalog.plan(kept, topology="cpux2", strategy=s).report.peak_memory.values()) for s in ("zero",))
    need = max(edatalog.plan(again, topology="cpux2", strategy="zero").report.peak_memory.values())
    assert need < lean
    memory = f"{(need + lean) // 2}B"
    planned, what = solved_plan(req, 2, "cpux2", memory, 1.0, tmp_path / "plan.json")
    assert planned.recompute and "recomputed" in what and planned.plan == str(tmp_path / "plan.json")
    with pytest.raises(EdlError, match=r"no plan of this program fits .* the leanest, zero, holds"):
        edatalog.plan(again, topology="cpux2", memory=f"{need // 2}B", time_limit=1.0)


def test_a_program_without_layers_cannot_recompute_them() -> None:
    prog = edatalog.compile_string(SGD_MLP, name="mlp.edl")
    with pytest.raises(EdlError, match="no repeated module"):
        edatalog.step_program(prog, recompute=True)
    with pytest.raises(EdlError, match="no repeated module"):
        recompute_layers(prog.graph, len(prog.graph.nodes))
