"""Random edatalog programs for property tests, and a brute-force oracle that evaluates them.

:func:`programs` is a hypothesis strategy of :class:`GeneratedProgram`: the ``.edl`` text
(``.source``), f64 values for its inputs and params (``.inputs``) and, for every derived relation,
the cells and presence mask that the Datalog semantics give (``.expected``).  The expected values
come from :func:`oracle`, which never looks at the parser, the compiler or the IR: it walks the
generator's own structure (:class:`ProgramSpec`) point by point over each rule's join space, with
Python float64 scalar math and explicit presence tracking.

The programs cover: dims used in shapes and extent annotations, consts, inputs and params, chains of
rules where later rules read earlier relations, all five aggregation operators, several rules for
one relation (``=`` rules made disjoint with literal head slots such as ``(0, i)`` / ``(1, i)`` or
with complementary guards), affine guards, literal and composite index positions in bodies and
heads, repeated variables (``x[i, i]``), head-only (broadcast) indices, index values, dims and
consts used as numbers, and scalar expressions over every function of the language, with
comparisons and ``where``.

Values stay finite by construction: ``log``, ``sqrt``, ``rsqrt``, division and powers only get
arguments that are safe for them, ``exp`` gets bounded arguments, and a static magnitude bound is
tracked through every expression and relation (too-large ones are squashed with ``tanh``), so
rounding differences stay far below the tolerances of the tests.
"""

from __future__ import annotations

import itertools
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias, TypeVar

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

if TYPE_CHECKING:
    import edatalog

T = TypeVar("T")
AGGOPS = ("=", "+=", "*=", "max=", "min=")
_VAR_NAMES = ("i", "j", "k", "l", "m", "n", "p", "q", "s", "t", "u", "v", "w", "z")
_DIM_NAMES = ("N", "M", "K")
_LIMIT = 1000.0  # magnitude bound kept on every expression and relation
_CMP = ("<", "<=", ">", ">=", "==", "!=")
_UNARY_FNS = (
    *("tanh", "exp", "log", "sqrt", "rsqrt", "sigmoid", "silu", "gelu", "gelu_tanh"),
    *("relu", "erf", "abs", "sin", "cos"),
)


