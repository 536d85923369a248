"""The compiled torch runtime (:mod:`edatalog.backend.running.compiled`), its recorder and its graph
passes.

The runtime tests of :mod:`tests.backend.test_torch_runtime` run every plan through both paths
(the first call interprets, the second compiles); here: when it compiles and what it keeps, that
a graph replays the interpreter bit for bit (f32 and bf16, one device and several), that new
weights and outputs that may lack cells need no recompiling and keep their presence, that the
recorder refuses decisions on values, and each graph pass, bit for bit on a graph of its own.
"""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import edatalog
from edatalog.backend.running import compiled, cudagraphs, fxnodes, fxpasses
from edatalog.backend.running.compiled import CompiledExecutable
from edatalog.backend.running.torch_runtime import TorchExecutable
from edatalog.backend.running.tracer import TraceError, record
from edatalog.errors import EdlWarning
from edatalog.executable import Executable

LLAMA = Path(__file__).resolve().parents[2] / "programs" / "llama_block.edl"
DIMS = {"B": 1, "S": 8, "D": 32, "H": 4, "KVH": 2, "F": 48}


@functools.cache
def _llama(dtype: str = "f32") -> edatalog.Program:
    return edatalog.compile(LLAMA, dims=DIMS, dtype=dtype)


def _compile(text: str) -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.compile_string(text)


