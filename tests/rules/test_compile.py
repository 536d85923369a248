"""Rule compiler tests: extents, supports, dtypes, overrides and the join-agg specs it builds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import edatalog
from edatalog.errors import EdlError
from edatalog.ir.graph import Graph, VerifyError
from edatalog.ir.scalar import Load

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "programs" / "llama_block.edl"


def _graph(text: str, **dims: int) -> Graph:
    return edatalog.compile_string(text, name="t.edl", dims=dims or None).graph


def test_join_agg_spec_of_a_projection() -> None:
    g = _graph(
        "dim B = 2, S = 3, D = 8, H = 2, E = D / H.\ninput xn[B, S, D] : f32.\nparam wq[H * E, D] : f32.\n"
        "q[b, s, h, e] += xn[b, s, d] * wq[(h, e), d].\n"
    )
    (node,) = g.nodes
    assert [(i.name, i.extent, i.symbol) for i in node.indices] == [
        ("b", 2, "B"),
        ("s", 3, "S"),
        ("h", 2, "H"),
        ("e", 4, "E"),
        ("d", 8, "D"),
    ]
    assert node.agg == "sum" and node.agg_indices == ("d",)
    assert [str(a) for a in node.inputs] == ["xn[b,s,d]", "wq[(h,e),d]"]
    assert node.inputs[1].axes[0].affine().terms == (("e", 1), ("h", 4))  # h major: axis = 4*h + e
    assert str(node) == "q[b,s,h,e] += xn[b,s,d] * wq[(h,e),d]"
    assert g.relation("q").shape == (2, 3, 2, 4) and g.relation("q").symbols == ("B", "S", "H", "E")
    line = str(g).splitlines()[-3]
    assert line.split() == ["q[b,s,h,e]", "+=", "xn[b,s,d]", "*", "wq[(h,e),d]", "sum", "d", "2·B·S·H·E·D", "flops"]
    assert g.outputs == ("q",)  # with no `output` statement, the relations nobody reads


def test_extents_flow_across_rules_and_composites() -> None:
    g = _graph(
        "dim N = 6.\ninput x[N] : f32.\n"
        "y[(a, b:2)] = x[(a, b)].\n"  # a = N / 2 = 3
        "z[a, b:2] = y[(a, b)].\n"  # a composite needs all parts but one known: a = 6 / 2
    )
    assert g.relation("z").shape == (3, 2)
    assert g.relation("z").symbols == ("N/2", "2")


def test_gqa_heads_split_by_declared_products(tmp_path: Path) -> None:
    prog = edatalog.compile(LLAMA, dims={"D": 48, "H": 6, "KVH": 2, "F": 40, "S": 5})
    g = prog.graph
    assert g.relation("q").shape == (1, 5, 2, 3, 8)
    assert g.relation("q").symbols == ("B", "S", "KVH", "G", "E")
    assert g.relation("rc").symbols == ("S", "E/2")
    assert g.relation("qr").symbols[-1] == "E"  # (0, i) and (1, i) with i:E/2 make an axis of E


def test_derived_dims_follow_overrides() -> None:
    g = _graph("dim D = 64, H = 4, E = D / H.\ninput x[H * E] : f32.\ny[(h, e)] = x[(h, e)] * E.", D=32)
    assert dict(g.dims)["E"] == 8
    assert g.relation("x").shape == (32,)


def test_const_override_and_builtin_constants() -> None:
    prog = edatalog.compile_string("const c = 2.0, d = c * pi.\ninput x[2] : f64.\ny[i] = x[i] * d.", consts={"c": 3.0})
    assert prog.consts["d"] == pytest.approx(3.0 * 3.141592653589793)


def test_unknown_override_is_an_error() -> None:
    with pytest.raises(EdlError, match="unknown dim 'Q'") as info:
        edatalog.compile_string("dim S = 2.\ninput x[S] : f32.\ny[i] = x[i].", dims={"Q": 3})
    assert "S" in (info.value.diagnostic.help or "")


def test_causal_support_propagates_through_softmax() -> None:
    prog = edatalog.compile(ROOT / "programs" / "attention.edl", dims={"S": 8})
    g = prog.graph
    assert str(g.relation("sc").support) == "t <= s"
    assert str(g.relation("p").support) == "t <= s"
    assert g.relation("m").support.is_true and g.relation("l").support.is_true
    # Every rule reading sc or p carries the guard, so the planner and the cost model see it.
    for name in ("m", "p", "l", "o"):
        assert str(g.node(name).guard) == "t <= s", name
    assert g.node("y").guard.is_true


def test_flops_count_only_supported_points() -> None:
    prog = edatalog.compile(ROOT / "programs" / "attention.edl", dims={"B": 1, "S": 8, "D": 16, "H": 2})
    costs = prog.graph.costs
    s = 8
    causal = s * (s + 1) // 2
    e = 8
    # q.k / sqrt(E): mul + div per point, plus the sum.
    assert costs["sc"].points == 1 * 2 * causal * e
    assert costs["sc"].flops == 3 * 1 * 2 * causal * e
    assert costs["sc"].dense_points == 1 * 2 * s * s * e
    assert costs["m"].flops == 2 * causal  # one max per supported point
    assert costs["sc"].bytes_out == 2 * causal * 4


def test_rope_halves_merge_into_a_full_support() -> None:
    g = _graph(
        "dim S = 4, E = 6.\ninput q[S, E] : f32.\n"
        "r[s, (0, i:E/2)] = q[s, (1, i)].\n"  # the other rule gets i from r's axis
        "r[s, (1, i)] = -q[s, (0, i)].\n"
    )
    assert g.relation("r").shape == (4, 6)
    assert g.relation("r").support.is_true
    assert [n.name for n in g.nodes] == ["r#1", "r#2"]


def test_partial_support_of_disjoint_rules() -> None:
    g = _graph("dim N = 5.\ninput x[N] : f32.\ny[i] = x[i] where i < 2.\ny[i] = 2.0 * x[i] where i >= 3.")
    assert str(g.relation("y").support) == "i <= 1 or i >= 3"


@pytest.mark.parametrize(
    ("body", "dtype"),
    [
        ("x[i] * 0.5", "f32"),  # numbers are weak
        ("x[i] + w[i]", "f64"),
        ("n[i] + 1", "i64"),
        ("n[i] / 2", "f64"),  # division needs floats: the program's widest float
        ("n[i] * i", "i64"),
        ("where(n[i] > 2, 1, 0)", "i64"),
        ("h[i] * h[i]", "f16"),
        ("h[i] * b[i]", "f32"),  # f16 with bf16 meet at f32
    ],
)
def test_dtype_inference(body: str, dtype: str) -> None:
    g = _graph(
        "dim N = 4.\ninput x[N] : f32.\ninput w[N] : f64.\ninput n[N] : i64.\ninput h[N] : f16.\n"
        f"input b[N] : bf16.\ny[i] = {body}.\noutput y, x, w, n, h, b."
    )
    assert g.relation("y").dtype == dtype


def test_effective_guard_includes_user_guards() -> None:
    g = _graph("dim N = 4.\ninput x[N, N] : f32.\ny[i] += x[i, j] where i + j < 4, j != 1.")
    assert str(g.nodes[0].guard) == "(i + j <= 3, j <= 0) or (i + j <= 3, j >= 2)"


def test_head_literals_and_repeated_indices() -> None:
    g = _graph("dim N = 3.\ninput x[N] : f32.\nd[i, i] = x[i].\nc[0, i] = x[i].\nc[2, i] = -x[i].")
    assert str(g.relation("d").support) == "i == a1"
    assert g.relation("c").shape == (3, 3)
    assert str(g.relation("c").support) == "a0 == 0 or a0 == 2"


def test_json_round_trip_and_fingerprint() -> None:
    prog = edatalog.compile(LLAMA, dims={"S": 8})
    g = prog.graph
    again = Graph.from_json(g.to_json())
    assert again == g
    assert again.fingerprint() == g.fingerprint()
    assert str(again) == str(g)
    # Comments and layout do not change what a program computes; dims do.
    text = LLAMA.read_text()
    commented = edatalog.compile_string("# a comment\n\n" + text, dims={"S": 8}).graph
    assert commented.fingerprint() == g.fingerprint()
    assert edatalog.compile(LLAMA, dims={"S": 16}).graph.fingerprint() != g.fingerprint()


def test_json_load_rejects_foreign_objects() -> None:
    with pytest.raises(ValueError, match="unknown IR object type"):
        Graph.from_json('{"format": 2, "ir": {"$type": "os.system", "command": "true"}}')
    with pytest.raises(ValueError, match="format"):
        Graph.from_json('{"format": 99, "ir": {}}')


def test_verify_catches_broken_graphs() -> None:
    g = edatalog.compile(ROOT / "programs" / "mlp.edl", dims={"B": 2, "D": 4, "F": 8}).graph
    g.verify()
    node = g.nodes[0]
    bad_index = dataclasses.replace(node, indices=node.indices[:-1])
    with pytest.raises(VerifyError, match="unknown index"):
        dataclasses.replace(g, nodes=(bad_index, *g.nodes[1:])).verify()
    with pytest.raises(VerifyError, match="before it is complete"):
        dataclasses.replace(g, nodes=tuple(reversed(g.nodes))).verify()
    wrong_dtype = dataclasses.replace(node, dtype="f64")
    with pytest.raises(VerifyError, match="dtype"):
        dataclasses.replace(g, nodes=(wrong_dtype, *g.nodes[1:])).verify()


def test_every_shipped_program_compiles_at_default_dims() -> None:
    for path in sorted((ROOT / "programs").glob("*.edl")):
        g = edatalog.compile(path).graph
        g.verify()
        assert g.outputs
        # Every rule that computes costs flops; a copy (a selection's i64 places, `rank = beaten`)
        # costs none.
        computing = [n.name for n in g.nodes if not isinstance(n.expr.nodes[n.expr.root], Load)]
        assert computing and all(g.costs[name].flops > 0 for name in computing), path.name


# -- what a new user meets first (issue 23) -------------------------------------------------------------


def test_a_prefix_of_a_longer_table_is_read_through_an_index_expression() -> None:
    """A position table longer than the sequence: the plain index is an extent mismatch whose
    help says how to read the prefix, and the way it says works."""
    head = "dim S = 3, P = 8, D = 2.\ninput x[S, D] : f64.\nparam wpe[P, D] : f64.\noutput h.\n"
    with pytest.raises(EdlError) as info:
        edatalog.compile_string(head + "h[s, d] = x[s, d] + wpe[s, d].\n", name="pos.edl")
    text = str(info.value)
    assert "extent mismatch for index 's' at axis 0 of wpe" in text
    assert "to read only the first 3 of the 8 places of wpe's axis 0" in text and "there, which reads" in text
    assert "s + 0" in text and "help: an index has one extent in a rule" in text
    prog = edatalog.compile_string(head + "h[s, d] = x[s, d] + wpe[s + 0, d].\n", name="pos.edl")
    values = prog.random_inputs(seed=0)
    np.testing.assert_array_equal(prog.run(values)["h"], values["x"] + values["wpe"][:3])


def test_a_lookup_of_computed_floats_says_where_integers_come_from() -> None:
    src = "dim V = 4, D = 2, S = 3.\ninput x[S] : f32.\nparam t[V, D] : f32.\noutput e.\n"
    with pytest.raises(EdlError) as info:
        edatalog.compile_string(src + "top[s] = x[s] * 2.0.\ne[s, d] = t[v, d] where top[s] = v.\n", name="f.edl")
    text = str(info.value)
    assert "'top' is f32: a lookup needs integer values" in text and "f.edl:6:25" in text
    assert "no float-to-integer conversion" in text and "declare 'top'" not in text
    with pytest.raises(EdlError, match="declare 'x' as i64 or i32"):
        edatalog.compile_string(src + "e[s, d] = t[v, d] where x[s] = v.\n", name="f.edl")
