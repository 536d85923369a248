"""The baselines' all-reduces between CPU ranks of one machine, run as edatalog's runtime runs its own.

edatalog's torch runtime all-reduces among gloo ranks of one machine through shared memory
(:mod:`edatalog.backend.running.shm_all_reduce`), 7-10x faster than gloo's ``all_reduce``
between busy CPU ranks.  A baseline gets every trick edatalog gets: :func:`route` sets up the
same segment for a process group and

- returns an ``all_reduce(tensor)`` for hand-written programs (in place, as
  ``dist.all_reduce``), which :func:`ddp_comm_hook` makes DDP's gradient all-reduce;
- re-registers the CPU kernel of torch's functional all-reduce (``_c10d_functional::all_reduce``,
  what DTensor's row-parallel layers call) so that a sum over any group routed here takes its
  segment too, and gloo's own for any other group or reduction.  The result is complete when the kernel
  returns; torch's ``wait_tensor`` on it finds no pending work and returns it.

Where the ranks cannot share memory (not one machine, not x86-64), :func:`route` returns None
and every baseline keeps gloo's, as edatalog's runtime does then.

  reduce = route(dist.group.WORLD, timeout=900)   # every rank of the group, once
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

_LIBRARY: list[Any] = []  # the kernel override, made once and kept alive


def route(group: Any, timeout: float) -> Callable[[Any], Any] | None:
    """Set up the shared-memory all-reduce for ``group`` (a collective of its members) and route
    the functional all-reduce over it there; returns the in-place all-reduce, or None."""
    from edatalog.backend.running import shm_all_reduce as shm

    if not shm.register(group, timeout):
        return None
    _override()
    name = group.group_name

    def all_reduce(tensor: Any) -> Any:
        return shm.shm_all_reduce_(tensor, "sum", name)

    return all_reduce


def _override() -> None:
    """Re-register the CPU kernel of torch's functional all-reduce (once): a sum over any group
    routed here goes through shared memory, anything else to gloo's in-place op."""
    if _LIBRARY:
        return
    import torch

    from edatalog.backend.running import shm_all_reduce as shm

    functional = torch.ops._c10d_functional
    gloo_all_reduce = functional.all_reduce_.default  # the in-place op keeps gloo's kernel

    def functional_all_reduce(tensor: Any, reduce_op: str, group_name: str) -> Any:
        out = tensor.clone(memory_format=torch.contiguous_format)
        if shm.registered(group_name) and reduce_op.lower() == "sum":
            return shm.shm_all_reduce_(out, "sum", group_name)
        gloo_all_reduce(out, reduce_op, group_name)
        return functional.wait_tensor.default(out)

    library = torch.library.Library("_c10d_functional", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": the point
        library.impl("all_reduce", functional_all_reduce, "CPU")
    _LIBRARY.append(library)


def ddp_comm_hook(all_reduce: Callable[[Any], Any], world: int) -> Callable[[Any, Any], Any]:
    """A DDP communication hook that averages each gradient bucket with ``all_reduce`` (from
    :func:`route`), as DDP's default hook does with gloo's: divided by the ranks, then summed.
    It returns a completed future: the all-reduce runs in the backward's thread, where DDP's
    own overlaps gloo's with the rest of the backward.  (A lambda: DDP rejects a hook whose
    ``bucket`` is annotated other than as its class, and annotations here are strings.)"""
    return lambda state, bucket: _averaged(bucket.buffer(), all_reduce, world)


def _averaged(buffer: Any, all_reduce: Callable[[Any], Any], world: int) -> Any:
    import torch

    buffer.div_(world)
    all_reduce(buffer)
    done: Any = torch.futures.Future()
    done.set_result(buffer)
    return done