def _split(prog: edatalog.Program, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    params = {r.name for r in prog.arguments if r.kind == "param"}
    return {k: v for k, v in values.items() if k in params}, {k: v for k, v in values.items() if k not in params}


def _pair(prog: edatalog.Program, plan: Any = None, seed: int = 0) -> tuple[Executable, Executable, dict[str, Any]]:
    """A compiled and an interpreted executable of ``prog``, loaded alike, and the inputs."""
    params, inputs = _split(prog, prog.random_inputs(seed=seed))
    made = []
    for mode in ("graph", "none"):
        exe = edatalog.executable(prog, plan, backend="torch", device="cpu", compile=mode)
        exe.load(params)
        made.append(exe)
    return made[0], made[1], inputs


def _impl(exe: Executable) -> CompiledExecutable:
    assert isinstance(exe._impl, CompiledExecutable)
    return exe._impl


@pytest.fixture(autouse=True)
def _fresh_process_cache() -> None:
    compiled._KEPT.clear()


# -- when it compiles, what it keeps ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_the_first_call_interprets_the_second_compiles_and_graphs_replay_bit_for_bit(dtype: str) -> None:
    prog = _llama(dtype)
    exe, ref, inputs = _pair(prog)
    want = ref(inputs)["y"]
    first = exe(inputs)["y"]
    assert not _impl(exe).replays  # interpreted
    second = exe(inputs)["y"]
    replay = _impl(exe).last_compiled
    assert replay is not None and replay.mode is compiled.Compile.GRAPH and replay.nodes > 0
    third = exe(inputs)["y"]
    assert _impl(exe).last_compiled is replay  # nothing compiled again
    for got in (first, second, third):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_plan_of_several_logical_devices_replays_what_the_interpreter_computes() -> None:
    """Bit for bit where the presence pass decided every buffer (Megatron); within rounding
    where a random plan cuts attention apart: there a partial that turns out full keeps its mask
    in the graph (no decision on values), where the interpreter drops it and sums in another
    order."""
    prog = _llama()
    for plan, tolerance in (
        (edatalog.plan(prog, topology="cpux3", strategy="megatron"), 0.0),
        (edatalog.plan(prog, topology="cpux3", strategy="random", seed=3), 1e-5),
    ):
        exe, ref, inputs = _pair(prog, plan)
        want = ref(inputs)["y"]
        for _ in range(3):
            torch.testing.assert_close(exe(inputs)["y"], want, rtol=tolerance, atol=tolerance)
        assert _impl(exe).replays


def test_compiled_graphs_are_kept_for_the_process() -> None:
    """A second executable of the same program replays from its first call."""
    prog = _llama()
    exe, _, inputs = _pair(prog)
    exe(inputs)
    exe(inputs)
    calls: list[int] = []
    eager = TorchExecutable.__call__

    def counting(self: TorchExecutable, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return eager(self, *args, **kwargs)

    again, _, _ = _pair(prog)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TorchExecutable, "__call__", counting)
        again(inputs)
    assert not calls and _impl(again).replays


def test_new_weights_need_no_recompiling() -> None:
    prog = _llama()
    exe, ref, inputs = _pair(prog)
    exe(inputs)
    exe(inputs)
    replay = _impl(exe).last_compiled
    other = _split(prog, prog.random_inputs(seed=7))[0]
    exe.load(other)
    ref.load(other)
    torch.testing.assert_close(exe(inputs)["y"], ref(inputs)["y"], rtol=0, atol=0)
    assert _impl(exe).last_compiled is replay


def test_a_new_input_shape_is_a_new_signature() -> None:
    prog = _compile("dim N = 4.\ninput x[N] : f32.\noutput y.\ny[i] = x[i] * 2.0 + 1.0.")
    exe = edatalog.executable(prog, backend="torch", device="cpu")
    x = torch.arange(4, dtype=torch.float32)
    for _ in range(3):
        torch.testing.assert_close(exe({"x": x})["y"], x * 2 + 1)
    sliced = torch.arange(8, dtype=torch.float32)[4:]  # another storage offset: taken as a copy at offset 0
    torch.testing.assert_close(exe({"x": sliced})["y"], sliced * 2 + 1)
    assert len(_impl(exe).replays) == 1


def test_recording_calls_run_the_interpreter() -> None:
    prog = _llama()
    exe, _, inputs = _pair(prog)
    exe(inputs)
    exe(inputs)
    out = exe.run(inputs, record=True)
    assert exe.last_times and out.values["y"].shape == (1, 8, 32)
    exe(inputs)
    assert exe.last_times == []


def test_outputs_that_may_lack_cells_keep_their_presence() -> None:
    """y has a cell only where some j <= i: row 0 of a 4 x 4 band under i < 2 is absent where
    the guard leaves it; the compiled graph returns the mask, and outputs equal the
    interpreter's, absent cells 0."""
    prog = _compile(
        "dim N = 4.\ninput x[N, N] : f32.\noutput y, z.\n"
        "y[i, k:N] += x[i, j] where j < i, k <= i.\n"
        "z[i] = x[i, i] + 1.0.\n"
    )
    exe, ref, inputs = _pair(prog)
    want = ref.run(inputs)
    for _ in range(3):
        got = exe.run(inputs)
        for name in ("y", "z"):
            torch.testing.assert_close(got.values[name], want.values[name], rtol=0, atol=0)
            assert (got.present[name] is None) == (want.present[name] is None), name
            mask, wanted = got.present[name], want.present[name]
            if wanted is not None:
                assert mask is not None and torch.equal(mask, wanted), name
    assert _impl(exe).replays and want.present["y"] is not None and want.present["z"] is None


def test_a_guarded_contraction_replays_fast_and_falls_back_where_a_factor_is_not_finite() -> None:
    """The graph takes a guarded sum of products as a contraction with the guard a 0/1 factor,
    assuming its factors finite (an infinite value at an excluded point would give inf * 0 =
    nan there); where the assumption fails the call runs on the interpreter, which masks."""
    prog = _compile(
        "dim N = 6.\ninput x[N, N] : f32.\ninput w[N] : f32.\noutput y.\ny[i] += x[i, j] * w[j] where j <= i.\n"
    )
    exe, ref, _ = _pair(prog)
    x = torch.randn(6, 6)
    w = torch.randn(6)
    for _ in range(3):
        torch.testing.assert_close(exe({"x": x, "w": w})["y"], ref({"x": x, "w": w})["y"], rtol=0, atol=0)
    replay = next(iter(_impl(exe).replays.values()))
    assert replay.checks and _impl(exe)._replayed
    x[0, 5] = float("inf")  # excluded by the guard: y stays finite
    want = ref({"x": x, "w": w})["y"]
    assert torch.isfinite(want).all()
    torch.testing.assert_close(exe({"x": x, "w": w})["y"], want, rtol=0, atol=0)
    assert not _impl(exe)._replayed


def test_lookups_compile_and_out_of_range_ids_are_still_errors() -> None:
    prog = _compile(
        "dim B = 2, S = 3, V = 7, D = 4.\ninput ids[B, S] : i64.\nparam emb[V, D] : f32.\noutput y.\n"
        "y[b, s, d] = emb[v, d] * 2.0 where ids[b, s] = v.\n"
    )
    exe, ref, _ = _pair(prog)
    ids = torch.tensor([[0, 6, 3], [2, 2, 5]])
    for _ in range(3):
        torch.testing.assert_close(exe({"ids": ids})["y"], ref({"ids": ids})["y"], rtol=0, atol=0)
    assert _impl(exe).replays
    with pytest.raises(edatalog.EdlError, match=r"ids\[0, 1\] = 7 is out of range"):
        exe({"ids": torch.tensor([[0, 7, 3], [2, 2, 5]])})


def test_compile_modes_are_checked() -> None:
    prog = _llama()
    with pytest.raises(edatalog.EdlError, match="unknown compile mode 'fast'"):
        edatalog.executable(prog, backend="torch", compile="fast")
    exe = edatalog.executable(prog, backend="torch", device="cpu", compile="none")
    assert isinstance(exe._impl, TorchExecutable)
    assert _impl(edatalog.executable(prog, backend="torch", device="cpu")).mode is compiled.Compile.GRAPH
    with pytest.raises(edatalog.EdlError, match="'cudagraph' replays on one CUDA GPU, but the program runs on cpu"):
        edatalog.executable(prog, backend="torch", device="cpu", compile="cudagraph")


# -- CUDA graphs -----------------------------------------------------------------------------------


def _on_gpu(prog: edatalog.Program, mode: str, params: dict[str, Any], plan: Any = None) -> Executable:
    exe = edatalog.executable(prog, plan, backend="torch", device="cuda", compile=mode)
    exe.load(params)  # numpy, onto the executable's GPU
    return exe


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_a_cuda_graph_replays_the_graph_bit_for_bit(dtype: str) -> None:
    prog = _llama(dtype)
    params, _ = _split(prog, prog.random_inputs(seed=0))
    exe, ref = _on_gpu(prog, "auto", params), _on_gpu(prog, "graph", params)
    assert _impl(exe).mode is compiled.Compile.CUDAGRAPH  # auto, on one GPU
    kept = []
    for seed in range(4):  # interpreted, captured, then replays of new inputs
        inputs = _split(prog, prog.random_inputs(seed=seed))[1]
        got, want = exe(inputs)["y"], ref(inputs)["y"]
        assert got.is_cuda and torch.equal(got, want), seed
        kept.append((got, want))
    graphed = list(_impl(exe).graphed.values())
    assert graphed and all(g.captured for g in graphed)
    assert all(torch.equal(got, want) for got, want in kept)  # a later replay leaves earlier results be


@pytest.mark.gpu
def test_a_cuda_graph_takes_new_weights_and_plans_of_logical_devices() -> None:
    prog = _llama()
    params, inputs = _split(prog, prog.random_inputs(seed=0))
    plan = edatalog.plan(prog, topology="a100x4", strategy="megatron")
    exe, ref = _on_gpu(prog, "cudagraph", params, plan), _on_gpu(prog, "graph", params, plan)
    for _ in range(3):
        assert torch.equal(exe(inputs)["y"], ref(inputs)["y"])
    other = _split(prog, prog.random_inputs(seed=5))[0]
    for e in (exe, ref):
        e.load(other)
    assert torch.equal(exe(inputs)["y"], ref(inputs)["y"])  # captured again on the new weights


@pytest.mark.gpu
def test_inductor_kernels_replay_as_a_cuda_graph() -> None:
    prog = _compile("dim N = 1024.\ninput x[N] : f32.\noutput y.\ny[i] = exp(x[i] * 0.5) + x[i].")
    exe = edatalog.executable(prog, backend="torch", device="cuda", compile="inductor")
    for _ in range(4):
        x = torch.randn(1024, device="cuda")
        torch.testing.assert_close(exe({"x": x})["y"], torch.exp(x * 0.5) + x)
    graphed = list(_impl(exe).graphed.values())
    assert graphed and all(isinstance(g, cudagraphs.CudaGraphed) and g.captured for g in graphed)


@pytest.mark.gpu
def test_a_program_that_carries_state_replays_as_a_graph() -> None:
    from tests.edatalog.test_training import SGD_MLP

    prog, _ = edatalog.step_program(edatalog.compile_string(SGD_MLP, name="mlp.edl"), optimizer=edatalog.SGD(lr=0.1))
    assert prog.graph.carries
    exe = edatalog.executable(prog, backend="torch", device="cuda")
    assert _impl(exe).mode is compiled.Compile.GRAPH
    with pytest.raises(edatalog.EdlError, match="carries state"):
        edatalog.executable(prog, backend="torch", device="cuda", compile="cudagraph")


@pytest.mark.slow
def test_inductor_compiles_the_graph(caplog: pytest.LogCaptureFixture) -> None:
    prog = _compile("dim N = 16.\ninput x[N] : f32.\noutput y.\ny[i] = exp(x[i] * 0.5) + x[i].")
    exe = edatalog.executable(prog, backend="torch", device="cpu", compile="inductor")
    x = torch.randn(16)
    caplog.set_level(logging.INFO, logger="edatalog.notice")
    for _ in range(3):
        torch.testing.assert_close(exe({"x": x})["y"], torch.exp(x * 0.5) + x)
    assert any("compiling" in r.getMessage() and "inductor" in r.getMessage() for r in caplog.records)
    replay = _impl(exe).last_compiled
    assert replay is not None and replay.mode is compiled.Compile.INDUCTOR


# -- the recorder ----------------------------------------------------------------------------------


def test_the_recorder_replays_what_it_saw() -> None:
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    constant = torch.randn(5)

    def fn(x: Any, y: Any) -> list[Any]:
        z = (x @ y).t().contiguous()
        return [z[1:] + constant[1:, None], None]

    rec = record(fn, [a, b])
    gm = torch.fx.GraphModule(rec.module, rec.graph)
    assert torch.equal(gm(a, b)[0], rec.outputs[0]) and gm(a, b)[1] is None
    a2, b2 = torch.randn(3, 4), torch.randn(4, 5)
    assert torch.equal(gm(a2, b2)[0], fn(a2, b2)[0])


def test_the_recorder_refuses_decisions_on_values() -> None:
    def reads_back(x: Any) -> list[Any]:
        return [x * 2 if float(x.sum()) > 0 else x]

    def nonzero(x: Any) -> list[Any]:
        return [torch.nonzero(x)]

    for fn in (reads_back, nonzero):
        with pytest.raises(TraceError, match="depends on values"):
            record(fn, [torch.randn(4)])


# -- the graph passes, each bit for bit ------------------------------------------------------------


def _graph(fn: Any, *args: Any) -> tuple[Any, Any, dict[Any, Any], list[Any]]:
    rec = record(fn, list(args))
    return rec.module, rec.graph, rec.shapes, rec.outputs


def _ops(graph: Any, name: str) -> int:
    return sum(1 for n in graph.nodes if name in str(n.target))


def test_view_chains_fold_into_one_view_of_their_base() -> None:
    x = torch.randn(2, 3, 8)

    def fn(x: Any) -> list[Any]:
        v = x.view(6, 8)[1:5].t().reshape(8, 2, 2).permute(2, 0, 1)
        w = x.view(6, 8)  # its own shape again: the base itself
        return [v * 2, w.view(2, 3, 8) + 1]

    module, graph, shapes, want = _graph(fn, x)
    assert fxpasses.fold_views(graph, shapes) > 0
    graph.eliminate_dead_code()
    gm = torch.fx.GraphModule(module, graph)
    views = [n for n in graph.nodes if fxnodes.is_view(n)]
    assert len(views) == 1 and "as_strided" in str(views[0].target)
    got = gm(x)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    y = torch.randn(2, 3, 8)
    assert all(torch.equal(g, w) for g, w in zip(gm(y), fn(y), strict=True))


def test_constants_fold_unless_something_writes_into_them() -> None:
    def fn(x: Any) -> list[Any]:
        scale = torch.full((), 3.0) * 2  # folded: reads no input
        table = torch.arange(4, dtype=torch.float32)
        table.mul_(2)  # written in place: made on every call
        return [x * scale + table]

    x = torch.randn(4)
    module, graph, _, want = _graph(fn, x)
    assert fxpasses.fold_constants(graph, module) >= 1
    graph.eliminate_dead_code()
    gm = torch.fx.GraphModule(module, graph)
    assert _ops(graph, "full") == 0 and _ops(graph, "arange") == 1
    for _ in range(2):  # the in-place write does not accumulate from call to call
        assert torch.equal(gm(x)[0], want[0])


def test_equal_values_are_computed_once_but_two_outputs_keep_their_own_memory() -> None:
    """share_values: ``exp(x)`` twice is computed once; two equal copies that are both returned
    stay two (merged, a caller writing into one output would change the other)."""

    def fn(x: Any) -> list[Any]:
        first, second = x.t().contiguous(), x.t().contiguous()
        return [first, second, torch.exp(x) + torch.exp(x)]

    x = torch.randn(3, 4)
    module, graph, _, want = _graph(fn, x)
    assert _ops(graph, "exp") == 2 and _ops(graph, "clone") == 2
    fxpasses.share_views(graph)  # one transpose of x: the copies' arguments are then one
    fxpasses.share_values(graph, module)
    graph.eliminate_dead_code()
    assert _ops(graph, "exp") == 1 and _ops(graph, "clone") == 2
    got = torch.fx.GraphModule(module, graph)(x)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert got[0].data_ptr() != got[1].data_ptr()


def test_every_output_is_the_callers_own_memory_after_simplify() -> None:
    """Whatever the passes share or fold, a caller writing into one output changes neither
    another output nor what a later call returns: equal elements of multi-output ops, equal
    constants (folded, then shared into one), a view of a constant."""

    def fn(x: Any) -> list[Any]:
        twice = torch.ones(3) * 2
        return [x.max(1).values, x.max(1).values, twice, torch.ones(3) * 2, twice.view(1, 3), x + 1]

    x = torch.randn(3, 4)
    rec = record(fn, [x])
    gm, summary = fxpasses.simplify(rec.module, rec.graph, rec.shapes)
    assert summary["outputs_copied"] == 3
    first = gm(x)
    for k, out in enumerate(first):
        out.add_(100.0)  # the caller's to write
        others = [o for j, o in enumerate(gm(x)) if j != k] + [o for j, o in enumerate(first) if j != k]
        assert all(o.abs().max() < 100 for o in others), k
        out.sub_(100.0)


def test_a_copy_updated_in_place_becomes_the_op_on_the_view() -> None:
    def fn(x: Any, c: Any) -> list[Any]:
        view = x[:, 1:3]
        owned = torch.empty(view.shape)
        owned.copy_(view)
        torch.mul(owned, c, out=owned)
        torch.add(owned, 1.0, out=owned)
        return [owned]

    x, c = torch.randn(4, 5), torch.randn(2)
    module, graph, shapes, want = _graph(fn, x, c)
    fxpasses.fold_views(graph, shapes)
    assert fxpasses.copies_into_fresh(graph, shapes) == 1
    graph.eliminate_dead_code()
    gm = torch.fx.GraphModule(module, graph)
    assert _ops(graph, "empty") == 0 and _ops(graph, "copy_") == 0
    assert torch.equal(gm(x, c)[0], want[0])


def test_a_copy_only_read_by_pointwise_ops_becomes_its_view() -> None:
    def fn(x: Any, c: Any) -> list[Any]:
        view = x[:, 1:3]
        owned = torch.empty(view.shape)
        owned.copy_(view)
        made = torch.mul(x[:, 3:5], 3.0)
        torch.addcmul(made, owned, c, value=-1, out=made)  # reads the copy, writes elsewhere
        return [made, torch.exp(owned)]

    x, c = torch.randn(4, 5), torch.randn(2)
    module, graph, shapes, want = _graph(fn, x, c)
    fxpasses.fold_views(graph, shapes)
    assert fxpasses.copies_only_read(graph, shapes) == 1
    graph.eliminate_dead_code()
    gm = torch.fx.GraphModule(module, graph)
    assert _ops(graph, "empty") == 0 and _ops(graph, "copy_") == 0
    for got, w in zip(gm(x, c), want, strict=True):
        assert torch.equal(got, w)


def test_a_copy_stays_where_its_view_is_written_or_it_is_read_otherwise() -> None:
    def written(x: Any, c: Any) -> list[Any]:
        view = x[:, 1:3]
        owned = torch.empty(view.shape)
        owned.copy_(view)
        x.mul_(2.0)  # the view changes after the copy: the copy keeps the old values
        return [torch.mul(owned, c)]

    def viewed(x: Any, c: Any) -> list[Any]:
        owned = torch.empty((4, 2))
        owned.copy_(x[:, 1:3])
        return [torch.mul(owned, c), owned.t() @ x]  # read through a view, and by a matmul

    for fn in (written, viewed):
        x, c = torch.randn(4, 5), torch.randn(2)
        module, graph, shapes, want = _graph(fn, x.clone(), c)
        fxpasses.fold_views(graph, shapes)
        assert fxpasses.copies_only_read(graph, shapes) == 0, fn.__name__
        gm = torch.fx.GraphModule(module, graph)
        for got, w in zip(gm(x.clone(), c), want, strict=True):
            assert torch.equal(got, w)


def test_a_copy_of_a_transposed_view_stays() -> None:
    """Ops on a transposed view make transposed results, which a row sum or a GEMM reads in
    another order than the copy's (other bits): the copy of such a view stays, in both passes."""

    def updated(x: Any) -> list[Any]:
        owned = torch.empty((x.shape[1], x.shape[0]))
        owned.copy_(x.t())
        torch.mul(owned, 3.0, out=owned)
        return [owned.sum(-1), owned @ torch.ones(x.shape[0], 7)]

    def read(x: Any) -> list[Any]:
        owned = torch.empty((x.shape[1], x.shape[0]))
        owned.copy_(x.t())
        made = torch.mul(owned, 3.0)
        return [made.sum(-1), made @ torch.ones(x.shape[0], 7)]

    for fn, rewrite in ((updated, fxpasses.copies_into_fresh), (read, fxpasses.copies_only_read)):
        x = torch.randn(1000, 64)
        module, graph, shapes, want = _graph(fn, x)
        fxpasses.fold_views(graph, shapes)
        assert rewrite(graph, shapes) == 0, fn.__name__
        gm = torch.fx.GraphModule(module, graph)
        for got, w in zip(gm(x), want, strict=True):
            assert torch.equal(got, w), fn.__name__


def test_simplify_keeps_the_results_of_a_traced_block_bit_for_bit() -> None:
    prog = _llama()
    exe, ref, inputs = _pair(prog)
    exe(inputs)
    exe(inputs)
    summary = _impl(exe).last_compiled.summary  # type: ignore[union-attr]
    assert summary["nodes"] < summary["nodes_before"] and summary["views_folded"] and summary["fast_calls"]
    x = torch.from_numpy(np.asarray(prog.random_inputs(seed=5)["x"]))
    torch.testing.assert_close(exe({"x": x})["y"], ref({"x": x})["y"], rtol=0, atol=0)


def test_a_replayed_call_holds_what_the_interpreter_holds() -> None:
    """On a CPU the peak of a replayed call is its programs' buffers at most, counted as the
    interpreter counts them while it runs."""
    prog = _llama()
    plan = edatalog.plan(prog, topology="cpux2", strategy="megatron")
    exe, ref, inputs = _pair(prog, plan)
    ref(inputs)
    for _ in range(3):
        exe(inputs)
    assert _impl(exe).replays
    assert exe.peak_memory() == ref.peak_memory()
