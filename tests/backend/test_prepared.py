"""Blocks prepared once per layout (backend/kernels/prepared.py) compute what the general evaluation does.

The property test cuts every rule of a random program into a random block, reads its inputs from
the reference's values (sometimes through non-contiguous layouts), and, wherever
:func:`prepare_block` takes the block, compares its result with :func:`evaluate_node`'s on the
cells that exist, and checks that no input was written.  The unit tests pin which paths the
LLaMA block takes, that in-place chains keep the language's rounding (``f16``/``bf16`` rules round
once), and that rules reading no input run once per executable.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import edatalog
from edatalog.backend.kernels.arrays import TORCH
from edatalog.backend.kernels.joinagg import evaluate_node, known_presence
from edatalog.backend.kernels.prepared import _Contraction, _Elementwise, layout_of, prepare_block
from edatalog.backend.kernels.reference import evaluate
from edatalog.backend.running import interpreter
from edatalog.backend.running.compiled import CompiledExecutable
from edatalog.backend.running.torch_runtime import TorchExecutable
from edatalog.errors import EdlWarning
from edatalog.ir import program as ir
from edatalog.ir.graph import Graph, JoinAgg
from edatalog.ir.regions import Region
from edatalog.ir.rewrite import restrict
from edatalog.solver import auto
from tests.strategies import GeneratedProgram, example_settings, programs

CPU = torch.device("cpu")
_SETTINGS = example_settings("EDL_PROPERTY_EXAMPLES", 100)
DIMS = {"B": 1, "S": 8, "D": 32, "H": 4, "KVH": 4, "F": 48}


def _scrambled(t: torch.Tensor, rnd: random.Random) -> torch.Tensor:
    """``t``'s values, laid out contiguous or, half the time, with its axes stored in reverse."""
    if t.ndim < 2 or rnd.random() < 0.5:
        return t.clone()
    flipped = torch.empty(tuple(reversed(t.shape)), dtype=t.dtype)
    return flipped.permute(*reversed(range(t.ndim))).copy_(t)


