"""Softmax attention, recognized in a graph by its structure (never by rule or relation names).

Five rules mean exactly what ``scaled_dot_product_attention`` computes::

    sc[.., s, t] += q[.., s, .., e] * k[.., t, .., e] * c   (where g(s, t))
    mx[.., s]   max= sc[.., s, t]
    p[.., s, t]    = exp(sc[.., s, t] - mx[.., s])
    l[.., s]      += p[.., s, t]
    o[.., s, .., f] += p[.., s, t] * v[.., t, .., f] / l[.., s]

A sixth rule may read the maxima and sums: the rows' log-sum-exp, which a training step keeps
for the backward (``edatalog.rules.grad``), as flash attention's forward does::

    lse[.., s]     = mx[.., s] + log(l[.., s])

:func:`attention_chains` finds such chains: what each body computes, which index each access
holds, and that the scores, maxima, probabilities and sums are read by nothing else (the
log-sum-exp aside).  The backend fuses each device's blocks of a chain into one kernel
(:mod:`edatalog.backend.lowering.fusion`) that makes ``o`` (and ``lse``); the solver costs the
chain as that kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from edatalog.ir.forms import plain_indices, product_form
from edatalog.ir.graph import Access, Graph, JoinAgg
from edatalog.ir.scalar import Const, Load, Op


@dataclass(frozen=True)
class Chain:
    """One attention chain of a graph: its five rules (six with the log-sum-exp), and which
    inputs are q, k and v."""

    scores: str  # sc += q * k * c
    maxima: str  # mx max= sc
    probs: str  # p = exp(sc - mx)
    sums: str  # l += p
    out: str  # o += p * v / l
    q: int  # input of ``scores``
    k: int  # input of ``scores``
    v: int  # input of ``out``
    scale: float
    lse: str | None = None  # lse = mx + log(l), where a rule reads the rows' log-sum-exp

    @property
    def inner(self) -> tuple[str, ...]:
        """The rules whose blocks never leave a fused kernel: scores, maxima, probabilities, sums."""
        return (self.scores, self.maxima, self.probs, self.sums)

    @property
    def nodes(self) -> tuple[str, ...]:
        return (*self.inner, self.out, *((self.lse,) if self.lse is not None else ()))


def attention_chains(graph: Graph) -> list[Chain]:
    """Every attention chain of ``graph`` (see the module docstring)."""
    readers: dict[str, list[JoinAgg]] = {}
    for n in graph.nodes:
        for acc in n.inputs:
            readers.setdefault(acc.relation, []).append(n)
    out = []
    for o in graph.nodes:
        chain = _match(graph, o, readers)
        if chain is not None:
            out.append(chain)
    return out


def _only(graph: Graph, relation: str) -> JoinAgg | None:
    producers = graph.producers(relation)
    return producers[0] if len(producers) == 1 and relation not in graph.outputs else None


def _plain(acc: Access) -> list[str] | None:
    """The indices of an access made of plain indices only, one per axis; else None."""
    return plain_indices(acc.axes)


def _match(graph: Graph, o: JoinAgg, readers: dict[str, list[JoinAgg]]) -> Chain | None:
    # o += p * v / l: a product of three loads, p and v multiplied, l divided, one summed index.
    if o.agg != "sum" or len(o.agg_indices) != 1:
        return None
    form = product_form(o)
    if form is None or form.negate or form.constants or len(form.factors) != 3:
        return None
    loads: dict[int, list[int]] = {}
    for node_id, power in form.factors:
        n = o.expr.nodes[node_id]
        if not isinstance(n, Load):
            return None
        loads.setdefault(power, []).append(n.input)
    if sorted(len(v) for v in loads.values()) != [1, 2] or len(loads.get(1, [])) != 2 or len(loads.get(-1, [])) != 1:
        return None
    (l_in,) = loads[-1]
    t = o.agg_indices[0]
    p_pos = next((k for k in loads[1] if _produced_by(graph, o.inputs[k].relation, "=")), None)
    if p_pos is None:
        return None
    v_pos = next(k for k in loads[1] if k != p_pos)
    p_acc, l_acc = o.inputs[p_pos], o.inputs[l_in]
    p_node, l_node = _only(graph, p_acc.relation), _only(graph, l_acc.relation)
    if p_node is None or l_node is None:
        return None
    # p = exp(sc - mx)
    sub = exp_of_difference(p_node)
    if sub is None or p_node.aggop != "=":
        return None
    sc_acc, mx_acc = p_node.inputs[sub[0]], p_node.inputs[sub[1]]
    sc_node, mx_node = _only(graph, sc_acc.relation), _only(graph, mx_acc.relation)
    if sc_node is None or mx_node is None:
        return None
    # mx max= sc; l += p: one load each, reducing one index.
    if not (_reduces_one_load(mx_node, "max", sc_acc.relation) and _reduces_one_load(l_node, "sum", p_acc.relation)):
        return None
    # sc += q * k * c, one summed index.
    s_form = product_form(sc_node)
    if sc_node.agg != "sum" or len(sc_node.agg_indices) != 1 or s_form is None or s_form.negate:
        return None
    if len(s_form.factors) != 2 or any(
        p != 1 or not isinstance(sc_node.expr.nodes[k], Load) for k, p in s_form.factors
    ):
        return None
    scale = scale_of(sc_node, s_form.constants)
    if scale is None:
        return None
    q_pos, k_pos = (sc_node.expr.nodes[k].input for k, _ in s_form.factors)  # type: ignore[union-attr]
    # Every access plain; the intermediates read by nothing else; the indices line up.
    for acc in (*sc_node.inputs, *mx_node.inputs, *p_node.inputs, *l_node.inputs, *o.inputs):
        if _plain(acc) is None:
            return None
    if {n.name for n in readers.get(sc_acc.relation, [])} != {mx_node.name, p_node.name}:
        return None
    if {n.name for n in readers.get(p_acc.relation, [])} != {l_node.name, o.name}:
        return None
    # The maxima read by p alone and the sums by o alone, or both also by one log-sum-exp rule.
    by_mx = [n for n in readers.get(mx_acc.relation, []) if n.name != p_node.name]
    by_l = [n for n in readers.get(l_acc.relation, []) if n.name != o.name]
    if len(readers.get(mx_acc.relation, [])) != 1 + len(by_mx) or len(readers.get(l_acc.relation, [])) != 1 + len(by_l):
        return None  # p or o reads the same relation twice
    lse = None
    if by_mx or by_l:
        if len(by_mx) != 1 or by_mx != by_l or not _is_lse(by_mx[0], mx_acc.relation, l_acc.relation, p_node):
            return None
        lse = by_mx[0].name
    if not _lined_up(sc_node, q_pos, k_pos, o, p_pos, v_pos, t):
        return None
    if not _same_cells(mx_node, p_node, l_node, sc_acc, mx_acc, p_acc, l_acc):
        return None
    return Chain(sc_node.name, mx_node.name, p_node.name, l_node.name, o.name, q_pos, k_pos, v_pos, scale, lse)


def _is_lse(node: JoinAgg, mx: str, sums: str, p: JoinAgg) -> bool:
    """Whether ``node`` is ``lse[.., s] = mx[.., s] + log(l[.., s])``: each of its cells one
    row of the probabilities ``p``, read whole and plain, under no guard."""
    if node.aggop != "=" or node.lookups or not node.guard.is_true or node.agg_indices or len(node.inputs) != 2:
        return False
    loads = {acc.relation: k for k, acc in enumerate(node.inputs)}
    if set(loads) != {mx, sums}:
        return False
    head = [ax.parts[0].index for ax in node.out_axes]
    if any(_plain(acc) != head for acc in node.inputs) or len(head) != len(p.out_axes) - 1:
        return False
    nodes = node.expr.nodes
    root = nodes[node.expr.root]
    if not (isinstance(root, Op) and root.op == "add"):
        return False
    a, b = (nodes[k] for k in root.args)
    if isinstance(a, Op):
        a, b = b, a
    if not (isinstance(a, Load) and a.input == loads[mx] and isinstance(b, Op) and b.op == "log"):
        return False
    inner = nodes[b.args[0]]
    return isinstance(inner, Load) and inner.input == loads[sums]


def _same_cells(
    mx: JoinAgg, p: JoinAgg, sums: JoinAgg, sc_in_p: Access, mx_in_p: Access, p_in_o: Access, l_in_o: Access
) -> bool:
    """The intermediates address one cell grid: ``p[.., s, t]`` is computed from
    ``sc[.., s, t]`` and ``mx[..., s]``, ``mx`` and ``l`` drop the key axis of what they reduce,
    and ``o`` reads ``l`` as it reads ``p`` without the key: so a region of one is the same cells
    of the others (what fusing blocks relies on)."""
    p_head = [ax.parts[0].index for ax in p.out_axes]
    if _plain(sc_in_p) != p_head or _plain(mx_in_p) != p_head[:-1]:
        return False
    for reducer in (mx, sums):
        read = _plain(reducer.inputs[0]) or []
        head = [ax.parts[0].index for ax in reducer.out_axes]
        if not read or head != read[:-1] or list(reducer.agg_indices) != read[-1:]:
            return False
    p_read, l_read = _plain(p_in_o) or [], _plain(l_in_o) or []
    return bool(p_read) and l_read == p_read[:-1]


def _produced_by(graph: Graph, relation: str, aggop: str) -> bool:
    producers = graph.producers(relation)
    return len(producers) == 1 and producers[0].aggop == aggop


def exp_of_difference(node: JoinAgg) -> tuple[int, int] | None:
    root = node.expr.nodes[node.expr.root]
    if not (isinstance(root, Op) and root.op == "exp"):
        return None
    sub = node.expr.nodes[root.args[0]]
    if not (isinstance(sub, Op) and sub.op == "sub"):
        return None
    a, b = (node.expr.nodes[x] for x in sub.args)
    if not (isinstance(a, Load) and isinstance(b, Load)):
        return None
    return a.input, b.input


def _reduces_one_load(node: JoinAgg, agg: str, relation: str) -> bool:
    root = node.expr.nodes[node.expr.root]
    return (
        node.agg == agg
        and len(node.agg_indices) == 1
        and isinstance(root, Load)
        and node.inputs[root.input].relation == relation
    )


def scale_of(node: JoinAgg, constants: Sequence[tuple[int, int]]) -> float | None:
    """The product of the constant factors (``1 / sqrt(E)``), folded in Python."""
    value = 1.0
    for k, power in constants:
        c = _fold(node, k)
        if c is None or c == 0:
            return None
        value = value * c if power > 0 else value / c
    return value


def _fold(node: JoinAgg, k: int) -> float | None:
    from edatalog.ir.scalar import FOLD

    n = node.expr.nodes[k]
    if isinstance(n, Const):
        return float(n.value)
    if isinstance(n, Op):
        args = [_fold(node, a) for a in n.args]
        if any(a is None for a in args):
            return None
        try:
            return float(FOLD[n.op](*args))
        except (ArithmeticError, ValueError):
            return None
    return None


def _lined_up(sc: JoinAgg, q_pos: int, k_pos: int, o: JoinAgg, p_pos: int, v_pos: int, t: str) -> bool:
    """The chain's accesses name the same axes the same way: the score's query index ``s`` and
    key index ``t`` are the last two axes of every intermediate, in that order, as in
    ``sc[.., s, t]``, and the key index is what ``o`` sums over."""
    sc_head = [ax.parts[0].index for ax in sc.out_axes]
    if len(sc_head) < 2:
        return False
    e = sc.agg_indices[0]
    q_idx, k_idx = _plain(sc.inputs[q_pos]) or [], _plain(sc.inputs[k_pos]) or []
    s_name, t_name = sc_head[-2], sc_head[-1]
    if not sc.guard.vars <= {s_name, t_name}:
        return False  # the mask is over (s, t) only
    if s_name in k_idx or t_name in q_idx or s_name not in q_idx or t_name not in k_idx:
        return False
    if e not in q_idx or e not in k_idx:
        return False
    # o reads p[.., s, t]: its key index t must be the one it sums.
    p_idx = _plain(o.inputs[p_pos]) or []
    v_idx = _plain(o.inputs[v_pos]) or []
    return bool(p_idx) and p_idx[-1] == t and t in v_idx and p_idx[-2] not in v_idx


def key_index(graph: Graph, chain: Chain, rule: str) -> str:
    """The key index (``t``) of one rule of ``chain``, as that rule names it: the last head
    index of the scores and the probabilities, the index the maxima, the sums and the output
    sum over.  A block that splits it cannot be one flash kernel."""
    node = graph.node(rule)
    if rule in (chain.scores, chain.probs):
        last = node.out_axes[-1].parts[0].index
        assert last is not None
        return last
    return node.agg_indices[0]