def example_settings(env: str, default: int) -> settings:
    """Hypothesis settings for a property test: ``default`` derandomized examples (what CI runs),
    or, with the environment variable ``env`` set to N, N random ones for a longer hunt."""
    long = os.environ.get(env)
    return settings(
        max_examples=int(long) if long else default,
        derandomize=not long,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- structure -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """One component of an index position: a variable, an integer literal, or (in bodies) an
    index expression such as ``i + j - 1``; and its extent.  An expression that lands outside
    ``0 .. extent - 1`` reads a cell that does not exist."""

    var: str | None
    lit: int | None
    extent: int
    lin: Lin | None = None

    def place(self, env: Mapping[str, int]) -> int | None:
        if self.var is not None:
            return env[self.var]
        if self.lin is not None:
            v = self.lin.value(env)
            return v if 0 <= v < self.extent else None
        return _lit(self)

    def render(self) -> str:
        return self.var if self.var is not None else self.lin.render() if self.lin is not None else str(self.lit)


@dataclass(frozen=True)
class Pos:
    """An index position: one part, or a row-major composite (first part major)."""

    parts: tuple[Part, ...]

    @property
    def composite(self) -> bool:
        return len(self.parts) > 1

    @property
    def extent(self) -> int:
        return math.prod(p.extent for p in self.parts)

    def coord(self, env: Mapping[str, int]) -> int | None:
        """The place addressed, or None when an index expression falls outside its part."""
        c = 0
        for p in self.parts:
            place = p.place(env)
            if place is None:
                return None
            c = c * p.extent + place
        return c


def _lit(p: Part) -> int:
    assert p.lit is not None
    return p.lit


@dataclass(frozen=True)
class Atom:
    rel: str
    positions: tuple[Pos, ...]

    def cell(self, env: Mapping[str, int]) -> tuple[int, ...] | None:
        """The cell read or written, or None when it lies outside the relation."""
        coords = [pos.coord(env) for pos in self.positions]
        return None if any(c is None for c in coords) else tuple(c for c in coords if c is not None)

    @property
    def vars(self) -> list[str]:
        return [p.var for pos in self.positions for p in pos.parts if p.var is not None]


@dataclass(frozen=True)
class Num:
    value: float | int


@dataclass(frozen=True)
class Idx:
    """An index variable used as a number."""

    var: str


@dataclass(frozen=True)
class Named:
    """A dim, a const or ``pi`` used as a number."""

    name: str
    value: float | int


@dataclass(frozen=True)
class Read:
    atom: Atom


@dataclass(frozen=True)
class Neg:
    arg: Expr


@dataclass(frozen=True)
class Bin:
    op: str  # + - * / ^
    lhs: Expr
    rhs: Expr


@dataclass(frozen=True)
class Call:
    fn: str
    args: tuple[Expr, ...]


@dataclass(frozen=True)
class Where:
    cond: Cond
    then: Expr
    other: Expr


@dataclass(frozen=True)
class Cmp:
    op: str
    lhs: Expr
    rhs: Expr


@dataclass(frozen=True)
class Not:
    arg: Cond


@dataclass(frozen=True)
class Logic:
    op: str  # and | or
    lhs: Cond
    rhs: Cond


Expr: TypeAlias = Num | Idx | Named | Read | Neg | Bin | Call | Where
Cond: TypeAlias = Cmp | Not | Logic


@dataclass(frozen=True)
class Lin:
    """``sum(coef * var) + const (+ dim)``: one side of a guard."""

    terms: tuple[tuple[int, str], ...] = ()
    const: int = 0
    dim: tuple[str, int] | None = None  # a dim written by name, with its value

    def value(self, env: Mapping[str, int]) -> int:
        return sum(c * env[v] for c, v in self.terms) + self.const + (self.dim[1] if self.dim else 0)

    def render(self) -> str:
        out = ""
        items: list[tuple[int, str]] = list(self.terms)
        if self.dim is not None:
            items.append((1, self.dim[0]))
        if self.const or not items:
            items.append((self.const, ""))
        for c, name in items:
            mag = abs(c)
            text = str(mag) if not name else name if mag == 1 else f"{mag}*{name}"
            if not out:
                out = text if c >= 0 else f"-{text}"
            else:
                out += f" + {text}" if c >= 0 else f" - {text}"
        return out


@dataclass(frozen=True)
class GuardSpec:
    lhs: Lin
    op: str
    rhs: Lin

    def holds(self, env: Mapping[str, int]) -> bool:
        return _compare(self.op, self.lhs.value(env), self.rhs.value(env))

    def render(self) -> str:
        return f"{self.lhs.render()} {self.op} {self.rhs.render()}"


@dataclass(frozen=True)
class RuleSpec:
    head: Atom
    aggop: str
    body: Expr
    guards: tuple[GuardSpec, ...]
    extents: tuple[tuple[str, int], ...]  # every index variable of the rule and its extent
    # Extent annotations to write: (atom number, position, part) -> extent text; atom 0 is the head,
    # body atoms count from 1 in the order they are written.
    notes: tuple[tuple[tuple[int, int, int], str], ...] = ()

    @property
    def atoms(self) -> list[Atom]:
        return _atoms(self.body)

    @property
    def vars(self) -> tuple[str, ...]:
        return tuple(v for v, _ in self.extents)

    def render(self) -> str:
        notes = dict(self.notes)
        counter = [0]

        def atom(a: Atom) -> str:
            no = counter[0]
            counter[0] += 1
            positions = []
            for k, pos in enumerate(a.positions):
                parts = []
                for c, p in enumerate(pos.parts):
                    text = p.render()
                    note = notes.get((no, k, c))
                    parts.append(text if note is None else f"{text}:{note}")
                positions.append(f"({', '.join(parts)})" if pos.composite else parts[0])
            return f"{a.rel}[{', '.join(positions)}]"

        head = atom(self.head)
        body = _render(self.body, atom)
        where = f" where {', '.join(g.render() for g in self.guards)}" if self.guards else ""
        return f"{head} {self.aggop} {body}{where}."


@dataclass(frozen=True)
class RelSpec:
    name: str
    kind: str  # input | param | derived
    shape: tuple[int, ...]
    shape_text: tuple[str, ...] = ()  # declared shape (inputs and params)
    aggop: str | None = None


@dataclass(frozen=True)
class ProgramSpec:
    """A generated program.  ``rules`` are in evaluation order (a relation's rules together, each
    reading only relations before it); ``source_order`` is the order they are written in."""

    dims: tuple[tuple[str, int, str | None], ...]  # name, value, definition text (None: a number)
    consts: tuple[tuple[str, float], ...]
    relations: tuple[RelSpec, ...]
    rules: tuple[RuleSpec, ...]
    source_order: tuple[int, ...]
    declared_outputs: tuple[str, ...] | None

    def relation(self, name: str) -> RelSpec:
        return next(r for r in self.relations if r.name == name)

    @property
    def derived(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.relations if r.kind == "derived")

    @property
    def outputs(self) -> tuple[str, ...]:
        """The declared outputs, or else (as the language defines) the derived relations no rule reads."""
        if self.declared_outputs is not None:
            return self.declared_outputs
        read = {a.rel for r in self.rules for a in r.atoms}
        return tuple(n for n in self.derived if n not in read)

    def node_names(self) -> list[str]:
        """The compiler's name for the join-agg node of each rule: the relation's name, or
        ``rel#k`` numbered in source order when the relation has several rules."""
        written = [self.rules[k].head.rel for k in self.source_order]
        rank: dict[int, int] = {}
        for pos, k in enumerate(self.source_order):
            rank[k] = written[:pos].count(self.rules[k].head.rel)
        out = []
        for k, r in enumerate(self.rules):
            n = written.count(r.head.rel)
            out.append(r.head.rel if n == 1 else f"{r.head.rel}#{rank[k] + 1}")
        return out

    def render(self) -> str:
        lines = []
        dims = ", ".join(f"{n} = {text if text is not None else v}" for n, v, text in self.dims)
        lines.append(f"dim {dims}.")
        if self.consts:
            lines.append("const " + ", ".join(f"{n} = {v!r}" for n, v in self.consts) + ".")
        for r in self.relations:
            if r.kind != "derived":
                lines.append(f"{r.kind} {r.name}[{', '.join(r.shape_text)}] : f64.")
        if self.declared_outputs is not None:
            lines.append(f"output {', '.join(self.declared_outputs)}.")
        lines.extend(self.rules[k].render() for k in self.source_order)
        return "\n".join(lines) + "\n"


def _atoms(e: Expr | Cond) -> list[Atom]:
    """Body atoms in the order they are written."""
    if isinstance(e, Read):
        return [e.atom]
    out: list[Atom] = []
    for sub in _children(e):
        out.extend(_atoms(sub))
    return out


def _children(e: Expr | Cond) -> Sequence[Expr | Cond]:
    if isinstance(e, Neg | Not):
        return (e.arg,)
    if isinstance(e, Bin | Cmp | Logic):
        return (e.lhs, e.rhs)
    if isinstance(e, Call):
        return e.args
    if isinstance(e, Where):
        return (e.cond, e.then, e.other)
    return ()


def _num_text(v: float | int) -> str:
    if isinstance(v, int):
        return str(v)
    text = repr(float(v))
    assert "e" not in text and "." in text, text
    return text


def _render(e: Expr | Cond, atom: Callable[[Atom], str]) -> str:
    """Fully parenthesized text; ``atom`` renders (and numbers) each atom in writing order."""

    def go(e: Expr | Cond) -> str:
        if isinstance(e, Num):
            return _num_text(e.value)
        if isinstance(e, Idx):
            return e.var
        if isinstance(e, Named):
            return e.name
        if isinstance(e, Read):
            return atom(e.atom)
        if isinstance(e, Neg):
            return f"(-{go(e.arg)})"
        if isinstance(e, Bin | Cmp | Logic):
            lhs = go(e.lhs)
            return f"({lhs} {e.op} {go(e.rhs)})"
        if isinstance(e, Call):
            return f"{e.fn}({', '.join(go(a) for a in e.args)})"
        if isinstance(e, Where):
            cond = go(e.cond)
            then = go(e.then)
            return f"where({cond}, {then}, {go(e.other)})"
        assert isinstance(e, Not)
        return f"(not {go(e.arg)})"

    return go(e)


# -- the oracle ------------------------------------------------------------------------------------


def _compare(op: str, a: float, b: float) -> bool:
    if op == "<":
        return a < b
    if op == "<=":
        return a <= b
    if op == ">":
        return a > b
    if op == ">=":
        return a >= b
    if op == "==":
        return a == b
    assert op == "!="
    return a != b


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def _gelu_tanh(x: float) -> float:
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


_FUNCTIONS: dict[str, Callable[[float], float]] = {
    "exp": math.exp,
    "log": math.log,
    "sqrt": math.sqrt,
    "rsqrt": lambda x: 1.0 / math.sqrt(x),
    "abs": abs,
    "sin": math.sin,
    "cos": math.cos,
    "tanh": math.tanh,
    "sigmoid": _sigmoid,
    "silu": lambda x: x * _sigmoid(x),
    "gelu": lambda x: 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0))),
    "gelu_tanh": _gelu_tanh,
    "relu": lambda x: max(x, 0.0),
    "erf": math.erf,
}


