"""Buffer reuse in traced graphs (backend/running/fxreuse.py): results bit for bit, and memory
written only where nothing reads it any more."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import edatalog
from edatalog.backend.kernels.arrays import onednn_linear_op
from edatalog.backend.running import fxnodes, fxpasses, fxreuse
from edatalog.backend.running.compiled import CompiledExecutable
from edatalog.backend.running.tracer import record

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _simplified(fn: Any, args: list[Any], min_bytes: int = 0) -> tuple[Any, int]:
    rec = record(fn, args)
    reused = fxreuse.reuse_buffers(rec.graph, rec.shapes, min_bytes=min_bytes)
    fxpasses.fast_calls(rec.graph)
    rec.graph.lint()
    return torch.fx.GraphModule(rec.module, rec.graph), reused


def _same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):  # chains of exp overflow: a NaN must be where eager has one
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def test_a_chain_writes_into_dead_buffers_bit_for_bit() -> None:
    def fn(x: Any, y: Any) -> list[Any]:
        a = x * 3.0
        b = torch.sqrt(a.abs())  # a dies here
        c = b * y  # b dies: c may take a's memory
        d = torch.exp(c / 7.0)
        return [d, torch.mm(d, y.t())]

    x, y = torch.randn(64, 64), torch.randn(64, 64)
    gm, reused = _simplified(fn, [x, y])
    assert reused >= 2
    for args in ([x, y], [torch.randn(64, 64), torch.randn(64, 64)]):
        saved = [a.clone() for a in args]
        _same(gm(*args), fn(*args))
        _same(args, saved)  # inputs are never written


def test_a_buffer_read_through_a_view_stays_alive() -> None:
    def fn(x: Any, y: Any) -> list[Any]:
        a = x * 2.0
        parts = a.split(8)  # views of a, read after b is made
        t = a.t()
        b = y + 1.0  # must not take a's memory
        return [parts[1] + b[8:], t + b.t()]

    x, y = torch.randn(16, 16), torch.randn(16, 16)
    gm, _ = _simplified(fn, [x, y])
    _same(gm(x, y), fn(x, y))


def test_a_call_outside_aten_may_alias_what_it_reads() -> None:
    """A functional collective's wait returns the tensor it waits for: the buffer lives on
    through whatever reads the wait's result."""

    def fn(x: Any, y: Any) -> list[Any]:
        a = x * 2.0
        waited = torch.ops._c10d_functional.wait_tensor(a)
        b = y + 1.0  # must not take a's memory: waited is a
        return [waited + b]

    x, y = torch.randn(16, 16), torch.randn(16, 16)
    gm, _ = _simplified(fn, [x, y])
    _same(gm(x, y), fn(x, y))


@pytest.mark.skipif(onednn_linear_op() is None, reason="this torch has no oneDNN")
def test_onednn_linear_makes_memory_of_its_own() -> None:
    """oneDNN's linear (the torch kernels' large f32 GEMMs on a CPU) is trusted to return
    memory of its own: it aliases none of its operands, and once it dies its memory is given
    to a later result (here the exp, in place)."""

    def fn(x: Any, w: Any) -> list[Any]:
        y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return [torch.exp(y)]  # y dies here: the only memory the exp can take

    x, w = torch.randn(64, 64), torch.randn(64, 64)
    rec = record(fn, [x, w])
    linear = next(n for n in rec.graph.nodes if "linear_pointwise" in str(n.target))
    assert fxnodes.aliased_args(linear) == []
    gm, reused = _simplified(fn, [x, w])
    assert reused == 1
    _same(gm(x, w), fn(x, w))


def test_a_reshape_that_copies_keeps_its_copy_alive() -> None:
    """``reshape`` of a transposed tensor traces to ``clone`` then ``_unsafe_view``, whose
    schema claims a fresh result: the clone's memory is still the returned tensor's."""

    def fn(x: Any, y: Any) -> list[Any]:
        a = y.t()
        kept = a.reshape(-1).view(a.shape)
        return [kept, torch.sin(x) * 2.0]

    x, y = torch.randn(16, 16), torch.randn(16, 16)
    gm, _ = _simplified(fn, [x, y])
    _same(gm(x, y), fn(x, y))


