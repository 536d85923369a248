"""Small all-reduces on gloo as pairwise exchanges (recursive doubling over blocking messages).

Why: between CPU ranks on one machine, gloo's all-reduce of a few KiB costs several times a
message's round trip.  Measured on a 2-vCPU VM (torch 2.13, 2 ranks, a loop of 4 x (40 small
matmuls, then a 2 KiB all-reduce)): 2.8-3.9 ms a loop with ``dist.all_reduce``, 1.0-1.4 ms
with the exchange below, and half the CPU time (gloo's event loop thread spends ~0.5 ms of
CPU per small all-reduce, which the other rank's kernels then wait for).  A tensor-parallel
plan of a small model meets one such all-reduce per layer and projection.

How: over a group of ``2^k`` members, ``k`` steps; at step ``s`` each member exchanges its
partial with the member whose group index differs in bit ``s`` and combines the two.  Of each
pair the lower index sends first and the higher receives first, so both messages are blocking
and none waits on a posted request (``batch_isend_irecv`` and ``isend`` + ``recv`` were slower
and noisier in the same loop).  Every member ends with the same bits: both of a pair combine
the lower index's value with the higher's, in that order (``torch.maximum(-0.0, 0.0)`` is the
second).

Which all-reduces take it is one rule shared with the cost model,
:func:`edatalog.solver.costmodel.all_reduce_route`: since ranks of one machine all-reduce
through shared memory (:mod:`edatalog.backend.running.shm_all_reduce`), those across machines,
or on a machine whose ranks cannot share memory.  A recorded graph calls it as a
custom op, ``edatalog::exchange_all_reduce`` (:func:`exchange_all_reduce_op`): one ATen-level
call the tracer records and a replay repeats, with a fresh result."""

from __future__ import annotations

import functools
from typing import Any

from edatalog.backend.kernels.arrays import torch_module
from edatalog.backend.running.fxnodes import all_reduce_op

_GROUPS: dict[str, Any] = {}  # group name -> process group, registered by the ranks' collectives


def register_group(group: Any) -> None:
    """Make ``group`` known to :func:`exchange_all_reduce_op` by its name (the op's arguments
    are tensors and strings, as a graph records them)."""
    _GROUPS[group.group_name] = group


def exchange_all_reduce_(x: Any, reduce: str, group: Any) -> Any:
    """Reduce ``x`` (contiguous) in place over ``group`` (a power-of-two number of ranks, this
    rank one of them) by pairwise exchanges; returns ``x``."""
    torch = torch_module()
    dist = torch.distributed
    ranks = dist.get_process_group_ranks(group)
    me, n = ranks.index(dist.get_rank()), len(ranks)
    if n & (n - 1):
        raise ValueError(f"an exchange all-reduce needs a power-of-two group, not {n} ranks")
    other = torch.empty_like(x)
    step = 1
    while step < n:
        partner = me ^ step
        peer = ranks[partner]
        if me < partner:
            dist.send(x, peer, group=group)
            dist.recv(other, peer, group=group)
            _combine(torch, reduce, x, other, out=x)
        else:
            dist.recv(other, peer, group=group)
            dist.send(x, peer, group=group)
            _combine(torch, reduce, other, x, out=x)
        step <<= 1
    return x


# Each reduction as the torch function that combines two values (edatalog's all-reduces share it).
COMBINE = {"sum": "add", "prod": "mul", "max": "maximum", "min": "minimum"}


def _combine(torch: Any, reduce: str, lower: Any, higher: Any, out: Any) -> None:
    """``out = lower (op) higher``, the lower group index's value first on both of a pair."""
    name = COMBINE.get(reduce)
    if name is None:
        raise ValueError(f"no exchange all-reduce for the reduction {reduce!r}")
    getattr(torch, name)(lower, higher, out=out)


def exchange_all_reduce(x: Any, reduce: str, group: str) -> Any:
    """The reduction of ``x`` over the registered group ``group`` (its name) as a fresh tensor,
    ``x`` left as it was: what a recorded graph calls (:func:`exchange_all_reduce_op`, or this
    function directly)."""
    torch = torch_module()
    return exchange_all_reduce_(x.clone(memory_format=torch.contiguous_format), reduce, _GROUPS[group])


@functools.cache
def exchange_all_reduce_op() -> Any:
    """``edatalog::exchange_all_reduce(Tensor x, str reduce, str group) -> Tensor``: as
    :func:`exchange_all_reduce`, an op that a graph records
    (:func:`~edatalog.backend.running.fxnodes.all_reduce_op`)."""
    return all_reduce_op("exchange_all_reduce", exchange_all_reduce)