def _eval(e: Expr, env: Mapping[str, int], data: Mapping[str, np.ndarray]) -> float:
    if isinstance(e, Num | Named):
        return float(e.value)
    if isinstance(e, Idx):
        return float(env[e.var])
    if isinstance(e, Read):
        cell = e.atom.cell(env)
        assert cell is not None, "evaluated only where every cell read exists"
        return float(data[e.atom.rel][cell])
    if isinstance(e, Neg):
        return -_eval(e.arg, env, data)
    if isinstance(e, Bin):
        a, b = _eval(e.lhs, env, data), _eval(e.rhs, env, data)
        if e.op == "+":
            return a + b
        if e.op == "-":
            return a - b
        if e.op == "*":
            return a * b
        if e.op == "/":
            return a / b
        assert e.op == "^"
        return float(a**b)
    if isinstance(e, Call):
        args = [_eval(a, env, data) for a in e.args]
        if e.fn == "max":
            return max(args)
        if e.fn == "min":
            return min(args)
        return float(_FUNCTIONS[e.fn](args[0]))
    assert isinstance(e, Where)
    return _eval(e.then, env, data) if _test(e.cond, env, data) else _eval(e.other, env, data)


def _test(c: Cond, env: Mapping[str, int], data: Mapping[str, np.ndarray]) -> bool:
    if isinstance(c, Cmp):
        return _compare(c.op, _eval(c.lhs, env, data), _eval(c.rhs, env, data))
    if isinstance(c, Not):
        return not _test(c.arg, env, data)
    if c.op == "and":
        return _test(c.lhs, env, data) and _test(c.rhs, env, data)
    return _test(c.lhs, env, data) or _test(c.rhs, env, data)


@dataclass(frozen=True)
class OracleResult:
    values: dict[str, tuple[np.ndarray, np.ndarray]]  # derived relation -> (data, present)
    contributing: tuple[np.ndarray, ...]  # per rule: the points that contribute, over RuleSpec.extents


def _present(mask: np.ndarray, cell: tuple[int, ...] | None) -> bool:
    return cell is not None and bool(mask[cell])


def oracle(spec: ProgramSpec, inputs: Mapping[str, np.ndarray]) -> OracleResult:
    """Evaluate ``spec`` by brute force: every point of every rule's join space contributes when its
    guards hold and every cell it reads is present; a cell is present when something contributes."""
    data: dict[str, np.ndarray] = {}
    present: dict[str, np.ndarray] = {}
    for rel in spec.relations:
        if rel.kind != "derived":
            data[rel.name] = np.asarray(inputs[rel.name], dtype=np.float64)
            present[rel.name] = np.ones(rel.shape, dtype=bool)
    contributing: list[np.ndarray] = []
    values: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name in spec.derived:
        rel = spec.relation(name)
        cells: dict[tuple[int, ...], list[float]] = {}
        for rule in spec.rules:
            if rule.head.rel != name:
                continue
            names = rule.vars
            sizes = [n for _, n in rule.extents]
            mask = np.zeros(sizes, dtype=bool)
            atoms = rule.atoms
            for point in itertools.product(*(range(n) for n in sizes)):
                env = dict(zip(names, point, strict=True))
                if not all(g.holds(env) for g in rule.guards):
                    continue
                if not all(_present(present[a.rel], a.cell(env)) for a in atoms):
                    continue
                mask[point] = True
                head = rule.head.cell(env)
                assert head is not None, "heads address cells with plain indices"
                cells.setdefault(head, []).append(_eval(rule.body, env, data))
            contributing.append(mask)
        out = np.zeros(rel.shape, dtype=np.float64)
        pres = np.zeros(rel.shape, dtype=bool)
        for cell, vals in cells.items():
            pres[cell] = True
            out[cell] = _combine(rel.aggop, vals)
        data[name], present[name] = out, pres
        values[name] = (out, pres)
    return OracleResult(values, tuple(contributing))


def _combine(aggop: str | None, vals: list[float]) -> float:
    if aggop == "=":
        assert len(vals) == 1, "generator bug: '=' rules overlap"
        return vals[0]
    if aggop == "+=":
        return math.fsum(vals)
    if aggop == "*=":
        return math.prod(vals)
    if aggop == "max=":
        return max(vals)
    assert aggop == "min="
    return min(vals)


# -- the generator ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    max_rules: int = 4  # rules in all
    max_group: int = 3  # rules for one relation
    max_inputs: int = 3
    max_rank: int = 3
    max_extent: int = 4  # dims and annotations; composite axes span products of them
    max_vars: int = 4  # index variables per rule
    max_points: int = 192  # join-space size per rule
    max_depth: int = 3  # expression nesting