def test_a_pointwise_op_writes_over_the_operand_that_dies_there() -> None:
    """``exp(a)`` where ``a`` dies goes into ``a``'s own memory, still in the cache, rather
    than into another dead buffer."""

    def fn(x: Any) -> list[Any]:
        other = x * 2.0
        junk = other + 1.0  # other dies: its memory goes to the pool
        a = junk * x  # junk dies here: a is written over it
        return [torch.exp(a)]  # a dies here: in place

    x = torch.randn(32, 32)
    gm, _ = _simplified(fn, [x])
    _same(gm(x), fn(x))
    outs = [n for n in gm.graph.nodes if n.kwargs.get("out") is not None]
    memory = {n: n.kwargs["out"].args[0] for n in outs}
    by_name = {n.target.__name__: n for n in outs}
    assert memory[by_name["exp"]] is memory[by_name["mul"]]


def test_an_operand_read_through_another_geometry_is_not_written_in_place() -> None:
    """``a * a.t()`` reads element (j, i) after writing (i, j): written over ``a`` it would
    read what it wrote."""

    def fn(x: Any) -> list[Any]:
        a = torch.sin(x)
        return [a * a.t()]

    x = torch.randn(32, 32)
    gm, _ = _simplified(fn, [x])
    _same(gm(x), fn(x))


def test_returned_buffers_and_their_views_are_never_written() -> None:
    def fn(x: Any) -> list[Any]:
        a = x * 2.0
        v = a[2:]
        b = torch.sin(x)  # a is returned (through v): b must not take it
        c = b * 5.0
        return [v, c]

    x = torch.randn(32, 32)
    gm, _ = _simplified(fn, [x])
    out = gm(x)
    _same(out, fn(x))
    assert out[0].untyped_storage().data_ptr() != out[1].untyped_storage().data_ptr()


def test_small_buffers_are_left_to_the_allocator() -> None:
    def fn(x: Any) -> list[Any]:
        return [torch.exp(torch.sin(x * 2.0))]

    assert _simplified(fn, [torch.randn(8, 8)], min_bytes=fxreuse.MIN_BYTES)[1] == 0
    assert _simplified(fn, [torch.randn(8, 8)], min_bytes=0)[1] >= 1


def test_every_op_of_the_public_bindings_list_takes_out() -> None:
    """A call this pass makes goes through the public binding only for these names."""
    a, b = torch.rand(4, 4) + 0.5, torch.rand(4, 4) + 0.5
    idx = torch.tensor([0, 2])
    calls: dict[str, Callable[[Any, Any], Any]] = {
        "cat": lambda f, o: f([a, b], 0, out=o),
        "where": lambda f, o: f(a > 1, a, b, out=o),
        "gather": lambda f, o: f(a, 0, idx.view(1, 2).expand(4, 2).contiguous(), out=o),
        "index_select": lambda f, o: f(a, 0, idx, out=o),
        "sum": lambda f, o: f(a, [0], False, out=o),
        "mean": lambda f, o: f(a, [0], False, out=o),
        "amax": lambda f, o: f(a, [0], False, out=o),
        "linear": lambda f, o: f(a, b, out=o),
        "bmm": lambda f, o: f(a[None], b[None], out=o),
        "addcmul": lambda f, o: f(a, b, a, value=-1, out=o),
        "addcdiv": lambda f, o: f(a, b, a, value=-1, out=o),
    }
    binary = {"add", "sub", "mul", "div", "maximum", "minimum", "pow", "mm"}

    def two(f: Any, o: Any) -> Any:
        return f(a, b, out=o)

    def one(f: Any, o: Any) -> Any:
        return f(a, out=o)

    for name in sorted(fxreuse.OUT_BINDINGS):
        f = fxpasses._binding(name)
        assert f is not None, name
        call: Callable[[Any, Any], Any] = calls.get(name) or (two if name in binary else one)
        want = call(f, None) if name not in calls else None
        out = torch.empty(0)
        got = call(f, out)
        assert got is out, name
        if want is not None:
            torch.testing.assert_close(got, want, rtol=0, atol=0)


