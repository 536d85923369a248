"""``benchmarks/shm_collectives.py``: once routed, the baselines' all-reduces over the group go
through edatalog's shared-memory all-reduce (the hand-written one, torch's functional
all-reduce as DTensor calls it, DDP's gradient buckets through the hook) and give gloo's
results; other groups and reductions keep gloo's."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def routed_rank() -> dict[str, Any]:
    """One rank (spawned): each all-reduce routed, counted by the segment's sequence number."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_reduce as functional_all_reduce

    from edatalog.backend.running import shm_all_reduce as shm
    from edatalog.backend.running.spmd import init_group

    shm_collectives = importlib.import_module("shm_collectives")  # benchmarks/ is not a package
    torch.set_num_threads(1)
    init_group("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    assert group is not None
    other = dist.new_group(list(range(world)))
    reduce = shm_collectives.route(group, 60.0)
    assert reduce is not None
    segment = shm._GROUPS[group.group_name]
    out: dict[str, Any] = {}
    x = torch.arange(6.0) + rank
    before = segment.sequence
    out["hand"] = reduce(x.clone()).numpy()
    out["functional"] = functional_all_reduce(x, "sum", group).numpy()
    out["routed"] = segment.sequence - before  # both went through the segment
    before = segment.sequence
    out["max"] = functional_all_reduce(x, "max", group).numpy()  # gloo's: not a sum
    out["other"] = functional_all_reduce(x, "sum", other).numpy()  # gloo's: not the routed group
    out["not routed"] = segment.sequence - before
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, shm_collectives.ddp_comm_hook(reduce, world))
    before = segment.sequence
    ddp(torch.full((2, 4), float(rank + 1))).sum().backward()
    grad = model.weight.grad
    assert grad is not None
    out["ddp"] = (grad.numpy().copy(), segment.sequence - before)
    return out


@pytest.mark.distributed
def test_the_baselines_all_reduces_go_through_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from edatalog.backend.running.launch import spawn

    monkeypatch.setenv("EDL_DIST_TIMEOUT", "60")
    got = spawn(2, routed_rank)
    x = [np.arange(6.0) + r for r in range(2)]
    for rank in range(2):
        r = got[rank]
        np.testing.assert_array_equal(r["hand"], x[0] + x[1])
        np.testing.assert_array_equal(r["functional"], x[0] + x[1])
        np.testing.assert_array_equal(r["other"], x[0] + x[1])
        np.testing.assert_array_equal(r["max"], x[1])
        assert r["routed"] == 2 and r["not routed"] == 0
        grad, calls = r["ddp"]
        # d/dW of sum(W x + b) over the batch, averaged over the ranks: 2 rows of (rank + 1) each.
        np.testing.assert_allclose(grad, np.full((3, 4), (2 * 1 + 2 * 2) / 2))
        assert calls >= 1