def _block_inputs(
    graph: Graph, node: JoinAgg, ranges: dict[str, tuple[int, int]], env: dict[str, Any], rnd: random.Random
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    data, present = [], []
    for acc in node.inputs:
        value = env[acc.relation]
        need = Region.through(acc.axes, ranges)
        at = need.at(Region.whole(tuple(np.shape(value.data))))
        data.append(_scrambled(torch.from_numpy(np.ascontiguousarray(np.asarray(value.data)[at])), rnd))
        present.append(None if value.present is None else torch.from_numpy(np.ascontiguousarray(value.present[at])))
    return data, present


def _axes(access_or_node: Any) -> tuple[Any, ...]:
    return access_or_node.out_axes if isinstance(access_or_node, JoinAgg) else access_or_node.axes


@_SETTINGS
@given(programs(), st.randoms(use_true_random=False))
def test_prepared_blocks_equal_the_general_evaluation(gen: GeneratedProgram, rnd: random.Random) -> None:
    graph = gen.compile().graph
    env = evaluate(graph, gen.inputs)
    for node in graph.nodes:
        ranges = {}
        for i in node.indices:
            lo = rnd.randrange(i.extent)
            ranges[i.name] = (lo, rnd.randrange(lo + 1, i.extent + 1))
        places = [p.places(ranges) for acc in (*node.inputs, node) for ax in _axes(acc) for p in ax.parts]
        if any(hi <= lo for lo, hi in places):
            continue  # the block reaches no cell of some relation: plans never make it
        block = restrict(node, ranges)
        data, present = _block_inputs(graph, node, ranges, env, rnd)
        exact = all(graph.relation(acc.relation).support_exact for acc in node.inputs)
        known = known_presence(block, exact, TORCH, CPU)
        fast = prepare_block(block, layout_of(data), TORCH, CPU, known)
        if fast is None:
            continue
        before = [d.clone() for d in data]
        with np.errstate(all="ignore"):
            want, _, want_vars = evaluate_node(block, data, present, TORCH, known)
        got, got_present, got_vars = fast(data)
        for d, b in zip(data, before, strict=True):
            assert torch.equal(d, b), f"{node.name}: a prepared block wrote into its input"
        assert got_vars == want_vars, node.name
        assert known is not None and got_present is known.present
        shape = np.broadcast_shapes(tuple(got.shape), tuple(want.shape))
        mask = torch.ones(shape, dtype=torch.bool) if known.present is None else known.present.broadcast_to(shape)
        assert got.dtype == want.dtype, node.name
        torch.testing.assert_close(
            got.broadcast_to(shape)[mask], want.broadcast_to(shape)[mask], rtol=1e-9, atol=1e-12, msg=node.name
        )


def _llama(dtype: str = "f32") -> edatalog.Program:
    return edatalog.compile("programs/llama_block.edl", dims=DIMS, dtype=dtype)


def _ran_once(prog: edatalog.Program) -> Any:
    """A one-device torch executable of the LLaMA block, called once."""
    values = prog.random_inputs(seed=0)
    exe = edatalog.executable(prog, backend="torch", device="cpu", compile="none")
    exe.load({k: v for k, v in values.items() if k != "x"})
    exe({"x": values["x"]})
    return exe


def _kernels(exe: Any) -> interpreter.Kernels:
    """The interpreter's per-executable kernel state (executables made with compile="none")."""
    assert isinstance(exe._impl, TorchExecutable)
    return exe._impl.kernels


def _prepared_kinds(prog: edatalog.Program) -> dict[str, str]:
    exe = _ran_once(prog)
    kinds = {}
    for (key, _, _), fast in _kernels(exe).prepared.items():
        kinds[key[0]] = "general" if fast is None else type(fast).__name__.lstrip("_").lower()
    return kinds


def test_the_llama_block_runs_prepared_except_its_attention() -> None:
    kinds = _prepared_kinds(_llama("bf16"))
    for name in ("q", "k", "v", "attn", "gate", "up", "down", "ss", "ss2"):
        assert kinds[name] == "contraction", name
    for name in ("xn", "hn", "act", "h", "y", "qr#1", "qr#2", "kr#1", "kr#2", "rc", "rs"):
        assert kinds[name] == "elementwise", name
    assert "sc" not in kinds and "o" not in kinds  # fused: torch's attention


def test_gemms_over_row_major_relations_take_strided_views() -> None:
    exe = _ran_once(_llama())
    gemms = [f for (k, _, _), f in _kernels(exe).prepared.items() if k[0] in ("q", "gate", "down")]
    assert gemms and all(isinstance(f, _Contraction) and f.strided for f in gemms)


def test_guarded_sums_and_padded_reads_take_the_general_path() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        prog = edatalog.compile_string(
            """
            dim N = 6.
            input a[N, N] : f32.
            input x[N] : f32.
            output s, d.
            s[i] += a[i, j] * a[j, i] where j <= i.
            d[i] = x[i] - x[i - 1] where i >= 1.
            """
        )
    graph = prog.graph
    values = {"a": torch.ones(6, 6), "x": torch.arange(6.0)}
    for node in graph.nodes:
        full = {i.name: (0, i.extent) for i in node.indices}
        block = restrict(node, full)
        data = [values[acc.relation] for acc in node.inputs]
        known = known_presence(block, True, TORCH, CPU)
        assert prepare_block(block, layout_of(data), TORCH, CPU, known) is None, node.name


def test_in_place_chains_round_half_precision_once() -> None:
    """``h * 10 / 10`` on f16 60000: computed in f32 and rounded once it gives 60000; rounding
    the product first would give inf (docs/language.md 10.2).  The prepared chain writes its
    ops into one f32 array, and must keep that."""
    prog = edatalog.compile_string(
        """
        dim N = 4.
        input h[N] : f16.
        output y.
        y[i] = h[i] * 10 / 10.
        """
    )
    h = np.array([60000, 1, -60000, 0.5], dtype=np.float16)
    exe = edatalog.executable(prog, backend="torch", device="cpu", compile="none")
    for _ in range(2):  # the first call prepares the block, the second runs it prepared
        got = exe({"h": torch.from_numpy(h)})["y"]
    assert isinstance(next(iter(_kernels(exe).prepared.values())), _Elementwise)
    np.testing.assert_array_equal(got.numpy(), prog.run({"h": h})["y"])
    assert got.dtype == torch.float16 and float(got[0]) == 60000.0


_FUSED = """
dim N = 64, M = 8.
input a[N, M] : {t}.
input b[N, M] : {t}.
input c[N, M] : {t}.
input s[] : {t}.
output y.
output z.
output w.
y[i, j] = a[i, j] - s[] * (b[i, j] + 1) .
z[i, j] = a[i, j] * 2 + b[i, j] / c[i, j] .
w[i, j] = 0.5 + b[i, j] / s[] .
"""


def _fused_inputs(dtype: Any) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(64, 8, generator=g, dtype=dtype),
        "b": torch.randn(64, 8, generator=g, dtype=dtype),
        "c": torch.rand(64, 8, generator=g, dtype=dtype) + 0.5,
        "s": torch.tensor(0.75, dtype=dtype),
    }


