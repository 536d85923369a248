"""Small all-reduces on gloo as pairwise exchanges (:mod:`edatalog.backend.running.exchange_all_reduce`).

On 2 and 4 gloo ranks, every reduction of f32 and i64 tensors against ``dist.all_reduce`` of
the same values: equal (to rounding for a sum or product of four f32 partials, taken in
another order), and the same bits on every rank (zeros of either sign included).  The custom
op the recorded graphs call returns the reduction as a fresh tensor, leaves its argument as it
was, replays from a recorded graph, and is never dead code.  The runtime's choice of it follows
the cost model's rule: ranks of one machine all-reduce through shared memory instead, so a
plan's programs run end to end on it in ``test_collectives.py`` with shared memory withheld (2
ranks)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.backend.all_reduce_ops import check_against_gloo, check_op_results, op_checks

REDUCTIONS = ("sum", "prod", "max", "min")


def exchange_rank() -> dict[str, Any]:
    """One rank (spawned): each reduction by exchanges and by gloo, and the custom op eager and
    replayed from a recorded graph."""
    import torch
    import torch.distributed as dist

    from edatalog.backend.running.exchange_all_reduce import (
        exchange_all_reduce_,
        exchange_all_reduce_op,
        register_group,
    )
    from edatalog.backend.running.spmd import init_group

    torch.set_num_threads(1)
    init_group("cpu")
    rank = dist.get_rank()
    group = dist.new_group(list(range(dist.get_world_size())))
    register_group(group)
    gen = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {}
    ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    for dtype in (torch.float32, torch.int64):
        for reduce in REDUCTIONS:
            x = (
                (torch.rand(3, 5, generator=gen) * 4 - 2).to(dtype)
                if dtype.is_floating_point
                else torch.randint(-3, 4, (3, 5), generator=gen)
            )
            theirs = x.clone()
            dist.all_reduce(theirs, op=ops[reduce], group=group)
            ours = exchange_all_reduce_(x.clone(), reduce, group)
            out[f"{reduce} {dtype}"] = (ours.numpy(), theirs.numpy())
    signed = torch.tensor([0.0, -0.0]) if rank % 2 else torch.tensor([-0.0, 0.0])
    out["zeros"] = [exchange_all_reduce_(signed.clone(), reduce, group).numpy() for reduce in ("max", "min")]
    out["op"] = op_checks(exchange_all_reduce_op(), group.group_name, rank)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("n", [2, 4])
def test_pairwise_exchanges_reduce_as_gloo_does(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from edatalog.backend.running.launch import spawn

    monkeypatch.setenv("EDL_DIST_TIMEOUT", "60")
    got = spawn(n, exchange_rank)
    assert sorted(got) == list(range(n))

    def inexact(key: str, ours: np.ndarray) -> bool:
        return key.startswith(("sum", "prod")) and n > 2 and ours.dtype.kind == "f"

    check_against_gloo(got, n, ("op", "zeros"), inexact, 1e-6)
    # Zeros of either sign: the same one on every rank (a pair combines in one order).
    for rank in range(n):
        for ours, first in zip(got[rank]["zeros"], got[0]["zeros"], strict=True):
            assert np.array_equal(np.signbit(ours), np.signbit(first)), rank
    check_op_results({rank: got[rank]["op"] for rank in range(n)}, n)
