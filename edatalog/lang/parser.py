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
import dataclasses
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyparsing as pp

from edatalog.errors import EdlError, Note, Source, Span
from edatalog.lang import ast

DTYPES = ("f64", "f32", "f16", "bf16", "i64", "i32", "bool")
DECL_KEYWORDS = ("dim", "const", "input", "param", "output", "module", "end")
KEYWORDS = frozenset((*DECL_KEYWORDS, "where", "and", "or", "not"))
# Words with a meaning in one place only, and free to be names elsewhere: ``param w[..] : f32
# from "name"``, ``h = block(x) repeat L as layers``.
CONTEXTUAL = frozenset(("from", "repeat", "as"))

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
        value = float(text) if is_float else int(text)
        if is_float and value == float("inf"):
            raise EdlError(
                f"number {text} is too large for a floating-point value",
                span,
                help="the largest f64 is about 1.8e308; write inf for infinity",
            )
        return ast.Num(value, text, span)

    num = _node(pp.Regex(r"\d+(?:\.\d+)?(?:[eE][+-]?\d+)?"), number, "a number")

    expr: pp.Forward = pp.Forward()

    # Index positions: a variable or literal, optionally with an extent, or a composite of them.
    extent: pp.Forward = pp.Forward()

    def component(span: Span, t: pp.ParseResults) -> ast.Component:
        head = t[0]
        ext = t[1] if len(t) > 1 else None
        if isinstance(head, ast.Name):
            return ast.Component(head.ident, None, ext, span)
        if isinstance(head, ast.Num) and isinstance(head.value, int):
            return ast.Component(None, head.value, ext, span)
        return ast.Component(None, None, ext, span, head)  # an index expression: checked later

    index_start = pp.FollowedBy(pp.Regex(r"[A-Za-z_0-9(-]").set_name("an index"))
    comp = _node(index_start + expr + pp.Opt(colon - extent), component, "an index")
    # A composite has a comma; `(l + k) * 2` is an index expression, not a composite.
    composite = _node(
        lpar + comp + pp.Suppress(",") - _list(comp) - rpar,
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

    # A name, a relation reference `name[...]` or a call `name(...)`: one alternative, decided by
    # what follows the name, so operands never re-parse their name.
    def named(span: Span, t: pp.ParseResults) -> ast.Expr:
        name, name_span = t[0]
        if len(t) == 1:
            return ast.Name(name, span)
        kind, items = t[1]
        if kind == "[":
            return ast.Atom(name, items, span, name_span)
        return ast.Call(name, items, span, name_span)

    index_trailer = index_list.copy().add_parse_action(lambda t: [("[", tuple(t))])
    call_trailer = (lpar - pp.Opt(_list(expr)) - rpar).add_parse_action(lambda t: [("(", tuple(t))])
    name_or_where = _tok_span(ident | pp.Keyword("where"), "a name")
    named_ref = _node(name_or_where + pp.Opt(index_trailer | call_trailer), named, "an operand")
    # A parenthesized operand's span includes its parentheses: '(T - K) / 2' is one span.
    paren = _node(lpar - expr - rpar, lambda sp, t: dataclasses.replace(t[0], span=sp), "an operand")
    primary = (num | named_ref | paren).set_name("an operand")

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
    # Binary operators are parsed flat (operand, op, operand, ...) and nested by precedence
    # climbing in Python: one grammar level instead of six keeps pyparsing fast.
    kw_not = _tok_span(pp.Keyword("not"), "'not'")
    binop = (pp.one_of("<= >= == != < > + - * /") | pp.Keyword("and") | pp.Keyword("or")).set_name("an operator")
    item = pp.Group(pp.ZeroOrMore(kw_not) + neg)
    flat = item + pp.ZeroOrMore(binop - item)
    expr <<= flat.copy().set_parse_action(_climb)
    expr.set_name("an expression")
    extent <<= expr
    extent.set_name("an extent")
    add = expr

    # Statements.
    string = _tok_span(pp.QuotedString('"', unquote_results=True).set_name("a quoted name"), "a quoted name")

    def bindings(kw: str, make: Callable[..., Any]) -> pp.ParserElement:
        def binding(span: Span, t: pp.ParseResults) -> ast.Binding:
            name, name_span = t[0]
            return ast.Binding(name, t[1], span, name_span, tuple(t[2:]))

        # ``, "key"`` continues the keys, ``, NAME =`` the bindings: no error stop after the comma.
        keyed = pp.Opt(pp.Keyword("from").suppress() - string + pp.ZeroOrMore(pp.Suppress(",") + string))
        item = _node(name_tok - pp.Suppress("=").set_name("'='") - expr + keyed, binding, f"a {kw} binding")
        return _node(
            pp.Keyword(kw).suppress() - _list(item),
            lambda sp, t: make(tuple(t), sp),
            f"a {kw} declaration",
        )

    dtype_name = "a dtype (" + ", ".join(DTYPES) + ")"
    dtype = _tok_span(pp.one_of(" ".join(DTYPES), as_keyword=True).set_name(dtype_name), dtype_name)

    def rel_decl(kind: str) -> pp.ParserElement:
        def build(span: Span, t: pp.ParseResults) -> ast.RelationDecl:
            items = list(t)
            sources: list[tuple[tuple[str, Span], ...]] = []
            while items and isinstance(items[-1], tuple) and items[-1][0] == "from":
                sources.insert(0, items.pop()[1])
            (name, name_span), *shape, (dt, dt_span) = items
            flat = tuple(x for group in sources for x in group)
            return ast.RelationDecl(kind, name, tuple(shape), dt, span, name_span, dt_span, flat)

        shape = lbrack - pp.Opt(_list(add)) - rbrack
        sources = (pp.Keyword("from").suppress() - _list(string)).add_parse_action(lambda t: [("from", tuple(t))])
        decl = pp.Keyword(kind).suppress() - name_tok - shape - colon - dtype - pp.Opt(sources)
        return _node(decl, build, f"an {kind} declaration")

    # Output names may be an instance group's relations: ``layers.kr`` (every instance's kr).
    dotted = _tok_span(pp.Regex(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*").set_name("a name"), "a name")
    output = _node(
        pp.Keyword("output").suppress() - _list(dotted),
        lambda sp, t: ast.OutputDecl(tuple(t), sp),
        "an output declaration",
    )

    module_start = _node(
        pp.Keyword("module").suppress() - name_tok,
        lambda sp, t: ast.ModuleStart(t[0][0], sp, t[0][1]),
        "a module declaration",
    )
    module_end = _node(
        pp.Keyword("end").suppress() - pp.Opt(name_tok),
        lambda sp, t: ast.ModuleEnd(t[0][0] if len(t) else None, sp),
        "'end'",
    )

    def instance(span: Span, t: pp.ParseResults) -> ast.Instance:
        items = list(t)
        (result, result_span), (module, module_span) = items[0], items[1]
        args, count, prefix = [], None, None
        for item in items[2:]:
            if isinstance(item, tuple) and item and item[0] == "repeat":
                count = item[1]
            elif isinstance(item, tuple) and item and item[0] == "as":
                prefix = item[1]
            else:
                args.append(item)
        return ast.Instance(
            result,
            result_span,
            module,
            module_span,
            tuple(args),
            count,
            None if prefix is None else prefix[0],
            None if prefix is None else prefix[1],
            span,
        )

    repeat = (pp.Keyword("repeat").suppress() - add).add_parse_action(lambda t: [("repeat", t[0])])
    as_name = (pp.Keyword("as").suppress() - name_tok).add_parse_action(lambda t: [("as", t[0])])
    args = lpar - pp.Opt(_list(name_tok)) - rpar
    instance_stmt = _node(
        name_tok + pp.Suppress("=") + name_tok + args - pp.Opt(repeat) - pp.Opt(as_name),
        instance,
        "a module instance",
    )

    aggop_name = "an aggregation operator (=, +=, *=, max=, min=, argmax=, argmin=, top=, argtop=)"
    aggop_re = r"\+=|\*=|max=|min=|argmax=|argmin=|top=|argtop=|=(?!=)"
    aggop = _tok_span(pp.Regex(aggop_re).set_name(aggop_name), aggop_name)

    def rule(span: Span, t: pp.ParseResults) -> ast.Rule:
        head, (op, op_span), body, *guards = t
        return ast.Rule(head, op, body, tuple(_as_lookup(g) for g in guards), span, op_span)

    def lookup(span: Span, t: pp.ParseResults) -> ast.Lookup:
        atom = next(x for x in t if isinstance(x, ast.Atom))
        name, name_span = next(x for x in t if isinstance(x, tuple) and x[0] != ":")
        extent = next((x[1] for x in t if isinstance(x, tuple) and x[0] == ":"), None)
        last = extent.span if extent is not None else name_span
        first, end = (atom.span, last) if isinstance(t[0], ast.Atom) else (name_span, atom.span)
        return ast.Lookup(atom, name, name_span, first.to(end), extent)

    assign = pp.Regex(r"=(?![=])").suppress().set_name("'='")
    ranged = name_tok + pp.Opt((colon + extent).add_parse_action(lambda t: [(":", t[0])]))
    lookup_item = _node((atom_ref + assign + ranged) | (ranged + assign + atom_ref), lookup, "a lookup")
    guards = pp.Keyword("where").suppress() - _list(lookup_item | expr)
    rule_stmt = _node(atom_ref - aggop - expr - pp.Opt(guards), rule, "a rule")

    return {
        "dim": bindings("dim", ast.DimDecl),
        "const": bindings("const", ast.ConstDecl),
        "input": rel_decl("input"),
        "param": rel_decl("param"),
        "output": output,
        "module": module_start,
        "end": module_end,
        "instance": instance_stmt,
        "rule": rule_stmt,
    }


def _as_lookup(g: ast.Expr | ast.Lookup) -> ast.Expr | ast.Lookup:
    """``ids[b, s] == v`` as a guard is the lookup ``ids[b, s] = v``."""
    if isinstance(g, ast.Compare) and g.op == "==":
        if isinstance(g.lhs, ast.Atom) and isinstance(g.rhs, ast.Name):
            return ast.Lookup(g.lhs, g.rhs.ident, g.rhs.span, g.span)
        if isinstance(g.rhs, ast.Atom) and isinstance(g.lhs, ast.Name):
            return ast.Lookup(g.rhs, g.lhs.ident, g.lhs.span, g.span)
    return g


_PREC = {"or": 1, "and": 2, "<": 4, "<=": 4, ">": 4, ">=": 4, "==": 4, "!=": 4, "+": 5, "-": 5, "*": 6, "/": 6}
_NOT_PREC = 3  # `not a < b` is `not (a < b)`; `not a and b` is `(not a) and b`


def _climb(text: str, loc: int, toks: pp.ParseResults) -> ast.Expr:
    """Nest a flat ``item (op item)*`` by precedence; items are groups of ``not`` prefixes and an
    operand, at even positions, with the operators between them."""
    items = list(toks)
    base = _WHERE.get().base

    def operand(pos: int, k: int) -> tuple[ast.Expr, int]:
        group = list(items[pos])
        if k < len(group) - 1:  # a `not` prefix: it governs everything tighter than `and`
            _, not_span = group[k]
            arg, nxt = climb(pos, k + 1, _NOT_PREC + 1)
            return ast.Unary("not", arg, not_span.to(arg.span)), nxt
        return group[-1], pos + 1

    def climb(pos: int, k: int, min_prec: int) -> tuple[ast.Expr, int]:
        lhs, pos = operand(pos, k)
        while pos < len(items) and _PREC[items[pos]] >= min_prec:
            op = items[pos]
            prec = _PREC[op]
            rhs, nxt = climb(pos + 1, 0, prec + 1)
            span = lhs.span.to(rhs.span)
            if prec == _PREC["<"]:
                if nxt < len(items) and _PREC[items[nxt]] == prec:
                    raise pp.ParseFatalException(
                        text,
                        rhs.span.end - base,
                        "comparisons do not chain; join them with 'and' in where(), "
                        "or write separate guards: 'where a < b, b < c'",
                    )
                lhs = ast.Compare(op, lhs, rhs, span)
            else:
                lhs = ast.Binary(op, lhs, rhs, span)
            pos = nxt
        return lhs, pos

    return climb(0, 0, 0)[0]


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
    """Parse a whole program.  Raises :class:`EdlError` on the first syntax error.  The syntax
    tree is immutable, so the last few parses are kept: a generation compiles its two programs
    twice each (once for the checkpoint's dims, once with them), and pyparsing takes ~0.4 s
    for a whole model."""
    return _parse(text, name)


@functools.lru_cache(maxsize=16)
def _parse(text: str, name: str) -> ast.Program:
    source = Source(name, text)
    return ast.Program(source, _modules(_statements(source, text)))


def _modules(flat: list[Any]) -> tuple[ast.Statement, ...]:
    """Statements with each ``module NAME.`` .. ``end.`` run gathered into one :class:`ast.Module`."""
    out: list[ast.Statement] = []
    open_: ast.ModuleStart | None = None
    body: list[ast.Statement] = []
    for stmt in flat:
        if isinstance(stmt, ast.ModuleStart):
            if open_ is not None:
                raise EdlError(
                    f"module '{stmt.name}' inside module '{open_.name}'",
                    stmt.span,
                    help=f"end module '{open_.name}' with 'end.' first; modules do not nest",
                    notes=[Note(f"module '{open_.name}' begins here", open_.span)],
                )
            open_, body = stmt, []
        elif isinstance(stmt, ast.ModuleEnd):
            if open_ is None:
                raise EdlError("'end' without a module", stmt.span, help="'end.' closes a 'module NAME.' above it")
            if stmt.name is not None and stmt.name != open_.name:
                raise EdlError(
                    f"'end {stmt.name}' closes module '{open_.name}'",
                    stmt.span,
                    help=f"write 'end.' or 'end {open_.name}.'",
                    notes=[Note(f"module '{open_.name}' begins here", open_.span)],
                )
            out.append(ast.Module(open_.name, tuple(body), open_.span, open_.name_span))
            open_ = None
        elif open_ is not None:
            body.append(stmt)
        else:
            out.append(stmt)
    if open_ is not None:
        raise EdlError(
            f"module '{open_.name}' has no 'end'",
            open_.span,
            help="close it with 'end.' after its last statement",
        )
    return tuple(out)


def _statements(source: Source, text: str) -> list[Any]:
    chunks = split_statements(text)
    statements = []
    for k, chunk in enumerate(chunks):
        try:
            statements.append(parse_statement(source, chunk))
        except EdlError as err:
            prev = chunks[k - 1] if k else None
            if prev is not None and _dangling_decimal(text, prev, chunk):
                raise EdlError(
                    err.message,
                    err.span,
                    help=f"the '.' at {source.span(prev.end)} ended the previous statement; "
                    "write decimals with digits on both sides (2.0, not 2.)",
                ) from None
            raise
    return statements


def _dangling_decimal(text: str, prev: Chunk, chunk: Chunk) -> bool:
    """Whether ``prev`` ended at the dot of a number like ``2.`` that the statement ``chunk``
    continues on the same line: ``y[i] = 2. * x[i].``"""
    if not re.search(r"(?<![\w.])\d+$", text[prev.start : prev.end]):
        return False
    rest = text[chunk.start : chunk.end]
    stripped = rest.lstrip(" \t\r")
    if not stripped or stripped[0] in "\n#":
        return False
    m = _LEADING_WORD.match(stripped)
    return not (m and m.group(1) and (m.group(1) in DECL_KEYWORDS or _is_rule_head(stripped, m)))


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


def parse_statement(source: Source, chunk: Chunk) -> Any:
    text = source.text[chunk.start : chunk.end]
    m = _LEADING_WORD.match(text)
    word = m.group(1) if m else None
    kind = word if word in DECL_KEYWORDS and not _is_rule_head(text, m) else "rule"
    if kind == "rule" and m is not None and _INSTANCE.match(text, m.start(1) if m.group(1) else 0):
        kind = "instance"
    token = _WHERE.set(_Where(source, chunk.start))
    try:
        result = _grammars()[kind].parse_string(text, parse_all=True)
    except pp.ParseBaseException as exc:
        raise _syntax_error(source, chunk, text, exc, kind) from None
    except RecursionError:
        start = chunk.start + len(text) - len(_COMMENT.sub(lambda c: " " * len(c.group()), text).lstrip())
        raise EdlError(
            "expression nested too deeply",
            source.span(start, start + (len(word) if word else 1)),
            help="split it into several rules, or use fewer parentheses",
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
    assert isinstance(stmt, _STATEMENTS)
    return stmt


_STATEMENTS = (
    ast.DimDecl,
    ast.ConstDecl,
    ast.RelationDecl,
    ast.OutputDecl,
    ast.Rule,
    ast.ModuleStart,
    ast.ModuleEnd,
    ast.Instance,
)

# ``h = decoder(`` begins a module instance (a rule's head has brackets: ``h[b] = ...``).
_INSTANCE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\s*=\s*[A-Za-z_][A-Za-z0-9_]*\s*\(")


def _is_rule_head(text: str, m: re.Match[str] | None) -> bool:
    """``input[i] = ...`` would be a rule for a relation named like a keyword; keywords are reserved,
    but we still want the error to say so rather than 'expected a name'."""
    return m is not None and text[m.end() : m.end() + 1] == "["


def _syntax_error(source: Source, chunk: Chunk, text: str, exc: pp.ParseBaseException, kind: str) -> EdlError:
    loc = min(exc.loc, len(text))
    # Skip whitespace so the caret lands on the offending token, not before it.
    while loc < len(text) and text[loc] in " \t\r\n":
        loc += 1
    found_m = re.match(r"[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d+)?|[=<>!+*]=|[^ \t\r\n]", text[loc:])
    found = found_m.group(0) if found_m else None
    expected = _expected(exc)
    start = chunk.start + loc
    span = source.span(start, start + (len(found) if found else 1))
    own = exc.msg or ""
    if isinstance(exc, pp.ParseFatalException) and not own.startswith("Expected") and own not in ("", "None"):
        # A message of our own, e.g. from _climb (pyparsing may re-raise it as a ParseSyntaxException).
        return EdlError(own, span)
    if found is None:
        message = f"expected {expected}, found the end of the statement" if expected else "unexpected end of statement"
    else:
        message = f"expected {expected}, found '{found}'" if expected else f"unexpected '{found}'"
    # Code before the error, with comments blanked out so that offsets stay put.
    code = _COMMENT.sub(lambda c: " " * len(c.group()), text[:loc])
    end = len(code.rstrip())
    if found is not None and end > 0 and "\n" in code[end:] and _starts_statement(text[loc:]):
        # A statement starts on a new line where this one should have ended: the '.' is missing.
        return EdlError(
            message,
            span,
            help="did you forget the '.' that ends the previous statement?",
            notes=[Note("the previous statement ends here, without '.'", source.span(chunk.start + end))],
        )
    if found is not None and end == 0 and kind == "rule" and not (found[0].isalpha() or found[0] == "_"):
        message = f"expected a declaration or a rule, found '{found}'"
    help_text = None
    if found is not None and "\n" in code[end:] and kind == "rule" and end > 0 and code[end - 1] in "])0123456789":
        help_text = "did you forget the '.' that ends the previous statement?"
    if found in KEYWORDS and ("name" in (expected or "") or "index" in (expected or "") or expected == "']'"):
        help_text = f"'{found}' is a reserved word; choose another name"
    if found == "." and kind == "rule":
        help_text = "a statement ends with '.' followed by whitespace; write decimals as 1.0, not 1."
    if found == "==" and expected.startswith("an aggregation operator"):
        help_text = "'==' compares two values; a rule defines its head with '=' (or +=, *=, max=, min=)"
    if found is not None and len(found) == 1 and not (found.isascii() and (found.isalnum() or found in _PUNCTUATION)):
        help_text = f"'{found}' is not part of the language; the operators are + - * / ^ < <= > >= == != and or not"
    return EdlError(message, span, help=help_text)


_PUNCTUATION = "_[](),.:=+-*/^<>!#"


_RULE_START = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\s*\[[^\n]*(?:\+=|\*=|max=|min=|(?<![=<>!])=(?!=))")


def _starts_statement(text: str) -> bool:
    """Whether ``text`` begins like a statement of its own: a declaration or a rule head."""
    m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)\s", text)
    return bool(m and m.group(1) in DECL_KEYWORDS) or bool(_RULE_START.match(text))


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
