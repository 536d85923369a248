"""The scalar function of a join-agg: a DAG of operations on the joined values.

Nodes are stored in topological order in :class:`ScalarExpr`; each operation refers to earlier
nodes by position, so shared sub-expressions are computed once.  Leaves are the values of the
node's inputs (``Load``), numbers (``Const``) and index values (``IndexValue``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from edatalog.ir.affine import Affine


@dataclass(frozen=True)
class OpInfo:
    arity: int
    flops: int  # cost per evaluation, as counted in FLOP totals
    infix: str | None = None  # operator symbol for infix ops
    prec: int = 100  # binding strength for printing
    result: str = "value"  # "value" | "bool"


# The scalar operations of the language; ``gelu`` is the exact (erf) form, ``gelu_tanh`` the
# tanh approximation used by GPT-2.
OPS: dict[str, OpInfo] = {
    "neg": OpInfo(1, 1, "-", 6),
    "not": OpInfo(1, 1, "not ", 3, "bool"),
    "add": OpInfo(2, 1, "+", 4),
    "sub": OpInfo(2, 1, "-", 4),
    "mul": OpInfo(2, 1, "*", 5),
    "div": OpInfo(2, 1, "/", 5),
    "pow": OpInfo(2, 1, "^", 7),
    "max": OpInfo(2, 1),
    "min": OpInfo(2, 1),
    "and": OpInfo(2, 1, "and", 2, "bool"),
    "or": OpInfo(2, 1, "or", 1, "bool"),
    "lt": OpInfo(2, 1, "<", 3, "bool"),
    "le": OpInfo(2, 1, "<=", 3, "bool"),
    "gt": OpInfo(2, 1, ">", 3, "bool"),
    "ge": OpInfo(2, 1, ">=", 3, "bool"),
    "eq": OpInfo(2, 1, "==", 3, "bool"),
    "ne": OpInfo(2, 1, "!=", 3, "bool"),
    "where": OpInfo(3, 1),
    "exp": OpInfo(1, 1),
    "log": OpInfo(1, 1),
    "sqrt": OpInfo(1, 1),
    "rsqrt": OpInfo(1, 1),
    "abs": OpInfo(1, 1),
    "sin": OpInfo(1, 1),
    "cos": OpInfo(1, 1),
    "tanh": OpInfo(1, 1),
    "sigmoid": OpInfo(1, 1),
    "silu": OpInfo(1, 1),
    "gelu": OpInfo(1, 1),
    "gelu_tanh": OpInfo(1, 1),
    "relu": OpInfo(1, 1),
    "erf": OpInfo(1, 1),
    "floor": OpInfo(1, 1),
    "ceil": OpInfo(1, 1),
    "round": OpInfo(1, 1),
    "trunc": OpInfo(1, 1),
}

FUNCTIONS = {name: info.arity for name, info in OPS.items() if info.infix is None}
COMPARISONS = {"<": "lt", "<=": "le", ">": "gt", ">=": "ge", "==": "eq", "!=": "ne"}
BINARY = {"+": "add", "-": "sub", "*": "mul", "/": "div", "^": "pow", "and": "and", "or": "or"}


def _gelu_tanh(x: float) -> float:
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


# Reference semantics on Python floats, used to fold constants at compile time.
FOLD: dict[str, Callable[..., float | bool]] = {
    "neg": lambda a: -a,
    "not": lambda a: not a,
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "pow": lambda a, b: float(a) ** b,  # `^` is a float power: 10 ^ 400 must not build a huge int
    "max": max,
    "min": min,
    "and": lambda a, b: bool(a) and bool(b),
    "or": lambda a, b: bool(a) or bool(b),
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "where": lambda c, a, b: a if c else b,
    "exp": math.exp,
    "log": math.log,
    "sqrt": math.sqrt,
    "rsqrt": lambda a: 1.0 / math.sqrt(a),
    "abs": abs,
    "sin": math.sin,
    "cos": math.cos,
    "tanh": math.tanh,
    "sigmoid": _sigmoid,
    "silu": lambda a: a * _sigmoid(a),
    "gelu": lambda a: 0.5 * a * (1.0 + math.erf(a / math.sqrt(2.0))),
    "gelu_tanh": _gelu_tanh,
    "relu": lambda a: max(a, 0.0),
    "erf": math.erf,
    "floor": lambda a: float(math.floor(a)),
    "ceil": lambda a: float(math.ceil(a)),
    "round": lambda a: float(round(a)),  # halves to even, as numpy and torch round
    "trunc": lambda a: float(math.trunc(a)),
}


@dataclass(frozen=True)
class Load:
    """The value of the join-agg's input number ``input`` at the current point."""

    input: int


