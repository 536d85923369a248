"""All-reduces between gloo ranks of one machine through shared memory
(:mod:`edatalog.backend.running.shm_all_reduce`).

On 2 and 4 gloo ranks: every reduction of f32, i64 and bool-as-bytes tensors against
``dist.all_reduce`` of the same values, equal (to rounding for a sum or product of four f32
partials, taken in another order) and the same bits on every rank; a tensor larger than a slot
(by chunks, the sets of slots used in turn); the custom op and its direct call from a replayed
graph, fresh results, never dead code.  A rank that never comes ends its peers' wait with an
error that names it, within the timeout.  Plans run on it end to end in ``test_collectives.py``
and the SPMD runtime tests: the runtime takes it for every all-reduce between gloo ranks of one
machine (:func:`edatalog.solver.costmodel.all_reduce_route`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.backend.all_reduce_ops import check_against_gloo, check_op_results, op_checks

REDUCTIONS = ("sum", "prod", "max", "min")


def shm_rank(slot_bytes: int) -> dict[str, Any]:
    """One rank (spawned): each reduction through shared memory and by gloo; a tensor of several
    chunks; the custom op eager, recorded, replayed and called directly."""
    import torch
    import torch.distributed as dist

    from edatalog.backend.running import shm_all_reduce as shm
    from edatalog.backend.running.spmd import init_group

    torch.set_num_threads(1)
    init_group("cpu")
    rank = dist.get_rank()
    group = dist.new_group(list(range(dist.get_world_size())))
    assert not shm.registered(group.group_name)
    assert shm.register(group, 60.0, slot_bytes) and shm.registered(group.group_name)  # small slots: chunks
    name = group.group_name
    again = dist.new_group(list(range(dist.get_world_size())))  # another executable's group of these ranks
    assert shm.register(again, 60.0) and shm._GROUPS[again.group_name] is shm._GROUPS[name]  # one segment
    gen = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {}
    ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    for dtype in (torch.float32, torch.int64, torch.uint8):
        for reduce in REDUCTIONS:
            if dtype.is_floating_point:
                x = (torch.rand(3, 5, generator=gen) * 4 - 2).to(dtype)
            else:
                x = torch.randint(0 if dtype == torch.uint8 else -3, 4, (3, 5), generator=gen).to(dtype)
            theirs = x.clone()
            dist.all_reduce(theirs, op=ops[reduce], group=group)
            ours = shm.shm_all_reduce_(x.clone(), reduce, name)
            out[f"{reduce} {dtype}"] = (ours.numpy(), theirs.numpy())
    big = torch.randn(1024, generator=gen)  # 4 KiB: several slots' worth
    theirs = big.clone()
    dist.all_reduce(theirs, group=group)
    out["chunks"] = (shm.shm_all_reduce_(big.clone(), "sum", name).numpy(), theirs.numpy())
    try:
        shm.shm_all_reduce_(big, "avg", name)
        out["avg"] = "no error"
    except ValueError as exc:
        out["avg"] = str(exc)
    out["op"] = op_checks(shm.shm_all_reduce_op(), name, rank, direct=True)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("n", [2, 4])
def test_shared_memory_reduces_as_gloo_does(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from edatalog.backend.running.launch import spawn

    monkeypatch.setenv("EDL_DIST_TIMEOUT", "60")
    got = spawn(n, shm_rank, (1024,))
    assert sorted(got) == list(range(n))

    def inexact(key: str, ours: np.ndarray) -> bool:
        return ours.dtype.kind == "f" and (key == "chunks" or (key.startswith(("sum", "prod")) and n > 2))

    check_against_gloo(got, n, ("op", "avg"), inexact, 1e-5)
    for rank in range(n):
        assert got[rank]["avg"] == "no shared-memory all-reduce for the reduction 'avg'"
    check_op_results({rank: got[rank]["op"] for rank in range(n)}, n)


def _world_segment(timeout: float) -> tuple[Any, Any]:
    """In a spawned rank: the process group of every rank, with its segment made; the module."""
    import torch.distributed as dist

    from edatalog.backend.running import shm_all_reduce as shm
    from edatalog.backend.running.spmd import init_group

    init_group("cpu")
    group = dist.group.WORLD
    assert group is not None and shm.register(group, timeout)
    return shm, group


def absent_rank() -> str:
    """One rank (spawned): rank 1 never comes to the second all-reduce; rank 0's wait ends."""
    import torch
    import torch.distributed as dist

    shm, group = _world_segment(1.0)
    x = torch.ones(4)
    shm.shm_all_reduce_(x, "sum", group.group_name)
    if dist.get_rank() == 1:
        dist.barrier()  # rank 0 comes here only after giving up
        return "absent"
    try:
        shm.shm_all_reduce_(x, "sum", group.group_name)
    except RuntimeError as exc:
        dist.barrier()
        return str(exc)
    return "no error"


