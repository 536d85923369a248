"""Starting SPMD jobs: N processes on this machine, each a rank of one torch.distributed group.

``edl run --nproc N`` and ``edl calibrate --nproc N`` start their ranks themselves, with torch's
elastic launcher (what ``torchrun`` runs), so that a user never writes a launch script.  A rank
that fails or dies makes the launcher stop the others and raise; :func:`spawn` turns that into
one :class:`EdlError` naming the ranks, their exit codes and the first error, never a hang and
never a screen of launcher logs.  Under ``torchrun`` itself (``torchrun --nproc-per-node N -m
edatalog.cli run ...``) nothing is started: :func:`in_spmd_job` says so and the ranks are this
process and its siblings.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from edatalog.errors import EdlError

T = TypeVar("T")

MONITOR_SECONDS = 0.1  # how often the launcher looks for a failed rank


def in_spmd_job() -> bool:
    """Whether this process is a rank of a job started by torchrun (or by :func:`spawn`)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def spawn(nproc: int, entry: Callable[..., T], args: Sequence[Any] = ()) -> dict[int, T]:
    """Run ``entry(*args)`` in ``nproc`` new processes on this machine, as ranks 0..nproc-1 of
    one job (the ``RANK``/``WORLD_SIZE``/``MASTER_*`` environment is set for
    ``torch.distributed.init_process_group``); returns each rank's return value.  ``entry`` must
    be a module-level function (it is pickled into the new processes)."""
    if nproc < 1:
        raise EdlError(f"--nproc must be at least 1, not {nproc}")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"edatalog-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port
        max_restarts=0,  # a failed rank ends the job: its work cannot be redone alone
        monitor_interval=MONITOR_SECONDS,
        start_method="spawn",
    )
    names = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing.spawn")
    quiet = [logging.getLogger(name) for name in names]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.CRITICAL)  # the failure is reported once, below, not as launcher logs
    try:
        return dict(elastic_launch(config, entry)(*args))
    except ChildFailedError as exc:
        raise EdlError(_failure_text(exc, nproc), help=_failure_help(exc)) from None
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)


def _failure_text(exc: Any, nproc: int) -> str:
    failures = dict(exc.failures)
    lines = []
    for rank in sorted(failures):
        f = failures[rank]
        why = f"signal {f.signal_name()}" if f.exitcode < 0 else f"exit code {f.exitcode}"
        # A raised exception comes as {"message": "ValueError: ...", "extraInfo": {traceback}}.
        message = f.message.get("message", "") if isinstance(f.message, dict) else str(f.message)
        detail = _last_line(message)
        lines.append(f"rank {rank} failed ({why})" + (f": {detail}" if detail else ""))
    return f"the job of {nproc} processes stopped: " + "; ".join(lines)


def _failure_help(exc: Any) -> str:
    failures = dict(exc.failures)
    if any(f.exitcode < 0 for f in failures.values()):
        return "a rank was killed (out of memory, or by a signal); the other ranks were stopped"
    return "the other ranks were stopped; run again with one process (--nproc 1) to see the error alone"


def _last_line(message: str) -> str:
    text = message.strip().splitlines()
    return text[-1].strip() if text else ""