@dataclass(frozen=True)
class Const:
    value: float | int | bool
    label: str | None = None  # the const's name in the program, for printing


@dataclass(frozen=True)
class IndexValue:
    """The value of a join index, used as a number."""

    index: str


@dataclass(frozen=True)
class Op:
    op: str
    args: tuple[int, ...]


ScalarNode = Load | Const | IndexValue | Op


@dataclass(frozen=True)
class ScalarExpr:
    nodes: tuple[ScalarNode, ...]
    root: int

    def verify(self, n_inputs: int, indices: Sequence[str]) -> None:
        assert 0 <= self.root < len(self.nodes), "root out of range"
        for k, node in enumerate(self.nodes):
            if isinstance(node, Load):
                assert 0 <= node.input < n_inputs, f"node {k} loads missing input {node.input}"
            elif isinstance(node, IndexValue):
                assert node.index in indices, f"node {k} reads unknown index {node.index}"
            elif isinstance(node, Op):
                info = OPS.get(node.op)
                assert info is not None, f"node {k}: unknown op {node.op}"
                assert len(node.args) == info.arity, f"node {k}: {node.op} takes {info.arity} args"
                assert all(0 <= a < k for a in node.args), f"node {k} refers forward"

    def live(self) -> list[int]:
        """Nodes reachable from the root, in topological order."""
        return self.under(self.root)

    def under(self, root: int) -> list[int]:
        """The nodes of the sub-DAG under ``root`` (itself included), in topological order."""
        seen = {root}
        for k in range(root, -1, -1):
            node = self.nodes[k]
            if k in seen and isinstance(node, Op):
                seen.update(node.args)
        return sorted(seen)

    def varying(self) -> set[int]:
        """Live nodes whose value changes across the join space (depend on a load or an index);
        the rest are constants computed once."""
        out: set[int] = set()
        for k in self.live():
            n = self.nodes[k]
            if isinstance(n, (Load, IndexValue)) or (isinstance(n, Op) and any(a in out for a in n.args)):
                out.add(k)
        return out

    def at(self, values: Mapping[int, float]) -> float | None:
        """The value at one point, in Python floats, from the loads' values by input position;
        None where it is not finite there or needs a value not given (an index's, another
        load's).  For recognizers that check what a rule computes at chosen points."""
        out: list[float] = []
        for n in self.nodes:
            if isinstance(n, Load):
                if n.input not in values:
                    return None
                out.append(values[n.input])
            elif isinstance(n, Const):
                out.append(float(n.value))
            elif isinstance(n, Op):
                try:
                    out.append(float(FOLD[n.op](*(out[a] for a in n.args))))
                except (ArithmeticError, ValueError, TypeError):
                    out.append(math.nan)
            else:
                return None
        value = out[self.root]
        return value if math.isfinite(value) else None

    @property
    def flops_per_point(self) -> int:
        return sum(OPS[n.op].flops for k in self.varying() if isinstance(n := self.nodes[k], Op))

    def index_values(self) -> list[str]:
        return [n.index for k in self.live() if isinstance(n := self.nodes[k], IndexValue)]

    def render(self, load: Callable[[int], str], node: int | None = None, parent_prec: int = 0) -> str:
        """Infix text, with inputs printed by ``load`` and minimal parentheses."""
        k = self.root if node is None else node
        n = self.nodes[k]
        if isinstance(n, Load):
            return load(n.input)
        if isinstance(n, IndexValue):
            return n.index
        if isinstance(n, Const):
            return n.label if n.label else _number(n.value)
        info = OPS[n.op]
        if info.infix is None:
            return f"{n.op}({', '.join(self.render(load, a) for a in n.args)})"
        if info.arity == 1:
            text = f"{info.infix}{self.render(load, n.args[0], info.prec)}"
        else:
            # Left-associative ops bind their right operand one level tighter; ^ is the opposite.
            lp, rp = (info.prec + 1, info.prec) if n.op == "pow" else (info.prec, info.prec + 1)
            if info.prec == 3:  # comparisons do not chain
                lp = rp = 4
            lhs = self.render(load, n.args[0], lp)
            rhs = self.render(load, n.args[1], rp)
            text = f"{lhs} {info.infix} {rhs}" if n.op != "pow" else f"{lhs}^{rhs}"
        return f"({text})" if info.prec < parent_prec else text


