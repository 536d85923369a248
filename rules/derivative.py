"""Symbolic derivatives of a rule's scalar function, in reverse mode.

A rule's body is a DAG of scalar operations on its inputs' values (:class:`ScalarExpr`).  Its
vector-Jacobian product at every point of the join space is again such a DAG: given the
incoming gradient ``g`` (the gradient of the head's cell), :func:`vjp` builds, for each input,
``g * d body / d input``, sharing sub-expressions with the body (an ``exp`` reuses its own value,
``tanh`` its own square).  The gradient rules of :mod:`edatalog.rules.grad` are made of these.

What has no derivative is refused here, with the reason: a comparison or a logical operation
used as a number (``x * (x > 0)``: write ``where(x > 0, x, 0.0)``, whose gradient is the
branch taken).  Conditions of ``where`` and index values carry no gradient, by definition.
Non-smooth points follow torch: ``max(a, b)`` and ``min`` send the gradient to ``a`` on a tie,
``relu`` and ``abs`` have derivative 0 at 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from edatalog.ir.scalar import OPS, Const, ExprBuilder, IndexValue, Load, Op, ScalarExpr


class NotDifferentiable(Exception):
    """The body uses an operation whose result has no derivative as a number (the message says
    which, and what to write instead)."""


class Builder:
    """An :class:`ExprBuilder` with the algebra of derivatives: products and sums by 0 and 1
    vanish as they are built, so a linear rule's gradient is a plain product."""

    def __init__(self) -> None:
        self.b = ExprBuilder()

    def node(self, node: Load | Const | IndexValue | Op) -> int:
        return self.b.add(node)

    def const(self, value: float) -> int:
        return self.b.add(Const(value))

    def _value(self, k: int) -> float | None:
        n = self.b.nodes[k]
        return float(n.value) if isinstance(n, Const) and n.label is None else None

    def op(self, name: str, *args: int) -> int:
        return self.b.add(Op(name, args))

    def mul(self, a: int, b: int) -> int:
        va, vb = self._value(a), self._value(b)
        if va == 0.0 or vb == 0.0:
            return self.const(0.0)
        if va == 1.0:
            return b
        if vb == 1.0:
            return a
        if va == -1.0:
            return self.neg(b)
        if vb == -1.0:
            return self.neg(a)
        return self.op("mul", a, b)

    def add(self, a: int, b: int) -> int:
        if self._value(a) == 0.0:
            return b
        if self._value(b) == 0.0:
            return a
        return self.op("add", a, b)

    def sub(self, a: int, b: int) -> int:
        if self._value(b) == 0.0:
            return a
        if self._value(a) == 0.0:
            return self.neg(b)
        return self.op("sub", a, b)

    def neg(self, a: int) -> int:
        n = self.b.nodes[a]
        if isinstance(n, Op) and n.op == "neg":
            return n.args[0]
        return self.op("neg", a)

    def div(self, a: int, b: int) -> int:
        if self._value(a) == 0.0:
            return self.const(0.0)
        if self._value(b) == 1.0:
            return a
        return self.op("div", a, b)

    def where(self, cond: int, a: int, b: int) -> int:
        if a == b:
            return a
        return self.op("where", cond, a, b)

    def build(self, root: int) -> ScalarExpr:
        return self.b.build(root)


def copy_into(bld: Builder, expr: ScalarExpr, load: Callable[[int], int]) -> dict[int, int]:
    """``expr``'s live nodes built into ``bld``, each input ``k`` read as node ``load(k)``: the
    map from ``expr``'s node numbers to ``bld``'s."""
    new: dict[int, int] = {}
    for k in expr.live():
        n = expr.nodes[k]
        if isinstance(n, Load):
            new[k] = load(n.input)
        elif isinstance(n, Op):
            new[k] = bld.node(Op(n.op, tuple(new[a] for a in n.args)))
        else:
            new[k] = bld.node(n)
    return new


def vjp(bld: Builder, expr: ScalarExpr, new: dict[int, int], seed: int, wanted: Sequence[int]) -> dict[int, int]:
    """Per input number in ``wanted``, the node of ``seed * d expr / d input`` (summed over every
    load of it), built into ``bld`` next to ``expr``'s own nodes (``new``, from
    :func:`copy_into`).  Inputs the root does not depend on are absent."""
    adjoint: dict[int, int] = {expr.root: seed}
    out: dict[int, int] = {}
    wanted_set = set(wanted)
    for k in reversed(expr.live()):
        g = adjoint.get(k)
        if g is None:
            continue
        n = expr.nodes[k]
        if isinstance(n, Load):
            if n.input in wanted_set:
                out[n.input] = bld.add(out[n.input], g) if n.input in out else g
            continue
        if not isinstance(n, Op):
            continue  # constants and index values carry no gradient
        for arg, contribution in _partials(bld, n, [new[a] for a in n.args], new[k], g, expr, k):
            if contribution is None:
                continue
            adjoint[arg] = bld.add(adjoint[arg], contribution) if arg in adjoint else contribution
    return out