_UNARY: list[Callable[[Any], Any]] = [
    torch.sin,
    torch.exp,
    torch.tanh,
    lambda t: t * 1.5,
    lambda t: t.t().contiguous(),
    lambda t: t + 0.25,
]


@settings(max_examples=120, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["unary", "binary", "view", "mm"]), st.integers(0, 50), st.integers(0, 50)),
        min_size=1,
        max_size=14,
    ),
    st.integers(0, 2**16),
)
def test_random_graphs_give_the_eager_results(steps: list[tuple[str, int, int]], seed: int) -> None:
    """Random straight-line programs of views, elementwise ops and matmuls over square
    buffers, some results returned: the reusing graph equals eager execution, twice."""

    def fn(x: Any, y: Any) -> list[Any]:
        values = [x, y]
        for kind, i, j in steps:
            a, b = values[i % len(values)], values[j % len(values)]
            if kind == "unary":
                values.append(_UNARY[(i + j) % len(_UNARY)](a))
            elif kind == "binary":
                values.append(a * b + 1.0)
            elif kind == "view":
                values.append(a.t() if i % 2 else a.reshape(-1).view(a.shape))
            else:
                values.append(torch.mm(a, b) / 16.0)
        return [v for k, v in enumerate(values[2:]) if (k + seed) % 3 == 0] + [values[-1]]

    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    gm, _ = _simplified(fn, [x, y])
    for args in ([x, y], [torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)]):
        saved = [a.clone() for a in args]
        _same(gm(*args), fn(*args))
        _same(args, saved)


def test_a_compiled_program_on_the_cpu_reuses_large_buffers_bit_for_bit() -> None:
    prog = edatalog.compile_string(
        """
        dim N = 256.
        input x[N, N] : f32.
        input w[N, N] : f32.
        output y.
        a[i, j] = exp(x[i, j] * 0.5).
        b[i, j] = a[i, j] * a[i, j] + 1.0.
        h[i, k] += b[i, j] * w[j, k].
        y[i, k] = sqrt(h[i, k] * h[i, k] + 1.0).
        """
    )
    inputs = prog.random_inputs(seed=1)
    exe = prog.executable(backend="torch", device="cpu", compile="graph")
    want = np.asarray(prog.executable(backend="torch", device="cpu", compile="none")(inputs)["y"])
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(exe(inputs)["y"]), want)
    impl = exe._impl
    assert isinstance(impl, CompiledExecutable) and impl.last_compiled is not None
    assert impl.last_compiled.summary["buffers_reused"] >= 1


def test_an_op_on_a_tensor_before_and_after_a_fused_update_of_it_is_not_shared() -> None:
    """torch's fused AdamW writes the tensors of its list arguments: ``p * 2`` before it and
    after it are two values (the passes must see the write, which names no single tensor)."""

    def fn(p: Any, g: Any, m: Any, v: Any, t: Any) -> list[Any]:
        before = p * 2.0
        torch._fused_adamw_(
            [p], [g], [m], [v], [], [t], lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8,
            amsgrad=False, maximize=False, grad_scale=None, found_inf=None,
        )  # fmt: skip
        return [before, p * 2.0]

    base = [torch.randn(32, 32), torch.randn(32, 32), torch.randn(32, 32), torch.rand(32, 32), torch.tensor(1.0)]
    rec = record(fn, [a.clone() for a in base])
    gm, _ = fxpasses.simplify(rec.module, rec.graph, rec.shapes, reuse=True)
    got, want = gm(*[a.clone() for a in base]), fn(*[a.clone() for a in base])
    _same(got, want)
    assert not torch.equal(got[0], got[1])