def _number(v: float | int | bool) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == int(v) and abs(v) < 1e16:
        return f"{int(v)}.0"
    return repr(v)


class ExprBuilder:
    """Builds a :class:`ScalarExpr` with common sub-expressions shared and constants folded."""

    def __init__(self) -> None:
        self.nodes: list[ScalarNode] = []
        self._ids: dict[ScalarNode, int] = {}

    def add(self, node: ScalarNode) -> int:
        if isinstance(node, Op) and all(isinstance(self.nodes[a], Const) for a in node.args):
            folded = self._fold(node)
            if folded is not None:
                node = folded
        if node not in self._ids:
            self._ids[node] = len(self.nodes)
            self.nodes.append(node)
        return self._ids[node]

    def _fold(self, node: Op) -> Const | None:
        args = [self.nodes[a] for a in node.args]
        values = [a.value for a in args if isinstance(a, Const)]
        try:
            value = FOLD[node.op](*values)
        except (ArithmeticError, ValueError, OverflowError):
            return None  # leave it to run time, which follows IEEE rules (inf, nan)
        if isinstance(value, complex):
            return None
        labels = [a.label for a in args if isinstance(a, Const)]
        if any(labels):  # keep names visible: `sqrt(E)` prints better than 11.313708
            return None
        return Const(value)

    def build(self, root: int) -> ScalarExpr:
        return ScalarExpr(tuple(self.nodes), root)


def substitute_indices(expr: ScalarExpr, mapping: Mapping[str, Affine]) -> ScalarExpr:
    """``expr`` with the index values in ``mapping`` replaced by affine functions of others (an
    index that a guard ``t == l + k`` defines is computed from ``l`` and ``k``)."""
    b = ExprBuilder()
    new: list[int] = []
    for node in expr.nodes:
        if isinstance(node, IndexValue) and node.index in mapping:
            new.append(_affine_value(b, mapping[node.index]))
        elif isinstance(node, Op):
            new.append(b.add(Op(node.op, tuple(new[a] for a in node.args))))
        else:
            new.append(b.add(node))
    return b.build(new[expr.root])


def _affine_value(b: ExprBuilder, value: Affine) -> int:
    terms = []
    for var, coef in value.terms:
        term = b.add(IndexValue(var))
        terms.append(term if coef == 1 else b.add(Op("mul", (b.add(Const(coef)), term))))
    if not terms:
        return b.add(Const(value.const))
    acc = terms[0]
    for term in terms[1:]:
        acc = b.add(Op("add", (acc, term)))
    if value.const:
        op = "add" if value.const > 0 else "sub"
        acc = b.add(Op(op, (acc, b.add(Const(abs(value.const))))))
    return acc
