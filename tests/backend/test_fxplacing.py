"""Results computed in place and broadcasts left to the op (backend/running/fxplacing.py), run
as part of the traced graph's simplification: results bit for bit, the calls gone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from edatalog.backend.running import fxpasses
from edatalog.backend.running.tracer import record


def _simplified(fn: Any, args: list[Any]) -> tuple[Any, dict[str, int]]:
    rec = record(fn, args)
    return fxpasses.simplify(rec.module, rec.graph, rec.shapes)


def _calls(gm: Any, name: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op in {"call_function", "call_method"} and name in str(n.target))


def _same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _rotary(q: Any, c: Any, s: Any) -> list[Any]:
    """The interpreter's way with a rotary embedding: each half computed fresh, updated in
    place, then copied into its place in the relation's buffer."""
    a, b = q[..., :16], q[..., 16:]
    lo = torch.mul(a, c)
    torch.addcmul(lo, b, s, value=-1, out=lo)
    hi = torch.mul(b, c)
    torch.addcmul(hi, a, s, out=hi)
    out = torch.empty(4, 2, 32)
    out[..., :16].copy_(lo)
    out[..., 16:].copy_(hi)
    return [out * 2.0]


def test_halves_are_computed_in_their_places_bit_for_bit() -> None:
    args = [torch.randn(4, 2, 32), torch.randn(16), torch.randn(16)]
    gm, summary = _simplified(_rotary, args)
    assert summary["results_placed"] == 2
    assert _calls(gm, "copy_") == 0
    for call in (args, [torch.randn(4, 2, 32), torch.randn(16), torch.randn(16)]):
        _same(gm(*call), _rotary(*call))


def test_a_read_of_the_place_between_keeps_the_copy() -> None:
    """Something reads the cells the copy will fill before it does: the op must not write them
    earlier (the read would see the result instead of the ones)."""

    def fn(x: Any, y: Any) -> list[Any]:
        out = torch.empty(2, 8)
        out.fill_(1.0)
        t = torch.mul(x, y)
        seen = out[:, :4] + 0.5
        out[:, :4].copy_(t)
        return [out * 1.0, seen]

    args = [torch.randn(2, 4), torch.randn(2, 4)]
    gm, summary = _simplified(fn, args)
    assert summary["results_placed"] == 0
    _same(gm(*args), fn(*args))


def test_a_read_of_other_cells_between_does_not() -> None:
    def fn(x: Any, y: Any) -> list[Any]:
        out = torch.empty(2, 8)
        out[:, 4:].copy_(y * 3.0)
        t = torch.mul(x, y)
        seen = out[:, 4:] + 0.5  # the other half: untouched by t
        out[:, :4].copy_(t)
        return [out * 1.0, seen]

    args = [torch.randn(2, 4), torch.randn(2, 4)]
    gm, summary = _simplified(fn, args)
    assert summary["results_placed"] == 2
    _same(gm(*args), fn(*args))


def test_a_result_read_after_its_copy_keeps_it() -> None:
    def fn(x: Any, y: Any) -> list[Any]:
        out = torch.empty(2, 8)
        t = torch.mul(x, y)
        out[:, :4].copy_(t)
        out[:, 4:].copy_(y)
        return [out * 1.0, t + 1.0]

    args = [torch.randn(2, 4), torch.randn(2, 4)]
    gm, summary = _simplified(fn, args)
    assert summary["results_placed"] == 0
    _same(gm(*args), fn(*args))


def test_a_broadcasting_view_is_left_to_the_op() -> None:
    def fn(x: Any, w: Any, c: Any) -> list[Any]:
        return [x * w.expand(1, 256), torch.mul(x, c.view(1, 1, 16).expand(1, 16, 16).reshape(1, 256))]

    args = [torch.randn(1, 256), torch.randn(256), torch.randn(16)]
    gm, summary = _simplified(fn, args)
    assert summary["broadcasts_implied"] >= 1
    _same(gm(*args), fn(*args))


