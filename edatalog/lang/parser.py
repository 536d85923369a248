"""Parse ``.edl`` text into the syntax tree of :mod:`edatalog.lang.ast`.

Parsing is two steps:

1. :func:`split_statements` cuts the text at statement terminators: a ``.`` followed by
   whitespace, the end of the file or a comment (so ``11008.`` ends a statement and ``1.5`` does
   not).  Cutting first lets every statement fail on its own, with a precise location.
2. Each statement is parsed with the pyparsing grammar for its leading keyword.

Syntax errors become :class:`~edatalog.errors.EdlError` saying what was expected.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyparsing as pp

from edatalog.errors import EdlError, Source, Span
from edatalog.lang import ast

DTYPES = ("f64", "f32", "f16", "bf16", "i64", "i32", "bool")
AGGOPS = ("=", "+=", "*=", "max=", "min=")
DECL_KEYWORDS = ("dim", "const", "input", "param", "output")
KEYWORDS = frozenset((*DECL_KEYWORDS, "where", "and", "or", "not"))

# ---------------------------------------------------------------------------------------------
# Step 1: statements.


@dataclass(frozen=True)
class Chunk:
    """The text of one statement: ``[start, end)`` excludes the terminating dot at ``end``."""

    start: int
    end: int
    terminated: bool


def split_statements(text: str) -> list[Chunk]:
    """Cut ``text`` at statement terminators, skipping comments.  Blank chunks are dropped."""
    chunks: list[Chunk] = []
    start = 0
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "#":
            nl = text.find("\n", i)
            i = n if nl < 0 else nl
            continue
        if ch == "." and (i + 1 == n or text[i + 1].isspace() or text[i + 1] == "#"):
            chunks.append(Chunk(start, i, True))
            start = i + 1
        i += 1
    chunks.append(Chunk(start, n, False))
    return [c for c in chunks if not _blank(text[c.start : c.end])]


_COMMENT = re.compile(r"#[^\n]*")


def _blank(text: str) -> bool:
    return not _COMMENT.sub("", text).strip()


# ---------------------------------------------------------------------------------------------
# Step 2: the grammar.  Parse actions build AST nodes; spans are made absolute through the
# statement's offset held in a context variable while a statement is parsed.


@dataclass(frozen=True)
class _Where:
    source: Source
    base: int


_WHERE: contextvars.ContextVar[_Where] = contextvars.ContextVar("edl_parse_where")


def _span(start: int, end: int) -> Span:
    w = _WHERE.get()
    return Span(w.source, w.base + start, w.base + end)


def _node(expr: pp.ParserElement, build: Callable[[Span, pp.ParseResults], Any], name: str) -> pp.ParserElement:
    """``expr`` whose match is turned into one AST node by ``build(span, tokens)``."""

    def action(toks: pp.ParseResults) -> Any:
        return build(_span(toks[0], toks[2]), toks[1])

    return pp.Located(expr).set_parse_action(action).set_name(name)


def _tok_span(expr: pp.ParserElement, name: str) -> pp.ParserElement:
    """A token kept as ``(text, span)``."""
    return _node(expr, lambda sp, t: (t[0], sp), name)


def _list(item: pp.ParserElement) -> pp.ParserElement:
    """``item (, item)*``; after a comma another item is required, which gives precise errors."""
    return item + pp.ZeroOrMore(pp.Suppress(",") - item)


def _left_assoc(operand: pp.ParserElement, ops: pp.ParserElement, name: str) -> pp.ParserElement:
    def build(span: Span, t: pp.ParseResults) -> ast.Expr:
        expr = t[0]
        for k in range(1, len(t), 2):
            rhs = t[k + 1]
            op = t[k]
            expr = ast.Binary(op, expr, rhs, expr.span.to(rhs.span))
        return expr

    return _node(operand + pp.ZeroOrMore(ops - operand), build, name)


def _build_grammar() -> dict[str, pp.ParserElement]:
    pp.ParserElement.set_default_whitespace_chars(" \t\r\n")
    lbrack, rbrack = pp.Suppress("[").set_name("'['"), pp.Suppress("]").set_name("']'")
    lpar, rpar = pp.Suppress("(").set_name("'('"), pp.Suppress(")").set_name("')'")
    colon = pp.Suppress(":").set_name("':'")

    ident_re = pp.Regex(r"[A-Za-z_][A-Za-z0-9_]*").set_name("a name")
    ident = ident_re.copy().add_condition(lambda t: t[0] not in KEYWORDS).set_name("a name")
    name_tok = _tok_span(ident, "a name")

    def number(span: Span, t: pp.ParseResults) -> ast.Num:
        text = t[0]
        is_float = any(c in text for c in ".eE")
        return ast.Num(float(text) if is_float else int(text), text, span)

    num = _node(pp.Regex(r"\d+(?:\.\d+)?(?:[eE][+-]?\d+)?"), number, "a number")
    integer = pp.Regex(r"\d+").set_name("an integer")

    expr: pp.Forward = pp.Forward()

    # Index positions: a variable or literal, optionally with an extent, or a composite of them.
    extent: pp.Forward = pp.Forward()

    def component(span: Span, t: pp.ParseResults) -> ast.Component:
        head = t[0]
        ext = t[1] if len(t) > 1 else None
        if head.isdigit():
            return ast.Component(None, int(head), ext, span)
        return ast.Component(head, None, ext, span)

    comp = _node((ident | integer).set_name("an index") + pp.Opt(colon - extent), component, "an index")
    composite = _node(
        lpar - _list(comp) - rpar,
        lambda sp, t: ast.Position(tuple(t), True, sp),
        "a composite index",
    )
    single = _node(comp, lambda sp, t: ast.Position((t[0],), False, sp), "an index")
    position = (composite | single).set_name("an index")
    index_list = lbrack - pp.Opt(_list(position)) - rbrack

    def atom(span: Span, t: pp.ParseResults) -> ast.Atom:
        name, name_span = t[0]
        return ast.Atom(name, tuple(t[1:]), span, name_span)

    atom_ref = _node(name_tok + index_list, atom, "a relation reference")

    def call(span: Span, t: pp.ParseResults) -> ast.Call:
        name, name_span = t[0]
        return ast.Call(name, tuple(t[1:]), span, name_span)

    fn_tok = _tok_span(ident | pp.Keyword("where"), "a function name")
    call_ref = _node(fn_tok + lpar - pp.Opt(_list(expr)) - rpar, call, "a function call")
    name_ref = _node(ident, lambda sp, t: ast.Name(t[0], sp), "a name")
    paren = lpar - expr - rpar
    primary = (num | atom_ref | call_ref | name_ref | paren).set_name("an operand")

    neg: pp.Forward = pp.Forward()

    def power(span: Span, t: pp.ParseResults) -> ast.Expr:
        if len(t) == 1:
            return t[0]
        return ast.Binary("^", t[0], t[2], span)

    pow_expr = _node(primary + pp.Opt(pp.Literal("^") - neg), power, "an operand")

    def negate(span: Span, t: pp.ParseResults) -> ast.Expr:
        return t[0] if len(t) == 1 else ast.Unary("-", t[1], span)

    neg <<= _node((pp.Literal("-") + neg) | pow_expr, negate, "an operand")
    neg.set_name("an operand")
    mul = _left_assoc(neg, pp.one_of("* /"), "an expression")
    add = _left_assoc(mul, pp.one_of("+ -"), "an expression")
    extent <<= add
    extent.set_name("an extent")

    def compare(span: Span, t: pp.ParseResults) -> ast.Expr:
        if len(t) == 1:
            return t[0]
        return ast.Compare(t[1], t[0], t[2], span)

    cmp = _node(add + pp.Opt(pp.one_of("<= >= == != < >") - add), compare, "an expression")
    kw_not = pp.Keyword("not")
    lnot: pp.Forward = pp.Forward()
    lnot <<= _node((kw_not + lnot) | cmp, negate_word, "an expression")
    lnot.set_name("an expression")
    land = _left_assoc(lnot, pp.Keyword("and"), "an expression")
    lor = _left_assoc(land, pp.Keyword("or"), "an expression")
    expr <<= lor
    expr.set_name("an expression")

    # Statements.
    def bindings(kw: str, make: Callable[..., Any]) -> pp.ParserElement:
        def binding(span: Span, t: pp.ParseResults) -> ast.Binding:
            name, name_span = t[0]
            return ast.Binding(name, t[1], span, name_span)

        item = _node(name_tok - pp.Suppress("=").set_name("'='") - expr, binding, f"a {kw} binding")
        return _node(
            pp.Keyword(kw).suppress() - _list(item),
            lambda sp, t: make(tuple(t), sp),
            f"a {kw} declaration",
        )

    dtype_name = "a dtype (" + ", ".join(DTYPES) + ")"
    dtype = _tok_span(pp.one_of(" ".join(DTYPES), as_keyword=True).set_name(dtype_name), dtype_name)

    def rel_decl(kind: str) -> pp.ParserElement:
        def build(span: Span, t: pp.ParseResults) -> ast.RelationDecl:
            (name, name_span), *shape, (dt, dt_span) = t
            return ast.RelationDecl(kind, name, tuple(shape), dt, span, name_span, dt_span)

        shape = lbrack - pp.Opt(_list(add)) - rbrack
        return _node(pp.Keyword(kind).suppress() - name_tok - shape - colon - dtype, build, f"an {kind} declaration")

    output = _node(
        pp.Keyword("output").suppress() - _list(name_tok),
        lambda sp, t: ast.OutputDecl(tuple(t), sp),
        "an output declaration",
    )

    aggop_name = "an aggregation operator (=, +=, *=, max=, min=)"
    aggop = _tok_span(pp.Regex(r"\+=|\*=|max=|min=|=(?!=)").set_name(aggop_name), aggop_name)

    def rule(span: Span, t: pp.ParseResults) -> ast.Rule:
        head, (op, op_span), body, *guards = t
        return ast.Rule(head, op, body, tuple(guards), span, op_span)

    guards = pp.Keyword("where").suppress() - _list(expr)
    rule_stmt = _node(atom_ref - aggop - expr - pp.Opt(guards), rule, "a rule")

    return {
        "dim": bindings("dim", ast.DimDecl),
        "const": bindings("const", ast.ConstDecl),
        "input": rel_decl("input"),
        "param": rel_decl("param"),
        "output": output,
        "rule": rule_stmt,
    }


def negate_word(span: Span, t: pp.ParseResults) -> ast.Expr:
    return t[0] if len(t) == 1 else ast.Unary("not", t[1], span)


_GRAMMARS: dict[str, pp.ParserElement] | None = None


def _grammars() -> dict[str, pp.ParserElement]:
    global _GRAMMARS
    if _GRAMMARS is None:
        comment = pp.Regex(r"#[^\n]*")
        built = _build_grammar()
        for g in built.values():
            g.ignore(comment)
            g.parse_with_tabs()
        _GRAMMARS = built
    return _GRAMMARS


# ---------------------------------------------------------------------------------------------
# Entry points.


def parse(text: str, name: str = "<string>") -> ast.Program:
    """Parse a whole program.  Raises :class:`EdlError` on the first syntax error."""
    source = Source(name, text)
    chunks = split_statements(text)
    statements = []
    for k, chunk in enumerate(chunks):
        try:
            statements.append(parse_statement(source, chunk))
        except EdlError as err:
            prev = chunks[k - 1] if k else None
            if prev is not None and err.diagnostic.help is None and text[prev.end - 1 : prev.end].isdigit():
                raise EdlError(
                    err.message,
                    err.span,
                    help=f"the '.' at {source.span(prev.end)} ended the previous statement; "
                    "write decimals with digits on both sides (2.0, not 2.)",
                ) from None
            raise
    return ast.Program(source, tuple(statements))


def parse_file(path: str) -> ast.Program:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise EdlError(f"no such file: {path}", help="check the path; programs end in .edl") from None
    except IsADirectoryError:
        raise EdlError(f"{path} is a directory, not an .edl file") from None
    except UnicodeDecodeError as exc:
        raise EdlError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise EdlError(f"cannot read {path}: {exc.strerror}") from None
    return parse(text, path)


_LEADING_WORD = re.compile(r"(?:\s|#[^\n]*)*([A-Za-z_][A-Za-z0-9_]*)?")


def parse_statement(source: Source, chunk: Chunk) -> ast.Statement:
    text = source.text[chunk.start : chunk.end]
    m = _LEADING_WORD.match(text)
    word = m.group(1) if m else None
    kind = word if word in DECL_KEYWORDS and not _is_rule_head(text, m) else "rule"
    token = _WHERE.set(_Where(source, chunk.start))
    try:
        result = _grammars()[kind].parse_string(text, parse_all=True)
    except pp.ParseBaseException as exc:
        raise _syntax_error(source, chunk, text, exc, kind) from None
    except RecursionError:
        raise EdlError(
            "expression nested too deeply", source.span(chunk.start), help="split it into several rules"
        ) from None
    finally:
        _WHERE.reset(token)
    if not chunk.terminated:
        end = chunk.start + len(text.rstrip())
        raise EdlError(
            "statement does not end with '.'",
            source.span(max(chunk.start, end - 1), end),
            help="end every statement with '.' followed by a space, a newline or the end of the file",
        )
    stmt = result[0]
    assert isinstance(stmt, (ast.DimDecl, ast.ConstDecl, ast.RelationDecl, ast.OutputDecl, ast.Rule))
    return stmt


def _is_rule_head(text: str, m: re.Match[str] | None) -> bool:
    """``input[i] = ...`` would be a rule for a relation named like a keyword; keywords are reserved,
    but we still want the error to say so rather than 'expected a name'."""
    return m is not None and text[m.end() : m.end() + 1] == "["


def _syntax_error(source: Source, chunk: Chunk, text: str, exc: pp.ParseBaseException, kind: str) -> EdlError:
    loc = min(exc.loc, len(text))
    # Skip whitespace so the caret lands on the offending token, not before it.
    while loc < len(text) and text[loc].isspace():
        loc += 1
    found_m = re.match(r"[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d+)?|[=<>!+*]=|\S", text[loc:])
    found = found_m.group(0) if found_m else None
    expected = _expected(exc)
    start = chunk.start + loc
    span = source.span(start, start + (len(found) if found else 1))
    if found is None:
        message = f"expected {expected}, found the end of the statement" if expected else "unexpected end of statement"
    else:
        message = f"expected {expected}, found '{found}'" if expected else f"unexpected '{found}'"
    help_text = None
    if found is not None and "\n" in text[:loc] and kind == "rule" and loc > 0:
        before = text[:loc].rstrip()
        if before and before[-1] in "])0123456789" and "\n" in text[len(before) : loc]:
            help_text = "did you forget the '.' that ends the previous statement?"
    if found in KEYWORDS and "name" in (expected or ""):
        help_text = f"'{found}' is a reserved word; choose another name"
    if found == "." and kind == "rule":
        help_text = "a statement ends with '.' followed by whitespace; write decimals as 1.0, not 1."
    return EdlError(message, span, help=help_text)


def _expected(exc: pp.ParseBaseException) -> str:
    msg = exc.msg or ""
    if msg in ("", "None"):
        return "a name"
    if msg.startswith("Expected "):
        msg = msg[len("Expected ") :]
    msg = re.sub(r", found .*$", "", msg)
    msg = msg.replace("end of text", "the end of the statement ('.')")
    if msg.startswith("Keyword "):
        msg = msg[len("Keyword ") :]
    if msg.startswith(("{", "[")):
        named = re.findall(r"\b(an? [a-z ]+)", msg)
        msg = named[-1].strip() if named else "a valid continuation"
    return msg
