"""Fuzzing the compiler front to back: whatever text it is given, ``edatalog.compile_string`` either
succeeds or raises :class:`edatalog.EdlError`, never another exception.

Three generators: (a) garbage weighted toward the language's tokens, (b) mutations of the shipped
programs in ``programs/`` (tokens and characters deleted, duplicated or swapped, numbers set to
0 or huge values, identifiers renamed, statements and declarations dropped, dims overridden), and
(c) random small programs that are well formed, so the later passes (extents, guards, supports)
see many shapes too.

Runs are reproducible (``derandomize=True``, no example database).  For a longer, randomized
hunt, set ``EDL_FUZZ_EXAMPLES``, e.g. ``EDL_FUZZ_EXAMPLES=5000 pytest tests/edatalog/test_fuzz.py``.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edatalog

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = {p.name: p.read_text(encoding="utf-8") for p in sorted((ROOT / "programs").glob("*.edl"))}

_LONG = int(os.environ.get("EDL_FUZZ_EXAMPLES", "0"))


def _settings(examples: int) -> settings:
    """Small and deterministic in CI; ``EDL_FUZZ_EXAMPLES`` makes it long and random."""
    return settings(
        max_examples=_LONG or examples,
        deadline=None,  # z3 and pyparsing have slow first calls
        derandomize=not _LONG,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


def compile_or_user_error(text: str, **overrides: Any) -> edatalog.Program | None:
    """Compile ``text``; an :class:`EdlError` is fine (and must render as a diagnostic), anything
    else propagates and fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", edatalog.EdlWarning)
        try:
            return edatalog.compile_string(text, name="fuzz.edl", **overrides)
        except edatalog.EdlError as exc:
            err = exc
    _check_rendering(err, text)
    return None


def _check_rendering(err: edatalog.EdlError, text: str) -> None:
    rendered = str(err)
    lines = rendered.split("\n")
    assert "error: " in lines[0]
    assert all(ch.isprintable() or ch in "\t\n" for ch in rendered), ascii(rendered)
    if err.span is not None:
        assert rendered.startswith(f"fuzz.edl:{err.span.line}:{err.span.col}: error: ")
        assert 0 <= err.span.start <= err.span.end <= len(text) + 1  # +1: "found the end of the statement"
        assert "^" in lines[2]


# ---------------------------------------------------------------------------------------------
# (a) Garbage.

_TOKENS = [
    *"[](),.:=+-*/^<>#_",
    *("+=", "*=", "max=", "min=", "<=", ">=", "==", "!=", ". ", ".\n"),
    *("dim", "const", "input", "param", "output", "where", "and", "or", "not"),
    *("f32", "f64", "bf16", "i32", "bool", "exp", "sqrt", "max", "pi", "inf"),
    *("i", "j", "x", "y", "N", "D", "E", "h", "e", "x[i]", "y[i, j]", "(h, e)", "i:N"),
    *("0", "1", "2", "2.", "2.5", "1e-5", "1e999", "99999999999999999999", "-1"),
    *("\n", "\t", " ", "  ", "\r\n", "# comment\n", "\u00a0", "é", "×", "∑", "😀", "\x00", "\ufeff"),
]
_garbage = st.lists(
    st.one_of(
        st.sampled_from(_TOKENS),
        st.sampled_from(_TOKENS),  # weighted toward tokens
        st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True),
        st.from_regex(r"[0-9]{1,25}(\.[0-9]{1,3})?([eE][+-]?[0-9]{1,4})?", fullmatch=True),
        st.text(max_size=3),
    ),
    max_size=60,
).map("".join)

_PRELUDE = "dim N = 4, M = 6, H = 2, E = M / H.\ninput x[N] : f32.\ninput w[N, M] : f32.\n"


@_settings(250)
@given(_garbage)
def test_garbage_raises_only_edl_errors(text: str) -> None:
    compile_or_user_error(text)


@_settings(150)
@given(_garbage)
def test_garbage_after_valid_declarations_raises_only_edl_errors(text: str) -> None:
    compile_or_user_error(_PRELUDE + text)


# ---------------------------------------------------------------------------------------------
# (b) Mutations of the shipped programs.

_TOKEN_RE = re.compile(r"#[^\n]*|\s+|[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|\+=|\*=|[<>=!]=|.", re.S)
_NUMBERS = ["0", "1", "-1", "00", "2.", "0.0", "1e999", "1e-999", "99999999999999999999", "9" * 40, "3"]
_NAMES = ["where", "and", "dim", "input", "pi", "exp", "i", "N", "x", "_", "A" * 50, "é"]


