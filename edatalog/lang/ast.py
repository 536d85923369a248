"""The syntax tree of an ``.edl`` program, exactly as written, every node with its source span.

The tree is deliberately dumb: names are unresolved strings and shapes are unevaluated
expressions.  Meaning is given by the rule compiler (``edatalog.rules``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from edatalog.errors import Source, Span

# ---------------------------------------------------------------------------------------------
# Expressions.  One grammar serves scalar bodies, dim expressions, extents and guards; each user
# of an expression checks that only the forms it allows appear.


@dataclass(frozen=True)
class Num:
    value: int | float
    text: str
    span: Span


@dataclass(frozen=True)
class Name:
    """An identifier used as a number: an index variable, a dim or a const."""

    ident: str
    span: Span


@dataclass(frozen=True)
class Call:
    fn: str
    args: tuple[Expr, ...]
    span: Span
    fn_span: Span


@dataclass(frozen=True)
class Unary:
    op: str  # "-" | "not"
    arg: Expr
    span: Span


@dataclass(frozen=True)
class Binary:
    op: str  # "+" "-" "*" "/" "^" "and" "or"
    lhs: Expr
    rhs: Expr
    span: Span


@dataclass(frozen=True)
class Compare:
    op: str  # "<" "<=" ">" ">=" "==" "!="
    lhs: Expr
    rhs: Expr
    span: Span


@dataclass(frozen=True)
class Component:
    """One component of an index position: a variable, an integer literal, or an index
    expression such as ``l + k`` (``expr``; legal only in bodies); maybe with an extent."""

    var: str | None
    literal: int | None
    extent: Expr | None
    span: Span
    expr: Expr | None = None

    def __str__(self) -> str:
        if self.expr is not None:
            core = self.expr.span.text
        else:
            core = self.var if self.var is not None else str(self.literal)
        return core if self.extent is None else f"{core}:{self.extent.span.text}"


@dataclass(frozen=True)
class Position:
    """An index position of an atom: a single component, or a row-major composite ``(i, j, ...)``."""

    components: tuple[Component, ...]
    composite: bool
    span: Span

    def __str__(self) -> str:
        inner = ",".join(str(c) for c in self.components)
        return f"({inner})" if self.composite else inner


@dataclass(frozen=True)
class Atom:
    """A relation reference ``name[pos, ...]`` in a head or a body."""

    relation: str
    positions: tuple[Position, ...]
    span: Span
    name_span: Span

    def __str__(self) -> str:
        return f"{self.relation}[{','.join(str(p) for p in self.positions)}]"


Expr = Num | Name | Call | Unary | Binary | Compare | Atom

# ---------------------------------------------------------------------------------------------
# Statements.


@dataclass(frozen=True)
class Binding:
    """``name = expr`` inside a ``dim`` or ``const`` declaration, maybe with the key of a model
    configuration that sets it: ``dim L = 32 from "num_hidden_layers"``."""

    name: str
    expr: Expr
    span: Span
    name_span: Span
    sources: tuple[tuple[str, Span], ...] = ()  # configuration keys (``a.b``: key b of a), the first found


@dataclass(frozen=True)
class DimDecl:
    items: tuple[Binding, ...]
    span: Span


@dataclass(frozen=True)
class ConstDecl:
    items: tuple[Binding, ...]
    span: Span


@dataclass(frozen=True)
class RelationDecl:
    """``input x[B, S, D] : f32`` or ``param w[F, D] : bf16``, maybe with the checkpoint names
    it is loaded from: ``param wq[D, D] : f32 from "model.layers.{i}.self_attn.q_proj.weight"``
    (the first a checkpoint has; ``{i}`` is the instance's number in a repeated module)."""

    kind: str  # "input" | "param"
    name: str
    shape: tuple[Expr, ...]
    dtype: str
    span: Span
    name_span: Span
    dtype_span: Span
    sources: tuple[tuple[str, Span], ...] = ()


@dataclass(frozen=True)
class OutputDecl:
    names: tuple[tuple[str, Span], ...]
    span: Span


@dataclass(frozen=True)
class Lookup:
    """``ids[b, s] = v`` among a rule's guards: the index ``v`` takes the value ``ids`` holds
    (a value-to-index join; ``v = ids[b, s]`` and ``ids[b, s] == v`` say the same)."""

    atom: Atom
    var: str
    var_span: Span
    span: Span
    extent: Expr | None = None  # ``pos[] = p:T``: the index's range, where no relation gives it


@dataclass(frozen=True)
class Rule:
    """``head aggop body [where guard, ...]``."""

    head: Atom
    aggop: str  # "=" "+=" "*=" "max=" "min=", or a selection: "argmax=" "argmin=" "top=" "argtop="
    body: Expr
    guards: tuple[Expr | Lookup, ...]
    span: Span
    aggop_span: Span
    # The rule's type where the compiler states it rather than infers it: only rules generated
    # from a selection have one (``edatalog.rules.select``); nothing in the syntax sets it.
    dtype: str | None = None

    @property
    def lookups(self) -> tuple[Lookup, ...]:
        return tuple(g for g in self.guards if isinstance(g, Lookup))

    @property
    def conditions(self) -> tuple[Expr, ...]:
        """The guards that are conditions on index values (all but the lookups)."""
        return tuple(g for g in self.guards if not isinstance(g, Lookup))


@dataclass(frozen=True)
class ModuleStart:
    """``module decoder.``: the statements up to ``end.`` define the module."""

    name: str
    span: Span
    name_span: Span


@dataclass(frozen=True)
class ModuleEnd:
    """``end.`` (or ``end decoder.``) closes a module."""

    name: str | None
    span: Span


@dataclass(frozen=True)
class Instance:
    """``h = decoder(h0, rc) repeat L as layers``: ``count`` instances of a module, named
    ``prefix.0 ..``, chained (instance ``k + 1`` reads instance ``k``'s first output where
    instance 0 reads the first argument); the other arguments go to every instance; the last
    instance's first output is the relation ``result``."""

    result: str
    result_span: Span
    module: str
    module_span: Span
    args: tuple[tuple[str, Span], ...]
    count: Expr | None
    prefix: str | None
    prefix_span: Span | None
    span: Span


@dataclass(frozen=True)
class Module:
    """A module: inputs (its arguments, then per-instance inputs), params, rules and outputs,
    over the program's dims and consts."""

    name: str
    statements: tuple[Statement, ...]
    span: Span  # the ``module`` statement
    name_span: Span


Statement = DimDecl | ConstDecl | RelationDecl | OutputDecl | Rule | Instance | Module


@dataclass(frozen=True)
class Program:
    source: Source
    statements: tuple[Statement, ...]


def walk(expr: Expr) -> list[Expr]:
    """All sub-expressions of ``expr`` in pre-order (atoms are leaves)."""
    out: list[Expr] = []
    stack: list[Expr] = [expr]
    while stack:
        e = stack.pop()
        out.append(e)
        if isinstance(e, Call):
            stack.extend(reversed(e.args))
        elif isinstance(e, Unary):
            stack.append(e.arg)
        elif isinstance(e, (Binary, Compare)):
            stack.extend((e.rhs, e.lhs))
    return out


def position_vars(positions: tuple[Position, ...]) -> Iterator[str]:
    """The index variables of ``positions``, in order, repeats included: plain components and
    the variables of index expressions (``l`` and ``k`` in ``x[l + k]``)."""
    for p in positions:
        for c in p.components:
            if c.var is not None:
                yield c.var
            if c.expr is not None:
                yield from (n.ident for n in walk(c.expr) if isinstance(n, Name))


def body_vars(body: Expr) -> Iterator[str]:
    """The index variables of the relation references in ``body``, in order, repeats included."""
    for e in walk(body):
        if isinstance(e, Atom):
            yield from position_vars(e.positions)
