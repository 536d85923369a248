"""The public API: compile, run, input validation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import edatalog
from edatalog.errors import EdlError, EdlWarning

ROOT = Path(__file__).resolve().parents[2]
SOFTMAX = ROOT / "programs" / "softmax.edl"


def test_run_returns_outputs_as_numpy() -> None:
    prog = edatalog.compile(SOFTMAX, dims={"N": 3, "C": 5})
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    out = prog.run({"x": x})
    assert set(out) == {"y"}
    y = out["y"]
    assert y.dtype == np.float32 and y.shape == (3, 5)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(axis=1, keepdims=True), rtol=1e-6)


def test_absent_cells_read_as_zero_and_masks_are_available() -> None:
    prog = edatalog.compile_string("dim N = 4.\ninput x[N] : f64.\ny[i] = x[i] * 2.0 where i != 1.")
    x = np.arange(1.0, 5.0)
    assert prog.run({"x": x})["y"].tolist() == [2.0, 0.0, 6.0, 8.0]
    val = prog.evaluate({"x": x})["y"]
    assert val.present is not None and val.present.tolist() == [True, False, True, True]


def test_missing_input_points_at_its_declaration() -> None:
    prog = edatalog.compile(SOFTMAX, dims={"N": 3, "C": 5})
    with pytest.raises(EdlError, match="missing value for input 'x'") as info:
        prog.run({})
    assert str(info.value).startswith(f"{SOFTMAX}:5:7: error:")


def test_wrong_shape_names_the_dims() -> None:
    prog = edatalog.compile(SOFTMAX, dims={"N": 3, "C": 5})
    with pytest.raises(EdlError, match=r"shape \(3, 5\) \(\[N=3, C=5\] : f32\), but the value has shape \(5, 3\)"):
        prog.run({"x": np.zeros((5, 3), np.float32)})


def test_unknown_input_name_suggests_the_closest() -> None:
    prog = edatalog.compile(SOFTMAX, dims={"N": 3, "C": 5})
    with pytest.raises(EdlError, match="'xx' is not an input") as info:
        prog.run({"x": np.zeros((3, 5)), "xx": 1})
    assert "did you mean 'x'?" in str(info.value)


def test_values_are_converted_to_the_declared_dtype_when_safe() -> None:
    prog = edatalog.compile(SOFTMAX, dims={"N": 2, "C": 2})
    assert prog.run({"x": [[1, 2], [3, 4]]})["y"].dtype == np.float32  # ints and f64 convert to f32
    ints = edatalog.compile_string("input n[2] : i32.\ny[i] = n[i] + 1.")
    with pytest.raises(EdlError, match="declared i32, but the value has dtype float64"):
        ints.run({"n": np.zeros(2)})


def test_random_inputs_cover_every_input_and_param() -> None:
    prog = edatalog.compile(ROOT / "programs" / "mlp.edl", dims={"B": 2, "D": 4, "F": 8})
    values = prog.random_inputs(seed=3)
    assert set(values) == {"x", "w1", "b1", "w2", "b2"}
    assert all(v.dtype == np.float32 for v in values.values())
    again = prog.random_inputs(seed=3)
    assert all(np.array_equal(values[k], again[k]) for k in values)


def test_float64_programs_stay_float64() -> None:
    prog = edatalog.compile_string("input x[3] : f64.\ny[i] = x[i] / 3.0.")
    x = np.array([1.0, 2.0, 3.0])
    y = prog.run({"x": x})["y"]
    assert y.dtype == np.float64 and y.tolist() == (x / 3.0).tolist()


def test_half_precision_computes_in_f32_and_rounds() -> None:
    # Summed in bf16, 1000 ones would stall at 256 (256 + 1 rounds back to 256); in f32 they give
    # 1000, which bf16 stores exactly.
    prog = edatalog.compile_string("input x[1000] : bf16.\ns[] += x[i].")
    s = prog.run({"x": np.ones(1000, np.float32)})["s"]
    assert str(s.dtype) == "bfloat16" and float(s) == 1000.0


def test_unused_param_warns() -> None:
    with pytest.warns(EdlWarning, match="param 'w' is never used"):
        prog = edatalog.compile_string("input x[2] : f32.\nparam w[2] : f32.\ny[i] = x[i].")
    assert [w.severity for w in prog.warnings] == ["warning"]


def test_program_text_form_is_the_graph() -> None:
    prog = edatalog.compile(SOFTMAX)
    assert str(prog) == str(prog.graph)
    assert "m[n] max= x[n,c]" in str(prog)
    assert repr(prog).startswith("<edatalog.Program")


def test_boolean_arithmetic_and_sums_are_integers() -> None:
    prog = edatalog.compile_string(
        "dim N = 3.\ninput m[N] : bool.\nc[] += m[i].\nd[i] = m[i] - m[i].\nn[i] = -m[i].\na[] max= m[i].\n"
        "output c, d, n, a."
    )
    out = prog.run({"m": np.array([True, False, True])})
    assert out["c"].dtype == np.int64 and int(out["c"]) == 2
    assert out["d"].tolist() == [0, 0, 0] and out["n"].tolist() == [-1, 0, -1]
    assert out["a"].dtype == np.bool_ and bool(out["a"])


@pytest.mark.parametrize("values", [None, [np.zeros((2, 2), np.float32)], "x", 3])
def test_values_that_are_not_a_mapping_are_edl_errors(values: object) -> None:
    prog = edatalog.compile(SOFTMAX, dims={"N": 2, "C": 2})
    for method in (prog.run, prog.evaluate, prog.prepare):
        with pytest.raises(EdlError, match="the values must be a mapping from input and param names") as info:
            method(values)  # type: ignore[arg-type]
        assert info.value.diagnostic.help is not None and "random_inputs" in info.value.diagnostic.help
        assert type(values).__name__ in info.value.message


def test_plan_execute_returns_arrays_as_run_does() -> None:
    prog = edatalog.compile_string("dim N = 4.\ninput x[N] : f64.\ny[i] = x[i] * 2.0 where i != 1.\nz[] += x[i].")
    x = np.arange(1.0, 5.0)
    plan = edatalog.plan(prog, "a100x2", "random", seed=1)
    out = plan.execute(prog.prepare({"x": x}))
    assert list(out) == list(prog.outputs) == ["y", "z"]
    assert all(isinstance(v, np.ndarray) for v in out.values())
    assert out["y"].tolist() == [2.0, 0.0, 6.0, 8.0]  # the absent cell reads as 0
    assert float(out["z"]) == 10.0
    via_run = prog.run({"x": x}, plan=plan)
    assert all(np.array_equal(via_run[k], out[k]) for k in out)
    detailed = prog.evaluate({"x": x})  # the detailed view: every relation, with presence masks
    assert set(detailed) == {"x", "y", "z"} and detailed["y"].present is not None


def test_a_program_without_rules_warns_once() -> None:
    with pytest.warns(EdlWarning, match="the program has no rules: it computes nothing and has no outputs"):
        prog = edatalog.compile_string("# nothing yet\n")
    assert len(prog.warnings) == 1 and prog.run({}) == {}
    prog = edatalog.compile_string("dim N = 2.\ninput x[N] : f32.\nparam w[N] : f32.\n")
    assert [w.message for w in prog.warnings] == ["the program has no rules: it computes nothing and has no outputs"]
    assert prog.warnings[0].span is not None and prog.warnings[0].span.line == 1  # at the first declaration
    passthrough = edatalog.compile_string("input x[2] : f32.\noutput x.\n")  # an identity: no warning
    assert passthrough.warnings == ()
    assert passthrough.run({"x": np.ones(2, np.float32)})["x"].tolist() == [1.0, 1.0]


MIXED = """\
dim N = 4.
input x[N] : f32.
input n[N] : i32.
param w[N] : f64.
y[i] = x[i] * w[i].
c[i] = n[i] + 1.
z[i:N] = i * 0.5.
"""


def test_a_dtype_retypes_every_float_and_nothing_else() -> None:
    prog = edatalog.compile_string(MIXED, dtype="bf16")
    types = {r.name: r.dtype for r in prog.graph.relations}
    assert types == {"x": "bf16", "n": "i32", "w": "bf16", "y": "bf16", "c": "i32", "z": "bf16"}
    assert {r.name: r.dtype for r in edatalog.compile_string(MIXED).graph.relations}["y"] == "f64"
    with pytest.raises(EdlError, match="dtype 'i8' is not a float type") as info:
        edatalog.compile_string(MIXED, dtype="i8")
    assert "bf16" in str(info.value)


def test_a_bf16_llama_block_stays_near_the_f32_one() -> None:
    """Re-typed to bf16, the block runs in bf16 with torch, within 3e-2 of the f32 reference
    (relative to its largest value), at a sequence long enough that rotary angles reach hundreds
    of radians."""
    torch = pytest.importorskip("torch")
    dims = {"S": 512, "D": 64, "H": 4, "KVH": 2, "F": 96}
    f32 = edatalog.compile(ROOT / "programs" / "llama_block.edl", dims=dims)
    bf16 = edatalog.compile(ROOT / "programs" / "llama_block.edl", dims=dims, dtype="bf16")
    values = f32.random_inputs(0)
    want = f32.run(values)["y"]
    got = bf16.run(values, backend="torch")["y"]
    assert got.dtype == torch.bfloat16
    err = float(np.abs(got.float().numpy() - want).max() / np.abs(want).max())
    assert err <= 3e-2, err