def test_a_sum_with_a_product_is_one_fused_call() -> None:
    """``a - s * x`` runs as ``addcmul(a, s, x, value=-1)`` and ``x + b / c`` as ``addcdiv``:
    one pass each, the same in the interpreter (prepared or not) and in the compiled graph.
    A sum whose other term is broadcast (``0.5 + b / s``) stays two ops: ``addcdiv`` would
    first copy the broadcast term into the result."""
    prog = edatalog.compile_string(_FUSED.format(t="f32"))
    x = _fused_inputs(torch.float32)
    a, b, c, s = x["a"], x["b"], x["c"], x["s"]
    want = {
        "y": torch.addcmul(a, s, b + 1, value=-1),
        "z": torch.addcdiv(a * 2, b, c),
        "w": 0.5 + b / s,
    }
    graph = edatalog.executable(prog, backend="torch", device="cpu", compile="graph")
    interp = edatalog.executable(prog, backend="torch", device="cpu", compile="none")
    for _ in range(3):  # interpreted, prepared; recorded, replayed
        for exe in (graph, interp):
            got = exe(x)
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    impl = graph._impl
    assert isinstance(impl, CompiledExecutable) and impl.last_compiled is not None
    replay = impl.last_compiled
    assert isinstance(replay.run, torch.fx.GraphModule)
    code = replay.run.code
    assert code.count("torch.addcmul(") == 1 and code.count("torch.addcdiv(") == 1, code
    ref = prog.run({k: v.numpy() for k, v in x.items()})
    for name in want:
        np.testing.assert_allclose(ref[name], want[name].numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_prepared_llama_block_equals_the_reference(dtype: str) -> None:
    prog = _llama(dtype)
    values = prog.random_inputs(seed=1)
    want = edatalog.compile("programs/llama_block.edl", dims=DIMS).run(values)
    exe = edatalog.executable(prog, backend="torch", device="cpu", compile="none")
    exe.load({k: v for k, v in values.items() if k != "x"})
    for _ in range(3):
        got = exe({"x": values["x"]})["y"].float().numpy()
    scale = np.abs(want["y"]).max()
    assert np.abs(got - want["y"]).max() / scale < (1e-5 if dtype == "f32" else 3e-2)


def test_rules_reading_no_input_run_once_per_executable(monkeypatch: pytest.MonkeyPatch) -> None:
    prog = _llama()
    assert interpreter.static_nodes(prog.graph) == {"rc", "rs"}
    exe = _ran_once(prog)
    made: list[str] = []
    kernel = interpreter.Device.kernel

    def counting(self: interpreter.Device, op: Any) -> Any:
        made.append(op.node)
        return kernel(self, op)

    monkeypatch.setattr(interpreter.Device, "kernel", counting)
    x = prog.random_inputs(seed=0)["x"]
    fresh = edatalog.executable(prog, backend="torch", device="cpu", compile="none")
    fresh.load({k: v for k, v in prog.random_inputs(seed=0).items() if k != "x"})
    want = fresh({"x": x})["y"].clone()
    assert made.count("rc") == 1 and made.count("rs") == 1  # the fresh executable's first call
    made.clear()
    for _ in range(2):
        torch.testing.assert_close(exe({"x": x})["y"], want, rtol=0, atol=0)
    assert "rc" not in made and "rs" not in made and made.count("q") == 2


Product = tuple[str, dict[str, np.ndarray], bool]


@st.composite
def _products(draw: st.DrawFn) -> Product:
    """A sum of a product of two inputs over random indices, its inputs, and whether the two
    factors are one relation (``x * x``)."""
    extents = {v: draw(st.integers(1, 4)) for v in "ijklm"}
    names = list(extents)
    ia = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    ib = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    both = sorted(set(ia) | set(ib))
    out = draw(st.lists(st.sampled_from(both), max_size=3, unique=True))
    square = draw(st.booleans())
    if square:
        ib = ia
    scale = draw(st.sampled_from(["", " * 0.5", " / 3", " * -2"]))
    dims = ", ".join(f"{v.upper()} = {n}" for v, n in extents.items())
    text = (
        f"dim {dims}.\n"
        f"input a[{', '.join(v.upper() for v in ia)}] : f64.\n"
        + ("" if square else f"input b[{', '.join(v.upper() for v in ib)}] : f64.\n")
        + "output c.\n"
        + f"c[{', '.join(f'{v}:{v.upper()}' for v in out)}] += a[{', '.join(ia)}]"
        + f" * {'a' if square else 'b'}[{', '.join(ib)}]{scale}.\n"
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    values = {"a": rng.standard_normal([extents[v] for v in ia])}
    if not square:
        values["b"] = rng.standard_normal([extents[v] for v in ib])
    return text, values, square


@_SETTINGS
@given(_products(), st.randoms(use_true_random=False))
def test_prepared_products_equal_the_reference(case: Product, rnd: random.Random) -> None:
    """Sums of products (GEMMs, batched GEMMs, dot products, sums of squares, private indices,
    constant factors) over inputs in scrambled layouts, run twice by the torch runtime (the
    second call runs the prepared block), equal the numpy reference."""
    text, values, _ = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        prog = edatalog.compile_string(text)
    want = prog.run(values)["c"]
    exe = edatalog.executable(prog, backend="torch", device="cpu", compile="none")
    inputs = {k: _scrambled(torch.from_numpy(v), rnd) for k, v in values.items()}
    for _ in range(2):
        got = exe(inputs)["c"]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-12)
    for name, v in values.items():
        np.testing.assert_array_equal(inputs[name].numpy(), v)  # the inputs are left as they were


def test_an_output_that_reads_no_input_is_made_on_every_call() -> None:
    """A caller may write into the outputs it gets: an output is never a block kept between
    calls, even one that depends on nothing."""
    prog = edatalog.compile_string(
        """
        dim N = 4.
        input x[N] : f32.
        output t, y.
        t[i:N] = i * 2.0.
        y[i] = x[i] + t[i].
        """
    )
    assert interpreter.static_nodes(prog.graph) == set()
    exe = edatalog.executable(prog, backend="torch", device="cpu", compile="none")
    first = exe({"x": torch.zeros(4)})
    first["t"].fill_(-1)
    again = exe({"x": torch.zeros(4)})
    torch.testing.assert_close(again["t"], torch.tensor([0.0, 2.0, 4.0, 6.0]))
    torch.testing.assert_close(again["y"], torch.tensor([0.0, 2.0, 4.0, 6.0]))


def test_the_cost_model_knows_which_blocks_take_the_general_path() -> None:
    """The timeline prices general-path blocks apart (``OpCost.general``, from ``general_path``
    of the block): on a plan that cuts attention apart (Megatron, its scores chunked along the
    keys, so no fused kernel), each kernel's flag is what the torch runtime then did,
    block for block: prepared, or the general evaluation."""
    prog = _llama()
    machine = edatalog.topology("cpux2")
    setup = auto._Setup(prog.graph, machine, machine.devices[0].memory, "join")
    choice = dict(setup.starts)["megatron"]
    t = [i.name for i in prog.graph.node("sc").indices].index("t")
    choice["sc"] = next(k for k, o in enumerate(setup.options["sc"]) if o.cand.chunk > 1 and t in o.cand.chunked)
    plan = edatalog.Plan(auto._plan(prog.graph, machine, setup.options, choice, "join"), prog.graph, machine)
    values = prog.random_inputs(seed=0)
    exe = edatalog.executable(prog, plan, backend="torch", device="cpu,cpu", compile="none")
    exe.load({k: v for k, v in values.items() if k != "x"})
    exe({"x": values["x"]})
    ran = {key: fast is None for (key, _, _), fast in _kernels(exe).prepared.items()}
    priced = {
        (op.node, op.ranges): plan.schedule.costs[(d, k)].general
        for d, k, op in plan.schedule.programs.ops()
        if isinstance(op, ir.Kernel)
    }
    assert ran and {key: priced[key] for key in ran} == ran
    assert {name for (name, _), general in ran.items() if general} >= {"mx", "l", "o"}
    assert not all(ran.values())  # the rest prepared
