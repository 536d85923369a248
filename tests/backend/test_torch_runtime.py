"""The torch runtime in one process (:mod:`edatalog.backend.running.torch_runtime`): a plan's device
programs on N logical devices, all on the CPU here, against the numpy reference.

The bar of the runtime issue: every strategy's plan equals the reference in one process, on 1 to
8 logical devices, for LLaMA blocks with multi-head and grouped-query attention (f32, to 1e-4),
and for random programs (f64, against the brute-force oracle of :mod:`tests.strategies`).  Also:
outputs are torch tensors whose absent cells read 0 (``Outputs.present`` marks them), recording
gives one time per op, the torch devices may be named one by one, torch tensors are accepted as
inputs and params, and a plan made for another program is refused.

Each check runs the compiled runtime twice: its first call of an input signature interprets the
programs, its second traces them into a graph and replays it; both must equal the reference.

For a longer, random run of the property test::

    EDL_TORCH_RUNTIME_EXAMPLES=500 .venv/bin/pytest tests/backend/test_torch_runtime.py
"""

from __future__ import annotations

import functools
import itertools
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import edatalog
from edatalog.backend.running.compiled import CompiledExecutable
from edatalog.backend.running.torch_runtime import op_label
from edatalog.errors import EdlWarning
from edatalog.executable import Executable
from edatalog.ir import program as ir
from tests.strategies import GeneratedProgram, example_settings, programs

LLAMA = Path(__file__).resolve().parents[2] / "programs" / "llama_block.edl"
# Small enough for a few milliseconds per call; B = 2 gives the data strategy a batch to split.
DIMS = {"B": 2, "S": 16, "D": 64, "H": 4, "F": 96}
HEADS = {"mha": 4, "gqa": 2}  # KVH: 4 key/value heads for 4 query heads, or 2 shared by 2 each
# A machine with each device count: the topology decides reductions (2x4: two nodes of four).
MACHINES = {1: "cpux1", 2: "cpux2", 3: "cpux3", 4: "a100x4", 8: "2x4"}
F32_RTOL, F32_ATOL = 1e-4, 1e-5
F64_RTOL, F64_ATOL = 1e-9, 1e-12


def _compile(text: str) -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.compile_string(text)


@functools.cache
def _llama(heads: str, batch: int = 2) -> edatalog.Program:
    return edatalog.compile(LLAMA, dims={**DIMS, "B": batch, "KVH": HEADS[heads]})


@functools.cache
def _values(heads: str, batch: int = 2) -> dict[str, np.ndarray]:
    return _llama(heads, batch).random_inputs(seed=0)


@functools.cache
def _reference(heads: str, batch: int = 2) -> dict[str, np.ndarray]:
    out = _llama(heads, batch).run(_values(heads, batch))
    assert all(isinstance(v, np.ndarray) for v in out.values())
    return out


