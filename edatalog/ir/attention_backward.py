"""The backward of a softmax attention, recognized in a graph by its structure (never by rule or
relation names).

The gradient of an attention chain (:mod:`edatalog.ir.attention`) is written as flash
attention's backward computes it (``edatalog.rules.grad``): the chain keeps its rows'
log-sum-exp ``lse = mx + log(l)`` from the forward, and eight rules, given the gradient ``go`` of
the chain's output ``o``, make the rest::

    sc'[.., s, t] += q * k * c            the chain's scores again, heads renamed
    p'[.., s, t]   = exp(sc' - lse)        the chain's probabilities, normalized
    gl[.., s]     += -(go[o's cell] * o[o's cell])        over o's cells
    gp[.., s, t]  += go * v                                over o's points
    gsc[.., s, t] += p' * (gp + gl)                        over p's points
    gq[q's cell]  += gsc * k * c                           over the scores' points
    gk[k's cell]  += gsc * q * c
    gv[v's cell]  += go * p'                               over o's points

Together they compute what torch's attention backward computes from q, k, v, ``o``, ``lse`` and
``go``: the gradients of q, k and v (those of k and v summed over the query heads that share
them).  :func:`attention_backwards` finds them: each rule's head, indices, reads, body and guard
as above, and every intermediate read by these rules only.  The backend runs each device's block
of them as one kernel (:mod:`edatalog.backend.lowering.fusion`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from edatalog.ir.attention import Chain, attention_chains, key_index, scale_of
from edatalog.ir.forms import product_form
from edatalog.ir.graph import Access, Graph, JoinAgg
from edatalog.ir.scalar import Load, Op


@dataclass(frozen=True)
class Backward:
    """The backward rules of one attention chain (see the module docstring), by name."""

    chain: Chain  # the forward's, with its log-sum-exp
    scores: str  # the chain's scores made again
    probs: str  # the normalized probabilities made again
    grad_sums: str  # gl
    grad_probs: str  # gp
    grad_scores: str  # gsc
    grad_q: str | None  # None where the loss needs no gradient of q
    grad_k: str | None
    grad_v: str | None
    grad_out: str  # the relation go

    @property
    def inner(self) -> tuple[str, ...]:
        """The rules whose blocks a fused backward makes and reads itself."""
        return (self.scores, self.probs, self.grad_sums, self.grad_probs, self.grad_scores)

    @property
    def results(self) -> tuple[str, ...]:
        """The rules whose blocks leave a fused backward: the gradients of q, k and v asked for."""
        return tuple(r for r in (self.grad_q, self.grad_k, self.grad_v) if r is not None)

    @property
    def nodes(self) -> tuple[str, ...]:
        return (*self.inner, *self.results)

    def key_of(self, graph: Graph, rule: str) -> str | None:
        """The key index (``t``) of one of these rules, as it names it; None for the sums'
        gradient, which has none.  A block that splits it cannot be one flash kernel."""
        chain = self.chain
        if rule == self.scores:
            return key_index(graph, chain, chain.scores)  # the same indices as the forward's rule
        if rule == self.probs:
            return key_index(graph, chain, chain.probs)
        if rule == self.grad_sums:
            return None
        if rule in (self.grad_probs, self.grad_v):
            return key_index(graph, chain, chain.out)  # over o's points
        if rule == self.grad_scores:
            return key_index(graph, chain, chain.probs)  # over p's points
        return key_index(graph, chain, chain.scores)  # q's and k's, over the scores' points

    def source(self, result: str) -> str:
        """The intermediate rule a result reads: the scores' gradient for q and k, p' for v."""
        return self.probs if result == self.grad_v else self.grad_scores


def attention_backwards(graph: Graph) -> list[Backward]:
    """The backward of every attention chain of ``graph`` written as the module docstring says."""
    readers: dict[str, list[JoinAgg]] = {}
    for n in graph.nodes:
        for acc in n.inputs:
            readers.setdefault(acc.relation, []).append(n)
    found = []
    for chain in attention_chains(graph):
        backward = _match(graph, chain, readers) if chain.lse is not None else None
        if backward is not None:
            found.append(backward)
    return found


def _match(graph: Graph, chain: Chain, readers: dict[str, list[JoinAgg]]) -> Backward | None:
    sc, mx, p, _, o = (graph.node(n) for n in chain.nodes[:5])
    assert chain.lse is not None
    lse = graph.node(chain.lse)

    def read_by(relation: str) -> set[str]:
        return {n.name for n in readers.get(relation, [])}

    # The scores made again, and the probabilities from them and the log-sum-exp.
    sc2 = _again(graph, sc, {}, readers)
    p2 = None if sc2 is None else _again(graph, p, {sc.out: sc2.out, mx.out: lse.out}, readers)
    if sc2 is None or p2 is None or read_by(sc2.out) != {p2.name}:
        return None
    p_pos = next(k for k, a in enumerate(o.inputs) if a.relation == p.out)
    l_pos = next(k for k, a in enumerate(o.inputs) if a.relation != p.out and k != chain.v)
    l_axes, p_axes, v_acc = o.inputs[l_pos].axes, o.inputs[p_pos].axes, o.inputs[chain.v]
    cells = tuple(i for i in o.indices if i.name not in o.agg_indices)
    # gsc = p' * (gp + gl) over p's points, and gv = go * p' over o's points: p''s readers.
    mx_axes = next(a.axes for a in p.inputs if a.relation == mx.out)
    gsc = gv = None
    for n in readers.get(p2.out, []):
        if n.indices == p.indices and n.out_axes == p.out_axes and len(n.inputs) == 3:
            gsc = n if gsc is None else None
        elif n.out_axes == v_acc.axes and n.indices == o.indices:
            gv = n if gv is None else None
    if gsc is None or len(readers[p2.out]) != 1 + (gv is not None):
        return None
    if not all(len(graph.producers(acc.relation)) == 1 for acc in gsc.inputs[1:]):
        return None
    gp, gl = (graph.producers(acc.relation)[0] for acc in gsc.inputs[1:])
    if not gl.inputs or gl.inputs[0].axes != o.out_axes:
        return None
    go = gl.inputs[0].relation
    at_o = Access(go, o.out_axes)
    shadow, exact = o.guard.project(list(o.out_indices), o.box)
    if not (
        exact
        and gsc.inputs == (Access(p2.out, p.out_axes), Access(gp.out, p.out_axes), Access(gl.out, mx_axes))
        and _is_scaled_sum(gsc)
        and _sum_rule(gsc, p.guard)
        and read_by(gp.out) == {gsc.name}
        and read_by(gl.out) == {gsc.name}
        and gl.indices == cells
        and gl.out_axes == l_axes
        and gl.inputs == (at_o, Access(o.out, o.out_axes))
        and _product(gl, {0: 1, 1: 1}, negate=True)
        and _sum_rule(gl, shadow)
        and gp.indices == o.indices
        and gp.out_axes == p_axes
        and _product_of(gp, {at_o: 1, v_acc: 1})
        and _sum_rule(gp, o.guard)
        and (gv is None or (_product_of(gv, {at_o: 1, Access(p2.out, p_axes): 1}) and _sum_rule(gv, o.guard)))
    ):
        return None
    # gq += gsc * k * c and gk += gsc * q * c, over the scores' points.
    q_acc, k_acc = sc.inputs[chain.q], sc.inputs[chain.k]
    at_sc = Access(gsc.out, sc.out_axes)
    grads = {n.out_axes: n for n in readers.get(gsc.out, [])}
    gq, gk = grads.get(q_acc.axes), grads.get(k_acc.axes)
    if gq is gk or len(readers.get(gsc.out, [])) != (gq is not None) + (gk is not None):
        return None
    if gq is None and gk is None and gv is None:
        return None
    for grad, other in ((gq, k_acc), (gk, q_acc)):
        if grad is not None and not (
            grad.indices == sc.indices
            and _product_of(grad, {at_sc: 1, other: 1}, scale=chain.scale)
            and _sum_rule(grad, sc.guard)
        ):
            return None
    for n in (gl, gp, gsc):
        if not _only_producer(graph, n):
            return None
    q, k, v = (n.name if n is not None else None for n in (gq, gk, gv))
    return Backward(chain, sc2.name, p2.name, gl.name, gp.name, gsc.name, q, k, v, go)


def _again(graph: Graph, node: JoinAgg, renamed: dict[str, str], readers: dict[str, list[JoinAgg]]) -> JoinAgg | None:
    """The one rule that is ``node`` with its head renamed and its reads of the relations in
    ``renamed`` renamed so: the forward's rule made again."""
    inputs = tuple(replace(a, relation=renamed.get(a.relation, a.relation)) for a in node.inputs)
    found = [
        n
        for n in readers.get(inputs[0].relation, [])
        if n.name != node.name and n.inputs == inputs and n.anonymous == node.anonymous
    ]
    if len(found) != 1 or not _only_producer(graph, found[0]):
        return None
    return found[0]