class _Gen:
    """Program-level state while drawing."""

    def __init__(self, draw: st.DrawFn, cfg: Config) -> None:
        self.draw, self.cfg = draw, cfg
        self.dims: list[tuple[str, int, str | None]] = []
        self.consts: list[tuple[str, float]] = []
        self.rels: list[RelSpec] = []
        self.bounds: dict[str, float] = {}
        self.rules: list[RuleSpec] = []
        self.late: set[tuple[str, int]] = set()  # derived axes whose extent is a head-literal default

    # Draw helpers; each shrinks towards its first (simplest) option.
    def chance(self, p: float) -> bool:
        return self.draw(st.integers(0, 99)) >= round(100 * (1 - p))

    def pick(self, options: Sequence[T]) -> T:
        return options[self.draw(st.integers(0, len(options) - 1))]

    def weighted(self, *options: tuple[str, float]) -> str:
        live = [(o, w) for o, w in options if w > 0]
        total = sum(w for _, w in live)
        x = self.draw(st.integers(0, 999)) * total / 1000
        for o, w in live:
            if x < w:
                return o
            x -= w
        return live[-1][0]

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def extent_text(self, n: int) -> str:
        """How to write the extent ``n``: a dim of that value, a product of dims, or the number."""
        names = [d for d, v, _ in self.dims if v == n]
        names += [f"{a}*{b}" for a, va, _ in self.dims for b, vb, _ in self.dims if va * vb == n and a < b]
        options = [str(n), *names]
        text = self.pick(options)
        assert isinstance(text, str)
        return text

    # -- declarations ----------------------------------------------------------------------------

    def declare(self) -> None:
        cfg = self.cfg
        for name in _DIM_NAMES[: self.integer(1, len(_DIM_NAMES))]:
            self.dims.append((name, self.integer(1, cfg.max_extent), None))
        if len(self.dims) >= 2 and self.chance(0.2):
            (a, va, _), (b, vb, _) = self.dims[0], self.dims[1]
            self.dims.append(("P", va * vb, f"{a} * {b}"))
        for k in range(self.integer(0, 2)):
            v = self.pick((0.5, -1.25, 2.0, 0.75, -0.5))
            assert isinstance(v, float)
            self.consts.append((f"c{k}", v))
        n_in = self.integer(1, cfg.max_inputs)
        for k in range(n_in):
            kind = "param" if self.chance(0.3) else "input"
            rank = int(self.weighted(("1", 3), ("2", 4), ("0", 0.5), ("3", 1.5 if cfg.max_rank >= 3 else 0)))
            shape: list[int] = []
            text: list[str] = []
            for _ in range(rank):
                how = self.weighted(("dim", 5), ("num", 1), ("prod", 1.5))
                base = [d for d in self.dims if d[2] is None]
                if how == "prod" and len(base) >= 2:
                    (a, va, _), (b, vb, _) = (base[i] for i in self.draw(st.permutations(range(len(base))))[:2])
                    shape.append(va * vb)
                    text.append(f"{a}*{b}")
                elif how == "num":
                    n = self.integer(1, cfg.max_extent)
                    shape.append(n)
                    text.append(str(n))
                else:
                    name, v, _ = self.dims[self.integer(0, len(self.dims) - 1)]
                    shape.append(v)
                    text.append(name)
            name = f"{'w' if kind == 'param' else 'x'}{k}"
            self.rels.append(RelSpec(name, kind, tuple(shape), tuple(text)))
            self.bounds[name] = 2.0

    # -- groups of rules -------------------------------------------------------------------------

    def group(self, name: str, budget: int) -> None:
        aggop = str(self.pick(AGGOPS))
        n = self.integer(1, min(budget, self.cfg.max_group))
        if aggop == "=" and n > 1:
            rules, bound = self._eq_group(name, n)
        else:
            rules, bound = self._free_group(name, aggop, n)
        shape = tuple(pos.extent for pos in rules[0].head.positions)
        annotated = self._annotate(rules)
        self.rels.append(RelSpec(name, "derived", shape, aggop=aggop))
        self.bounds[name] = bound
        self.rules.extend(annotated)

    def _free_group(self, name: str, aggop: str, n: int) -> tuple[list[RuleSpec], float]:
        rules: list[RuleSpec] = []
        bounds: list[float] = []
        shape: tuple[int, ...] | None = None
        for _ in range(n):
            rg = _RuleGen(self, None)
            body, b = rg.body(aggop, first=shape is None)
            head = rg.free_head(name, aggop) if shape is None else rg.fit_head(name, shape)
            shape = tuple(pos.extent for pos in head.positions)
            guards = rg.guards(int(self.weighted(("0", 4), ("1", 4), ("2", 2))))
            rule, b = rg.finish(head, aggop, body, b, guards)
            rules.append(rule)
            bounds.append(b)
        return rules, _combine_bounds(aggop, bounds)

    def _eq_group(self, name: str, n: int) -> tuple[list[RuleSpec], float]:
        """``n`` disjoint ``=`` rules: one head template, separated by a literal slot or guards."""
        rg = _RuleGen(self, None)
        body, b = rg.body("=", first=True)
        head = rg.free_head(name, "=")
        template = list(head.positions)
        vars_ext = dict(rg.vars)
        splittable = [v for v in dict.fromkeys(head.vars) if vars_ext[v] >= n]
        mechs = [("slot", 2.0), ("split", 2.0 if splittable else 0)]
        if n == 2:
            mechs += [("eqne", 1.0 if splittable else 0), ("pair", 1.0 if len(set(head.vars)) >= 2 else 0)]
        mech = self.weighted(*mechs)
        slot_lits: list[int] = []
        slot_at: tuple[int, int] | None = None
        sep: list[list[GuardSpec]] = [[] for _ in range(n)]
        if mech == "slot":
            size = n + self.integer(0, 1)
            slot_lits = list(self.draw(st.permutations(range(size))))[:n]
            candidates = [k for k, pos in enumerate(template) if not pos.composite and pos.parts[0].var is not None]
            if candidates and self.chance(0.6):  # (L, v) or (v, L) in place of v
                k = candidates[self.integer(0, len(candidates) - 1)]
                var_part = template[k].parts[0]
                lit = Part(None, slot_lits[0], size)
                first = self.chance(0.7)
                template[k] = Pos((lit, var_part) if first else (var_part, lit))
                slot_at = (k, 0 if first else 1)
            else:  # a literal position of its own
                k = self.integer(0, len(template))
                template.insert(k, Pos((Part(None, slot_lits[0], size),)))
                slot_at = (k, 0)
        elif mech in ("split", "eqne"):
            v = str(self.pick(splittable))
            ext = vars_ext[v]
            if mech == "eqne":
                c = self.integer(0, ext - 1)
                sep[0].append(GuardSpec(Lin(((1, v),)), "==", Lin((), c)))
                sep[1].append(GuardSpec(Lin(((1, v),)), "!=", Lin((), c)))
            else:
                cuts = sorted(self.draw(st.permutations(range(1, ext)))[: n - 1])
                for r in range(n):
                    if r > 0:
                        sep[r].append(GuardSpec(Lin(((1, v),)), ">=", Lin((), cuts[r - 1])))
                    if r < n - 1:
                        sep[r].append(GuardSpec(Lin((), cuts[r]), ">", Lin(((1, v),))))
        else:  # pair
            va, vb = self.draw(st.permutations(sorted(set(head.vars))))[:2]
            strict = self.chance(0.5)
            sep[0].append(GuardSpec(Lin(((1, va),)), "<" if strict else "<=", Lin(((1, vb),))))
            sep[1].append(GuardSpec(Lin(((1, va),)), ">=" if strict else ">", Lin(((1, vb),))))

        def head_for(r: int) -> Atom:
            if slot_at is None:
                return Atom(name, tuple(template))
            k, c = slot_at
            parts = list(template[k].parts)
            parts[c] = Part(None, slot_lits[r], parts[c].extent)
            return Atom(name, (*template[:k], Pos(tuple(parts)), *template[k + 1 :]))

        rules: list[RuleSpec] = []
        bounds: list[float] = []
        for r in range(n):
            if r > 0:
                rg = _RuleGen(self, vars_ext)
                body, b = rg.body("=")
            guards = sep[r] + rg.guards(self.integer(0, 1))
            rule, b = rg.finish(head_for(r), "=", body, b, guards)
            rules.append(rule)
            bounds.append(b)
        return rules, max(bounds)

    def _annotate(self, rules: list[RuleSpec]) -> list[RuleSpec]:
        """Choose extent annotations so that the compiler infers exactly the extents drawn: every
        variable not read at a plain (non-composite) body position is annotated; a composite in a
        body leaves at most one literal part to infer; a literal in a head is annotated unless the
        default (one more than the largest literal written at that place) gives its extent."""
        top: dict[tuple[int, int, int], int] = {}
        for rule in rules:
            for k, pos in enumerate(rule.head.positions):
                for c, p in enumerate(pos.parts):
                    if p.lit is not None:
                        place = (k, len(pos.parts), c)
                        top[place] = max(top.get(place, 0), p.lit)
        out = []
        for rule in rules:
            atoms = [rule.head, *rule.atoms]
            # Workaround (rules/extents.py): the split of a declared product axis (``w[M*N]`` read
            # as ``(i, j)``) is guessed before head literals get their default extents, so an
            # index whose extent comes only from such a default is annotated too.
            anchored = {
                pos.parts[0].var
                for a in atoms[1:]
                for k, pos in enumerate(a.positions)
                if not pos.composite and pos.parts[0].var and (a.rel, k) not in self.late
            }
            notes: dict[tuple[int, int, int], str] = {}
            done: set[str] = set()
            for a_no, atom in enumerate(atoms):
                for k, pos in enumerate(atom.positions):
                    lits = [c for c, p in enumerate(pos.parts) if p.lit is not None]
                    free_lit = lits[self.integer(0, len(lits) - 1)] if lits and pos.composite else None
                    for c, p in enumerate(pos.parts):
                        if p.var is not None:
                            need = p.var not in anchored and p.var not in done
                            if need or self.chance(0.08):
                                notes[(a_no, k, c)] = self.extent_text(p.extent)
                                done.add(p.var)
                            continue
                        if a_no == 0:
                            need = p.extent != top[(k, len(pos.parts), c)] + 1
                        else:
                            need = pos.composite and c != free_lit
                        if need or self.chance(0.1):
                            notes[(a_no, k, c)] = self.extent_text(p.extent)
            for k, pos in enumerate(rule.head.positions):
                if any(p.lit is not None and (0, k, c) not in notes for c, p in enumerate(pos.parts)):
                    self.late.add((rule.head.rel, k))
            out.append(
                RuleSpec(rule.head, rule.aggop, rule.body, rule.guards, rule.extents, tuple(sorted(notes.items())))
            )
        return out