def _split(prog: edatalog.Program, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(params, inputs)."""
    params = {r.name for r in prog.arguments if r.kind == "param"}
    return {k: v for k, v in values.items() if k in params}, {k: v for k, v in values.items() if k not in params}


def _executable(prog: edatalog.Program, plan: edatalog.Plan | None, values: dict[str, Any], device: Any) -> Executable:
    exe = edatalog.executable(prog, plan, backend="torch", device=device)
    exe.load(_split(prog, values)[0])
    return exe


def _assert_f32_close(got: Any, want: np.ndarray, what: str) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: a {type(got).__name__}, not a torch tensor"
    assert got.dtype == torch.float32 and got.device.type == "cpu", f"{what}: {got.dtype} on {got.device}"
    assert tuple(got.shape) == want.shape, f"{what}: shape {tuple(got.shape)}, expected {want.shape}"
    np.testing.assert_allclose(got.numpy(), want, rtol=F32_RTOL, atol=F32_ATOL, err_msg=what)


def _compiled(exe: Executable) -> bool:
    """Whether the executable's last call replayed a compiled graph (its first call of an input
    signature runs the interpreter, its second compiles)."""
    return isinstance(exe._impl, CompiledExecutable) and bool(exe._impl.replays)


def _check_llama(heads: str, plan: edatalog.Plan, device: Any = "cpu", batch: int = 2, compiled: bool = True) -> None:
    """The plan's outputs equal the reference's, interpreted (the first call), recorded (the
    second: the interpreter's run, traced into a graph) and replayed (the third: that graph,
    simplified); without ``compiled``, interpreted only."""
    prog = _llama(heads, batch)
    exe = _executable(prog, plan, _values(heads, batch), device)
    want = _reference(heads, batch)["y"]
    for call in ("interpreted", "recorded", "replayed") if compiled else ("interpreted",):
        out = exe(_split(prog, _values(heads, batch))[1])
        assert set(out) == {"y"}
        _assert_f32_close(out["y"], want, f"{heads} {plan.ir.strategy} on {plan.ir.n_devices}, {call}")
    assert _compiled(exe) == compiled


# -- LLaMA blocks, every strategy, 1 to 8 logical devices ---------------------------------------------


@pytest.mark.parametrize("n", sorted(MACHINES))
@pytest.mark.parametrize("strategy", ["replicate", "data", "megatron", "megatron-sp"])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_baseline_plans_of_llama_equal_the_reference(heads: str, strategy: str, n: int) -> None:
    plan = edatalog.plan(_llama(heads), topology=MACHINES[n], strategy=strategy)
    assert plan.ir.n_devices == n
    _check_llama(heads, plan)


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("n", sorted(MACHINES))
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_random_plans_of_llama_equal_the_reference(heads: str, n: int, seed: int) -> None:
    """Uneven splits of every index (the key index of the softmax too), random devices,
    replicated blocks: partial maxima and sums cross devices.  (B = 1: random plans cut every
    index, and each cut of the batch multiplies the ops of every rule.)  The first seed's
    plans are also recorded and replayed as graphs; the others' are interpreted only (their
    graphs take the suite's time: ~5 s each to record and simplify, for what the first seed and
    the compiled runtime's own tests check)."""
    prog = _llama(heads, batch=1)
    plan = edatalog.plan(prog, topology=MACHINES[n], strategy="random", seed=seed * 10 + n)
    _check_llama(heads, plan, batch=1, compiled=seed == 0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_solved_plans_of_llama_equal_the_reference(heads: str, n: int) -> None:
    # The limit covers building the solver's model (about a second on 4 devices here, two on 8,
    # twice that on a busy machine) and a search; on 8 devices a busy machine may leave only the
    # baselines (unsearched).  A full suite's run once left 2 devices unsearched in 2 s.  (On
    # 8 devices, where the baselines are accepted, 4 s: the solve takes all of its limit.)
    limit = 4.0 if n == 8 else max(3.0, 1.5 * n)
    plan = edatalog.plan(_llama(heads), topology=MACHINES[n], strategy="auto", time_limit=limit)
    assert plan.solution is not None and (plan.solution.searched or n == 8)
    assert plan.ir.strategy == "auto" and plan.ir.n_devices == n
    _check_llama(heads, plan)


def test_a_solved_plan_that_must_split_the_weights_equals_the_reference() -> None:
    """Under a memory limit that no replicated plan fits, the solver splits the params (heads and
    FFN columns, as Megatron does): partial sums are reduced across the two devices."""
    prog = _llama("gqa")
    weights = sum(v.nbytes for k, v in _values("gqa").items() if k != "x")
    plan = edatalog.plan(prog, topology="cpux2", strategy="auto", memory="100KB", time_limit=1.0)
    assert weights > 100_000 and not plan.over_memory()
    split = [p.relation for p in plan.ir.inputs if any(s.parts > 1 for s in p.tile.splits)]
    assert split, f"no param is split:\n{plan}"
    _check_llama("gqa", plan)


@pytest.mark.parametrize("n", [2, 3])
def test_logical_devices_may_be_named_one_by_one(n: int) -> None:
    plan = edatalog.plan(_llama("gqa"), topology=MACHINES[n], strategy="megatron")
    _check_llama("gqa", plan, device=["cpu"] * n)


def test_torch_devices_must_match_the_plan() -> None:
    prog = _llama("mha")
    plan = edatalog.plan(prog, topology="cpux2", strategy="megatron")
    with pytest.raises(edatalog.EdlError, match="2 devices, but 3 torch devices"):
        edatalog.executable(prog, plan, device=["cpu"] * 3)
    with pytest.raises(edatalog.EdlError, match="'nope' is not a torch device"):
        edatalog.executable(prog, plan, device="nope")
    if not torch.cuda.is_available():
        with pytest.raises(edatalog.EdlError, match="no CUDA GPU"):
            edatalog.executable(prog, plan, device="cuda")


def test_an_executable_runs_many_times_with_its_params_loaded_once() -> None:
    """Each call slices its own inputs; the loaded blocks of the params are not changed by a call."""
    prog = _llama("gqa", batch=1)
    values = _values("gqa", batch=1)
    plan = edatalog.plan(prog, topology="cpux2", strategy="random", seed=5)
    exe = _executable(prog, plan, values, "cpu")
    for seed in (1, 2):
        x = prog.random_inputs(seed, names=["x"])["x"]
        want = prog.run({**values, "x": x})["y"]
        _assert_f32_close(exe({"x": x})["y"], want, f"call with x of seed {seed}")


def test_torch_tensors_are_accepted_as_inputs_and_params() -> None:
    prog = _llama("mha")
    values = _values("mha")
    plan = edatalog.plan(prog, topology="cpux2", strategy="megatron")
    as_torch = {k: torch.from_numpy(v.copy()) for k, v in values.items()}
    as_torch["wq"].requires_grad_(True)  # a Parameter-like tensor is read, not differentiated
    exe = edatalog.executable(prog, plan, backend="torch", device="cpu")
    params, inputs = _split(prog, as_torch)
    exe.load(params)
    _assert_f32_close(exe(inputs)["y"], _reference("mha")["y"], "torch params and inputs")
    mixed = {**_split(prog, values)[1], "x": as_torch["x"].double()}  # cast to the declared f32
    _assert_f32_close(exe(mixed)["y"], _reference("mha")["y"], "an f64 tensor input")
    out = prog.run(as_torch, plan=plan, backend="torch", device="cpu")
    _assert_f32_close(out["y"], _reference("mha")["y"], "prog.run with torch values")


def test_a_plan_for_another_program_is_refused() -> None:
    mha, gqa = _llama("mha"), _llama("gqa")
    plan = edatalog.plan(gqa, topology="cpux2", strategy="megatron")
    with pytest.raises(edatalog.EdlError, match="another program"):
        edatalog.executable(mha, plan, backend="torch", device="cpu")
    with pytest.raises(edatalog.EdlError, match="another program"):
        mha.run(_values("mha"), plan=plan, backend="torch", device="cpu")


# -- what a call returns ------------------------------------------------------------------------------

PARTIAL = """
dim N = 6.
input x[N, N] : f32.
output y, z.
y[i] = x[i, 0] * 2.0 where i < 4.
z[i, j] max= x[i, k] + x[k, j] where k < i, k < j.
"""


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_absent_cells_read_zero_and_present_marks_them(seed: int) -> None:
    prog = _compile(PARTIAL)
    values = prog.random_inputs(seed)
    want = prog.evaluate(values)
    plan = edatalog.plan(prog, topology="cpux3", strategy="random", seed=seed)
    exe = edatalog.executable(prog, plan, backend="torch", device="cpu")
    exe.load({})
    out = exe.run(values)
    assert set(out.values) == set(out.present) == {"y", "z"}
    for name in ("y", "z"):
        got, present = out.values[name], out.present[name]
        assert isinstance(got, torch.Tensor) and isinstance(present, torch.Tensor), name
        assert present.dtype == torch.bool
        want_present = want[name].present
        assert want_present is not None
        assert np.array_equal(present.numpy(), want_present), f"{name}: presence"
        assert np.all(got.numpy()[~want_present] == 0), f"{name}: absent cells must read 0"
        np.testing.assert_allclose(got.numpy(), want[name].data, rtol=F32_RTOL, atol=F32_ATOL, err_msg=name)
    y_present = out.present["y"]
    assert y_present is not None and y_present.tolist() == [True] * 4 + [False] * 2
    # Where every cell exists, present is None.
    whole = _compile("dim N = 3.\ninput x[N] : f32.\noutput y.\ny[i] = x[i] + 1.0.\n")
    plan = edatalog.plan(whole, topology="cpux2", strategy="random", seed=seed)
    exe = edatalog.executable(whole, plan, backend="torch", device="cpu")
    exe.load({})
    got = exe.run({"x": np.arange(3, dtype=np.float32)})
    assert got.present == {"y": None}
    assert got.values["y"].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(("strategy", "n"), [("megatron", 2), ("random", 2), ("data", 3)])
def test_recording_gives_one_time_per_op(strategy: str, n: int) -> None:
    """One (device, label, start, end) per op of every device's program as run (fused attention
    included; frees are not ops that take time), in each device's program order."""
    batch = 1 if strategy == "random" else 2
    prog = _llama("gqa", batch)
    plan = edatalog.plan(prog, topology=MACHINES[n], strategy=strategy, seed=1)
    exe = _executable(prog, plan, _values("gqa", batch), "cpu")
    inputs = _split(prog, _values("gqa", batch))[1]
    out = exe.run(inputs, record=True)
    _assert_f32_close(out.values["y"], _reference("gqa", batch)["y"], "recorded run")
    assert exe.lowered is not None
    programs = exe.lowered.programs
    for p in programs.devices:
        want = [op_label(op) for op in p.ops if not isinstance(op, ir.Free)]
        got = [t for t in exe.last_times if t[0] == p.device]
        assert [label for _, label, _, _ in got] == want, f"device {p.device}"
        for (_, _, start, end), (_, _, next_start, _) in itertools.pairwise(got):
            assert 0.0 <= start <= end <= next_start
    assert len(exe.last_times) == sum(1 for _, _, op in programs.ops() if not isinstance(op, ir.Free))
    assert {d for d, _, _, _ in exe.last_times} <= set(range(n))
    labels = {label for _, label, _, _ in exe.last_times}
    assert {"exchange", "xn", "y"} & labels
    if strategy == "megatron":
        assert any(label.startswith("attention") for label in labels), labels
        # The row-parallel projections' partial sums: all-reduced, as the machine's library runs them.
        assert {"all_reduce attn", "all_reduce down"} <= labels
    exe(inputs)  # without record: nothing kept
    assert exe.last_times == []


# -- random programs under random plans ------------------------------------------------------------


@example_settings("EDL_TORCH_RUNTIME_EXAMPLES", 80)
@given(
    programs(),
    st.sampled_from([2, 3, 4, 1]),
    st.sampled_from(["random", "random", "data", "replicate"]),
    st.integers(0, 2**32 - 1),
)
def test_random_programs_under_random_plans_equal_the_oracle(
    gen: GeneratedProgram, n: int, strategy: str, seed: int
) -> None:
    """Random programs (every aggregation, guards, index expressions, several rules per relation)
    on 1 to 4 logical devices: f64 outputs equal the brute-force oracle's, presence exactly."""
    prog = gen.compile()
    try:
        plan = edatalog.plan(prog, topology=f"cpux{n}", strategy=strategy, seed=seed)
    except edatalog.EdlError:
        assume(False)  # the data strategy needs an input with an axis to split
        raise
    params, inputs = _split(prog, gen.inputs)
    exe = edatalog.executable(prog, plan, backend="torch", device="cpu")
    exe.load(params)
    exe.run(inputs)  # interpreted; the second call is traced (the interpreter's run, recorded)
    exe.run(inputs)
    out = exe.run(inputs)  # the simplified graph, replayed
    assert isinstance(exe._impl, CompiledExecutable) and exe._impl._replayed
    assert set(out.values) == set(gen.outputs)
    for name in gen.outputs:
        data, present = gen.expected[name]
        got, got_present = out.values[name], out.present[name]
        assert isinstance(got, torch.Tensor), name
        mask = np.ones(data.shape, dtype=bool) if got_present is None else got_present.numpy()
        assert np.array_equal(mask, present), f"{name}: presence"
        values = got.numpy().astype(np.float64)
        np.testing.assert_allclose(values[present], data[present], rtol=F64_RTOL, atol=F64_ATOL, err_msg=name)
        assert np.all(values[~present] == 0), f"{name}: absent cells must read 0"


# -- CUDA: logical devices on one GPU --------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["megatron", "random", "data"])
def test_logical_devices_on_one_gpu(strategy: str) -> None:
    prog = _llama("gqa")
    plan = edatalog.plan(prog, topology="a100x4", strategy=strategy, seed=2)
    exe = _executable(prog, plan, _values("gqa"), "cuda")
    out = exe(_split(prog, _values("gqa"))[1])["y"]
    assert out.is_cuda
    _assert_f32_close(out.cpu(), _reference("gqa")["y"], f"{strategy} on one GPU")
    exe = _executable(prog, plan, _values("gqa"), ["cuda:0", "cpu", "cuda:0", "cpu"])
    _assert_f32_close(exe(_split(prog, _values("gqa"))[1])["y"].cpu(), _reference("gqa")["y"], "cuda and cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["megatron", "random"])
def test_logical_devices_on_two_gpus_copy_on_their_own_streams(strategy: str) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    prog = _llama("gqa")
    plan = edatalog.plan(prog, topology="a100x2", strategy=strategy, seed=2)
    exe = _executable(prog, plan, _values("gqa"), ["cuda:0", "cuda:1"])
    for _ in range(3):  # again and again: copies of one call must not race the next call's kernels
        _assert_f32_close(exe(_split(prog, _values("gqa"))[1])["y"].cpu(), _reference("gqa")["y"], strategy)
    streams = exe._impl.copy_streams  # type: ignore[attr-defined]
    assert {(gpu.type, gpu.index) for gpu in streams} == {("cuda", 0), ("cuda", 1)}
    assert all(s != torch.cuda.current_stream(gpu) for gpu, s in streams.items())


def test_devices_by_name_one_for_all_or_one_each() -> None:
    from edatalog.backend.running.torch_runtime import torch_devices

    cpu = torch.device("cpu")
    assert torch_devices("cpu", 3) == [cpu] * 3
    assert torch_devices("cpu, cpu", 2) == torch_devices(["cpu", "cpu"], 2) == [cpu, cpu]  # as --device takes them
    with pytest.raises(edatalog.EdlError, match="the plan has 2 devices, but 3 torch devices were given"):
        torch_devices("cpu,cpu,cpu", 2)
    with pytest.raises(edatalog.EdlError, match="'gpu' is not a torch device"):
        torch_devices("gpu", 1)