@pytest.mark.distributed
def test_a_rank_that_never_comes_is_named_within_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from edatalog.backend.running.launch import spawn

    monkeypatch.setenv("EDL_DIST_TIMEOUT", "60")
    got = spawn(2, absent_rank)
    assert got[1] == "absent"
    assert "rank 0 timed out after 1 s waiting for rank 1 in a shared-memory all-reduce" in got[0], got[0]


def mismatched_rank() -> str:
    """One rank (spawned): the ranks reach an all-reduce of different sizes at the same point."""
    import torch
    import torch.distributed as dist

    shm, group = _world_segment(30.0)
    try:
        shm.shm_all_reduce_(torch.ones(4 + dist.get_rank()), "sum", group.group_name)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
def test_ranks_that_reach_different_all_reduces_fail_instead_of_mixing_data(monkeypatch: pytest.MonkeyPatch) -> None:
    from edatalog.backend.running.launch import spawn

    monkeypatch.setenv("EDL_DIST_TIMEOUT", "60")
    got = spawn(2, mismatched_rank)
    for rank in range(2):
        assert "of different tensors or groups at the same point of their programs" in got[rank], got[rank]


def unmappable_rank() -> tuple[bool, bool]:
    """One rank (spawned): the first member cannot map a segment (a full /dev/shm); every member
    learns that none was made."""
    import torch.distributed as dist

    from edatalog.backend.running import shm_all_reduce as shm
    from edatalog.backend.running.spmd import init_group

    init_group("cpu")
    group = dist.group.WORLD
    assert group is not None
    if dist.get_rank() == 0:
        shm._map = lambda path, size, create: None
    made = shm.register(group, 30.0)
    return made, shm.registered(group.group_name)


@pytest.mark.distributed
def test_a_segment_no_member_could_map_is_made_by_none(monkeypatch: pytest.MonkeyPatch) -> None:
    from edatalog.backend.running.launch import spawn

    monkeypatch.setenv("EDL_DIST_TIMEOUT", "60")
    assert spawn(2, unmappable_rank) == {0: (False, False), 1: (False, False)}


def barrier_rank(shared: bool) -> tuple[float, list[float], list[float]]:
    """One rank (spawned): rank 1 comes to the barrier 0.3 s late (rank 0 must wait for it), then
    both time calls that take rank 1 longer; with ``shared`` false the segment cannot be made
    (the ranks' hosts differ), and the barrier is gloo's."""
    import time

    import torch.distributed as dist

    from edatalog.backend.running import shm_all_reduce as shm
    from edatalog.backend.running.spmd import init_group, timed_calls

    init_group("cpu")
    if not shared:  # as if each rank were on a machine of its own
        shm._host_key = lambda: dist.get_rank()
    rank, world = dist.get_rank(), dist.group.WORLD
    assert world is not None
    meet = shm.barrier_of(world, 30.0)
    assert shm.registered(world.group_name) == shared
    if rank == 1:
        time.sleep(0.3)
    began = time.perf_counter()
    meet()
    waited = time.perf_counter() - began
    mine, slowest = timed_calls(lambda: time.sleep(0.002 * (1 + rank)), 5, warmup=1)
    return waited, mine, slowest


@pytest.mark.distributed
@pytest.mark.parametrize("shared", [True, False])
def test_calls_start_together_and_take_the_slowest_ranks_time(shared: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The barrier holds the early rank until the late one comes, through shared memory or
    gloo's; the timed calls are each rank's own and, gathered, the slowest rank's."""
    from edatalog.backend.running.launch import spawn

    monkeypatch.setenv("EDL_DIST_TIMEOUT", "60")
    got = spawn(2, barrier_rank, (shared,))
    assert got[0][0] >= 0.25 and got[1][0] < 0.25
    for rank in range(2):
        _, mine, slowest = got[rank]
        assert len(mine) == len(slowest) == 5
        assert all(t >= 0.002 * (1 + rank) for t in mine)
        assert all(s >= 0.004 and s >= m for s, m in zip(slowest, mine, strict=True))
    assert got[0][2] == got[1][2]
