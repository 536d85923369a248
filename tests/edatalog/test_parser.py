"""Parser unit tests: statement splitting, AST shapes and spans, precedence, syntax errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from edatalog.errors import EdlError
from edatalog.lang import ast
from edatalog.lang.parser import parse, split_statements

ROOT = Path(__file__).resolve().parents[2]


def _rule(text: str) -> ast.Rule:
    prog = parse(text, "t.edl")
    (stmt,) = prog.statements
    assert isinstance(stmt, ast.Rule)
    return stmt


def test_statement_terminator_needs_whitespace_after_dot() -> None:
    text = "dim F = 11008. const c = 1.5.\n# a. comment. with dots.\ny[i] = x[i].# trailing\n"
    chunks = split_statements(text)
    assert [text[c.start : c.end].strip() for c in chunks] == [
        "dim F = 11008",
        "const c = 1.5",
        "# a. comment. with dots.\ny[i] = x[i]",
    ]
    assert all(c.terminated for c in chunks)


def test_last_statement_may_end_at_end_of_file() -> None:
    prog = parse("input x[3] : f32.\ny[i] = x[i].", "t.edl")
    assert len(prog.statements) == 2


def test_declarations() -> None:
    prog = parse(
        "dim B = 1, S = 2048, E = D / H.\nconst eps = 1e-5, theta = 10000.0.\n"
        "input x[B, S, 2 * E] : bf16.\nparam w[E] : f64.\noutput y, z.\n",
        "t.edl",
    )
    dims, consts, inp, par, out = prog.statements
    assert isinstance(dims, ast.DimDecl) and [b.name for b in dims.items] == ["B", "S", "E"]
    assert isinstance(consts, ast.ConstDecl)
    assert next(b.expr for b in consts.items if isinstance(b.expr, ast.Num)).value == 1e-5
    assert isinstance(inp, ast.RelationDecl) and (inp.kind, inp.name, inp.dtype, len(inp.shape)) == (
        "input",
        "x",
        "bf16",
        3,
    )
    assert isinstance(par, ast.RelationDecl) and par.kind == "param"
    assert isinstance(out, ast.OutputDecl) and [n for n, _ in out.names] == ["y", "z"]


def test_integer_and_float_literals() -> None:
    rule = _rule("y[i] = x[i] * 2 + 2.5e-3 + 7e2.")
    nums = [e for e in ast.walk(rule.body) if isinstance(e, ast.Num)]
    assert [(n.value, type(n.value)) for n in nums] == [(2, int), (2.5e-3, float), (700.0, float)]


def test_atoms_composites_literals_and_extents() -> None:
    rule = _rule("q[b, s, (0, i)] += xn[b, s, d] * wq[(h:H, e:E/2), d].")
    assert rule.aggop == "+="
    head = rule.head
    assert head.relation == "q" and len(head.positions) == 3
    comp = head.positions[2]
    assert comp.composite and [c.literal for c in comp.components] == [0, None]
    wq = next(a for a in ast.walk(rule.body) if isinstance(a, ast.Atom) and a.relation == "wq")
    h, e = wq.positions[0].components
    assert (h.var, e.var) == ("h", "e")
    assert h.extent is not None and h.extent.span.text == "H"
    assert e.extent is not None and e.extent.span.text == "E/2"
    assert str(wq) == "wq[(h:H,e:E/2),d]"


def test_zero_dimensional_relation() -> None:
    rule = _rule("t[] += x[i].")
    assert rule.head.positions == ()


@pytest.mark.parametrize(
    ("text", "shape"),
    [
        ("-x[i]^2", ("-", ("^", "x", "2"))),
        ("a[i] - b[i] - c[i]", ("-", ("-", "a", "b"), "c")),
        ("2 ^ 3 ^ 2", ("^", "2", ("^", "3", "2"))),
        ("a[i] + b[i] * c[i]", ("+", "a", ("*", "b", "c"))),
        ("a[i] / b[i] * c[i]", ("*", ("/", "a", "b"), "c")),
        ("theta ^ (-2.0 * i / E)", ("^", "theta", ("/", ("*", ("-", "2.0"), "i"), "E"))),
        ("x[i] ^ -1", ("^", "x", ("-", "1"))),
    ],
)
def test_precedence_and_associativity(text: str, shape: object) -> None:
    def tree(e: ast.Expr) -> object:
        if isinstance(e, ast.Binary):
            return (e.op, tree(e.lhs), tree(e.rhs))
        if isinstance(e, ast.Unary):
            return (e.op, tree(e.arg))
        if isinstance(e, ast.Atom):
            return e.relation
        if isinstance(e, ast.Name):
            return e.ident
        assert isinstance(e, ast.Num)
        return e.text

    assert tree(_rule(f"y[i] = {text}.").body) == shape


def test_where_call_conditions_and_guards() -> None:
    rule = _rule("y[i, j] += where(i < 3 and not j == 1 or i != j, x[i], 0) where i <= j, i + j < 4.")
    assert isinstance(rule.body, ast.Call) and rule.body.fn == "where"
    cond = rule.body.args[0]
    assert isinstance(cond, ast.Binary) and cond.op == "or"
    assert [g.span.text for g in rule.guards] == ["i <= j", "i + j < 4"]


def test_spans_point_into_the_source() -> None:
    text = "input x[4] : f32.\n\ty[i] =   x[i] * 2.\n"
    prog = parse(text, "t.edl")
    rule = prog.statements[1]
    assert isinstance(rule, ast.Rule)
    assert rule.span.text == "y[i] =   x[i] * 2"
    assert (rule.span.line, rule.span.col) == (2, 2)
    assert str(rule.head.name_span) == "t.edl:2:2"
    assert rule.aggop_span.text == "="


@pytest.mark.parametrize(
    ("text", "where", "expected"),
    [
        ("y[i] = x[i] +.", "1:14", "expected an operand"),
        ("input x[3] : f31.", "1:14", "expected a dtype"),
        ("input x[3 : f32.", "1:11", "expected ']'"),
        ("y[i] == x[i].", "1:6", "expected an aggregation operator"),
        ("y[i] = x[i]\nz[i] = x[i].", "2:1", "found 'z'"),
        ("y[i] = x[i]", "1:11", "does not end with '.'"),
        ("where[i] = x[i].", "1:1", "expected a name"),
        ("y[(i, ] = x[i].", "1:7", "expected an index"),
        ("dim = 3.", "1:5", "expected a name"),
    ],
)
def test_syntax_errors_have_locations(text: str, where: str, expected: str) -> None:
    with pytest.raises(EdlError) as info:
        parse(text, "t.edl")
    err = info.value
    assert err.span is not None
    assert f"{err.span.line}:{err.span.col}" == where
    assert expected in err.message
    assert str(err).startswith(f"t.edl:{where}: error: ")
    assert "^" in str(err)


def test_missing_dot_gets_a_hint() -> None:
    with pytest.raises(EdlError) as info:
        parse("y[i] = x[i]\nz[i] = x[i].", "t.edl")
    assert info.value.diagnostic.help is not None and "'.'" in info.value.diagnostic.help


def test_decimal_without_digits_after_dot_gets_a_hint() -> None:
    with pytest.raises(EdlError) as info:
        parse("y[i] = 2. + x[i].", "t.edl")
    assert "2.0" in (info.value.diagnostic.help or "")


def test_caret_is_aligned_under_tabs() -> None:
    with pytest.raises(EdlError) as info:
        parse("\ty[i] = x[i] @ 3.", "t.edl")
    lines = str(info.value).splitlines()
    src, caret = lines[1], lines[2]
    assert src.endswith("\ty[i] = x[i] @ 3.")
    col = src.index("@")
    assert caret[col] == "^"


def test_deep_nesting_is_an_error_not_a_crash() -> None:
    with pytest.raises(EdlError, match="nested too deeply"):
        parse("y[i] = " + "(" * 400 + "x[i]" + ")" * 400 + ".", "t.edl")


@pytest.mark.parametrize("path", sorted((ROOT / "programs").glob("*.edl")), ids=lambda p: p.name)
def test_shipped_programs_parse(path: Path) -> None:
    prog = parse(path.read_text(), str(path))
    assert any(isinstance(s, ast.Rule) for s in prog.statements)
    assert any(isinstance(s, ast.OutputDecl) for s in prog.statements)


def test_dtype_names_match_the_ir() -> None:
    # The language and the IR keep their own copies (neither stage imports the other).
    from edatalog.ir import dtypes
    from edatalog.lang import parser

    assert parser.DTYPES == dtypes.DTYPES
