"""The torch runtime across processes (:mod:`edatalog.backend.running.spmd`): rank r of a gloo group runs
device r's program, on 2 and 3 processes of this machine, one thread each.

The bar of the runtime issue:

- every strategy's plan (replicate, data, megatron, megatron-sp, random, auto) equals the reference on every
  rank, for LLaMA blocks with multi-head and grouped-query attention (f32, to 1e-4) and for random
  programs of :mod:`tests.strategies` (f64, against its brute-force oracle);
- every rank gets every output whole; ``gather=False`` gives the rank's pieces, the rest absent;
- params loaded from a safetensors file are read in the rank's slices only, and equal the dict's;
- ranks holding different programs or plans all get an error, never a hang;
- ``edl run --backend torch --nproc N`` and ``torchrun --nproc-per-node N -m edatalog.cli run``
  run a plan and report measured and predicted times;
- a rank killed mid-run ends ``edl run --nproc 2`` with a non-zero exit and a message naming the
  rank within 60 s; a rank that hangs ends it after the group's timeout (``EDL_DIST_TIMEOUT``).

Starting processes costs seconds, so all the cases of one process count run in one job
(:mod:`tests.backend.spmd_ranks`; a module fixture), and the tests below read its results.  Every
job runs in a subprocess with a timeout: a hang fails a test, it never hangs the suite.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from safetensors.numpy import save_file

import edatalog
from edatalog.ir import dtypes
from edatalog.ir.regions import Region
from tests.backend.spmd_ranks import Case, Got, Job, RankResult
from tests.strategies import GeneratedProgram, programs

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "programs" / "llama_block.edl"
# Small blocks: a few milliseconds a call.  B = 2 gives the data strategy a batch to split; 4 query
# heads split over 3 ranks unevenly; GQA shares each key/value head between 2 query heads.
DIMS = {"B": 2, "S": 8, "D": 32, "H": 4, "F": 48}
HEADS = {"mha": 4, "gqa": 2}
LLAMA_PLANS = ("replicate", "data", "megatron", "megatron-sp", "random", "auto")
RANDOM_PLANS = ("replicate", "data", "random", "random", "auto")  # two random plans: two seeds
F32_RTOL, F32_ATOL = 1e-4, 1e-5
F64_RTOL, F64_ATOL = 1e-9, 1e-12
TIMEOUT = 30  # EDL_DIST_TIMEOUT of the jobs: the longest a rank waits for another
JOB_SECONDS = 300  # a job that takes longer hangs: its test fails


def _python_tool(name: str, module: str) -> list[str]:
    """The venv's console script ``name``, or ``python -m module``."""
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


EDL = _python_tool("edl", "edatalog.cli")
TORCHRUN = _python_tool("torchrun", "torch.distributed.run")