def _statements(text: str) -> list[tuple[int, int]]:
    """Rough statement extents: from the start of a line to the terminating dot."""
    return [(m.start(), m.end()) for m in re.finditer(r"(?m)^[^#\s][^\n]*?(?:\.(?=\s|$)|\n(?=\s*\n))", text)]


@st.composite
def _mutated(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    text = PROGRAMS[draw(st.sampled_from(sorted(PROGRAMS)))]
    for _ in range(draw(st.integers(1, 4))):
        toks = _TOKEN_RE.findall(text)
        if not toks:
            break
        kind = draw(st.integers(0, 11))
        k = draw(st.integers(0, len(toks) - 1))
        if kind == 0:  # delete a token
            del toks[k]
        elif kind == 1:  # duplicate a token
            toks.insert(k, toks[k])
        elif kind == 2:  # swap two tokens
            j = draw(st.integers(0, len(toks) - 1))
            toks[k], toks[j] = toks[j], toks[k]
        elif kind == 3:  # a number becomes 0, huge, or otherwise odd
            nums = [i for i, t in enumerate(toks) if t[0].isdigit()]
            if nums:
                toks[draw(st.sampled_from(nums))] = draw(st.sampled_from(_NUMBERS))
        elif kind == 4:  # rename one use of an identifier, or all of them
            names = sorted({t for t in toks if t[0].isalpha() or t[0] == "_"})
            old = draw(st.sampled_from(names)) if names else ""
            new = draw(st.one_of(st.sampled_from(names or ["x"]), st.sampled_from(_NAMES)))
            every = draw(st.booleans())
            hits = [i for i, t in enumerate(toks) if t == old]
            for i in hits if every else hits[:1]:
                toks[i] = new
        elif kind == 5:  # insert a token from the vocabulary
            toks.insert(k, draw(st.sampled_from(_TOKENS)))
        text = "".join(toks)
        if kind in (6, 7, 8) and text:  # character edits
            c = draw(st.integers(0, len(text) - 1))
            if kind == 6:
                text = text[:c] + text[c + 1 :]
            elif kind == 7:
                text = text[:c] + text[c] + text[c:]
            elif c + 1 < len(text):
                text = text[:c] + text[c + 1] + text[c] + text[c + 2 :]
        elif kind in (9, 10, 11):  # drop a declaration, drop or duplicate a statement
            spans = _statements(text)
            if kind == 9:
                spans = [s for s in spans if text[s[0] :].startswith(("dim", "const", "input", "param", "output"))]
            if spans:
                a, b = draw(st.sampled_from(spans))
                text = text[:a] + text[b:] if kind != 11 else text[:b] + "\n" + text[a:b] + text[b:]
    overrides: dict[str, Any] = {}
    if draw(st.integers(0, 4)) == 0:
        names = sorted(set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", text))) or ["N"]
        values = st.one_of(st.integers(-3, 70), st.sampled_from([2**63, 2**63 - 1, 10**30, True, 1.5, "8", None]))
        overrides["dims"] = draw(st.dictionaries(st.sampled_from([*names, "Q"]), values, max_size=3))
    if draw(st.integers(0, 6)) == 0:
        values = st.one_of(st.floats(allow_nan=True), st.integers(-(10**400), 10**400), st.sampled_from([True, "x"]))
        overrides["consts"] = draw(st.dictionaries(st.sampled_from(["eps", "theta", "pi", "zz"]), values, max_size=2))
    return text, overrides


@_settings(60)
@given(_mutated())
def test_mutated_programs_raise_only_edl_errors(case: tuple[str, dict[str, Any]]) -> None:
    text, overrides = case
    compile_or_user_error(text, **overrides)


# ---------------------------------------------------------------------------------------------
# (c) Random small programs that mostly parse, to exercise extents, guards and supports.

_DIMS = ["N", "M", "K"]
_VARS = ["i", "j", "k"]


@st.composite
def _index(draw: st.DrawFn) -> str:
    def component() -> str:
        core = draw(st.one_of(st.sampled_from(_VARS), st.sampled_from(["0", "1", "2"])))
        if draw(st.integers(0, 5)) == 0:
            core += ":" + draw(st.sampled_from([*_DIMS, "2", "N/2", "M*K", "0"]))
        return core

    if draw(st.integers(0, 3)) == 0:
        return "(" + ", ".join(component() for _ in range(draw(st.integers(1, 3)))) + ")"
    return component()


@st.composite
def _atom(draw: st.DrawFn, arity: dict[str, int]) -> str:
    name = draw(st.sampled_from(sorted(arity)))
    n = arity[name] if draw(st.integers(0, 40)) else draw(st.integers(0, 3))  # now and then a wrong arity
    return f"{name}[{', '.join(draw(_index()) for _ in range(n))}]"


@st.composite
def _body(draw: st.DrawFn, arity: dict[str, int], depth: int = 0) -> str:
    if depth > 2 or draw(st.integers(0, 2)) == 0:
        return draw(
            st.one_of(
                _atom(arity),
                _atom(arity),
                st.sampled_from(["1.0", "2", "0", "N", "pi", "c"]),
            )
        )
    op = draw(st.sampled_from([*"+-*/+-*/+-*/^", "<", "and"]))
    lhs, rhs = draw(_body(arity, depth + 1)), draw(_body(arity, depth + 1))
    if draw(st.integers(0, 4)) == 0:
        fn = draw(st.sampled_from(["exp", "max", "where", "sqrt"]))
        args = {"exp": [lhs], "sqrt": [lhs], "max": [lhs, rhs], "where": [f"{lhs} < {rhs}", lhs, rhs]}[fn]
        return f"{fn}({', '.join(args)})"
    return f"({lhs} {op} {rhs})"


@st.composite
def _program(draw: st.DrawFn) -> str:
    values = [["1", "2", "3", "4", "6"], ["2", "4", "N * 2", "N - 1", "N"], ["2", "3", "M / 2", "N * M"]]
    dims = [f"{d} = {draw(st.sampled_from(v))}" for d, v in zip(_DIMS, values, strict=True)]
    lines = [f"dim {', '.join(dims)}.", "const c = 0.5."]
    arity: dict[str, int] = {}
    for name in ("x", "w"):
        shape = [draw(st.sampled_from([*_DIMS, *_DIMS, "N * M", "2", "M * K"])) for _ in range(draw(st.integers(0, 3)))]
        dtype = draw(st.sampled_from(["f32", "f32", "i32", "bool", "bf16"]))
        lines.append(f"input {name}[{', '.join(shape)}] : {dtype}.")
        arity[name] = len(shape)
    for r in range(draw(st.integers(1, 4))):
        head_name = draw(st.sampled_from([*[f"r{r}"] * 16, "r0", "r0", "r0", "x"]))
        n = arity.get(head_name, draw(st.integers(0, 3)))
        body = draw(_body(arity))
        # Head indices mostly come from the body, so that many programs get past the checks.
        used = sorted(set(re.findall(r"\b[ijk]\b", body)))
        fresh = st.sampled_from(["i:N", "j:2", "k:M"])
        comps = [
            draw(st.one_of(st.sampled_from(used), _index()) if used else st.one_of(fresh, _index())) for _ in range(n)
        ]
        head = f"{head_name}[{', '.join(comps)}]"
        aggop = draw(st.sampled_from(["=", "=", "+=", "+=", "max=", "*=", "min="]))
        known = set(used) | {c[0] for c in comps if c[:1] in ("i", "j", "k")}
        pool = [
            g
            for g in ("i < j", "j <= i + 1", "i != 2", "2 * i >= N", "i == k")
            if set(re.findall(r"[ijk]", g)) <= known
        ]
        guards = draw(st.lists(st.sampled_from(pool), max_size=1)) if pool else []
        where = f" where {', '.join(guards)}" if guards else ""
        lines.append(f"{head} {aggop} {body}{where}.")
        arity.setdefault(head_name, n)
    if draw(st.booleans()):
        lines.append(f"output {draw(st.sampled_from(sorted(arity)))}.")
    return "\n".join(lines) + "\n"


@_settings(120)
@given(_program())
def test_random_programs_raise_only_edl_errors(text: str) -> None:
    compile_or_user_error(text)


# ---------------------------------------------------------------------------------------------
# Edge cases, one by one.

_X = "dim N = 4.\ninput x[N] : f32.\n"


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(_X + "y[i] = " + "(" * 1000 + "x[i]" + ")" * 1000 + ".", id="parens"),
        pytest.param(_X + "y[i] = x[i]" + " + x[i]" * 300 + ".", id="long-sum"),
        pytest.param(_X + "y[i] = " + "- " * 1000 + "x[i].", id="negations"),
        pytest.param(_X + "y[i] = x[i] where " + "not " * 1000 + "i < 2.", id="nots"),
        pytest.param(_X + "y[i] = " + "exp(" * 1000 + "x[i]" + ")" * 1000 + ".", id="calls"),
        pytest.param(_X + "y[i] = x[i] ^ " + "2 ^ " * 1000 + "2.", id="powers"),
        pytest.param(_X + "y[i] = x[i] where i < " + " + ".join(["1"] * 300) + ".", id="long-guard"),
        pytest.param("dim N = " + " + ".join(["1"] * 300) + ".\ninput x[N] : f32.\ny[i] = x[i].", id="long-dim"),
        pytest.param(_X + "const c = " + " * ".join(["1.5"] * 300) + ".\ny[i] = x[i] * c.", id="long-const"),
        pytest.param(
            "dim D0 = 2, " + ", ".join(f"D{k + 1} = D{k} + 1" for k in range(400)) + ".\ninput x[D400] : f32.\n"
            "y[i] = x[i].",
            id="dim-chain",
        ),
        pytest.param(
            _X + "const " + ", ".join(f"c{k} = c{k + 1} + 1.0" for k in range(400)) + ", c400 = 0.0.\n"
            "y[i] = x[i] * c0.",
            id="const-chain",
        ),
        pytest.param(
            "dim A0 = 10, " + ", ".join(f"A{k + 1} = A{k} * A{k}" for k in range(40)) + ".\ninput x[A40] : f32.\n"
            "y[i] = x[i].",
            id="dim-squares",
        ),
        pytest.param("y[i] = x[" + ", ".join(["i"] * 2000) + "].", id="many-indices"),
        pytest.param(_X + "y[" + "(" * 500 + "i" + ")" * 500 + "] = x[i].", id="nested-composites"),
        pytest.param("\n".join(f"dim N{k} = {k + 1}." for k in range(300)), id="many-statements"),
    ],
)
def test_deep_and_long_programs_raise_only_edl_errors(text: str) -> None:
    compile_or_user_error(text)


