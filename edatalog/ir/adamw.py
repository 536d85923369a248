"""AdamW's update in a graph: the three elementwise rules that mean exactly what torch's fused
AdamW kernel computes for one param.

A training step (:mod:`edatalog.rules.optim`) updates each param ``p`` with its gradient ``g``,
moments ``m`` and ``v``, the step count ``t`` and, under clipping, a scalar factor ``s``::

    m'[i] = b1 m[i] + (1 - b1) s g[i]
    v'[i] = b2 v[i] + (1 - b2) s^2 g[i]^2
    p'[i] = p[i] (1 - lr wd) - lr / (1 - b1^t) m'[i] / (sqrt(v'[i]) / sqrt(1 - b2^t) + eps)

:func:`adamw_updates` finds such triples by what the rules compute, not by their names or the
shape of their expression trees: each candidate's scalar function is evaluated at chosen points
to read off the constants (``b1``, ``b2``, ``lr``, ``wd``, ``eps``), then checked against the
formula at random points.  Any program whose rules compute this, written however, is found;
nothing else is.  The backend runs a found triple as one pass (torch's ``_fused_adamw_``) where
it can, and as the three rules elsewhere.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from edatalog.ir.graph import Access, Graph, JoinAgg

TOLERANCE = 1e-9  # relative: the checks evaluate in Python floats (f64)


@dataclass(frozen=True)
class AdamWUpdate:
    """One param's AdamW update: its three rules, what they read, and the constants."""

    first: str  # the rule of m'
    second: str  # the rule of v'
    update: str  # the rule of p'
    param: str
    grad: str
    first_state: str  # m
    second_state: str  # v
    step: str  # t, a scalar
    scale: str | None  # s, a scalar (the clipping factor), or None
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    reads: tuple[tuple[str, int, int], ...]  # (role, rule's place in ``nodes``, input position)

    @property
    def nodes(self) -> tuple[str, str, str]:
        return (self.first, self.second, self.update)

    @property
    def operands(self) -> dict[str, tuple[int, int]]:
        """Where each operand of the update is read: ``role -> (rule, input)``, the rule by its
        place in :attr:`nodes`, the input by its position in that rule: ``m``, ``g`` and ``s``
        by the rule of ``m'``, ``v`` by that of ``v'``, ``p`` and ``t`` by the update's (``s``
        only under clipping)."""
        return {role: (place, position) for role, place, position in self.reads}


def adamw_updates(graph: Graph) -> list[AdamWUpdate]:
    """Every AdamW update of ``graph`` (see the module docstring)."""
    # Lowering looks for them in every plan it lowers: a glance at each rule's shape first (an
    # update reads three blocks and one scalar), the evaluations only for the few that pass.
    candidates = [n for n in graph.nodes if len(n.inputs) == 4 and sum(not a.axes for a in n.inputs) == 1]
    if not candidates:
        return []
    producers: dict[str, list[JoinAgg]] = {}
    for node in graph.nodes:
        producers.setdefault(node.out, []).append(node)
    return [update for node in candidates if (update := _match(graph, node, producers)) is not None]


def _match(graph: Graph, u: JoinAgg, producers: dict[str, list[JoinAgg]]) -> AdamWUpdate | None:
    parts = _elementwise(graph, u, producers)
    if parts is None or len(parts[0]) != 3 or len(parts[1]) != 1:
        return None
    whole, scalars = parts
    made = {k: producers[u.inputs[k].relation][0] for k in whole if len(producers.get(u.inputs[k].relation, ())) == 1}
    first = second = None
    for k, node in made.items():
        moment = _moment(graph, node, producers)
        if moment is None:
            continue
        if moment[0] == 1:
            first = (k, node, moment)
        else:
            second = (k, node, moment)
    if first is None or second is None:
        return None
    (km, m_node, (_, beta1, m_state, grad, scale)), (kv, v_node, (_, beta2, v_state, grad2, scale2)) = first, second
    if grad != grad2 or scale != scale2 or m_state == v_state:
        return None
    kp = next(k for k in whole if k not in (km, kv))
    kt = scalars[0]
    consts = _update_constants(u, kp, km, kv, kt, beta1, beta2)
    if consts is None:
        return None
    lr, wd, eps = consts
    relations = [u.inputs[kp].relation, m_state, v_state, grad]
    dtypes = {graph.relation(r).dtype for r in [*relations, u.out, m_node.out, v_node.out]}
    if len(dtypes) != 1 or len(set(relations)) != 4:
        return None

    def at(node: JoinAgg, relation: str) -> int:
        return next(k for k, acc in enumerate(node.inputs) if acc.relation == relation)

    reads = [("p", 2, kp), ("t", 2, kt), ("m", 0, at(m_node, m_state)), ("g", 0, at(m_node, grad))]
    reads += [("v", 1, at(v_node, v_state))] + ([("s", 0, at(m_node, scale))] if scale is not None else [])
    return AdamWUpdate(
        m_node.name, v_node.name, u.name, relations[0], grad, m_state, v_state,
        u.inputs[kt].relation, scale, lr, beta1, beta2, eps, wd, tuple(reads),
    )  # fmt: skip


