"""``edatalog.executable``: a program, with a plan or without, ready to run many times.

Params load once, from whole numpy arrays, torch tensors or a safetensors file (the same values
whichever way), and every mistake in them is an :class:`EdlError` that names the param: a wrong
shape, a missing or unknown one, a file that is not there or not safetensors, or a call before
anything was loaded.  Without a plan the program runs on one torch device; ``prog.run(values,
plan=..., backend="torch")`` is the same in one call.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import edatalog

PROGRAMS = Path(__file__).resolve().parents[2] / "programs"
RTOL, ATOL = 1e-4, 1e-5


@functools.cache
def _mlp() -> edatalog.Program:
    return edatalog.compile(PROGRAMS / "mlp.edl", dims={"B": 4, "D": 16, "F": 24})


@functools.cache
def _llama() -> edatalog.Program:
    return edatalog.compile(PROGRAMS / "llama_block.edl", dims={"B": 1, "S": 8, "D": 32, "H": 4, "KVH": 2, "F": 48})


def _params(prog: edatalog.Program, seed: int = 0) -> dict[str, np.ndarray]:
    names = {r.name for r in prog.arguments if r.kind == "param"}
    return prog.random_inputs(seed, names=names)


def _inputs(prog: edatalog.Program, seed: int = 1) -> dict[str, np.ndarray]:
    names = {r.name for r in prog.arguments if r.kind == "input"}
    return prog.random_inputs(seed, names=names)


def _assert_close(got: Any, want: np.ndarray, what: str = "") -> None:
    assert isinstance(got, torch.Tensor), f"{what}: a {type(got).__name__}, not a torch tensor"
    np.testing.assert_allclose(got.numpy(), want, rtol=RTOL, atol=ATOL, err_msg=what)


def _plan(prog: edatalog.Program) -> edatalog.Plan:
    return edatalog.plan(prog, topology="cpux2", strategy="megatron")


@pytest.mark.parametrize("planned", [False, True])
def test_params_load_from_numpy_arrays_or_torch_tensors(planned: bool) -> None:
    prog = _mlp() if not planned else _llama()
    plan = _plan(prog) if planned else None
    params, inputs = _params(prog), _inputs(prog)
    want = prog.run({**params, **inputs})
    from_numpy = edatalog.executable(prog, plan, device="cpu")
    from_numpy.load(params)
    from_torch = edatalog.executable(prog, plan, device="cpu")
    from_torch.load({k: torch.from_numpy(v) for k, v in params.items()})
    for exe in (from_numpy, from_torch):
        out = exe(inputs)
        assert set(out) == set(prog.outputs)
        for name in prog.outputs:
            _assert_close(out[name], want[name], name)
        again = exe({k: torch.from_numpy(v) for k, v in inputs.items()})
        for name in prog.outputs:
            assert torch.equal(again[name], out[name]), f"{name}: torch inputs give other values"


@pytest.mark.parametrize("planned", [False, True])
def test_a_safetensors_file_loads_as_the_dict_does(planned: bool, tmp_path: Path) -> None:
    prog = _mlp() if not planned else _llama()
    plan = _plan(prog) if planned else None
    params, inputs = _params(prog, seed=4), _inputs(prog)
    path = tmp_path / "weights.safetensors"
    # The file may hold more than the params (here an input too): only the params are read.
    save_file({k: torch.from_numpy(v) for k, v in {**params, **inputs}.items()}, str(path))
    by_dict = edatalog.executable(prog, plan, device="cpu")
    by_dict.load(params)
    want = by_dict(inputs)
    for source in (path, str(path)):
        by_file = edatalog.executable(prog, plan, device="cpu")
        by_file.load(source)
        got = by_file(inputs)
        for name in prog.outputs:
            assert torch.equal(got[name], want[name]), f"{name} loaded from {type(source).__name__}"
    reference = prog.run({**params, **inputs})
    for name in prog.outputs:
        _assert_close(want[name], reference[name], name)


def test_a_wrong_shape_in_the_file_names_the_param(tmp_path: Path) -> None:
    prog = _mlp()
    params = {k: torch.from_numpy(v) for k, v in _params(prog).items()}
    params["w1"] = params["w1"].t().contiguous()
    path = tmp_path / "transposed.safetensors"
    save_file(params, str(path))
    exe = edatalog.executable(prog, device="cpu")
    with pytest.raises(edatalog.EdlError, match=r"w1 \(w1\): shape \[16, 24\] in the checkpoint, \[24, 16\] here"):
        exe.load(path)
    with pytest.raises(edatalog.EdlError, match="not loaded"):
        exe(_inputs(prog))


def test_a_missing_param_is_an_error(tmp_path: Path) -> None:
    prog = _mlp()
    params = _params(prog)
    exe = edatalog.executable(prog, device="cpu")
    with pytest.raises(edatalog.EdlError, match="missing value for param 'b2'"):
        exe.load({k: v for k, v in params.items() if k != "b2"})
    path = tmp_path / "partial.safetensors"
    save_file({k: torch.from_numpy(v) for k, v in params.items() if k not in ("b1", "w2")}, str(path))
    with pytest.raises(edatalog.EdlError, match=r"lacks 2 of the program's 4 params:\n  b1: none of b1\n  w2: none"):
        exe.load(path)
    with pytest.raises(edatalog.EdlError, match="'w3' is not a"):
        exe.load({**params, "w3": params["w2"]})
    with pytest.raises(edatalog.EdlError, match="no such checkpoint"):
        exe.load(tmp_path / "nowhere.safetensors")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")
    with pytest.raises(edatalog.EdlError, match="is not a safetensors file"):
        exe.load(broken)
    with pytest.raises(edatalog.EdlError, match="must have shape"):
        exe.load({**params, "b1": params["b1"][:-1]})


def test_calling_before_load_is_an_error() -> None:
    prog = _llama()
    exe = edatalog.executable(prog, _plan(prog), device="cpu")
    with pytest.raises(edatalog.EdlError, match="the params are not loaded") as info:
        exe(_inputs(prog))
    assert "exe.load(params)" in str(info.value)  # the help says what to do
    with pytest.raises(edatalog.EdlError, match="the params are not loaded"):
        exe.run(_inputs(prog))
    # A program without params needs no load.
    free = edatalog.compile_string("dim N = 3.\ninput x[N] : f32.\noutput y.\ny[i] = x[i] * 2.0.\n")
    exe = edatalog.executable(free, device="cpu")
    assert exe({"x": np.arange(3, dtype=np.float32)})["y"].tolist() == [0.0, 2.0, 4.0]


def test_inputs_are_checked_at_every_call() -> None:
    prog = _mlp()
    exe = edatalog.executable(prog, device="cpu")
    exe.load(_params(prog))
    with pytest.raises(edatalog.EdlError, match="missing value for input 'x'"):
        exe({})
    with pytest.raises(edatalog.EdlError, match="'x' must have shape"):
        exe({"x": np.zeros((3, 16), dtype=np.float32)})
    with pytest.raises(edatalog.EdlError, match=r"'w1' is not an? input"):
        exe({**_inputs(prog), "w1": _params(prog)["w1"]})


def test_without_a_plan_the_program_runs_on_one_device() -> None:
    prog = _llama()
    values = {**_params(prog), **_inputs(prog)}
    exe = edatalog.executable(prog, device="cpu")
    assert exe.plan is None
    exe.load(_params(prog))
    out = exe.run(_inputs(prog))
    assert out.present == {"y": None}
    _assert_close(out.values["y"], prog.run(values)["y"], "y")
    assert out.values["y"].device.type == "cpu" and out.values["y"].dtype == torch.float32


def test_loading_again_replaces_the_params() -> None:
    prog = _llama()
    plan = _plan(prog)
    inputs = _inputs(prog)
    exe = edatalog.executable(prog, plan, device="cpu")
    for seed in (0, 7, 0):
        params = _params(prog, seed)
        exe.load(params)
        _assert_close(exe(inputs)["y"], prog.run({**params, **inputs})["y"], f"params of seed {seed}")


def test_prog_run_with_a_plan_on_torch_returns_tensors() -> None:
    prog = _llama()
    values = {**_params(prog), **_inputs(prog)}
    plan = _plan(prog)
    want = prog.run(values)
    on_torch = prog.run(values, plan=plan, backend="torch")
    assert set(on_torch) == {"y"}
    _assert_close(on_torch["y"], want["y"], "torch")
    on_sim = prog.run(values, plan=plan)  # the simulator by default, numpy out
    assert isinstance(on_sim["y"], np.ndarray)
    np.testing.assert_allclose(on_sim["y"], want["y"], rtol=RTOL, atol=ATOL)
    one = prog.run(values, backend="torch", device="cpu")
    _assert_close(one["y"], want["y"], "torch without a plan")


def test_backends_and_plans_must_go_together() -> None:
    prog = _mlp()
    plan = edatalog.plan(prog, topology="cpux2", strategy="data")
    with pytest.raises(edatalog.EdlError, match="without a plan"):
        edatalog.executable(prog, plan, backend="reference")
    with pytest.raises(edatalog.EdlError, match="runs a plan"):
        edatalog.executable(prog, backend="sim")
    with pytest.raises(edatalog.EdlError, match="unknown backend 'torhc'"):
        edatalog.executable(prog, plan, backend="torhc")
    with pytest.raises(edatalog.EdlError, match="another program"):
        edatalog.executable(_llama(), plan)
    sim = edatalog.executable(prog, plan, backend="sim")
    sim.load(_params(prog))
    out = sim(_inputs(prog))
    assert isinstance(out["y"], np.ndarray)
    np.testing.assert_allclose(out["y"], prog.run({**_params(prog), **_inputs(prog)})["y"], rtol=RTOL, atol=ATOL)


def test_repr_says_backend_and_plan() -> None:
    prog = _llama()
    assert repr(edatalog.executable(prog, device="cpu")) == "<edatalog.Executable torch, no plan>"
    planned = edatalog.executable(prog, _plan(prog), device="cpu")
    assert repr(planned) == "<edatalog.Executable torch, plan 'megatron' on 2 devices>"
    assert repr(edatalog.executable(prog, backend="reference")) == "<edatalog.Executable reference, no plan>"
    assert (
        repr(prog.executable(_plan(prog), backend="sim")) == "<edatalog.Executable sim, plan 'megatron' on 2 devices>"
    )
