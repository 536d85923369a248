"""The ranks that ``tests/backend/test_spmd.py`` starts: one job of N processes runs many cases.

Starting processes costs seconds, so one job does all the work of one process count: every rank
compiles each case's program, loads its plan, builds the SPMD executable, loads the params (from a
dict, and from a safetensors file while recording which slices are read), runs it gathered and not
gathered, and returns what it got as numpy arrays; the test compares them with the reference.
Each executable runs four calls of one signature: the first interpreted, the second recorded (the
compiled runtime's segments), the last two replayed; ``whole`` and ``local`` are the replays'.
Then the ranks try plans that must be refused: different programs or plans on different ranks
(agreement), and a plan for another number of devices.

The test runs this module in a subprocess, so that a hang fails the test by its timeout instead of
hanging pytest, and so that the launcher's signal handlers stay out of pytest::

    python -c "from tests.backend.spmd_ranks import main; main()" JOB.pkl RESULT.pkl

which starts the job's ranks with :func:`edatalog.backend.running.launch.spawn` (the entry point, pickled
into the new processes, must be a module-level function: :func:`rank_main`).
"""

from __future__ import annotations

import pickle
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Case:
    """One program at some dims with one plan; values in a .npz file (inputs and params), and,
    with ``weights``, the params in a safetensors file too."""

    name: str
    source: str
    dims: dict[str, int]
    plan: str
    values: str
    weights: str | None = None


@dataclass(frozen=True)
class Job:
    """What every rank runs.  ``mismatched[k][r]`` is rank r's case of agreement check k: the
    ranks hold different programs or plans, and each must get an error.  ``wrong_size`` is a plan
    for another number of devices than the job has ranks, which ``edl run`` must refuse."""

    nproc: int
    cases: tuple[Case, ...]
    mismatched: tuple[tuple[Case, ...], ...] = ()
    wrong_size: Case | None = None


@dataclass
class Got:
    """What one rank got for one case: the outputs gathered (``whole``, with which cells exist:
    None for all) and not gathered (``local``); the outputs after loading the params from the
    safetensors file, whether the blocks it kept equal those loaded from the dict, every read of
    the file (``(name, ranges)``, ranges None for a whole tensor) and the (param, ranges) that this
    rank's program loads.  ``interpreted`` is the first (interpreted) call's outputs, gathered;
    ``replayed`` whether the last calls ran as recorded graphs."""

    whole: dict[str, np.ndarray]
    present: dict[str, np.ndarray | None]
    local: dict[str, np.ndarray]
    local_present: dict[str, np.ndarray | None]
    from_file: dict[str, np.ndarray] | None = None
    same_blocks: bool | None = None
    reads: list[tuple[str, Ranges | None]] = field(default_factory=list)
    loads: list[tuple[str, Ranges]] = field(default_factory=list)
    interpreted: dict[str, np.ndarray] = field(default_factory=dict)
    replayed: bool = False


@dataclass
class RankResult:
    rank: int
    world: int
    got: dict[str, Got]
    refused: dict[str, str]  # the error each case that must be refused raised here (empty: none)


def rank_main(job: Job) -> RankResult:
    """One rank: join the group, run every case, then the cases that must be refused."""
    import torch

    import edatalog
    from edatalog.backend.running.spmd import init_group

    warnings.simplefilter("ignore")  # generated programs warn (unused params, ...): not under test here
    torch.set_num_threads(1)  # one thread per rank: the ranks share this machine's cores
    init_group("cpu")
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    programs: dict[tuple[str, str], edatalog.Program] = {}

    def program(case: Case) -> edatalog.Program:
        key = (case.source, repr(sorted(case.dims.items())))
        if key not in programs:
            programs[key] = edatalog.compile(case.source, dims=case.dims)
        return programs[key]

    got = {case.name: _run_case(program(case), case) for case in job.cases}
    refused = {f"mismatch{k}": _refusal(program(cases[rank]), cases[rank]) for k, cases in enumerate(job.mismatched)}
    if job.wrong_size is not None:
        refused["wrong_size"] = _cli_refusal(job.wrong_size)
    dist.barrier()
    return RankResult(rank, world, got, refused)