def test_deep_nesting_is_reported_as_nesting() -> None:
    with pytest.raises(edatalog.EdlError, match="nested too deeply"):
        edatalog.compile_string(_X + "y[i] = x[i]" + " + x[i]" * 300 + ".")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dim S = 99999999999999999999.\ninput x[S] : f32.\ny[s] = x[s].", "too large"),
        ("dim S = 9223372036854775807.\ninput x[S] : f32.\ny[s] = x[s].", None),
        ("dim N = 3037000500, M = N * N.\ninput x[M] : f32.\ny[s] = x[s].", "too large"),
        ("dim N = 0.\ninput x[N] : f32.\ny[i] = x[i].", "must be positive"),
        ("dim N = 0 - 3.\ninput x[N] : f32.\ny[i] = x[i].", "must be positive"),
        ("dim N = 4 / 0.\ninput x[N] : f32.\ny[i] = x[i].", "division by zero"),
        ("dim N = 4, M = N / (N - 4).\ninput x[M] : f32.\ny[i] = x[i].", "division by zero"),
        (_X + "const c = 1.0 / 0.\ny[i] = x[i] * c.", "division by zero"),
        (_X + "const c = 10 ^ 4000.\ny[i] = x[i] * c.", "too large"),
        (_X + "const c = 10 ^ 10 ^ 10 ^ 10.\ny[i] = x[i] * c.", "too large"),
        (_X + "const c = " + "9" * 400 + ".\ny[i] = x[i] * c.", "too large"),
        (_X + "const c = 1e999.\ny[i] = x[i] * c.", "too large"),
        (_X + "y[i] = x[i] * 1e999.", "too large"),
        (_X + "y[i] = x[i] * 1e-999.", None),
        (_X + "const c = (0.0 - 1.0) ^ 0.5.\ny[i] = x[i] * c.", "not a real number"),
        (_X + "y[i] = x[i] where i < 2 * 99999999999999999999.", None),
        (_X + "y[i] = x[i] where i / 0 < 1.", "divides"),
        (_X + "t[] += x[i].", None),
        (_X + "t[] = x[0].", None),
        ("dim N = 4.\ninput x[] : f32.\ny[i:N] = x[].", None),
    ],
)
def test_numeric_edge_cases(text: str, message: str | None) -> None:
    if message is None:
        assert compile_or_user_error(text) is not None
    else:
        with pytest.raises(edatalog.EdlError, match=message):
            edatalog.compile_string(text)


def test_zero_dimensional_relation_runs() -> None:
    prog = edatalog.compile_string(_X + "t[] += x[i].\n")
    assert prog.graph.relation("t").shape == ()
    out = prog.run({"x": [1.0, 2.0, 3.0, 4.0]})
    assert float(out["t"]) == 10.0


@pytest.mark.parametrize(
    "dims", [{"N": 0}, {"N": -1}, {"N": 2**63}, {"N": True}, {"N": 2.0}, {"Q": 3}, {"n": 3}], ids=str
)
def test_bad_dim_overrides_are_edl_errors(dims: dict[str, Any]) -> None:
    with pytest.raises(edatalog.EdlError, match="override"):
        edatalog.compile_string(_X + "y[i] = x[i].", dims=dims)