def test_a_broadcast_that_sizes_the_result_stays() -> None:
    def fn(x: Any, w: Any) -> list[Any]:
        return [torch.mul(x, w.expand(3, 256))]  # x[1, 1]: the view makes the result 3 rows

    args = [torch.randn(1, 1), torch.randn(256)]
    gm, summary = _simplified(fn, args)
    assert summary["broadcasts_implied"] == 0
    _same(gm(*args), fn(*args))


def test_a_zero_dim_operand_in_another_dtype_stays_broadcast() -> None:
    """A 0-d tensor takes a lower part in type promotion than a 1-cell one: f32 times a 0-d f64
    is f32, times a [1, 1] f64 it is f64."""

    def fn(x: Any, s: Any) -> list[Any]:
        return [torch.mul(x, s.expand(1, 1))]

    args = [torch.randn(1, 4), torch.tensor(2.5, dtype=torch.float64)]
    gm, summary = _simplified(fn, args)
    assert summary["broadcasts_implied"] == 0
    _same(gm(*args), fn(*args))


def test_a_broadcast_that_sizes_an_out_tensor_stays() -> None:
    """``add(a, b, out=o)`` sizes its result by ``a`` and ``b`` alone: with ``a`` unbroadcast,
    ``o[1, 8]`` would be resized to ``[8]`` and the cells written elsewhere."""

    def fn(x: Any, y: Any) -> list[Any]:
        out = torch.empty(2, 8)
        torch.add(x.expand(1, 8), y, out=out[1:])
        out[:1].fill_(0.0)
        return [out * 1.0]

    args = [torch.randn(8), torch.randn(8)]
    gm, summary = _simplified(fn, args)
    assert summary["broadcasts_implied"] == 0
    _same(gm(*args), fn(*args))


def test_overlapping_places_keep_the_last_copy_last() -> None:
    """Two results copied into overlapping places: the one copied last must still win where
    they overlap, whichever op runs first."""

    def fn(a: Any, b: Any) -> list[Any]:
        first = torch.mul(a, b)
        second = torch.add(a, b)
        out = torch.empty(2, 6)
        out[:, 2:6].copy_(second)
        out[:, 0:4].copy_(first)  # overwrites columns 2 and 3
        return [out * 1.0]

    args = [torch.randn(2, 4), torch.randn(2, 4)]
    gm, summary = _simplified(fn, args)
    assert summary["results_placed"] == 1  # second in place; first, whose op runs before it, keeps its copy
    _same(gm(*args), fn(*args))


def test_an_update_that_reads_the_place_keeps_the_copy() -> None:
    def fn(x: Any, y: Any, s: Any) -> list[Any]:
        out = torch.empty(2, 8)
        out.fill_(1.0)
        t = torch.mul(x, y)
        torch.addcmul(t, out[:, :4], s, out=t)  # reads the ones the copy then overwrites
        out[:, :4].copy_(t)
        return [out * 1.0]

    args = [torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)]
    gm, summary = _simplified(fn, args)
    assert summary["results_placed"] == 0
    _same(gm(*args), fn(*args))


def _through_split(x: Any, y: Any) -> list[Any]:
    out = torch.empty(2, 8)
    out.fill_(1.0)
    left, _ = torch.split(out, 4, dim=1)  # getitem of a split: no view op, the same memory
    t = torch.mul(x, y)
    seen = left + 0.5
    out[:, :4].copy_(t)
    return [out * 1.0, seen]


def _through_detach(x: Any, y: Any) -> list[Any]:
    out = torch.empty(2, 4)
    out.fill_(1.0)
    alias = out.detach()
    t = torch.mul(x, y)
    seen = alias * 3.0
    out[0].copy_(t)
    return [out * 1.0, seen]


