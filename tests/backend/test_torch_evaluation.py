"""The evaluator on torch tensors (:data:`edatalog.backend.kernels.arrays.TORCH`) against the numpy
reference and the brute-force oracle: random programs node by node, half precision, index
expressions that pad, bands, the chunked path, contractions and writes into torch buffers.

A torch runtime calls ``evaluate_node(node, data, present, xp=TORCH)`` and ``write_cells(...,
xp=TORCH)``; these tests pin that it then computes what the reference computes: the same cells
present, the same values (to rounding: BLAS and libm differ between the two), the same dtypes,
and tensors out, never numpy arrays.

For a longer, random run::

    EDL_PROPERTY_EXAMPLES=2000 .venv/bin/pytest tests/backend/test_torch_evaluation.py
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given

import edatalog
from edatalog.backend.kernels import joinagg
from edatalog.backend.kernels.arrays import (
    NUMPY,
    ONEDNN_F32_MIN_MACS,
    TORCH,
    TorchOps,
    _cpu_has_bf16,
    onednn_linear_op,
    overlaps,
)
from edatalog.backend.kernels.contract import contract
from edatalog.backend.kernels.joinagg import evaluate_node
from edatalog.backend.kernels.reference import Value, evaluate, write_cells
from edatalog.errors import EdlWarning
from edatalog.ir.graph import Graph
from tests.strategies import GeneratedProgram, example_settings, programs

_SETTINGS = example_settings("EDL_PROPERTY_EXAMPLES", 100)
_CHUNKED_SETTINGS = example_settings("EDL_PROPERTY_EXAMPLES", 60)
RTOL, ATOL = 1e-9, 1e-12


def _compile(text: str, **dims: int) -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.compile_string(text, dims=dims)


def _host(a: Any) -> np.ndarray:
    assert isinstance(a, torch.Tensor), f"expected a tensor, got {type(a).__name__}"
    return TORCH.to_numpy(a)


def _mask(present: Any, shape: tuple[int, ...]) -> np.ndarray:
    if present is None:
        return np.ones(shape, dtype=bool)
    return np.broadcast_to(_host(present) if isinstance(present, torch.Tensor) else present, shape)


def _on_torch(env: Mapping[str, Value]) -> dict[str, Value]:
    return {
        name: Value(TORCH.asarray(v.data), None if v.present is None else TORCH.asarray(v.present))
        for name, v in env.items()
    }


def _assert_same_relations(got: Mapping[str, Value], want: Mapping[str, Value], rtol: float, atol: float) -> None:
    """Torch relations against numpy ones: dtype, presence, values on present cells, 0 elsewhere."""
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        data = _host(g.data)
        assert data.dtype == w.data.dtype, f"{name}: {data.dtype}, expected {w.data.dtype}"
        assert data.shape == w.data.shape, name
        present = _mask(g.present, data.shape)
        assert np.array_equal(present, _mask(w.present, data.shape)), f"{name}: presence"
        np.testing.assert_allclose(
            data.astype(np.float64), np.asarray(w.data, dtype=np.float64), rtol=rtol, atol=atol, err_msg=name
        )
        assert np.all(data[~present] == 0), f"{name}: absent cells must hold 0"


def _node_by_node(graph: Graph, env: Mapping[str, Value]) -> None:
    """Each node on torch, from the reference's values of what it reads, against the same node
    on numpy: the same output indices, presence and values."""
    tenv = _on_torch(env)
    for node in graph.nodes:
        reads = [env[a.relation] for a in node.inputs]
        treads = [tenv[a.relation] for a in node.inputs]
        with np.errstate(all="ignore"):
            want, want_present, want_vars = evaluate_node(node, [v.data for v in reads], [v.present for v in reads])
        got, got_present, got_vars = evaluate_node(
            node, [v.data for v in treads], [v.present for v in treads], xp=TORCH
        )
        assert got_vars == want_vars, node.name
        value = _host(got)
        assert value.dtype == np.asarray(want).dtype, node.name
        shape = np.broadcast_shapes(value.shape, np.shape(want))
        present = _mask(got_present, shape)
        assert np.array_equal(present, _mask(want_present, shape)), f"{node.name}: presence"
        np.testing.assert_allclose(
            np.broadcast_to(value, shape)[present],
            np.broadcast_to(want, shape)[present],
            rtol=RTOL,
            atol=ATOL,
            err_msg=f"{node.name}: {node}",
        )


@_SETTINGS
@given(programs())
def test_torch_matches_the_reference_node_by_node(gen: GeneratedProgram) -> None:
    """Every node of a random program evaluated on f64 tensors equals the numpy reference's node,
    and the whole program on torch equals the oracle: presence exactly, values to 1e-9."""
    graph = gen.compile().graph
    env = evaluate(graph, gen.inputs)
    _node_by_node(graph, env)
    got = evaluate(graph, gen.inputs, xp=TORCH)
    for name in gen.derived:
        data, present = gen.expected[name]
        g = got[name]
        values = _host(g.data)
        assert np.array_equal(_mask(g.present, data.shape), present), f"{name}: presence"
        np.testing.assert_allclose(values[present], data[present], rtol=RTOL, atol=ATOL, err_msg=name)
        assert np.all(values[~present] == 0), name


@pytest.mark.usefixtures("tiny_chunks")
@_CHUNKED_SETTINGS
@given(programs())
def test_torch_in_chunks_matches_the_oracle(gen: GeneratedProgram) -> None:
    """With chunks of 5 points every broadcast rule runs in pieces (output or aggregated index):
    on torch too, the results equal the oracle's."""
    got = evaluate(gen.compile().graph, gen.inputs, xp=TORCH)
    for name in gen.derived:
        data, present = gen.expected[name]
        g = got[name]
        assert np.array_equal(_mask(g.present, data.shape), present), name
        np.testing.assert_allclose(_host(g.data)[present], data[present], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.fixture
def tiny_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(joinagg, "CHUNK_POINTS", 5)


CHUNKED = """
dim N = 3, K = 40.
input x[N, K] : f64.
input m[N, K] : bool.
output s, p, hi, lo, any, all, kept, ps.
s[i] += x[i, k] * x[i, k] + 1.0 where k >= i.
p[i] *= 1.0 + x[i, k] / 8.0 where k < 30.
hi[i] max= x[i, k] - x[i, k - 1].
lo[i] min= x[i, k] where k > 12 * i, k < 20.
any[i] max= m[i, k] where k >= i.
all[i] min= m[i, k].
kept[i, k] = where(m[i, k] and not m[i, k - 1], x[i, k], -x[i, k]).
prev[i, k:K] = x[i, k - 1].
ps[i] += prev[i, k] * x[i, k].
"""


@pytest.mark.usefixtures("tiny_chunks")
def test_chunks_along_an_aggregated_index() -> None:
    """The longest index is aggregated: each chunk is reduced, masked with the identity where it
    has no point, and folded into the others; a cell no chunk reaches stays absent.  Every
    aggregation, bool ones with logical ops, on torch against numpy, both in tiny chunks."""
    prog = _compile(CHUNKED)
    inputs = prog.random_inputs(6)
    got, want = _both(prog, inputs)
    _assert_same_relations(got, want, RTOL, ATOL)
    assert got["any"].data.dtype == torch.bool
    assert _host(got["lo"].present).tolist() == [True, True, False]
    x = inputs["x"]
    np.testing.assert_allclose(_host(got["p"].data), np.prod(1 + x[:, :30] / 8, axis=1), rtol=1e-12)
    np.testing.assert_allclose(_host(got["ps"].data), np.sum(x[:, :-1] * x[:, 1:], axis=1), rtol=1e-12)


def _both(prog: edatalog.Program, inputs: Mapping[str, np.ndarray]) -> tuple[dict[str, Value], dict[str, Value]]:
    return evaluate(prog.graph, inputs, xp=TORCH), evaluate(prog.graph, inputs)


# -- half precision -------------------------------------------------------------------------------

HALF = """
dim N = 6, K = 300.
input x[N, K] : {t}.
param w[K] : {t}.
output s, one, ones, y, u, m, e.
s[i] += x[i, k] * w[k].
one[i, k] = x[i, k] * 0.0 + 1.0.
ones[i] += one[i, k].
y[i, k] = x[i, k] * 1.001 + w[k].
u[i] += y[i, k].
m[i] max= x[i, k] - w[k].
e[i, k] = exp(x[i, k]) / (1.0 + w[k] * w[k]).
"""


@pytest.mark.parametrize(("name", "ulp"), [("bf16", 2.0**-8), ("f16", 2.0**-11)])
def test_half_precision_computes_in_f32_and_rounds_when_stored(name: str, ulp: float) -> None:
    """f16/bf16 rules compute in f32 and round once, when a relation is stored, on torch as on
    numpy: the same dtypes out, bitwise the same cells where every step is an IEEE operation
    (``y``, ``m``), within one unit in the last place where BLAS or libm round differently (the
    sums, ``exp``).  Counting 300 ones in ``ones`` shows the accumulation is f32: in bf16 it
    would stop at 256."""
    prog = _compile(HALF.format(t=name))
    inputs = prog.random_inputs(0)
    assert inputs["x"].dtype == (np.dtype(ml_dtypes.bfloat16) if name == "bf16" else np.float16)
    got, want = _both(prog, inputs)
    assert got["y"].data.dtype == TORCH.dtype(name)
    _assert_same_relations(got, want, rtol=ulp, atol=ulp * 1e-2)
    for exact in ("y", "m", "one", "ones"):
        np.testing.assert_array_equal(_host(got[exact].data), want[exact].data, err_msg=exact)
    np.testing.assert_array_equal(_host(got["ones"].data).astype(np.float64), np.full(6, 300.0))
    # ``u`` reads ``y`` as stored (rounded), in f32: the sum of the rounded cells, rounded once.
    y32 = np.asarray(want["y"].data, dtype=np.float32)
    u = y32.astype(np.float64).sum(axis=1).astype(np.float32).astype(want["u"].data.dtype)
    np.testing.assert_allclose(_host(got["u"].data).astype(np.float64), u.astype(np.float64), rtol=ulp)


def test_half_precision_inputs_as_torch_tensors_round_trip() -> None:
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(ml_dtypes.bfloat16)
    t = TORCH.asarray(x)
    assert t.dtype == torch.bfloat16
    np.testing.assert_array_equal(TORCH.to_numpy(t), x)
    np.testing.assert_array_equal(NUMPY.asarray(t), x)


# -- index expressions, bands, contractions ----------------------------------------------------------

SHIFTS = """
dim B = 2, T = 7, C = 3, O = 4, K = 3.
input x[B, T] : f64.
input xc[B, C, T] : f64.
param w[O, C, K] : f64.
param v[K] : f64.
output prev, diff, rev, same, back, mixed.
prev[b, t:T] = x[b, t - 1].
diff[b, t] = x[b, t] - x[b, t - 1].
rev[b, t:T] = x[b, T - 1 - t].
same[b, o, l:T] += xc[b, c, l + k - 1] * w[o, c, k].
back[b, o, l:T] += xc[b, c, l - k + 1] * w[o, c, k].
mixed[b, t:T] max= x[b, t - k] + x[b, T - 1 - t + k] * v[k].
"""


def test_index_expressions_that_pad_or_run_backwards() -> None:
    """``x[b, t - 1]`` reads zero padding where it falls outside (absent there), ``x[T - 1 - t]``
    and ``l - k`` step backwards (torch has no negative strides: the view is flipped), and a
    same-padded convolution equals ``conv1d``."""
    prog = _compile(SHIFTS)
    inputs = prog.random_inputs(3)
    got, want = _both(prog, inputs)
    _assert_same_relations(got, want, RTOL, ATOL)
    x = inputs["x"]
    prev = got["prev"]
    assert prev.present is not None and isinstance(prev.present, torch.Tensor)
    assert _host(prev.present)[:, 0].tolist() == [False, False]
    np.testing.assert_array_equal(_host(prev.data)[:, 1:], x[:, :-1])
    np.testing.assert_array_equal(_host(got["rev"].data), x[:, ::-1])
    xc, w = torch.from_numpy(inputs["xc"]), torch.from_numpy(inputs["w"])
    conv = torch.nn.functional.conv1d(xc, w, padding=1).numpy()
    np.testing.assert_allclose(_host(got["same"].data), conv, rtol=1e-10, atol=1e-12)
    flipped = torch.nn.functional.conv1d(xc, w.flip(-1), padding=1).numpy()
    np.testing.assert_allclose(_host(got["back"].data), flipped, rtol=1e-10, atol=1e-12)


def test_bands_on_torch() -> None:
    """A sliding maximum and a band between sums of indices, evaluated over the band."""
    prog = _compile(
        "dim B = 2, T = 50, C = 3, N = 6, M = 20.\ninput x[B, T, C] : f64.\ninput z[M] : f64.\n"
        "output slide, y.\n"
        "slide[b, t:T - 2, c] max= x[b, u, c] where u >= t, u <= t + 2.\n"
        "y[i:N, j:N] += z[u] where u >= i + j - 1, u <= i + j + 1.\n"
    )
    inputs = prog.random_inputs(1)
    got, want = _both(prog, inputs)
    _assert_same_relations(got, want, RTOL, ATOL)
    windows = np.lib.stride_tricks.sliding_window_view(inputs["x"], 3, axis=1).max(axis=-1)
    np.testing.assert_array_equal(_host(got["slide"].data), windows)


CONTRACTIONS = """
dim N = 5, K = 7, M = 4.
input a[N, K] : f64.
input b[K, M] : f64.
input c[M] : f64.
input n[N, K] : i32.
input g[K, M] : i32.
output chain, scaled, ratio, ints, counted, guarded, poisoned.
chain[i] += a[i, k] * b[k, m] * c[m].
scaled[i, m] += -2.5 * a[i, k] / (1.0 + b[k, m] * b[k, m]) * 0.5.
ratio[i] += a[i, k] / c[m] where m < 3.
ints[i, m] += n[i, k] * g[k, m].
counted[i] += n[i, k] * 2.
guarded[i, m] += a[i, k] * b[k, m] where k <= i, k + m >= 2.
poisoned[i] += a[i, k] / (c[m] - c[m]) where m > 5.
"""


def test_contractions_on_torch() -> None:
    """Sums of products go pairwise through ``matmul`` on torch as on numpy: chains, constant
    scales and divisors, integer operands (torch sums them in 64 bits and is cast back), a guard
    as a 0/1 factor, and a factor that is not finite (``1 / 0``), which falls back to the masked
    path so that absent points (every point here) do not poison the sum."""
    prog = _compile(CONTRACTIONS)
    inputs = prog.random_inputs(2)
    got, want = _both(prog, inputs)
    _assert_same_relations(got, want, RTOL, ATOL)
    a, b, c = inputs["a"], inputs["b"], inputs["c"]
    np.testing.assert_allclose(_host(got["chain"].data), a @ b @ c, rtol=1e-12)
    assert _host(got["ints"].data).dtype == np.int32
    np.testing.assert_array_equal(_host(got["ints"].data), inputs["n"].astype(np.int64) @ inputs["g"])
    poisoned = got["poisoned"]
    assert poisoned.present is not None and not _host(poisoned.present).any()


def test_contract_takes_a_namespace() -> None:
    rng = np.random.default_rng(3)
    ext = {"i": 4, "j": 5, "k": 60, "l": 3}
    pairs = [("i", "j"), ("j", "k"), ("k", "l")]
    arrays = [rng.standard_normal((ext[p], ext[q])) for p, q in pairs]
    operands = [(torch.from_numpy(m), ix) for m, ix in zip(arrays, pairs, strict=True)]
    got, order = contract(operands, ["i", "l"], ext, TORCH)
    assert order == ("i", "l")
    np.testing.assert_allclose(_host(got), arrays[0] @ arrays[1] @ arrays[2], rtol=1e-10)


# -- writing into buffers -------------------------------------------------------------------------

HEADS = """
dim N = 4.
input x[N, N] : f64.
output d, dm, p, first.
d[i, i] = x[i, j] where j == 0.
dm[i, i] max= x[i, j] where j <= i.
dm[i, i] max= x[j, i] + 1.0 where j < 1.
p[(1, i)] *= x[i, j] where i + j < 4.
first[0, i] = x[i, 0] where i < 2.
"""


def test_heads_write_into_torch_buffers() -> None:
    """Diagonal heads (written through flat cell numbers, never through ``nonzero``), several
    rules folded with ``max=``, composite heads with a fixed place, and a caller's own buffer,
    written in place."""
    prog = _compile(HEADS)
    inputs = prog.random_inputs(5)
    got, want = _both(prog, inputs)
    _assert_same_relations(got, want, RTOL, ATOL)

    node = prog.graph.node("first")
    value, present, out_vars = evaluate_node(node, [TORCH.asarray(inputs["x"])], [None], xp=TORCH)
    assert prog.graph.relation("first").shape == (1, 4)
    buf = torch.full((1, 4), -1.0, dtype=torch.float64)
    cells = torch.zeros((1, 4), dtype=torch.bool)
    write_cells(buf, cells, node, value, present, out_vars, None, xp=TORCH)
    assert cells.tolist() == [[True, True, False, False]]
    assert buf[0].tolist() == [*inputs["x"][:2, 0].tolist(), -1.0, -1.0]


def test_a_namespace_with_a_default_device_places_what_has_no_input() -> None:
    prog = _compile("dim N = 3.\nr[i:N] = i * 2.\ns[] = 1.5.\n")
    env = evaluate(prog.graph, {}, xp=TorchOps(device="cpu"))
    assert isinstance(env["r"].data, torch.Tensor) and env["r"].data.tolist() == [0, 2, 4]
    assert env["s"].data.item() == 1.5


@pytest.mark.gpu
def test_cuda_tensors_stay_on_the_gpu() -> None:
    """On CUDA the results are CUDA tensors equal to the CPU reference's."""
    prog = _compile(SHIFTS)
    inputs = prog.random_inputs(3)
    on_gpu = {k: torch.from_numpy(v).cuda() for k, v in inputs.items()}
    got = evaluate(prog.graph, on_gpu, xp=TORCH)
    assert all(v.data.is_cuda for v in got.values())
    _assert_same_relations(got, evaluate(prog.graph, inputs), RTOL, ATOL)


def test_half_precision_gemms_run_natively_where_the_library_accumulates_in_f32() -> None:
    """A bf16 sum of two inputs' product is one bf16 matmul on torch (accumulating in f32,
    rounding once: what the rule means) where the device multiplies bf16 natively (a GPU, or a
    CPU with AVX-512 BF16 or AMX), not a matmul of inputs widened to f32; f16 only on a GPU; a
    guard, a scale, a third factor or numpy keep the widened path.  Either way the result is
    the rule's, rounded once."""
    prog = _compile(
        "dim N = 4, K = 8.\ninput x[N, K] : bf16.\nparam w[K, N] : bf16.\n"
        "g[i, j] += x[i, k] * w[k, j].\n"
        "h[i, j] += x[i, k] * w[k, j] where k <= i.\n"
        "c[i, j] += x[i, k] * w[k, j] / 2.\n"
        "t[i, j] += x[i, k] * w[k, j] * x[i, k].\n"
    )
    node = {n.name: n for n in prog.graph.nodes}
    cpu = torch.device("cpu")
    assert joinagg.native_gemm(node["g"], [None, None], TORCH, cpu) == _cpu_has_bf16()
    assert TORCH.native_matmul("bf16", torch.device("cuda", 0))
    assert not joinagg.native_gemm(node["g"], [None, None], NUMPY, None)
    assert not joinagg.native_gemm(node["g"], [torch.ones(4, 8, dtype=torch.bool), None], TORCH, cpu)
    for name in ("h", "c", "t"):
        assert not joinagg.native_gemm(node[name], [None, None], TORCH, cpu), name
    assert not TORCH.native_matmul("f16", cpu) and TORCH.native_matmul("f16", torch.device("cuda", 0))
    inputs = prog.random_inputs(0)
    got = evaluate_node(
        node["g"],
        [
            torch.from_numpy(inputs["x"].astype(np.float32)).bfloat16(),
            torch.from_numpy(inputs["w"].astype(np.float32)).bfloat16(),
        ],
        [None, None],
        TORCH,
    )[0]
    want = inputs["x"].astype(np.float32) @ inputs["w"].astype(np.float32)
    assert got.dtype == (torch.bfloat16 if _cpu_has_bf16() else torch.float32)  # widened: rounded by the caller
    np.testing.assert_allclose(got.float().numpy(), want, rtol=2.0**-8, atol=1e-6)


_DispatchMode: Any = torch.utils._python_dispatch.TorchDispatchMode


class _OpsSeen(_DispatchMode):  # type: ignore[misc]
    """Records the name of every op torch dispatches while it is active."""

    names: list[str]

    def __enter__(self) -> _OpsSeen:
        self.names = []
        super().__enter__()
        return self

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(onednn_linear_op() is None, reason="this torch has no oneDNN")
@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's, from mkldnn.flags
def test_large_f32_gemms_on_a_cpu_run_as_onednn_linear() -> None:
    """An f32 matmul of at least ``ONEDNN_F32_MIN_MACS`` multiply-adds on a CPU is oneDNN's
    linear, whatever the operands' strides; a smaller one, another dtype, or one autograd
    records stays ATen's.  Each gives the f64 product to f32's accuracy."""
    rng = np.random.default_rng(0)
    rows = ONEDNN_F32_MIN_MACS // (256 * 256)

    def ops(a: Any, b: Any) -> list[str]:
        with _OpsSeen() as seen:
            got = TORCH.matmul(a, b)
        want = a.detach().double().numpy() @ b.detach().double().numpy()
        np.testing.assert_allclose(got.detach().double().numpy(), want, rtol=1e-5, atol=1e-4)
        return seen.names

    big = torch.from_numpy(rng.standard_normal((rows, 256), dtype=np.float32))
    w = torch.from_numpy(rng.standard_normal((256, 256), dtype=np.float32))
    assert any("mkldnn._linear_pointwise" in n for n in ops(big, w))
    assert any("mkldnn._linear_pointwise" in n for n in ops(big.T.contiguous().T, w.T.contiguous()))
    assert not any("mkldnn" in n for n in ops(big[: rows - 1], w))  # one row short of the threshold
    assert not any("mkldnn" in n for n in ops(big.double(), w.double()))
    window = torch.from_numpy(rng.standard_normal(2 * 256, dtype=np.float32)).as_strided((256, 256), (1, 1))
    assert overlaps(window) and not overlaps(w) and not overlaps(w.T) and not overlaps(big[:1].expand(rows, 256))
    assert not any("mkldnn" in n for n in ops(big, window))  # oneDNN refuses a weight whose rows overlap
    with torch.backends.mkldnn.flags(enabled=False):
        assert not any("mkldnn" in n for n in ops(big, w))
    assert not any("mkldnn" in n for n in ops(big, w.requires_grad_()))


LARGE_GEMM = """
dim M = 96, K = 256, N = 384.
input x[M, K] : f32.
param w[N, K] : f32.
output y, z.
y[m, n] += x[m, k] * w[n, k].
z[m, n] += y[m, k] * w[k, n].
"""


def test_a_gemm_over_a_sliding_window_matches_the_reference() -> None:
    """``y[m, l] += w[m, k] * x[l + k]`` of 8M multiply-adds: its right operand is a view of
    ``x`` whose rows overlap, which oneDNN refuses; it stays ATen's, interpreted and recorded."""
    prog = _compile(
        "dim M = 256, K = 128, L = 256, T = L + K - 1.\ninput x[T] : f32.\nparam w[M, K] : f32.\n"
        "y[m, l:L] += w[m, k] * x[l + k].\n"
    )
    inputs = prog.random_inputs(0)
    want = evaluate(prog.graph, inputs)["y"].data
    for mode in ("none", "graph"):
        exe = edatalog.executable(prog, backend="torch", device="cpu", compile=mode)
        exe.load({"w": torch.from_numpy(inputs["w"])})
        for _ in range(3):
            got = exe({"x": torch.from_numpy(inputs["x"])})
        np.testing.assert_allclose(_host(got["y"]), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("compile_mode", ["none", "graph", pytest.param("inductor", marks=pytest.mark.slow)])
def test_large_gemms_of_a_program_match_the_reference(compile_mode: str) -> None:
    """A program whose f32 GEMMs take oneDNN's path (9M multiply-adds) gives the numpy
    reference's relations, interpreted, as a recorded graph, and compiled by inductor (which
    calls them as an opaque custom op: it lowers oneDNN's linear only for frozen weights)."""
    prog = _compile(LARGE_GEMM)
    inputs = prog.random_inputs(1)
    exe = edatalog.executable(prog, backend="torch", device="cpu", compile=compile_mode)
    exe.load({"w": torch.from_numpy(inputs["w"])})
    for _ in range(2):  # a compiled executable records (and compiles) on its second call
        exe({"x": torch.from_numpy(inputs["x"])})
    with _OpsSeen() as seen:
        got = exe({"x": torch.from_numpy(inputs["x"])})
    if onednn_linear_op() is not None:
        called = "edatalog.onednn_linear" if compile_mode == "inductor" else "mkldnn._linear_pointwise"
        assert sum(called in n for n in seen.names) == 2, seen.names
    want = evaluate(prog.graph, inputs)
    for name in ("y", "z"):
        np.testing.assert_allclose(_host(got[name]), want[name].data, rtol=1e-4, atol=1e-3)