def _run(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session; past ``timeout`` it is killed with its ranks, and the test fails."""
    proc = subprocess.Popen(
        list(cmd), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not end in {timeout} s:\n{out[-2000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "EDL_DIST_TIMEOUT": str(TIMEOUT), "OMP_NUM_THREADS": "1", **extra}


# -- the programs and their references ------------------------------------------------------------------


@dataclass
class Expected:
    """A case as the test sees it: its plan, and each output's reference cells and presence."""

    case: Case
    plan: edatalog.Plan
    want: dict[str, tuple[np.ndarray, np.ndarray]]  # output -> (cells, present)
    f64: bool


def _llama(heads: str) -> edatalog.Program:
    return edatalog.compile(LLAMA, dims={**DIMS, "KVH": HEADS[heads]})


class _Enough(Exception):
    """Raised by the draw once it has what it needs: hypothesis stops generating."""


def _shape(gen: GeneratedProgram) -> tuple[Any, ...]:
    """What tells programs apart for this test: their relations and rules."""
    return tuple((r.name, r.shape) for r in gen.spec.relations), len(gen.spec.rules)


@functools.cache
def _random_programs(count: int) -> tuple[GeneratedProgram, ...]:
    """The first ``count`` distinct programs of a derandomized run of :func:`tests.strategies.programs`
    with three rules or more, reading an input and a param, and 16 output cells or more: the same
    programs on every run."""
    chosen: list[GeneratedProgram] = []

    @settings(
        max_examples=4000,  # what is drawn depends on the process (modules imported before): room to spare
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        verbosity=Verbosity.quiet,
        suppress_health_check=list(HealthCheck),
    )
    @given(programs())
    def draw(gen: GeneratedProgram) -> None:
        cells = sum(int(gen.expected[o][1].sum()) for o in gen.outputs)
        read = {a.rel for rule in gen.spec.rules for a in rule.atoms}
        kinds = {r.kind for r in gen.spec.relations if r.shape and r.name in read}
        rich = len(gen.spec.rules) >= 3 and {"input", "param"} <= kinds and cells >= 16
        if rich and len(chosen) < count and all(_shape(gen) != _shape(c) for c in chosen):
            chosen.append(gen)
        if len(chosen) == count:
            raise _Enough

    try:
        draw()
    except _Enough:
        return tuple(chosen)
    raise AssertionError(f"fewer than {count} rich programs among 4000 drawn")


def _plans(prog: edatalog.Program, n: int, strategies: Sequence[str]) -> Iterator[tuple[str, edatalog.Plan]]:
    seeds: dict[str, int] = {}
    for strategy in strategies:
        seed = seeds[strategy] = seeds.get(strategy, -1) + 1
        label = f"{strategy}{seed}" if strategies.count(strategy) > 1 else strategy
        yield label, edatalog.plan(prog, topology=f"cpux{n}", strategy=strategy, seed=seed + 10 * n, time_limit=1.0)


def _save_values(path: Path, values: dict[str, np.ndarray]) -> str:
    np.savez(path, **values)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle
    return str(path)


def _cases(n: int, tmp: Path) -> list[Expected]:
    out: list[Expected] = []
    for heads in HEADS:
        prog = _llama(heads)
        values = prog.random_inputs(seed=1)
        reference = prog.run(values)
        want = {name: (a, np.ones(a.shape, dtype=bool)) for name, a in reference.items()}
        npz = _save_values(tmp / f"{heads}.npz", values)
        weights = tmp / f"{heads}.safetensors"
        save_file({r.name: values[r.name] for r in prog.arguments if r.kind == "param"}, str(weights))
        for label, plan in _plans(prog, n, LLAMA_PLANS):
            path = tmp / f"{heads}-{label}.json"
            plan.save(path)
            # The weights file is read by the plans that split the params and by the random ones.
            file = str(weights) if label in ("megatron", "random") else None
            case = Case(f"llama-{heads}-{label}", str(LLAMA), {**DIMS, "KVH": HEADS[heads]}, str(path), npz, file)
            out.append(Expected(case, plan, want, f64=False))
    for k, gen in enumerate(_random_programs(3)):
        source = tmp / f"random{k}.edl"
        source.write_text(gen.source, encoding="utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog = edatalog.compile(source)
        npz = _save_values(tmp / f"random{k}.npz", gen.inputs)
        weights = tmp / f"random{k}.safetensors"
        save_file({r.name: gen.inputs[r.name] for r in prog.arguments if r.kind == "param"}, str(weights))
        # The oracle computes in f64; an output the program types otherwise (an index
        # expression is i64) comes in its declared type.
        want = {name: _typed(gen.expected[name], prog.graph.relation(name).dtype) for name in prog.outputs}
        for label, plan in _plans(prog, n, RANDOM_PLANS):
            path = tmp / f"random{k}-{label}.json"
            plan.save(path)
            file = str(weights) if label == "random0" else None
            out.append(Expected(Case(f"random{k}-{label}", str(source), {}, str(path), npz, file), plan, want, True))
    return out


def _typed(expected: tuple[np.ndarray, np.ndarray], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    data, present = expected
    return data.astype(dtypes.to_numpy(dtype)), present


# -- one job per process count ----------------------------------------------------------------------------


@dataclass
class Ran:
    n: int
    expected: list[Expected]
    ranks: dict[int, RankResult]
    other_size: int  # the devices of a plan for another number of ranks


def _start(job: Job, tmp: Path) -> dict[int, RankResult]:
    job_file, result_file = tmp / "job.pkl", tmp / "result.pkl"
    job_file.write_bytes(pickle.dumps(job))
    code = "from tests.backend.spmd_ranks import main; main()"
    done = _run([sys.executable, "-c", code, str(job_file), str(result_file)], JOB_SECONDS, _env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = pickle.loads(result_file.read_bytes())
    assert not isinstance(result, str), f"the job failed: {result}"
    assert isinstance(result, dict)
    return result


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ran(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Ran:
    n = request.param
    tmp = tmp_path_factory.mktemp(f"spmd{n}")
    expected = _cases(n, tmp)
    by_name = {e.case.name: e.case for e in expected}
    gqa = next(e for e in expected if e.case.name == "llama-gqa-megatron").case
    # Agreement: rank 0 holds another plan than the others; then the last rank another program
    # (the block at another sequence length, with its own plan).
    longer_dims = {**gqa.dims, "S": 2 * DIMS["S"]}
    plan_file = tmp / "longer.json"
    edatalog.plan(edatalog.compile(LLAMA, dims=longer_dims), topology=f"cpux{n}", strategy="megatron").save(plan_file)
    longer_case = Case("longer", str(LLAMA), longer_dims, str(plan_file), "")
    mismatched = (
        (by_name["llama-gqa-data"], *[gqa] * (n - 1)),
        (*[gqa] * (n - 1), longer_case),
    )
    other_size = 3 if n == 2 else 2
    wrong_file = tmp / "wrong.json"
    edatalog.plan(_llama("gqa"), topology=f"cpux{other_size}", strategy="megatron").save(wrong_file)
    wrong = Case("wrong", str(LLAMA), gqa.dims, str(wrong_file), "")
    job = Job(n, tuple(e.case for e in expected), mismatched, wrong)
    return Ran(n, expected, _start(job, tmp), other_size)


def _assert_equal(got: np.ndarray, want: np.ndarray, f64: bool, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert got.dtype == want.dtype, f"{what}: {got.dtype}, expected {want.dtype}"  # f32, f64, or an int type
    rtol, atol = (F64_RTOL, F64_ATOL) if f64 else (F32_RTOL, F32_ATOL)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def _mask(present: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    return np.ones(shape, dtype=bool) if present is None else present


def _held(plan: edatalog.Plan, name: str, rank: int, shape: tuple[int, ...]) -> np.ndarray:
    """The cells of output ``name`` that the plan leaves on ``rank``."""
    mask = np.zeros(shape, dtype=bool)
    whole = Region.whole(shape)
    for entry in plan.schedule.outputs[name]:
        if rank in entry.holders:
            mask[entry.region.at(whole)] = True
    return mask


def test_every_strategy_equals_the_reference_on_every_rank(ran: Ran) -> None:
    """Each rank gets every output whole (gathered, the default): the reference's presence, its
    values where present, 0 where absent."""
    assert sorted(ran.ranks) == list(range(ran.n)) and all(r.world == ran.n for r in ran.ranks.values())
    strategies = {e.plan.ir.strategy for e in ran.expected}
    assert strategies == {"replicate", "data", "megatron", "megatron-sp", "random", "auto"}
    assert all(e.plan.ir.n_devices == ran.n for e in ran.expected)
    for e in ran.expected:
        for rank, result in ran.ranks.items():
            got = result.got[e.case.name]
            assert set(got.whole) == set(e.want), e.case.name
            for name, (data, present) in e.want.items():
                what = f"{e.case.name}, {name} on rank {rank}"
                mask = _mask(got.present[name], data.shape)
                assert np.array_equal(mask, present), f"{what}: presence"
                _assert_equal(np.where(present, got.whole[name], 0), np.where(present, data, 0), e.f64, what)
                assert np.all(got.whole[name][~present] == 0), f"{what}: absent cells must hold 0"
                assert got.replayed, f"{e.case.name} on rank {rank}: not replayed as recorded graphs"
                first = np.where(present, got.interpreted[name], 0)
                _assert_equal(first, np.where(present, data, 0), e.f64, f"{what} (interpreted)")


def test_outputs_not_gathered_are_the_pieces_each_rank_holds(ran: Ran) -> None:
    """``gather=False``: each rank has the cells the plan leaves on it, the others absent; the
    ranks' pieces together are the whole output."""
    split = 0
    for e in ran.expected:
        for name, (data, present) in e.want.items():
            union = np.zeros(data.shape, dtype=bool)
            for rank, result in ran.ranks.items():
                got = result.got[e.case.name]
                what = f"{e.case.name}, {name} on rank {rank} (not gathered)"
                mine = _held(e.plan, name, rank, data.shape) & present
                assert np.array_equal(_mask(got.local_present[name], data.shape), mine), f"{what}: presence"
                _assert_equal(np.where(mine, got.local[name], 0), np.where(mine, data, 0), e.f64, what)
                assert np.all(got.local[name][~mine] == 0), f"{what}: absent cells must hold 0"
                union |= mine
                split += int(present.any() and not np.array_equal(mine, present))
            assert np.array_equal(union, present), f"{e.case.name}, {name}: the ranks' pieces miss cells"
    assert split, "no plan leaves an output split across the ranks"


def test_params_from_safetensors_are_read_in_the_ranks_slices(ran: Ran) -> None:
    """``exe.load(path)`` on a rank reads exactly the slices its program loads, never a whole
    tensor, and runs as the params loaded from a dict do."""
    checked = [e for e in ran.expected if e.case.weights is not None]
    assert len(checked) == 7
    smaller = 0
    for e in checked:
        shapes = {r.name: r.shape for r in e.plan.graph.relations if r.kind == "param"}
        for rank, result in ran.ranks.items():
            got: Got = result.got[e.case.name]
            what = f"{e.case.name} on rank {rank}"
            assert got.same_blocks, f"{what}: the blocks from the file differ from the dict's"
            assert got.from_file is not None and set(got.from_file) == set(got.interpreted)
            for name, value in got.from_file.items():  # both the first call: interpreted
                assert np.array_equal(value, got.interpreted[name]), f"{what}: {name}"
            assert all(ranges is not None for _, ranges in got.reads), f"{what}: a whole tensor was read"
            assert sorted(r for r in got.reads if r[0] in shapes) == sorted(got.loads), what
            for name, shape in shapes.items():
                cells = sum(int(np.prod([hi - lo for lo, hi in rng])) for p, rng in got.loads if p == name)
                smaller += int(0 < cells < int(np.prod(shape)))
    assert smaller, "no rank read a part of a param only"
    megatron = next(e for e in checked if e.case.name == "llama-mha-megatron")
    wq = {rank: [rng for p, rng in r.got[megatron.case.name].loads if p == "wq"] for rank, r in ran.ranks.items()}
    rows = sorted(rng[0] for ranges in wq.values() for rng in ranges)
    assert rows[0][0] == 0 and rows[-1][1] == 4 * 8 and len(rows) == ran.n, f"wq's rows by rank: {wq}"


def test_ranks_holding_different_plans_or_programs_all_fail(ran: Ran) -> None:
    """Agreement: a rank with another plan, or another program (other dims), is an error on every
    rank, naming the ranks that differ; ``edl run`` under torchrun refuses a plan for another
    number of devices."""
    for check, odd in (("mismatch0", 0), ("mismatch1", ran.n - 1)):
        ranks = list(range(1, ran.n)) if odd == 0 else [ran.n - 1]
        for rank, result in ran.ranks.items():
            message = result.refused[check]
            assert f"ranks {ranks} hold another program or plan than rank 0" in message, (check, rank, message)
            assert "give every rank the same .edl file" in message
    for result in ran.ranks.values():
        message = result.refused["wrong_size"]
        assert f"the plan has {ran.other_size} devices, but this job has {ran.n} ranks" in message, message


# -- the command line ------------------------------------------------------------------------------------

SMALL = ["--dim", "B=2", "--dim", "S=8", "--dim", "D=32", "--dim", "H=4", "--dim", "F=48"]


def _small(heads: str) -> list[str]:
    return [*SMALL, "--dim", f"KVH={HEADS[heads]}"]


def test_edl_run_starts_the_ranks_itself(tmp_path: Path) -> None:
    prog = _llama("gqa")
    plan_file = tmp_path / "plan.json"
    edatalog.plan(prog, topology="cpux2", strategy="megatron").save(plan_file)
    out, trace = tmp_path / "out.npz", tmp_path / "trace.json"
    cmd = [*EDL, "run", str(LLAMA), *_small("gqa"), "--plan", str(plan_file), "--backend", "torch"]
    cmd += ["--nproc", "2", "--repeat", "3", "--random", "0", "--json", "-o", str(out), "--trace", str(trace)]
    cmd += ["--collectives", "on"]  # gloo's default is off
    done = _run(cmd, 120, _env())
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["nproc"] == 2 and report["backend"] == "torch"
    assert report["measured_ms"] > 0 and report["predicted_ms"] > 0
    assert len(report["calls_ms"]) == 3 and len(report["per_rank_ms"]) == 2
    assert set(report["peak_memory"]) == {"0", "1"} and all(b > 0 for b in report["peak_memory"].values())
    want = prog.run(prog.random_inputs(0))["y"]
    got = np.load(out)["y"]
    _assert_equal(got, want, False, "edl run --nproc 2")
    assert report["outputs"]["y"]["absent"] == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}, "a measured lane for each rank"
    reduced = {e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("all_reduce")}
    assert reduced == {"all_reduce attn", "all_reduce down"}, reduced  # Megatron's two, as collectives


def test_torchrun_runs_the_cli_as_one_rank(tmp_path: Path) -> None:
    plan_file, out = tmp_path / "plan.json", tmp_path / "out.npz"
    make = [*EDL, "plan", str(LLAMA), *_small("mha"), "-s", "random", "--seed", "3", "--topology", "cpux2"]
    done = _run([*make, "-o", str(plan_file)], 120, _env())
    assert done.returncode == 0, done.stderr[-4000:]
    run = ["-m", "edatalog.cli", "run", str(LLAMA), *_small("mha"), "--plan", str(plan_file), "--backend", "torch"]
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", *run, "--random", "0", "--json", "-o", str(out)]
    done = _run(cmd, 120, _env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)  # rank 0 reports; the other rank prints nothing
    assert report["nproc"] == 2 and {"measured_ms", "predicted_ms"} <= set(report)
    prog = _llama("mha")
    _assert_equal(np.load(out)["y"], prog.run(prog.random_inputs(0))["y"], False, "torchrun")


TWO_NODES = """\
name = "2x2"
nodes = [2, 2]
[device]
kind = "CPU"
memory = "4GiB"
flops = "100GFLOPS"
bandwidth = "20GB/s"
[links.intra]
bandwidth = "2GB/s"
latency = "70us"
[links.inter]
bandwidth = "1GB/s"
latency = "100us"
"""


# A program hypothesis drew (tests.strategies): r1 is no output and nothing reads it, yet the plans
# compute it, a partial of it on each of two ranks, combined where one receives the other's.
UNREAD_PARTIAL = """\
dim N = 3, M = 4, K = 1, P = N * M.
param w0[K, M] : f64.
input x1[P] : f64.
output r0.
r0[j:M*N, i:K*M] *= (i * 2).
r1[l, k] min= ((r0[(i:6, j:2), k:M] * w0[0, (j, j)]) * (w0[l, j + 1] - x1[(j, i)])).
r1[0, 3] min= (x1[i] + 0.5) where 3*i <= i - 1.
"""


def _combined_unread(programs: Any) -> bool:
    """Whether some rank combines a received partial into a buffer that it frees unread."""
    from edatalog.ir import program as ir

    for device in programs.devices:
        received = {op.buf for op in device.ops if isinstance(op, ir.Recv)}
        for k, op in enumerate(device.ops):
            if not isinstance(op, ir.Combine) or received.isdisjoint(op.sources):
                continue
            if not any(op.buf in ir.reads(o) for o in device.ops[k + 1 :] if not isinstance(o, ir.Free)):
                return True
    return False


def test_a_received_partial_that_nothing_reads_is_taken_all_the_same(tmp_path: Path) -> None:
    """The rank that receives the partial frees the combine unread; it must take the message all
    the same, or its sender waits for it to be taken until the timeout (the job failed so)."""
    source, plan_file, out = tmp_path / "unread.edl", tmp_path / "plan.json", tmp_path / "out.npz"
    source.write_text(UNREAD_PARTIAL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rule whose guard no cell meets
        prog = edatalog.compile(source)
    plan = edatalog.plan(prog, topology="cpux3", strategy="random", seed=30)
    assert _combined_unread(plan.lowered.programs), "no rank frees a received partial unread: pick another seed"
    plan.save(plan_file)
    cmd = [*EDL, "run", str(source), "--plan", str(plan_file), "--backend", "torch", "--nproc", "3"]
    done = _run([*cmd, "--random", "0", "--json", "-o", str(out)], 120, _env(EDL_DIST_TIMEOUT="10"))
    assert done.returncode == 0, done.stderr[-4000:]
    _assert_equal(np.load(out)["r0"], prog.run(prog.random_inputs(0))["r0"], True, "r0")


def test_a_torchrun_rank_that_fails_after_its_job_exits_with_the_error(tmp_path: Path) -> None:
    """Rank 0 fails writing its outputs, after the ranks ran and left their group: torchrun's job
    fails with edl's message (a finished rank's process ends without torch.distributed's
    teardown, with the command's exit code)."""
    plan_file = tmp_path / "plan.json"
    edatalog.plan(_llama("mha"), topology="cpux2", strategy="megatron").save(plan_file)
    run = ["-m", "edatalog.cli", "run", str(LLAMA), *_small("mha"), "--plan", str(plan_file), "--backend", "torch"]
    out = tmp_path / "out.npz"
    out.mkdir()  # a directory of that name: found only when rank 0 writes
    done = _run(
        [*TORCHRUN, "--standalone", "--nproc-per-node", "2", *run, "--random", "0", "-o", str(out)], 120, _env()
    )
    assert done.returncode != 0 and "cannot write" in done.stderr, done.stderr[-4000:]


def test_torchrun_runs_a_plan_for_two_nodes_on_two_agents(tmp_path: Path) -> None:
    """``torchrun --nnodes 2``: two agents (one per node, here both on this machine) of two ranks
    each run a plan for a machine of two nodes of two devices, unchanged; rank 0 reports."""
    machine, plan_file = tmp_path / "2x2.toml", tmp_path / "plan.json"
    machine.write_text(TWO_NODES)
    prog = _llama("gqa")
    edatalog.plan(prog, topology=str(machine), strategy="megatron").save(plan_file)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "two-nodes"]
    run = ["-m", "edatalog.cli", "run", str(LLAMA), *_small("gqa"), "--plan", str(plan_file), "--backend", "torch"]
    cmd = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", *rdzv, *run, "--random", "0", "--json"]
    logs = [(tmp_path / f"agent{k}.out", tmp_path / f"agent{k}.err") for k in range(2)]
    agents = []
    for k, (out_log, err_log) in enumerate(logs):
        with out_log.open("w") as out_file, err_log.open("w") as err_file:  # the agent keeps its own copies
            agents.append(
                subprocess.Popen(
                    [*cmd, "-o", str(tmp_path / f"out{k}.npz")],
                    cwd=ROOT,
                    env={**_env(), "PYTHONFAULTHANDLER": "1"},  # a rank that aborts says where
                    stdout=out_file,
                    stderr=err_file,
                    start_new_session=True,
                )
            )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(a.poll() is None for a in agents):
        time.sleep(0.1)
    hung = [a.poll() is None for a in agents]
    for a in agents:  # both agents together: one waits at its exit barrier for the other
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
        a.wait()
    done = [(out_log.read_text(), err_log.read_text()) for out_log, err_log in logs]
    said = [
        f"agent {k}: exit {a.returncode}{' (hung)' if hung[k] else ''}\n{done[k][1][-3000:]}"
        for k, a in enumerate(agents)
    ]
    assert not any(hung) and all(a.returncode == 0 for a in agents), "\n".join(said)
    reports = [json.loads(stdout) for stdout, _ in done if stdout.strip()]
    assert len(reports) == 1 and reports[0]["nproc"] == 4  # the agent holding rank 0 reports
    out = next(p for p in (tmp_path / "out0.npz", tmp_path / "out1.npz") if p.exists())
    _assert_equal(np.load(out)["y"], prog.run(prog.random_inputs(0))["y"], False, "two nodes of two")


def test_hierarchical_collectives_equal_direct_exchanges_on_two_nodes_of_two(tmp_path: Path) -> None:
    """Megatron on 2 x 2 gloo ranks (a machine of two nodes of two), its row-parallel partials
    reduced hierarchically (a reduce-scatter inside each node, then an all-reduce of each piece
    across the nodes, each a collective call) and directly (one reduce-scatter over all four):
    both equal the reference, and each other."""
    from edatalog.ir import program as ir

    machine = tmp_path / "2x2.toml"
    machine.write_text(TWO_NODES)
    prog = _llama("gqa")
    want = prog.run(prog.random_inputs(0))["y"]
    got = {}
    for reduction in ("hierarchical", "direct"):
        plan = edatalog.plan(prog, topology=str(machine), strategy="megatron", reduction=reduction, collectives="on")
        ops = [op for _, _, op in plan.lowered.programs.ops() if isinstance(op, ir.Collective)]
        spans = {(op.kind, len({d // 2 for d in op.group}), len(op.group)) for op in ops}
        if reduction == "hierarchical":
            assert (ir.CollectiveKind.REDUCE_SCATTER, 1, 2) in spans  # inside each node
            assert (ir.CollectiveKind.ALL_REDUCE, 2, 2) in spans  # across, one rank of each node
        else:
            assert not any(op.kind is ir.CollectiveKind.REDUCE_SCATTER and len(op.group) == 2 for op in ops)
        plan_file, out = tmp_path / f"{reduction}.json", tmp_path / f"{reduction}.npz"
        plan.save(plan_file)
        run = ["-m", "edatalog.cli", "run", str(LLAMA), *_small("gqa"), "--plan", str(plan_file), "--backend", "torch"]
        cmd = [sys.executable, *run, "--nproc", "4", "--collectives", "on", "--random", "0", "-o", str(out)]
        done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=JOB_SECONDS)
        assert done.returncode == 0, done.stderr[-3000:]
        got[reduction] = np.load(out)["y"]
        _assert_equal(got[reduction], want, False, f"{reduction} reduction on 2 x 2 ranks")
    np.testing.assert_allclose(got["hierarchical"], got["direct"], rtol=F32_RTOL, atol=F32_ATOL)


# -- faults ------------------------------------------------------------------------------------------------


def _ranks_of(pid: int) -> list[tuple[int, int]]:
    """The rank processes the launcher in process ``pid`` started, in the order it started them
    (rank 0 first): its children that run multiprocessing's spawn_main, as (pid, start time)."""
    ranks = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            ppid, start, cmdline = stat
            if ppid == pid and b"spawn_main" in cmdline:
                ranks.append((int(entry.name), start))
    return sorted(ranks)


def _stat(pid: int) -> tuple[int, int, bytes] | None:
    """A process's parent, start time (clock ticks after boot) and command line; None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[19]), cmdline


def _kill_if_alive(rank: tuple[int, int]) -> None:
    """SIGKILL a rank this test started, if it is still that process (its pid not reused)."""
    stat = _stat(rank[0])
    if stat is not None and stat[1] == rank[1]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank[0], signal.SIGKILL)


def _shares_memory(pid: int) -> bool:
    """Whether the process has mapped a shared-memory segment of edatalog's (its plan's group
    made one: the ranks meet there before each call, and all-reduce there)."""
    return "/dev/shm/edatalog-" in Path(f"/proc/{pid}/maps").read_text()


def _cpu_seconds(pid: int) -> float:
    """The CPU time the process has used (user and system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _terminating(pid: int) -> bool:
    """Whether the process has a SIGTERM waiting (it is stopped: it takes it when continued)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("ShdPnd:", "SigPnd:"))]
    return any(mask & (1 << (signal.SIGTERM - 1)) for mask in pending)


@dataclass
class Fault:
    returncode: int
    stderr: str
    seconds: float  # from the signal to the end of the job


def _fault(tmp_path: Path, sig: signal.Signals, timeout: int) -> Fault:
    """Start ``edl run --nproc 2`` for many calls, wait until both ranks are running calls (each
    has mapped its group's shared memory, which it does as it builds the plan's executable, and
    has used a second of CPU since), send ``sig`` to rank 1, and wait for the job to end (a
    stopped rank is continued once SIGTERM awaits it)."""
    if not Path("/proc/self/io").exists():
        pytest.skip("needs Linux's /proc to find and watch the ranks")
    plan_file = tmp_path / "plan.json"
    edatalog.plan(_llama("gqa"), topology="cpux2", strategy="megatron").save(plan_file)
    cmd = [*EDL, "run", str(LLAMA), *_small("gqa"), "--plan", str(plan_file), "--backend", "torch"]
    cmd += ["--nproc", "2", "--repeat", "1000000", "--random", "0"]
    err_file = tmp_path / "stderr.txt"
    with err_file.open("w") as err:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=_env(EDL_DIST_TIMEOUT=str(timeout)),
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    ranks: list[tuple[int, int]] = []
    mapped: dict[int, float] = {}  # rank's pid -> its CPU seconds when first seen with the segment
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the job ended before the fault: {err_file.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the ranks did not start running calls: {ranks}"
            ranks = _ranks_of(proc.pid)
            try:
                for pid, _ in ranks:
                    if pid not in mapped and _shares_memory(pid):
                        mapped[pid] = _cpu_seconds(pid)
                if len(ranks) == 2 and all(
                    pid in mapped and _cpu_seconds(pid) - mapped[pid] >= 1.0 for pid, _ in ranks
                ):
                    break
            except OSError:
                pass
            time.sleep(0.1)
        victim = ranks[1][0]
        os.kill(victim, sig)
        start = time.monotonic()
        while sig == signal.SIGSTOP and proc.poll() is None and time.monotonic() < start + 120:
            if _terminating(victim):
                os.kill(victim, signal.SIGCONT)  # a hung rank: SIGTERM ends it
                break
            time.sleep(0.1)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end in 120 s after {sig.name} to rank 1")
        return Fault(proc.returncode, err_file.read_text(), time.monotonic() - start)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for rank in ranks:  # a stopped rank outlives the job only if the launcher failed to kill it
            _kill_if_alive(rank)


def test_a_killed_rank_ends_the_job_within_60_seconds(tmp_path: Path) -> None:
    fault = _fault(tmp_path, signal.SIGKILL, TIMEOUT)
    assert fault.returncode != 0
    assert fault.seconds < 60, f"the job took {fault.seconds:.1f} s to end"
    assert "rank 1 failed (signal SIGKILL)" in fault.stderr, fault.stderr
    assert "a rank was killed" in fault.stderr and "Traceback" not in fault.stderr, fault.stderr


def test_a_hung_rank_ends_the_job_after_the_timeout(tmp_path: Path) -> None:
    """Rank 1 hangs (SIGSTOP): rank 0 waits for its messages until the group's timeout, fails,
    and the launcher ends the job, sending SIGTERM to rank 1.  A hung rank (deadlocked, looping)
    dies of it at once; a stopped one takes it only when continued, which the test does as soon
    as the SIGTERM is pending.  (Left stopped, it would be killed 30 s later: torch 2.13's agent
    waits that long after a failure whatever its shutdown timeout; see backend/running/launch.py.)"""
    fault = _fault(tmp_path, signal.SIGSTOP, 10)
    assert fault.returncode != 0
    assert fault.seconds < 60, f"the job took {fault.seconds:.1f} s to end"
    timed_out = re.search(r"rank 0 failed \(exit code \d+\): .*(timed out|timeout)", fault.stderr, re.IGNORECASE)
    assert timed_out, fault.stderr
    assert "EDL_DIST_TIMEOUT" in fault.stderr and "Traceback" not in fault.stderr, fault.stderr