def _through_bytes(x: Any, y: Any) -> list[Any]:
    out = torch.empty(8)
    out.fill_(1.0)
    cell = torch.ops.aten.slice.Tensor(torch.ops.aten.view.dtype(out, torch.uint8), 0, 4, 8)  # float cell 1
    t = torch.mul(x, y)
    seen = cell + 0
    out[0:2].copy_(t)
    return [out * 1.0, seen]


def _through_unsafe_view(x: Any, y: Any) -> list[Any]:
    out = torch.empty(2, 4)
    out.fill_(1.0)
    flat = torch.ops.aten._unsafe_view(out, [8])  # a view whose schema claims a fresh result
    t = torch.mul(x, y)
    seen = flat + 0.5
    out[0].copy_(t)
    return [out * 1.0, seen]


def _op_reads_its_place(x: Any) -> list[Any]:
    out = torch.empty(2, 8)
    out.copy_(x)
    left = torch.split(out, [4, 4], dim=1)[0]
    t = torch.mul(left, 2.0)  # columns 0..3, to be written over columns 1..4
    out[:, 1:5].copy_(t)
    return [out * 1.0]


@pytest.mark.parametrize(
    ("fn", "shapes"),
    [
        (_through_split, [(2, 4), (2, 4)]),
        (_through_detach, [(4,), (4,)]),
        (_through_bytes, [(2,), (2,)]),
        (_through_unsafe_view, [(4,), (4,)]),
        (_op_reads_its_place, [(2, 8)]),
    ],
)
def test_reads_through_other_aliases_keep_the_copy(fn: Any, shapes: list[tuple[int, ...]]) -> None:
    args = [torch.randn(*s) for s in shapes]
    gm, summary = _simplified(fn, args)
    assert summary["results_placed"] == 0
    _same(gm(*args), fn(*args))


def test_an_op_whose_bits_follow_the_layout_is_not_moved() -> None:
    """``sigmoid`` runs a vectorized loop over a fresh contiguous result and a scalar one over
    short strided rows: the last bits may differ, so it is not computed into its place."""

    def fn(x: Any) -> list[Any]:
        out = torch.empty(64, 24)
        out[:, :13].copy_(torch.sigmoid(x))
        out[:, 13:].fill_(0.0)
        return [out * 1.0]

    args = [torch.rand(64, 13) * 4]
    gm, summary = _simplified(fn, args)
    assert summary["results_placed"] == 0
    _same(gm(*args), fn(*args))


def test_a_broadcast_beside_a_permuted_operand_stays() -> None:
    """torch lays a fresh result out after its operands' strides: without the view the product
    of a permuted tensor would take the tensor's layout, and the views of it recorded after
    would read other cells."""

    def fn(w: Any, flat: Any) -> list[Any]:
        x = flat.as_strided((3, 2, 1, 3), (1, 3, 1, 6))
        r = torch.mul(w.view(1, 1, 3).expand(3, 2, 1, 3), x)
        return [r[:, 0] * 1.0]

    args = [torch.randn(3), torch.randn(18)]
    gm, summary = _simplified(fn, args)
    assert summary["broadcasts_implied"] == 0
    _same(gm(*args), fn(*args))


@pytest.mark.parametrize(("op", "removed"), [(torch.mul, 1), (torch.sigmoid, 0)])
def test_a_copy_made_to_be_updated_goes_only_for_ops_exact_in_any_layout(op: Any, removed: int) -> None:
    """fxpasses.copies_into_fresh: ``e = empty; e.copy_(v); op(e, out=e)`` becomes ``op(v)``,
    which reads the view's strides instead of the copy's: kept for ops whose bits follow the
    layout."""

    def fn(x: Any) -> list[Any]:
        v = x[:, :13]
        e = torch.empty(64, 13)
        e.copy_(v)
        if op is torch.mul:
            torch.mul(e, 3.0, out=e)
        else:
            torch.sigmoid(e, out=e)
        return [e * 1.0]

    args = [torch.rand(64, 24) * 4]
    gm, summary = _simplified(fn, args)
    assert summary["copies_removed"] == removed
    _same(gm(*args), fn(*args))
