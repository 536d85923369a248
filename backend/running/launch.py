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

import atexit
import contextlib
import functools
import logging
import os
import pickle
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from edatalog.errors import EdlError, show_notices

T = TypeVar("T")

MONITOR_SECONDS = 0.1  # how often the launcher looks for a failed rank
# How long the ranks may take to exit after SIGTERM when this process is told to stop (SIGTERM,
# SIGINT), before the launcher kills them (torch's default is 30 s).  When a rank fails, torch
# 2.13's agent ignores it and waits 30 s (LocalElasticAgent._stop_workers calls _shutdown()
# with its default timeout): only a rank that SIGTERM cannot end, a stopped one, waits that long.
SHUTDOWN_SECONDS = 3
# How long a rank that lost its connection to another waits before it fails: the launcher, which
# reports the first rank it sees fail, then sees the rank that died (the cause), not this one.
LINGER_SECONDS = 3.0
# What gloo says when the rank at the other end of a connection is gone.
_LOST_PEER = re.compile(r"by peer|broken pipe|socket closed|connection closed", re.IGNORECASE)


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
    from torch.distributed.elastic.multiprocessing.api import SignalException
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
        shutdown_timeout=SHUTDOWN_SECONDS,
        start_method="spawn",
    )
    names = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing.spawn")
    quiet = [logging.getLogger(name) for name in names]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.CRITICAL)  # the failure is reported once, below, not as launcher logs
    try:
        rank = functools.update_wrapper(functools.partial(_spawned_rank, entry), entry)  # the launcher logs its name
        results = elastic_launch(config, rank)(*args)
        return {r: pickle.loads(pickled) for r, pickled in results.items()}  # from the ranks it started
    except ChildFailedError as exc:
        raise EdlError(_failure_text(exc, nproc), help=_failure_help(exc)) from None
    except SignalException as exc:  # the launcher's handler: this process was told to stop
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise EdlError(
            f"the job of {nproc} processes was stopped by {signal.Signals(exc.sigval).name}",
            help="the signal came to this process, not from a rank; the ranks were stopped too",
        ) from None
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)


def as_rank(entry: Callable[..., T], *args: Any) -> T:
    """``entry(*args)`` as one rank of a job: an error that says another rank is gone waits
    :data:`LINGER_SECONDS` before it is raised, so that the launcher (this module's or torchrun's)
    reports the rank that died and why, not each rank that lost it.  After a return the rank
    leaves the group (:func:`leave_group`), and its process can end without torch.distributed's
    C++ teardown (:func:`rank_exit`); after an error it exits without tearing the group down
    (:func:`_exit_without_teardown`)."""
    global _FINISHED
    show_notices("rank 0")  # a rank's long compile is said once, by the first rank
    try:
        result = entry(*args)
        leave_group()  # its barrier fails too where a rank died after its work
    except BaseException as exc:
        if isinstance(exc, RuntimeError) and _LOST_PEER.search(str(exc)):
            time.sleep(LINGER_SECONDS)  # the launcher stops this rank meanwhile
        _exit_without_teardown(130 if isinstance(exc, KeyboardInterrupt) else 1)
        raise
    _FINISHED = True
    return result


def rank_exit(code: int) -> int:
    """``code``, the exit code of a process that ran as a rank (:func:`as_rank`) and has nothing
    left to do but return it (``edl run`` under torchrun, once it has printed and written its
    outputs; :func:`spawn`'s ranks, once their result is ready to go back): the process then
    ends with it at exit, after the other exit handlers and without torch.distributed's C++
    teardown (:func:`_end_after_handlers`).  Elsewhere it changes nothing."""
    global _ENDING
    if _FINISHED:
        _ENDING = code
    return code


def _spawned_rank(entry: Callable[..., T], *args: Any) -> bytes:
    """A rank of :func:`spawn`: its result goes back pickled here, so that torch's launcher,
    which then puts it on a queue, cannot fail to (a result that does not pickle fails the rank
    now, with its error) and the process may end without the teardown."""
    result = pickle.dumps(as_rank(entry, *args))
    rank_exit(0)
    return result


