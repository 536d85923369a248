"""What a rule's body is, structurally: a product of factors (:func:`product_form`).  The
backend evaluates products as contractions, the solver and the backend recognize attention by
them (:mod:`edatalog.ir.attention`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from edatalog.ir.graph import JoinAgg
from edatalog.ir.scalar import Op


@dataclass(frozen=True)
class Product:
    """A body written as ``(-1)^negate * prod(constant ^ +-1) * prod(factor ^ +-1)``: node
    numbers of the scalar DAG with their powers; constants do not vary over the join space."""

    factors: tuple[tuple[int, int], ...]
    constants: tuple[tuple[int, int], ...]
    negate: bool


@functools.lru_cache(maxsize=4096)
def product_form(node: JoinAgg) -> Product | None:
    """The body as a :class:`Product`, or None when it is not one (or has no varying factor)."""
    nodes = node.expr.nodes
    varying = node.expr.varying()
    factors: list[tuple[int, int]] = []
    constants: list[tuple[int, int]] = []
    negate = False

    def walk(k: int, power: int) -> bool:
        nonlocal negate
        n = nodes[k]
        if k not in varying:
            constants.append((k, power))
            return True
        if isinstance(n, Op) and n.op == "mul":
            return walk(n.args[0], power) and walk(n.args[1], power)
        if isinstance(n, Op) and n.op == "div":
            return walk(n.args[0], power) and walk(n.args[1], -power)
        if isinstance(n, Op) and n.op == "neg":
            negate = not negate
            return walk(n.args[0], power)
        factors.append((k, power))
        return True

    if not walk(node.expr.root, 1) or not factors:
        return None
    return Product(tuple(factors), tuple(constants), negate)