def _elementwise(
    graph: Graph, node: JoinAgg, producers: dict[str, list[JoinAgg]]
) -> tuple[list[int], list[int]] | None:
    """The positions of ``node``'s whole reads (each cell of the output reads the same cell) and
    of its scalar reads, if it is a plain elementwise rule over its output's box; else None."""
    if node.aggop != "=" or not node.guard.is_true or node.lookups or node.agg_indices:
        return None
    if len(producers.get(node.out, ())) != 1 or node.expr.index_values():
        return None
    rel = graph.relation(node.out)
    if tuple(i.extent for i in node.indices) != rel.shape:
        return None
    whole, scalars = [], []
    for k, acc in enumerate(node.inputs):
        if not acc.axes and not graph.relation(acc.relation).shape:
            scalars.append(k)
        elif acc.axes == node.out_axes and graph.relation(acc.relation).shape == rel.shape and _plain(acc):
            whole.append(k)
        else:
            return None
    return whole, scalars


def _plain(acc: Access) -> bool:
    return all(len(ax.parts) == 1 and ax.parts[0].index is not None for ax in acc.axes)


def _moment(
    graph: Graph, node: JoinAgg, producers: dict[str, list[JoinAgg]]
) -> tuple[int, float, str, str, str | None] | None:
    """``(power, beta, state, grad, scale)`` if ``node`` is ``state' = beta state + (1 - beta)
    (s g)^power`` for power 1 or 2 (s absent: 1)."""
    parts = _elementwise(graph, node, producers)
    if parts is None or len(parts[0]) != 2 or len(parts[1]) > 1:
        return None
    (ka, kb), scalars = parts
    ks = scalars[0] if scalars else None
    for kx, kg in ((ka, kb), (kb, ka)):

        def f(x: float, g: float, s: float = 1.0, kx: int = kx, kg: int = kg) -> float | None:
            values = {kx: x, kg: g}
            if ks is not None:
                values[ks] = s
            return node.expr.at(values)

        beta = _snap(f(1.0, 0.0))
        if beta is None or not 0.0 <= beta < 1.0:
            continue
        for power in (1, 2):

            def formula(x: float, g: float, s: float, beta: float = beta, power: int = power) -> float:
                return beta * x + (1.0 - beta) * (s * g) ** power

            scaled = ks is not None
            if _agrees(
                lambda x, g, s: f(x, g, s), formula, [(-2.0, 2.0), (-2.0, 2.0), (0.1, 2.0) if scaled else (1, 1)]
            ):
                return (
                    power,
                    beta,
                    node.inputs[kx].relation,
                    node.inputs[kg].relation,
                    (node.inputs[ks].relation if ks is not None else None),
                )
    return None


def _update_constants(
    u: JoinAgg, kp: int, km: int, kv: int, kt: int, beta1: float, beta2: float
) -> tuple[float, float, float] | None:
    """``(lr, wd, eps)`` if ``u`` is AdamW's update of the param at input ``kp`` from the moments
    at ``km`` and ``kv`` and the step at ``kt`` (see the module docstring)."""

    def f(p: float, m: float, v: float, t: float) -> float | None:
        return u.expr.at({kp: p, km: m, kv: v, kt: t})

    big = 1e6  # a step so late that both bias corrections are 1 (b^t underflows)
    decayed, r0, r1, r4 = f(1.0, 0.0, 1.0, big), f(0.0, 1.0, 0.0, big), f(0.0, 1.0, 1.0, big), f(0.0, 1.0, 4.0, big)
    if None in (decayed, r0, r1, r4) or 0.0 in (r0, r1, r4):
        return None
    assert decayed is not None and r0 is not None and r1 is not None and r4 is not None
    lr = _snap(-1.0 / (1.0 / r4 - 1.0 / r1))  # r_v = -lr / (sqrt(v) + eps)
    eps = None if lr is None else _snap(-lr / r0)
    if lr is None or eps is None or not (lr > 0.0 and eps > 0.0):
        return None
    wd = _snap((1.0 - decayed) / lr)
    assert wd is not None

    def formula(p: float, m: float, v: float, t: float) -> float:
        c1, c2 = 1.0 - beta1**t, 1.0 - beta2**t
        return p * (1.0 - lr * wd) - lr / c1 * m / (math.sqrt(v) / math.sqrt(c2) + eps)

    ranges = [(-2.0, 2.0), (-2.0, 2.0), (0.0, 4.0), (1, 50)]
    return (lr, wd, eps) if _agrees(f, formula, ranges) else None


def _agrees(
    f: Callable[..., float | None], formula: Callable[..., float], ranges: Sequence[tuple[float, float]]
) -> bool:
    """Whether ``f`` equals ``formula`` at a few points drawn from ``ranges`` (integer bounds:
    integers), deterministically."""
    rng = random.Random(0)
    for _ in range(6):
        args = [rng.randint(int(lo), int(hi)) if isinstance(lo, int) else rng.uniform(lo, hi) for lo, hi in ranges]
        got, want = f(*args), formula(*args)
        if got is None or not math.isclose(got, want, rel_tol=TOLERANCE, abs_tol=TOLERANCE):
            return False
    return True


def _snap(x: float | None) -> float | None:
    """``x`` read back from rounded arithmetic, as the number it was written as (``0.1``, not
    ``0.10000000000000003``) when one of 12 digits is that close; the checks then hold it."""
    if x is None:
        return None
    short = float(f"{x:.12g}")
    return short if math.isclose(short, x, rel_tol=1e-13, abs_tol=0.0) else x