def _is_bool(expr: ScalarExpr, k: int) -> bool:
    n = expr.nodes[k]
    return isinstance(n, Op) and OPS[n.op].result == "bool"


def _partials(
    bld: Builder, n: Op, a: list[int], out: int, g: int, expr: ScalarExpr, k: int
) -> list[tuple[int, int | None]]:
    """(argument node of ``expr``, ``g`` times the partial derivative by it) for each argument
    of node ``k`` (``n``), whose arguments and value are ``a`` and ``out`` in ``bld``."""
    op, args = n.op, n.args
    if OPS[op].result == "bool":
        raise NotDifferentiable(
            f"'{op}' is a condition: used as a number it has no derivative; write where(condition, a, b)"
        )
    if op == "where":
        if any(_is_bool(expr, x) and x != args[0] for x in args[1:]):
            raise NotDifferentiable("a condition is used as a number inside where(...)")
        zero = bld.const(0.0)
        return [(args[1], bld.where(a[0], g, zero)), (args[2], bld.where(a[0], zero, g))]
    for x in args:
        if _is_bool(expr, x):
            raise NotDifferentiable(
                f"a condition is used as a number in '{op}': it has no derivative; write where(condition, a, b)"
            )
    x = a[0]
    if op == "neg":
        return [(args[0], bld.neg(g))]
    if op == "add":
        return [(args[0], g), (args[1], g)]
    if op == "sub":
        return [(args[0], g), (args[1], bld.neg(g))]
    if op == "mul":
        return [(args[0], bld.mul(g, a[1])), (args[1], bld.mul(g, a[0]))]
    if op == "div":
        return [(args[0], bld.div(g, a[1])), (args[1], bld.neg(bld.div(bld.mul(g, out), a[1])))]
    if op == "pow":
        base = bld.mul(a[1], bld.op("pow", x, bld.sub(a[1], bld.const(1.0))))
        return [(args[0], bld.mul(g, base)), (args[1], bld.mul(g, bld.mul(out, bld.op("log", x))))]
    if op in ("max", "min"):
        first = bld.op("ge" if op == "max" else "le", a[0], a[1])  # a tie goes to the first
        zero = bld.const(0.0)
        return [(args[0], bld.where(first, g, zero)), (args[1], bld.where(first, zero, g))]
    return [(args[0], bld.mul(g, _unary(bld, op, x, out)))]


def _unary(bld: Builder, op: str, x: int, out: int) -> int:
    """The derivative of the unary ``op`` at ``x``, whose value there is ``out``."""
    one, zero = bld.const(1.0), bld.const(0.0)
    if op == "exp":
        return out
    if op == "log":
        return bld.div(one, x)
    if op == "sqrt":
        return bld.div(bld.const(0.5), out)
    if op == "rsqrt":
        return bld.mul(bld.const(-0.5), bld.mul(out, bld.mul(out, out)))
    if op == "abs":
        return bld.where(bld.op("gt", x, zero), one, bld.where(bld.op("lt", x, zero), bld.const(-1.0), zero))
    if op == "sin":
        return bld.op("cos", x)
    if op == "cos":
        return bld.neg(bld.op("sin", x))
    if op == "tanh":
        return bld.sub(one, bld.mul(out, out))
    if op == "sigmoid":
        return bld.mul(out, bld.sub(one, out))
    if op == "silu":
        s = bld.op("sigmoid", x)
        return bld.mul(s, bld.add(one, bld.mul(x, bld.sub(one, s))))
    if op == "relu":
        return bld.where(bld.op("gt", x, zero), one, zero)
    if op in ("floor", "ceil", "round", "trunc"):  # piecewise constant
        return zero
    if op == "erf":
        return bld.mul(bld.const(2.0 / math.sqrt(math.pi)), bld.op("exp", bld.neg(bld.mul(x, x))))
    if op == "gelu":
        cdf = bld.mul(bld.const(0.5), bld.add(one, bld.op("erf", bld.mul(x, bld.const(1.0 / math.sqrt(2.0))))))
        pdf = bld.mul(bld.const(1.0 / math.sqrt(2.0 * math.pi)), bld.op("exp", bld.mul(bld.const(-0.5), bld.mul(x, x))))
        return bld.add(cdf, bld.mul(x, pdf))
    if op == "gelu_tanh":
        c, k = math.sqrt(2.0 / math.pi), 0.044715
        x2 = bld.mul(x, x)
        t = bld.op("tanh", bld.mul(bld.const(c), bld.add(x, bld.mul(bld.const(k), bld.mul(x2, x)))))
        dt = bld.mul(bld.sub(one, bld.mul(t, t)), bld.mul(bld.const(c), bld.add(one, bld.mul(bld.const(3 * k), x2))))
        return bld.add(bld.mul(bld.const(0.5), bld.add(one, t)), bld.mul(bld.const(0.5), bld.mul(x, dt)))
    raise NotDifferentiable(f"no derivative is known for '{op}'")