def _run_case(prog: Any, case: Case) -> Got:
    import edatalog
    from edatalog.backend.kernels.arrays import TORCH
    from edatalog.backend.running.segments import CompiledSpmdExecutable
    from edatalog.ir import program as ir

    plan = edatalog.load_plan(case.plan, prog)
    values = dict(np.load(case.values))
    params = {r.name for r in prog.arguments if r.kind == "param"}
    inputs = {k: v for k, v in values.items() if k not in params}
    exe = edatalog.executable(prog, plan, backend="torch")
    exe.load({k: v for k, v in values.items() if k in params})
    impl = exe._impl
    assert isinstance(impl, CompiledSpmdExecutable)
    interpreted = exe.run(inputs)
    exe.run(inputs, gather=False)  # recorded
    whole = exe.run(inputs)
    replayed = impl._replayed
    local = exe.run(inputs, gather=False)
    got = Got(
        {k: TORCH.to_numpy(v) for k, v in whole.values.items()},
        {k: None if p is None else TORCH.to_numpy(p) for k, p in whole.present.items()},
        {k: TORCH.to_numpy(v) for k, v in local.values.items()},
        {k: None if p is None else TORCH.to_numpy(p) for k, p in local.present.items()},
        interpreted={k: TORCH.to_numpy(v) for k, v in interpreted.values.items()},
        replayed=replayed and impl._replayed,
    )
    if case.weights is not None:
        from_file = edatalog.executable(prog, plan, backend="torch")
        with _recording_reads() as reads:
            from_file.load(case.weights)
        got.from_file = {k: TORCH.to_numpy(v) for k, v in from_file(inputs).items()}
        got.reads = reads
        mine, theirs = impl.eager, from_file._impl  # the blocks each rank keeps
        assert isinstance(theirs, CompiledSpmdExecutable)
        theirs = theirs.eager
        got.same_blocks = mine.blocks.keys() == theirs.blocks.keys() and all(
            bool((mine.blocks[b] == theirs.blocks[b]).all()) for b in mine.blocks
        )
        got.loads = [
            (op.relation, tuple((a[0][0], a[-1][1]) for a in op.region.axes))
            for op in mine.program.ops
            if isinstance(op, ir.Load) and op.relation in params
        ]
    return got


def _refusal(prog: Any, case: Case) -> str:
    """The error building this case's executable raises here ("" if it builds)."""
    import edatalog

    try:
        edatalog.executable(prog, edatalog.load_plan(case.plan, prog), backend="torch")
    except edatalog.EdlError as exc:
        return str(exc)
    return ""


def _cli_refusal(case: Case) -> str:
    """The error ``edl run`` raises on this rank of a torchrun job given this case's plan ("" if none)."""
    from edatalog.cli import torch_run
    from edatalog.errors import EdlError

    job = torch_run.Job(case.source, case.dims, {}, None, case.plan, None, 0, "cpu", 1, 0, False)
    try:
        torch_run.rank_main(job)
    except EdlError as exc:
        return str(exc)
    return ""


@contextmanager
def _recording_reads() -> Iterator[list[tuple[str, Ranges | None]]]:
    """Every tensor (None) or slice (its ranges) read through ``safetensors.safe_open`` inside."""
    import safetensors

    real = safetensors.safe_open
    reads: list[tuple[str, Ranges | None]] = []

    class Slice:
        def __init__(self, name: str, inner: Any) -> None:
            self.name, self.inner = name, inner

        def get_shape(self) -> list[int]:
            return list(self.inner.get_shape())

        def get_dtype(self) -> str:
            return str(self.inner.get_dtype())

        def __getitem__(self, key: Any) -> Any:
            keys = key if isinstance(key, tuple) else (key,)
            shape = self.get_shape()
            reads.append((self.name, tuple(k.indices(n)[:2] for k, n in zip(keys, shape, strict=True))))
            return self.inner[key]

    class File:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner: Any = real(*args, **kwargs)

        def __enter__(self) -> File:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.inner.keys())

        def get_slice(self, name: str) -> Slice:
            return Slice(name, self.inner.get_slice(name))

        def get_tensor(self, name: str) -> Any:
            reads.append((name, None))
            return self.inner.get_tensor(name)

    safetensors.safe_open = File  # type: ignore[misc, assignment]  # executable.py and spmd.py import it per call
    try:
        yield reads
    finally:
        safetensors.safe_open = real  # type: ignore[misc]


def main() -> None:
    """``JOB.pkl RESULT.pkl``: run the job's ranks; the result is each rank's :class:`RankResult`,
    or the text of the error the launcher raised."""
    from edatalog.backend.running.launch import spawn
    from edatalog.errors import EdlError

    job_path, result_path = sys.argv[1:3]
    with open(job_path, "rb") as fh:
        job = pickle.load(fh)
    result: dict[int, RankResult] | str
    try:
        result = spawn(job.nproc, rank_main, (job,))
    except EdlError as exc:
        result = str(exc)
    with open(result_path, "wb") as fh:
        pickle.dump(result, fh)