def _combine_bounds(aggop: str, bounds: list[float]) -> float:
    if aggop == "+=":
        return sum(bounds)
    if aggop == "*=":
        return math.prod(bounds)
    return max(bounds)


class _RuleGen:
    """One rule while drawing: its index variables and their extents."""

    def __init__(self, g: _Gen, fixed: Mapping[str, int] | None) -> None:
        self.g = g
        self.vars: dict[str, int] = dict(fixed or {})
        self.fixed = fixed is not None
        self.loose: set[str] = set()  # indices made for index-only bodies, in no body atom

    @property
    def points(self) -> int:
        return math.prod(self.vars.values())

    def new_var(self, extent: int) -> str | None:
        cfg = self.g.cfg
        if self.fixed or len(self.vars) >= cfg.max_vars or self.points * extent > cfg.max_points:
            return None
        name = next(v for v in _VAR_NAMES if v not in self.vars)
        self.vars[name] = extent
        return name

    # -- index positions -------------------------------------------------------------------------

    def part(self, extent: int) -> Part:
        g = self.g
        same = [v for v, n in self.vars.items() if n == extent]
        can_new = not self.fixed and len(self.vars) < g.cfg.max_vars and self.points * extent <= g.cfg.max_points
        how = g.weighted(
            ("old", 4 if same else 0), ("new", 3 if can_new else 0), ("lit", 1), ("expr", 1 if self.vars else 0)
        )
        if how == "expr":  # l + k, t - 1, 2*i + j - 2: may reach outside the axis
            names = sorted(self.vars)
            terms = tuple((g.pick((1, 1, 1, -1, 2)), str(g.pick(names))) for _ in range(g.integer(1, 2)))
            merged: dict[str, int] = {}
            for c, name in terms:
                merged[name] = merged.get(name, 0) + c
            lin = Lin(tuple((c, name) for name, c in sorted(merged.items()) if c), g.integer(-2, 2))
            if lin.terms and (len(lin.terms) > 1 or lin.terms[0][0] != 1 or lin.const):  # not a bare variable
                return Part(None, None, extent, lin)
            how = "lit"
        if how == "old":
            return Part(str(g.pick(same)), None, extent)
        if how == "new":
            v = self.new_var(extent)
            assert v is not None
            return Part(v, None, extent)
        return Part(None, g.integer(0, extent - 1), extent)

    def pos(self, extent: int) -> Pos:
        g = self.g
        splits = [(a, extent // a) for a in range(2, extent) if extent % a == 0]
        if extent >= 2 and g.chance(0.3 if splits else 0.08):
            if splits and g.chance(0.85):
                a, b = splits[g.integer(0, len(splits) - 1)]
                sizes = [a, b]
                if g.chance(0.15):  # a third part
                    more = [(x, b // x) for x in range(2, b) if b % x == 0]
                    if more:
                        sizes = [a, *more[g.integer(0, len(more) - 1)]]
            else:
                sizes = [1, extent] if g.chance(0.5) else [extent, 1]
            return Pos(tuple(self.part(n) for n in sizes))
        return Pos((self.part(extent),))

    def atom(self, rel: RelSpec) -> Atom:
        return Atom(rel.name, tuple(self.pos(n) for n in rel.shape))

    # -- expressions -----------------------------------------------------------------------------

    def read(self) -> tuple[Expr, float]:
        """A read of an input or param, or (more often) of a relation derived earlier."""
        g = self.g
        derived = [r for r in g.rels if r.kind == "derived"]
        given = [r for r in g.rels if r.kind != "derived"]
        pool = derived if derived and g.chance(0.6) else given
        rel = pool[g.integer(0, len(pool) - 1)]
        return Read(self.atom(rel)), g.bounds[rel.name]

    def leaf(self) -> tuple[Expr, float]:
        g = self.g
        how = g.weighted(("read", 6), ("num", 2), ("idx", 2 if self.vars else 0), ("named", 1))
        if how == "read":
            return self.read()
        if how == "num":
            v: float = g.pick((1, 2, 3, 0.5, 2.0, 1.5, 0.25))
            return Num(v), abs(v)
        if how == "idx":
            var = g.pick(list(self.vars))
            return Idx(var), float(self.vars[var] - 1)
        named: list[tuple[str, float | int]] = [(d, v) for d, v, _ in g.dims]
        named += [*g.consts, ("pi", math.pi)]
        name, value = named[g.integer(0, len(named) - 1)]
        return Named(name, value), abs(value)

    def expr(self, depth: int) -> tuple[Expr, float]:
        g = self.g
        if depth <= 0 or g.chance(0.25):
            e, b = self.leaf()
        else:
            how = g.weighted(("bin", 6), ("fn", 6), ("neg", 1), ("maxmin", 2), ("where", 2), ("div", 2), ("pow", 1.5))
            e, b = getattr(self, f"_{how}")(depth - 1)
        if b > _LIMIT:
            e, b = Call("tanh", (e,)), 1.0
        return e, b

    def _bin(self, depth: int) -> tuple[Expr, float]:
        op = str(self.g.pick(("+", "*", "-")))
        (a, ba), (c, bc) = self.expr(depth), self.expr(depth)
        return Bin(op, a, c), ba * bc if op == "*" else ba + bc

    def _neg(self, depth: int) -> tuple[Expr, float]:
        a, b = self.expr(depth)
        return Neg(a), b

    def _fn(self, depth: int) -> tuple[Expr, float]:
        g = self.g
        fn = str(g.pick(_UNARY_FNS))
        a, b = self.expr(depth)
        if fn == "exp":
            if b > 5:
                a, b = Call("tanh", (a,)), 1.0
            return Call("exp", (a,)), math.exp(b)
        if fn in ("log", "rsqrt"):  # log(abs(a) + 1), rsqrt(abs(a) + 1)
            arg = Bin("+", Call("abs", (a,)), Num(1.0))
            return Call(fn, (arg,)), math.log(b + 1) if fn == "log" else 1.0
        if fn == "sqrt":  # sqrt(abs(a))
            return Call("sqrt", (Call("abs", (a,)),)), math.sqrt(b)
        if fn in ("tanh", "sigmoid", "erf", "sin", "cos"):
            return Call(fn, (a,)), 1.0
        return Call(fn, (a,)), b  # |f(x)| <= |x|

    def _maxmin(self, depth: int) -> tuple[Expr, float]:
        (a, ba), (c, bc) = self.expr(depth), self.expr(depth)
        return Call(str(self.g.pick(("max", "min"))), (a, c)), max(ba, bc)

    def _where(self, depth: int) -> tuple[Expr, float]:
        cond = self.cond(depth)
        (a, ba), (c, bc) = self.expr(depth), self.expr(depth)
        return Where(cond, a, c), max(ba, bc)

    def _div(self, depth: int) -> tuple[Expr, float]:
        g = self.g
        a, b = self.expr(depth)
        how = g.weighted(("abs", 3), ("num", 1), ("dim", 1), ("idx", 1 if self.vars else 0))
        if how == "abs":  # a / (1 + abs(d))
            d, _ = self.expr(depth)
            return Bin("/", a, Bin("+", Num(1.0), Call("abs", (d,)))), b
        if how == "num":
            v: float = g.pick((2.0, 0.5, 3, 4.0))
            return Bin("/", a, Num(v)), b / v
        if how == "dim":
            name, n, _ = g.dims[g.integer(0, len(g.dims) - 1)]
            return Bin("/", a, Named(name, n)), b / n
        var = g.pick(list(self.vars))  # a / (i + 1)
        return Bin("/", a, Bin("+", Idx(var), Num(1))), b

    def _pow(self, depth: int) -> tuple[Expr, float]:
        g = self.g
        a, b = self.expr(depth)
        how = g.weighted(("abs", 3), ("int", 2))
        if how == "int":  # a ^ 2, a ^ 3: negative bases are fine
            n = int(g.pick((2, 3)))
            return Bin("^", a, Num(n)), b**n
        c = g.pick((0.5, 2.0, 1.5, -1.0, -0.5))
        assert isinstance(c, float)
        base = Bin("+", Call("abs", (a,)), Num(1.0))
        exponent: Expr = Num(c) if c > 0 else Neg(Num(-c))
        return Bin("^", base, exponent), (b + 1) ** c if c > 0 else 1.0

    def cond(self, depth: int) -> Cond:
        g = self.g
        how = g.weighted(("cmp", 4), ("idx", 3 if self.vars else 0), ("not", 1 if depth > 0 else 0), ("logic", 1))
        op = str(g.pick(_CMP))
        if how == "cmp":
            (a, _), (c, _) = self.expr(min(depth, 1)), self.expr(min(depth, 1))
            return Cmp(op, a, c)
        if how == "idx":
            v = str(g.pick(list(self.vars)))
            other: Expr = Idx(str(g.pick(list(self.vars)))) if g.chance(0.5) else Num(g.integer(0, 3))
            return Cmp(op, Idx(v), other)
        if how == "not":
            return Not(self.cond(depth - 1))
        return Logic(str(g.pick(("and", "or"))), self.cond(depth - 1), self.cond(depth - 1))

    def body(self, aggop: str, first: bool = False) -> tuple[Expr, float]:
        """A rule body; ``+=`` bodies are often products (the evaluator contracts those).  The first
        rule of a relation is sometimes a function of index values alone (``r[i:N] = 2 * i``),
        which the compiler types as an integer relation."""
        g = self.g
        depth = g.integer(0, g.cfg.max_depth)
        if first and not self.vars and g.chance(0.06):
            for _ in range(g.integer(1, 2)):
                self.loose.add(self.new_var(g.pick([n for _, n, _ in g.dims])) or "")
            self.loose.discard("")
            return self.int_expr(g.integer(0, 2))
        if aggop == "+=" and g.chance(0.4):
            e, b = self.expr(1)
            for _ in range(g.integer(1, 2)):
                f, bf = self.expr(g.integer(0, 1))
                if g.chance(0.25):
                    e = Bin("/", e, Bin("+", Num(1.0), Call("abs", (f,))))
                else:
                    e, b = Bin("*", e, f), b * bf
            if g.chance(0.2):
                e = Neg(e)
            if b > _LIMIT:
                e, b = Call("tanh", (e,)), 1.0
            return e, b
        e, b = self.expr(depth)
        if not _atoms(e) and g.chance(0.85):  # most rules read something
            r, br = self.read()
            e, b = (Bin("*", r, e), br * b) if g.chance(0.5) else (Bin("+", e, r), br + b)
            if b > _LIMIT:
                e, b = Call("tanh", (e,)), 1.0
        return e, b

    def int_expr(self, depth: int) -> tuple[Expr, float]:
        """Integer arithmetic on index values, integers and dims."""
        g = self.g
        how = g.weighted(("leaf", 3 if depth <= 0 else 1), ("bin", 3), ("fn", 1), ("neg", 1), ("where", 1))
        if how == "leaf" or depth <= 0:
            leaf = g.weighted(("idx", 3), ("num", 1), ("dim", 1))
            if leaf == "idx" and self.vars:
                var = g.pick(list(self.vars))
                return Idx(var), float(self.vars[var] - 1)
            if leaf == "dim":
                name, n, _ = g.dims[g.integer(0, len(g.dims) - 1)]
                return Named(name, n), float(n)
            k = g.integer(0, 3)
            return Num(k), float(k)
        (a, ba), (c, bc) = self.int_expr(depth - 1), self.int_expr(depth - 1)
        if how == "bin":
            op = g.pick(("+", "-", "*"))
            return Bin(op, a, c), ba * bc if op == "*" else ba + bc
        if how == "fn":
            fn = g.pick(("max", "min", "abs", "relu"))
            return (Call(fn, (a, c)), max(ba, bc)) if fn in ("max", "min") else (Call(fn, (a,)), ba)
        if how == "neg":
            return Neg(a), ba
        return Where(self.cond(0), a, c), max(ba, bc)

    # -- heads -----------------------------------------------------------------------------------

    def free_head(self, name: str, aggop: str) -> Atom:
        """The head of a relation's first rule: it fixes the relation's shape."""
        g = self.g
        body_vars = list(self.vars)
        if aggop == "=":
            kept = body_vars
        else:  # indices that no body atom has must be kept: they exist only through the head
            kept = [v for v in body_vars if v in self.loose or g.chance(0.65)]
            if body_vars and not kept and g.chance(0.8):
                kept = [body_vars[g.integer(0, len(body_vars) - 1)]]
        order = [body_vars[k] for k in g.draw(st.permutations(range(len(body_vars))))]
        kept = [v for v in order if v in kept]
        positions: list[Pos] = []
        k = 0
        while k < len(kept):
            v = kept[k]
            if k + 1 < len(kept) and g.chance(0.2):
                positions.append(Pos((Part(v, None, self.vars[v]), Part(kept[k + 1], None, self.vars[kept[k + 1]]))))
                k += 2
                continue
            if g.chance(0.12):  # (L, v) or (v, L)
                size = g.integer(1, 3)
                lit = Part(None, g.integer(0, size - 1), size)
                var = Part(v, None, self.vars[v])
                positions.append(Pos((lit, var) if g.chance(0.5) else (var, lit)))
            else:
                positions.append(Pos((Part(v, None, self.vars[v]),)))
            k += 1
        if kept and g.chance(0.1):  # a repeated variable: r[i, i]
            v = kept[g.integer(0, len(kept) - 1)]
            positions.insert(g.integer(0, len(positions)), Pos((Part(v, None, self.vars[v]),)))
        if g.chance(0.12) and len(positions) < g.cfg.max_rank + 1:  # a literal position
            size = g.integer(1, 3)
            positions.insert(g.integer(0, len(positions)), Pos((Part(None, g.integer(0, size - 1), size),)))
        if g.chance(0.08):  # a broadcast index that only the head has
            size = int(g.pick([v for _, v, _ in g.dims]))
            b = self.new_var(size)
            if b is not None:
                positions.insert(g.integer(0, len(positions)), Pos((Part(b, None, size),)))
        return Atom(name, tuple(positions))

    def fit_head(self, name: str, shape: tuple[int, ...]) -> Atom:
        """The head of a further rule for a relation of the given shape."""
        g = self.g
        used: set[str] = set()
        positions = []
        for n in shape:
            fresh = [v for v, e in self.vars.items() if e == n and v not in used]
            old = [v for v, e in self.vars.items() if e == n and v in used]
            splits = [(a, n // a) for a in range(1, n + 1) if n % a == 0 and any(e == a for e in self.vars.values())]
            can_new = not self.fixed and self.points * n <= g.cfg.max_points and len(self.vars) < g.cfg.max_vars
            how = g.weighted(
                ("fresh", 8 if fresh else 0),
                ("old", 1 if old else 0),
                ("comp", 1 if splits else 0),
                ("lit", 1),
                ("new", 0.5 if can_new else 0),
            )
            if how in ("fresh", "old"):
                v = str(g.pick(fresh if how == "fresh" else old))
                used.add(v)
                positions.append(Pos((Part(v, None, n),)))
            elif how == "comp":
                a, b = splits[g.integer(0, len(splits) - 1)]
                v = str(g.pick([x for x, e in self.vars.items() if e == a]))
                used.add(v)
                lit = Part(None, g.integer(0, b - 1), b)
                positions.append(Pos((Part(v, None, a), lit)))
            elif how == "new":
                v = self.new_var(n) or ""
                positions.append(Pos((Part(v, None, n),)))
            else:
                positions.append(Pos((Part(None, g.integer(0, n - 1), n),)))
        return Atom(name, tuple(positions))

    # -- guards ----------------------------------------------------------------------------------

    def guards(self, count: int) -> list[GuardSpec]:
        g = self.g
        names = list(self.vars)
        out: list[GuardSpec] = []
        for _ in range(count if names else 0):
            v = str(g.pick(names))
            others = [x for x in names if x != v]
            w = str(g.pick(others)) if others and g.chance(0.9) else v
            op = str(g.pick(_CMP))
            form = g.weighted(
                ("vv", 3), ("vc", 3), ("sum", 2), ("scaled", 2), ("shift", 1), ("dim", 1), ("diff", 1), ("lin", 1)
            )
            if form == "vv":
                out.append(GuardSpec(Lin(((1, v),)), op, Lin(((1, w),))))
            elif form == "vc":
                out.append(GuardSpec(Lin(((1, v),)), op, Lin((), g.integer(0, self.vars[v]))))
            elif form == "sum":
                out.append(GuardSpec(Lin(((1, v), (1, w))), op, Lin((), g.integer(0, self.vars[v] + self.vars[w]))))
            elif form == "scaled":
                out.append(GuardSpec(Lin(((g.integer(2, 3), v),)), op, Lin(((1, w),), g.integer(-1, 1))))
            elif form == "shift":
                out.append(GuardSpec(Lin(((1, v),)), op, Lin(((1, w),), g.integer(-2, 2))))
            elif form == "dim":
                name, value, _ = g.dims[g.integer(0, len(g.dims) - 1)]
                out.append(GuardSpec(Lin(((1, v),), g.integer(-1, 1)), op, Lin((), 0, (name, value))))
            elif form == "diff":
                out.append(GuardSpec(Lin(((1, v), (-1, w))), op, Lin((), g.integer(-2, 2))))
            else:  # a*v + b*w op c
                a, b = (g.pick((1, 2, 3, -1, -2, -3)) for _ in range(2))
                out.append(GuardSpec(Lin(((a, v), (b, w))), op, Lin((), g.integer(-3, 6))))
        return out

    def finish(
        self, head: Atom, aggop: str, body: Expr, bound: float, guards: list[GuardSpec]
    ) -> tuple[RuleSpec, float]:
        """The rule, and the bound of what it writes; a body whose aggregate could grow too large
        is squashed with tanh."""
        kept = set(head.vars)
        count = math.prod(n for v, n in self.vars.items() if v not in kept)
        if aggop == "+=":
            if count * bound > _LIMIT:
                body, bound = Call("tanh", (body,)), 1.0
            bound *= count
        elif aggop == "*=" and bound > 1 and count * math.log(bound) > math.log(_LIMIT):
            body, bound = Call("tanh", (body,)), 1.0
        elif aggop == "*=":
            bound = max(bound, 1.0) ** count
        extents = tuple(self.vars.items())
        return RuleSpec(head, aggop, body, tuple(guards), extents), bound


# -- the strategy ----------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class GeneratedProgram:
    """A random program with its inputs and the oracle's view of what it computes.

    ``expected[rel] = (data, present)`` for every derived relation: float64 cells (0 where absent)
    and the presence mask.  ``contributing[node]`` is ``(indices, mask)``: the points of that join-agg
    node's join space that contribute (guards hold, every cell read is present), over ``indices``.
    """

    spec: ProgramSpec
    source: str
    inputs: dict[str, np.ndarray]
    expected: dict[str, tuple[np.ndarray, np.ndarray]]
    contributing: dict[str, tuple[tuple[str, ...], np.ndarray]] = field(default_factory=dict)

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.spec.outputs

    @property
    def derived(self) -> tuple[str, ...]:
        return self.spec.derived

    def compile(self) -> edatalog.Program:
        import edatalog
        from edatalog.errors import EdlWarning

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EdlWarning)
            return edatalog.compile_string(self.source, name="<generated>")

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in self.inputs.items())
        return f"GeneratedProgram(inputs: {shapes})\n{self.source}"


def _input_values(draw: st.DrawFn, spec: ProgramSpec) -> dict[str, np.ndarray]:
    seed = draw(st.integers(0, 2**32 - 1))
    mode = draw(st.sampled_from(("uniform", "small ints", "mixed")))
    rng = np.random.default_rng(seed)
    out = {}
    for rel in spec.relations:
        if rel.kind == "derived":
            continue
        real = rng.uniform(-2.0, 2.0, rel.shape)
        ints = rng.integers(-2, 3, rel.shape).astype(np.float64)
        if mode == "uniform":
            arr = real
        elif mode == "small ints":
            arr = ints
        else:
            arr = np.where(rng.random(rel.shape) < 0.5, real, ints)
        out[rel.name] = np.asarray(arr, dtype=np.float64)
    return out


@st.composite
def program_specs(draw: st.DrawFn, config: Config | None = None) -> ProgramSpec:
    """The structure of a random program (no values)."""
    cfg = config or Config()
    g = _Gen(draw, cfg)
    g.declare()
    budget = g.integer(1, cfg.max_rules)
    k = 0
    while budget > 0:
        before = len(g.rules)
        g.group(f"r{k}", budget)
        budget -= len(g.rules) - before
        k += 1
    derived = [r.name for r in g.rels if r.kind == "derived"]
    outputs: tuple[str, ...] | None = None
    if g.chance(0.5):
        chosen = [n for n in derived if g.chance(0.5)] or [derived[-1]]
        outputs = tuple(chosen)
    order = tuple(range(len(g.rules)))
    if g.chance(0.3):
        order = tuple(draw(st.permutations(order)))
    return ProgramSpec(tuple(g.dims), tuple(g.consts), tuple(g.rels), tuple(g.rules), order, outputs)


@st.composite
def programs(
    draw: st.DrawFn,
    *,
    max_rules: int = 4,
    max_group: int = 3,
    max_inputs: int = 3,
    max_rank: int = 3,
    max_extent: int = 4,
    max_vars: int = 4,
    max_points: int = 192,
    max_depth: int = 3,
) -> GeneratedProgram:
    """Random programs with random f64 inputs, and what they compute according to :func:`oracle`.

    The knobs bound the number of rules in all and for one relation, the inputs and their rank,
    dim values, index variables and join-space points per rule, and expression depth.
    """
    cfg = Config(max_rules, max_group, max_inputs, max_rank, max_extent, max_vars, max_points, max_depth)
    spec = draw(program_specs(cfg))
    inputs = _input_values(draw, spec)
    result = oracle(spec, inputs)
    names = spec.node_names()
    contributing = {
        names[k]: (rule.vars, mask) for k, (rule, mask) in enumerate(zip(spec.rules, result.contributing, strict=True))
    }
    return GeneratedProgram(spec, spec.render(), inputs, result.values, contributing)


__all__ = [
    "AGGOPS",
    "Config",
    "GeneratedProgram",
    "OracleResult",
    "ProgramSpec",
    "RuleSpec",
    "oracle",
    "program_specs",
    "programs",
]