def _exit_without_teardown(code: int) -> None:
    """Once this rank has failed, end its process as soon as Python has reported the error (the
    launcher's error file, edl's message), skipping the C++ teardown of its torch.distributed
    group: a gloo group whose peer hung or died can abort in its destructor ("terminate called
    without an active exception"), and the launcher would then report a signal, not the error."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        atexit.register(_exit_now, code)  # runs first: handlers run last-registered first


_FINISHED = False  # this process ran as a rank, which returned and left its group
_ENDING: int | None = None  # ... and then had only this exit code left to return


def _end_after_handlers() -> None:
    """The last exit handler (registered when this module is imported, so after the handlers of
    everything imported later: a compile worker pool's shutdown, say) of a rank that finished:
    its process ends there, before torch.distributed's C++ teardown.  Even after every rank
    finished and left the group, that teardown can abort under load ("terminate called without
    an active exception": one exit in about forty of a 2 x 2-rank ``torchrun --nnodes 2`` job
    on a busy 2-core machine); the launcher then fails the job, or waits for the aborted node's
    agent until its exit barrier times out."""
    if _ENDING is not None:
        _exit_now(_ENDING)


atexit.register(_end_after_handlers)


def _exit_now(code: int) -> None:
    logging.shutdown()  # registered before this module's handler, it would not run
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # what was printed cannot be written: fail, as Python exits then
        code = code or 120
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(code)


def leave_group() -> None:
    """End this rank's part in the job's torch.distributed group, if it joined one: wait for the
    other ranks, then destroy the group.  A process that exits with its gloo group alive can
    abort in the group's destructor ("terminate called without an active exception"; seen under
    load), which the launcher reports as a failed job although every rank finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _failure_text(exc: Any, nproc: int) -> str:
    """Which ranks failed and why: a user's error (an EdlError raised on a rank) as it reads in
    one process (its location, cell and rule), once for the ranks that raised the same."""
    failures = dict(exc.failures)
    said: dict[str, list[int]] = {}
    for rank in sorted(failures):
        f = failures[rank]
        why = f"signal {f.signal_name()}" if f.exitcode < 0 else f"exit code {f.exitcode}"
        user = _user_error(_message(f))
        detail = user[0] if user is not None else _last_line(_message(f))
        said.setdefault(f"({why})" + (f": {detail}" if detail else ""), []).append(rank)
    lines = [f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))} failed {text}" for text, r in said.items()]
    return f"the job of {nproc} processes stopped: " + "; ".join(lines)


def _user_error(message: str) -> tuple[str, str | None] | None:
    """An EdlError's error line and help line, from a rank's message (``EdlError: FILE:L:C: error:
    ...``, its source snippet, ``help: ...``); None for any other error."""
    text = message.strip()
    if not text.startswith("EdlError: "):
        return None
    lines = text.removeprefix("EdlError: ").splitlines()
    help_line = next((ln.strip().removeprefix("help: ") for ln in lines if ln.strip().startswith("help: ")), None)
    return lines[0].strip().replace(" error: ", " ", 1) if lines else "", help_line


def _failure_help(exc: Any) -> str:
    failures = dict(exc.failures)
    helps = [u[1] for f in failures.values() if (u := _user_error(_message(f))) is not None and u[1]]
    if helps:
        return helps[0]
    if any(f.exitcode < 0 for f in failures.values()):
        return "a rank was killed (out of memory, or by a signal); the other ranks were stopped"
    if any(TIMED_OUT.search(_message(f)) for f in failures.values()):
        return (
            "a rank waited longer than the group's timeout (EDL_DIST_TIMEOUT, in seconds) for another "
            "rank that did not answer: it hung, or is far slower; the other ranks were stopped"
        )
    return "the other ranks were stopped; run again with one process (--nproc 1) to see the error alone"


TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)  # what torch.distributed says of a wait too long


def _message(failure: Any) -> str:
    """A failed rank's error: a raised exception comes as {"message": "ValueError: ...",
    "extraInfo": {traceback}}."""
    message = failure.message
    return str(message.get("message", "")) if isinstance(message, dict) else str(message)


def _last_line(message: str) -> str:
    text = message.strip().splitlines()
    return text[-1].strip() if text else ""