def _only_producer(graph: Graph, node: JoinAgg) -> bool:
    return graph.producers(node.out) == (node,) and node.out not in graph.outputs


def _sum_rule(node: JoinAgg, guard: object) -> bool:
    return node.aggop == "+=" and not node.lookups and node.guard == guard


def _product(node: JoinAgg, powers: dict[int, int], negate: bool = False) -> bool:
    """Whether the body is the product of the loads of ``powers`` (input -> power), each once."""
    form = product_form(node)
    if form is None or form.negate != negate or form.constants:
        return False
    loads: dict[int, int] = {}
    for k, power in form.factors:
        n = node.expr.nodes[k]
        if not isinstance(n, Load) or n.input in loads:
            return False
        loads[n.input] = power
    return loads == powers


def _product_of(node: JoinAgg, powers: dict[Access, int], scale: float | None = None) -> bool:
    """Whether the body is the product of the accesses of ``powers`` (each read once, at that
    power) times ``scale`` (no constant when None)."""
    form = product_form(node)
    if form is None or form.negate or len(node.inputs) != len(powers) or set(node.inputs) != set(powers):
        return False
    if scale is None and form.constants:
        return False
    if scale is not None:
        value = scale_of(node, form.constants)
        if value is None or abs(value - scale) > 1e-12 * abs(scale):
            return False
    loads: dict[Access, int] = {}
    for k, power in form.factors:
        n = node.expr.nodes[k]
        if not isinstance(n, Load) or node.inputs[n.input] in loads:
            return False
        loads[node.inputs[n.input]] = power
    return loads == powers


def _is_scaled_sum(node: JoinAgg) -> bool:
    """Whether the body is ``load 0 * (load 1 + load 2)``."""
    nodes = node.expr.nodes
    root = nodes[node.expr.root]
    if not (isinstance(root, Op) and root.op == "mul"):
        return False
    a, b = (nodes[k] for k in root.args)
    if not (isinstance(a, Load) and a.input == 0 and isinstance(b, Op) and b.op == "add"):
        return False
    x, y = (nodes[k] for k in b.args)
    return isinstance(x, Load) and isinstance(y, Load) and (x.input, y.input) == (1, 2)
