"""What the tests of edatalog's own all-reduces (shared memory, pairwise exchanges) check alike:
their results against gloo's (:func:`check_against_gloo`), and of the custom op a recorded graph
calls, inside a spawned rank: its result eager, recorded, replayed and (``direct``) called as the
Python function behind it; whether it left its argument as it was; whether dead-code
elimination keeps it."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any


def check_against_gloo(
    got: dict[int, dict[str, Any]],
    n: int,
    skip: Collection[str],
    inexact: Callable[[str, Any], bool],
    tol: float,
) -> None:
    """Every rank's ``(ours, gloo's)`` pair under each key of ``got`` (but ``skip``): the same
    bits on every rank, and equal to gloo's, or within ``tol`` where ``inexact(key, ours)`` (f32
    sums and products rounded in another order)."""
    import numpy as np

    for key in got[0]:
        if key in skip:
            continue
        for rank in range(n):
            ours, theirs = got[rank][key]
            assert np.array_equal(ours, got[0][key][0]), (key, rank)  # the same bits on every rank
            if inexact(key, ours):
                np.testing.assert_allclose(ours, theirs, rtol=tol, atol=tol)
            else:
                assert np.array_equal(ours, theirs), (key, rank)


def op_checks(op: Any, group: str, rank: int, direct: bool = False) -> dict[str, Any]:
    """Run ``op`` (over the registered group named ``group``) on ``arange(6) + rank``."""
    import torch

    from edatalog.backend.running.fxpasses import direct_calls
    from edatalog.backend.running.tracer import record

    x = torch.arange(6.0).reshape(2, 3) + rank
    kept = x.clone()
    out: dict[str, Any] = {"eager": op(x, "sum", group).numpy()}
    recording = record(lambda a: [op(a, "sum", group) * 2], [x])
    out["recorded"] = recording.outputs[0].numpy()
    out["replayed"] = torch.fx.GraphModule(recording.module, recording.graph)(x)[0].numpy()
    if direct:
        module = torch.fx.GraphModule(recording.module, recording.graph)
        out["direct calls"] = direct_calls(module.graph)
        module.recompile()
        out["direct"] = module(x)[0].numpy()
    out["argument kept"] = bool(torch.equal(x, kept))

    def unread(a: Any) -> list[Any]:
        op(a, "sum", group)  # its result read by nothing: dead code, but a rank must not drop it
        return [a * 2]

    unused = record(unread, [x])
    unused.graph.eliminate_dead_code()
    out["kept as dead code"] = any(node.target is op for node in unused.graph.nodes)
    return out


def check_op_results(got: dict[int, dict[str, Any]], n: int) -> None:
    """Every rank's :func:`op_checks` against the sum over ``n`` ranks."""
    import numpy as np

    want = sum(np.arange(6.0).reshape(2, 3) + r for r in range(n))
    for rank in range(n):
        r = got[rank]
        assert r["argument kept"] and r["kept as dead code"], rank
        assert np.array_equal(r["eager"], want), rank
        for key in ("recorded", "replayed", "direct"):
            if key in r:
                assert np.array_equal(r[key], 2 * want), (key, rank)
        assert r.get("direct calls", 1) == 1  # the direct call replaced the op
