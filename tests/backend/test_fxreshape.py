"""Pointwise ops and reductions run in their operands' own shapes (backend/running/fxreshape.py),
as part of the traced graph's simplification: results bit for bit, the views gone."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edatalog.backend.running import fxnodes, fxpasses, fxreshape
from edatalog.backend.running.tracer import record


def _simplified(fn: Any, args: list[Any]) -> tuple[Any, dict[str, int]]:
    rec = record(fn, args)
    return fxpasses.simplify(rec.module, rec.graph, rec.shapes)


def _views(gm: Any) -> int:
    names = ("as_strided", "view", "expand", "permute")
    calls = [n for n in gm.graph.nodes if n.op in {"call_function", "call_method"}]
    return sum(1 for n in calls if any(v in str(n.target) for v in names))


def _same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous() == w.is_contiguous()
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def _layer_norm(x: Any, w: Any, b: Any) -> list[Any]:
    """The interpreter's way with a layer norm of ``x[1, 16, 32]``: each reduction over a
    ``[16, 32]`` view, its result viewed back and again with a dim of one to broadcast, the
    scale and shift written in place."""
    s = torch.sum(x.view(16, 32), [1]).view(1, 16)
    m = torch.mul(s, 1 / 32).view(1, 16, 1)
    d = torch.sub(x, m)
    d2 = d.view(16, 32)
    v = torch.sum(torch.mul(d2, d2), [1]).view(1, 16)
    r = torch.add(torch.mul(v, 1 / 32), 1e-5).view(1, 16, 1)
    torch.rsqrt(r, out=r)
    y = torch.mul(d, r)
    torch.mul(w.view(1, 1, 32), y, out=y)
    torch.add(y, b.view(1, 1, 32), out=y)
    return [torch.mm(y.view(16, 32), torch.ones(32, 8, dtype=x.dtype))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_norm_over_reshapes_runs_in_its_input_shape_bit_for_bit(dtype: torch.dtype) -> None:
    args = [torch.randn(1, 16, 32, dtype=dtype), torch.randn(32, dtype=dtype), torch.randn(32, dtype=dtype)]
    gm, summary = _simplified(_layer_norm, args)
    assert summary["views_reshaped"] >= 6
    assert _views(gm) == 1  # the GEMM's [16, 32] operand, which mm needs
    assert "True" in gm.code  # the sums keep their dims, and the results broadcast as they are
    for call in (args, [torch.randn(1, 16, 32, dtype=dtype), args[1], args[2]]):
        _same(gm(*call), _layer_norm(*call))


def test_a_bias_viewed_in_the_heads_shape_is_added_to_the_gemm_result_itself() -> None:
    def fn(x: Any, w: Any, b: Any) -> list[Any]:
        q = torch.mm(x, w).view(1, 16, 2, 8)
        q = torch.add(q, b.view(2, 8).expand(1, 1, 2, 8))
        return [q.permute(0, 2, 1, 3).contiguous()]

    args = [torch.randn(16, 32), torch.randn(32, 16), torch.randn(16)]
    gm, summary = _simplified(fn, args)
    assert summary["views_reshaped"] == 2
    add = next(n for n in gm.graph.nodes if "add" in str(n.target))
    assert add.args[1].name == "arg2"  # the bias as given, broadcast by the op
    _same(gm(*args), fn(*args))


def test_a_reduction_across_a_merged_dim_keeps_its_view() -> None:
    """Summing the rows of a ``[4, 8]`` view of ``x[2, 16]`` splits x's dims: no reduction of x
    alone gives it, so the view stays."""

    def fn(x: Any) -> list[Any]:
        return [torch.mul(torch.sum(x.view(4, 8), [1]), 2.0)]

    args = [torch.randn(2, 16)]
    gm, _ = _simplified(fn, args)
    assert any(n.target is torch.as_strided or "view" in str(n.target) for n in gm.graph.nodes)
    _same(gm(*args), fn(*args))


def test_a_reduction_keeps_the_dims_its_readers_put_back() -> None:
    def fn(x: Any) -> list[Any]:
        ss = torch.sum(x * x, [1])
        mx = torch.amax(x, [1])
        return [x * torch.rsqrt(ss.view(4, 1) / 256.0), x - mx.view(4, 1), mx * 2.0]

    args = [torch.randn(4, 256)]
    gm, summary = _simplified(fn, args)
    assert summary["views_reshaped"] == 1  # amax is also read as it is: a view of it moves to its reader
    assert gm.code.count("True") == 2  # both keep their dims; amax's readers broadcast it as it is
    _same(gm(*args), fn(*args))


def test_reductions_of_permuted_or_scalar_sources_keep_their_form() -> None:
    def permuted(flat: Any) -> list[Any]:
        x = flat.permute(2, 0, 1)
        return [x - torch.sum(x, [1]).view(3, 1, 5)]

    def scalar(s: Any, x: Any) -> list[Any]:
        return [x * torch.sum(s, [0]).view(1)]

    for fn, args in ((permuted, [torch.randn(4, 5, 3)]), (scalar, [torch.tensor(2.0), torch.randn(3)])):
        gm, summary = _simplified(fn, args)
        assert summary["views_reshaped"] == 0
        _same(gm(*args), fn(*args))


def test_a_transposed_operand_is_left_as_it_is() -> None:
    """A view that is not a row-major reshape (a transpose) makes no shape to run in."""

    def fn(x: Any, y: Any) -> list[Any]:
        return [torch.mm(torch.mul(x.t(), y), torch.ones(8, 4))]

    args = [torch.randn(8, 16), torch.randn(16, 8)]
    gm, summary = _simplified(fn, args)
    assert summary["views_reshaped"] == 0
    _same(gm(*args), fn(*args))


def test_a_zero_dim_operand_keeps_its_type_promotion() -> None:
    """A 0-d f32 operand does not promote a bf16 tensor; the op keeps reading it as 0-d."""

    def fn(x: Any, c: Any) -> list[Any]:
        return [torch.sum(torch.mul(x.view(4, 8), c), [1])]

    def expanded(x: Any, c: Any) -> list[Any]:  # a 1-cell view of it does: the result is f32
        return [torch.sum(torch.mul(x.view(4, 8), c.expand(4, 8)), [1])]

    args = [torch.randn(32, dtype=torch.bfloat16), torch.tensor(1.5)]
    for f, dtype in ((fn, torch.bfloat16), (expanded, torch.float32)):
        gm, _ = _simplified(f, args)
        _same(gm(*args), f(*args))
        assert gm(*args)[0].dtype == dtype


def test_an_all_reduce_runs_on_the_tensor_its_operand_reshapes() -> None:
    """edatalog's all-reduces are elementwise over any shape: a GEMM's result all-reduced as
    ``[1, 16, 32]`` and added back as ``[16, 32]`` needs no view either way."""
    from edatalog.backend.running.shm_all_reduce import shm_all_reduce_op

    op = shm_all_reduce_op()
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    mm = graph.call_function(torch.ops.aten.mm.default, (x, w))
    v = graph.call_function(torch.ops.aten.view.default, (mm, [1, 16, 32]))
    r = graph.call_function(op, (v, "sum", "none"))
    back = graph.call_function(torch.ops.aten.view.default, (r, [16, 32]))
    out = graph.call_function(torch.ops.aten.add.Tensor, (x, back))
    graph.output([out])
    f32 = torch.float32
    shapes = {
        x: ((16, 32), (32, 1), 0, f32),
        w: ((32, 32), (32, 1), 0, f32),
        mm: ((16, 32), (32, 1), 0, f32),
        v: ((1, 16, 32), (512, 32, 1), 0, f32),
        r: ((1, 16, 32), (512, 32, 1), 0, f32),
        back: ((16, 32), (32, 1), 0, f32),
        out: ((16, 32), (32, 1), 0, f32),
    }
    kept, saved = fxreshape.in_source_shapes(graph, torch.nn.Module(), shapes)
    assert saved == 2
    reduced = next(n for n in kept.nodes if n.target is op)
    assert reduced.args[0].target is torch.ops.aten.mm.default
    assert next(n for n in kept.nodes if n.target is torch.ops.aten.add.Tensor).args[1] is reduced


# -- random chains, bit for bit ----------------------------------------------------------------------

_SHAPES = [(64,), (8, 8), (4, 16), (2, 4, 8), (1, 8, 8), (2, 32), (4, 4, 4), (1, 64, 1)]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["reshape", "unary", "binary", "scale", "bias", "sum"]), st.integers(0, 63)),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_random_chains_over_reshapes_give_the_eager_results(steps: list[tuple[str, int]], dtype: torch.dtype) -> None:
    """Random chains of reshapes, elementwise ops (with broadcast operands) and reductions of
    trailing dims kept for broadcasting: the simplified graph equals eager execution bit for
    bit, whatever shapes its ops now run in."""

    def fn(x: Any, b: Any) -> list[Any]:
        values = [x]
        for kind, k in steps:
            a = values[-1]
            if kind == "reshape":
                values.append(a.reshape(_SHAPES[k % len(_SHAPES)]))
            elif kind == "unary":
                values.append([torch.sin, torch.tanh, torch.rsqrt, torch.sigmoid][k % 4](a.abs() + 1.0))
            elif kind == "binary":
                values.append(torch.mul(a, values[k % len(values)].reshape(a.shape)))
            elif kind == "scale":
                values.append(torch.mul(a, 0.5 + k / 64))
            elif kind == "bias":
                values.append(torch.add(a, b[: a.shape[-1]].view(*([1] * (a.dim() - 1)), a.shape[-1])))
            elif a.dim() > 1:  # a row's sum, viewed with a dim of one to broadcast
                s = torch.sum(a, [a.dim() - 1]).view(*a.shape[:-1], 1)
                values.append(torch.sub(a, s))
        return [values[-1].contiguous().view(-1)]

    g = torch.Generator().manual_seed(len(steps))
    x, b = torch.randn(64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
    gm, _ = _simplified(fn, [x, b])
    for args in ([x, b], [torch.randn(64, generator=g).to(dtype), b]):
        _same(gm(*args), fn(*args))


def test_an_op_writing_into_a_reshape_writes_the_tensor_itself() -> None:
    """``mul(w, view(y), out=view(y))`` over ``y[16, 32]`` viewed as ``[1, 16, 32]`` becomes
    ``mul(w, y, out=y)``; an ``out=`` that only broadcasts to the new shape is never taken (the
    op would resize it)."""

    def fn(x: Any, w: Any) -> list[Any]:
        y = torch.mul(x, 2.0)
        v = y.view(1, 16, 32)
        torch.mul(w.view(1, 1, 32), v, out=v)
        torch.add(v, 1.0, out=v)
        return [torch.mm(y, torch.ones(32, 4))]

    def into_another(x: Any) -> list[Any]:  # [1, 16, 32] is x's shape; y's only broadcasts to it
        y = torch.empty(16, 32)
        torch.add(x.view(16, 32), 1.0, out=y)
        return [torch.mm(y, torch.ones(32, 4))]

    for f, args, views in (
        (fn, [torch.randn(16, 32), torch.randn(32)], 0),
        (into_another, [torch.randn(1, 16, 32)], 1),
    ):
        gm, _ = _simplified(f, args)
        assert _views(gm) == views
        _same(gm(*args), f(*args))


def test_a_view_of_the_result_in_another_dtype_stays_a_view_of_it() -> None:
    """``view(mul(view(x, [4, 8]), 2), int32)``: an ``as_strided`` of the op's result in
    another shape would lose the dtype (and, for another element size, its bounds)."""

    def as_int(x: Any) -> list[Any]:
        return [torch.mul(x.view(4, 8), 2.0).view(torch.int32)]

    def summed_as_int(x: Any) -> list[Any]:
        return [torch.sum(x.view(4, 8), [1]).view(torch.int32)]

    def as_bf16(x: Any) -> list[Any]:
        return [torch.mul(x.view(4, 8), 2.0).view(torch.bfloat16)]

    for f, args in ((as_int, [torch.randn(32)]), (summed_as_int, [torch.randn(4, 2, 4)]), (as_bf16, [torch.randn(32)])):
        gm, _ = _simplified(f, args)
        _same(gm(*args), f(*args))


def test_a_tensor_an_out_op_resized_is_left_alone() -> None:
    """``mul(x, 2, out=buf)`` resizes ``buf[1, 8]`` to ``[4, 8]`` (torch warns): its recorded
    geometry is the one before, so no rewrite may trust it."""

    def resized(x: Any, y: Any) -> list[Any]:
        buf = torch.empty(1, 8)
        torch.mul(x, 2.0, out=buf)
        return [torch.add(y.view(4, 8), buf).view(32)]

    def flattened(x: Any) -> list[Any]:
        buf = torch.empty(32)
        torch.mul(x, 2.0, out=buf)
        return [torch.exp(buf.view(2, 16)).view(32)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's, of the resize
        for f, args in (
            (resized, [torch.randn(4, 8), torch.randn(4, 1, 8)]),
            (resized, [torch.randn(4, 8), torch.randn(2, 2, 8)]),
            (flattened, [torch.randn(4, 8)]),
        ):
            gm, _ = _simplified(f, args)
            _same(gm(*args), f(*args))


def test_the_pass_never_leaves_more_views_than_it_found() -> None:
    """Rewrites decided op by op can add views on net (a reduction keeping its dims for a
    reader that cannot take the view away; two equal views each counted as going): the pass
    keeps the better of its two sweeps only where it leaves fewer views than there were."""

    def unabsorbed(x: Any) -> list[Any]:
        return [torch.mul(torch.sum(x, [1]), 2.0)]

    def twice(x: Any) -> list[Any]:
        a, b = x.reshape(32), x.reshape(32)
        return [torch.mul(a, 2.0), torch.add(b, 1.0)]

    def scalar_sum(x: Any) -> list[Any]:
        s = torch.sum(x, [1, 0])
        return [s.view(1, 1) * x, s + 1.0]

    for f, args in (
        (unabsorbed, [torch.randn(4, 8)]),
        (twice, [torch.randn(8, 4).t()]),
        (scalar_sum, [torch.randn(4, 8)]),
    ):
        rec = record(f, args)
        before = sum(1 for n in rec.graph.nodes if fxnodes.is_view(n))
        gm, summary = _simplified(f, args)
        assert summary["views_reshaped"] >= 0
        _same(gm(*args), f(*args))
        rec = record(f, args)
        fxpasses.fold_views(rec.graph, rec.shapes)
        rec.graph.eliminate_dead_code()
        folded = sum(1 for n in rec.graph.nodes if fxnodes.is_view(n))
        assert folded <= before
        kept, saved = fxreshape.in_source_shapes(rec.graph, rec.module, rec.shapes)
        assert saved >= 0 and sum(1 for n in kept.nodes if fxnodes.is_view(n)) == folded - saved


def test_an_operand_read_transposed_in_the_new_shape_keeps_the_old_one() -> None:
    """Torch lays a fresh result out after its operands' strides: the rewrite is taken only
    where every operand steps through memory row-major in the new shape, so the result stays
    a contiguous tensor (here ``x.t()`` would be read with strides (.., 1, 16))."""

    def fn(x: Any, y: Any) -> list[Any]:
        return [torch.mul(y.view(16, 8), x.t()).view(1, 16, 8)]

    args = [torch.randn(8, 16), torch.randn(1, 16, 8)]
    gm, summary = _simplified(fn, args)
    assert summary["views_reshaped"] == 0
    _same(gm(*args), fn(*args))
