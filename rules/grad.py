"""Reverse-mode differentiation of a program: the gradient rules, as more rules of the same graph.

Every rule ``out[head] agg= f(in_1, ..., in_n) where guard`` sends the gradient of its head's
cells back to each input it reads, over its own join space and under its own guard, so masked
points cost nothing in the backward either:

    grad_in_k[axes of in_k] += grad_out[head] * d f / d in_k      where guard

- a sum (``+=``) and an assignment (``=``) pass ``grad_out`` to every point; a contraction's
  gradient is thus a contraction (``q[s,h] += x[s,d] * w[h,d]`` gives
  ``grad_w[h,d] += grad_q[s,h] * x[s,d]``), a broadcast's a sum and a sum's a broadcast;
- a maximum or minimum (``max=``, ``min=``) passes it to the points whose value is the
  result's, split evenly between tied points (as torch's ``amax`` does): a count of the winners
  is one more rule;
- elementwise bodies differentiate symbolically (:mod:`edatalog.rules.derivative`);
- an input read through index expressions (``x[b, c, i + p - 1]``, a convolution) gets its
  gradient through a fresh index defined by an equality guard, which the compiler's own pass
  substitutes away (:func:`edatalog.rules.eliminate.eliminate_defined`): the transposed
  convolution, as rules;
- a looked-up table (``emb[b,s,d] += tok[v,d] where ids[b,s] = v``) gets a scatter-add: the
  same lookup with the index in the head (``grad_tok[v,d] += grad_emb[b,s,d] where ids[b,s] =
  v``), each point adding to the row its id names, at the forward's points;
- products (``*=``) are refused, as are integer relations and conditions used as numbers;
- the maximum of a softmax (an attention chain, :mod:`edatalog.ir.attention`) gets no gradient:
  ``p = exp(sc - mx)`` is only read normalized (``o += p * v / l``, ``l += p``), which ``mx``
  does not change, so its gradient is exactly 0 (what reaches it through ``p`` and through
  ``l`` cancels) and the winners' rules are not made, as torch's fused attention backward
  (so for a maximum that only shifts a log-sum-exp, :mod:`edatalog.ir.logsumexp`);
  the chain's gradient is written as flash attention's backward computes it, from the rows'
  log-sum-exp that the forward keeps (``_attention_backward``).

The result is a graph whose outputs are the loss and ``grad_<param>`` for each param asked for,
planned and run as any program is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from edatalog.errors import EdlError
from edatalog.ir import dtypes
from edatalog.ir.affine import Affine, Constraint, Guard
from edatalog.ir.attention import Chain, attention_chains, exp_of_difference
from edatalog.ir.graph import Access, AxisMap, Graph, Index, JoinAgg, Part, Relation
from edatalog.ir.logsumexp import shift_only_maxima
from edatalog.ir.scalar import Load, Op, ScalarExpr
from edatalog.rules.derivative import Builder, NotDifferentiable, copy_into, vjp
from edatalog.rules.eliminate import eliminate_defined
from edatalog.rules.support import effective_guard, head_support

PREFIX = "grad_"


class GradError(EdlError):
    """A program that cannot be differentiated as asked.  ``origin`` is the source location
    text of the rule or relation at fault (the IR keeps it as text): the API turns it into the
    error's location."""

    def __init__(self, message: str, origin: str = "", help: str | None = None) -> None:
        super().__init__(message, help=help)
        self.origin, self.text, self.help_text = origin, message, help


def gradient(graph: Graph, loss: str, wrt: Sequence[str] | None = None) -> Graph:
    """``graph`` with the gradient of the scalar ``loss`` by each relation of ``wrt`` (default:
    every float param) as more rules; its outputs are ``loss`` then ``grad_<name>`` per name."""
    _check_loss(graph, loss)
    names = list(wrt) if wrt is not None else [r.name for r in graph.relations if r.kind == "param" and _floats(r)]
    for name in names:
        rel = _relation(graph, name)
        if not _floats(rel):
            raise EdlError(
                f"'{name}' holds integers ({rel.dtype}): it has no gradient",
                help="ask for the gradients of float params and inputs (wrt=...)",
            )
    if not names:
        raise EdlError("the program has no float param to differentiate by", help="name the inputs with wrt=...")
    return _Backward(graph, loss, names).graph()


def grad_name(graph: Graph, relation: str) -> str:
    """The name of ``relation``'s gradient: ``grad_<relation>``, made unique in ``graph``."""
    return fresh_name(graph, f"{PREFIX}{relation}")


def fresh_name(graph: Graph, base: str) -> str:
    """``base``, or ``base_1``, ``base_2``...: the first that no relation of ``graph`` has."""
    taken = {r.name for r in graph.relations}
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


def _floats(rel: Relation) -> bool:
    return dtypes.kind(rel.dtype) == "float"


def _relation(graph: Graph, name: str) -> Relation:
    try:
        return graph.relation(name)
    except KeyError:
        known = ", ".join(r.name for r in graph.relations)
        raise EdlError(f"the program has no relation '{name}'", help=f"relations: {known}") from None


def _check_loss(graph: Graph, loss: str) -> None:
    rel = _relation(graph, loss)
    if any(n != 1 for n in rel.shape):
        raise GradError(
            f"the loss must be a scalar, but '{loss}' is {rel.name}[{', '.join(rel.symbols)}] "
            f"({' x '.join(str(n) for n in rel.shape)} cells)",
            rel.origin,
            help=f"sum or average it into one cell: loss[] += {loss}[...] / N",
        )
    if not _floats(rel):
        raise EdlError(f"the loss '{loss}' holds integers ({rel.dtype}): it has no gradient")


class _Backward:
    """Builds the gradient rules of one graph, its rules taken in reverse order."""

    def __init__(self, graph: Graph, loss: str, wrt: list[str]) -> None:
        self.fwd, self.loss, self.wrt = graph, loss, wrt
        self.relations: dict[str, Relation] = {r.name: r for r in graph.relations}
        self.nodes: list[JoinAgg] = []
        self.grad: dict[str, str] = {}  # relation -> its gradient relation
        self.pending: dict[str, list[JoinAgg]] = {}  # gradient relation -> its rules so far
        # A softmax's maximum only shifts the scores: p / l does not depend on it, so its
        # gradient is exactly 0 (the terms through p and through l cancel) and is not sent; so
        # is a log-sum-exp's (a cross-entropy's log(s) + mx: edatalog.ir.logsumexp).
        chains = attention_chains(graph)
        self.shift_only = {graph.node(chain.maxima).out for chain in chains} | shift_only_maxima(graph)
        self.sums_of = {chain.out: graph.node(chain.sums).out for chain in chains}  # out's rule -> l
        self.chain_of = {chain.out: chain for chain in chains}  # out's rule -> its chain
        self.active = self._active() - self.shift_only

    def _active(self) -> set[str]:
        """Relations a gradient must reach: those that depend on a relation of ``wrt`` and that
        the loss depends on."""
        down = set(self.wrt)
        for n in self.fwd.nodes:
            if any(a.relation in down for a in n.inputs) and _floats(self.fwd.relation(n.out)):
                down.add(n.out)
        up = {self.loss}
        for n in reversed(self.fwd.nodes):
            if n.out in up:
                up.update(a.relation for a in n.inputs)
        return down & up

    def graph(self) -> Graph:
        if self.loss not in self.active:
            raise EdlError(
                f"the loss '{self.loss}' does not depend on {', '.join(self.wrt)}: every gradient would be zero",
                help="ask for the gradients of relations the loss reads (wrt=...)",
            )
        seed = self._gradient_of(self.loss)
        loss = self.fwd.relation(self.loss)
        heads = [Index(f"i{k}", 1, "1") for k in range(loss.rank)]
        self._add(
            seed,
            JoinAgg(
                name=seed,
                out=seed,
                indices=tuple(heads),
                inputs=(),
                expr=_const_expr(1.0),
                aggop="+=",
                out_axes=tuple(AxisMap((Part.of_index(i.name, 1),)) for i in heads),
                guard=Guard.true(),
                dtype=loss.dtype,
                origin=loss.origin,
            ),
        )
        for node in reversed(self.fwd.nodes):
            if node.out in self.active and node.out in self.grad:
                chain = self.chain_of.get(node.name)
                if chain is None or not self._attention_backward(chain):
                    self._backward(node)
        outputs = [self.loss]
        for name in self.wrt:
            grad = self.grad.get(name)
            if grad is None or (grad in self.pending and not self.pending[grad]):
                self._zero(name)  # the loss does not read it: its gradient is 0
            self._finish(self.grad[name])
            outputs.append(self.grad[name])
        for name in list(self.pending):
            self._finish(name)
        graph = dataclasses.replace(
            self.fwd,
            relations=tuple(self.relations.values()),
            nodes=(*self.fwd.nodes, *self.nodes),
            outputs=tuple(outputs),
        )
        graph.verify()
        return graph

    # -- gradient relations ---------------------------------------------------------------------------

    def _gradient_of(self, relation: str) -> str:
        if relation not in self.grad:
            name = grad_name(self._as_graph(), relation)
            self.grad[relation] = name
            self.pending[name] = []
            rel = self.fwd.relation(relation)
            # Declared now (its rules follow); its support is set once they are all made.
            self.relations[name] = Relation(
                name,
                "derived",
                rel.shape,
                rel.symbols,
                rel.dtype,
                rel.axis_names,
                Guard.true(),
                False,
                "+=",
                rel.origin,
            )
        return self.grad[relation]

    def _as_graph(self) -> Graph:
        return dataclasses.replace(self.fwd, relations=tuple(self.relations.values()))

    def _add(self, relation: str, node: JoinAgg) -> None:
        self.pending[relation].append(node)

    def _finish(self, relation: str) -> None:
        """Every rule of a gradient relation is made: fix its support and emit the rules."""
        nodes = self.pending.pop(relation, None)
        if nodes is None:
            return
        rel = self.relations[relation]
        support, exact = Guard.false(), True
        for node in nodes:
            piece, ok = head_support(node, rel.axis_names)
            reads = all(self.relations[a.relation].support_exact for a in node.inputs)
            support, exact = support | piece, exact and ok and reads
        self.relations[relation] = dataclasses.replace(
            rel, support=support.simplify(dict(zip(rel.axis_names, rel.shape, strict=True))), support_exact=exact
        )
        self.nodes.extend(nodes)

    def _zero(self, name: str) -> None:
        grad = self._gradient_of(name)
        rel = self.fwd.relation(name)
        idx = [Index(f"i{k}", n, s) for k, (n, s) in enumerate(zip(rel.shape, rel.symbols, strict=True))]
        self._add(
            grad,
            JoinAgg(
                name=f"{grad}#zero",
                out=grad,
                indices=tuple(idx),
                inputs=(),
                expr=_const_expr(0.0),
                aggop="+=",
                out_axes=tuple(AxisMap((Part.of_index(i.name, i.extent),)) for i in idx),
                guard=Guard.true(),
                dtype=rel.dtype,
                origin=rel.origin,
            ),
        )

    # -- one forward rule -------------------------------------------------------------------------------

    def _backward(self, node: JoinAgg) -> None:
        grad_out = self.grad[node.out]
        self._finish(grad_out)  # every reader of node.out is behind: its gradient is complete
        if node.aggop == "*=":
            raise GradError(
                f"rule '{node.name}' multiplies into its head (*=): products are not differentiated",
                node.origin,
                help="take logs and sum them (exp of += log(...)), or write the product out",
            )
        targets: dict[Access, list[int]] = {}
        for k, acc in enumerate(node.inputs):
            if acc.relation in self.active and _floats(self.fwd.relation(acc.relation)):
                if any(lk.input == k for lk in node.lookups):
                    continue
                targets.setdefault(acc, []).append(k)
        if not targets:
            return
        count = self._winners(node) if node.agg in ("max", "min") else None
        for acc, loads in targets.items():
            if acc.relation == self.sums_of.get(node.name) and self._softmax_sums(node, acc, grad_out):
                continue
            self._rule(node, acc, loads, grad_out, count)

    def _attention_backward(self, chain: Chain) -> bool:
        """The gradient of a whole attention chain, as flash attention's backward computes it:
        the rows' log-sum-exp kept from the forward (``lse = mx + log(l)``, read by the chain's
        fused kernel as flash attention's forward returns it), the scores and the normalized
        probabilities made again from q and k (``bwd_<name>``: the forward's are read by its
        own chain only, so a runtime may run the forward as one fused kernel and keep none of
        them), then

            grad_l[s]     += -(grad_o[s, f] * o[s, f])
            grad_p[s, t]  += grad_o[s, f] * v[t, f]                      where g(s, t)
            grad_sc[s, t] += p'[s, t] * (grad_p[s, t] + grad_l[s])       where g(s, t)

        and the gradients of q, k (through the scores) and v (``+= grad_o * p'``, through the
        output) as any rule's.  ``grad_p`` is one contraction: the rows' share is added where it
        is used, never broadcast over the keys and combined.  False (the rule-by-rule gradient
        then) where the output's guard has no exact shadow on its cells."""
        fwd = self.fwd
        o = fwd.node(chain.out)
        grad_o = self.grad[o.out]
        self._finish(grad_o)
        shadow, exact = o.guard.project(list(o.out_indices), o.box)
        if not exact:
            return False
        sc, _, p, sums = (fwd.node(n) for n in chain.inner)
        p_sc, p_mx = exp_of_difference(p) or (0, 1)
        lse = self._log_sum_exp(p, p.inputs[p_mx], sums)
        # The scores made again, and the probabilities normalized by the log-sum-exp.
        sc_again, p_again = self._copy_relation(sc.out), self._copy_relation(p.out)
        sc2 = dataclasses.replace(sc, name=sc_again, out=sc_again)
        reads = list(p.inputs)
        reads[p_sc] = dataclasses.replace(reads[p_sc], relation=sc_again)
        reads[p_mx] = dataclasses.replace(reads[p_mx], relation=lse)
        p2 = dataclasses.replace(p, name=p_again, out=p_again, inputs=tuple(reads))
        self.nodes += [sc2, p2]
        # The output over the normalized probabilities: o += p' * v (the sums divided out).
        p_pos = next(k for k, a in enumerate(o.inputs) if a.relation == p.out)
        l_pos = next(k for k, a in enumerate(o.inputs) if a.relation == sums.out)
        bld = Builder()
        o2 = dataclasses.replace(
            o,
            inputs=(Access(p2.out, o.inputs[p_pos].axes), o.inputs[chain.v]),
            expr=bld.build(bld.mul(bld.node(Load(0)), bld.node(Load(1)))),
        )
        # grad_l and grad_p through the output (named after the forward's l and p), grad_v.
        grad_l = self._gradient_named(lse, sums.out)
        bld = Builder()
        rule = JoinAgg(
            name=f"{grad_l}#{o.name}",
            out=grad_l,
            indices=tuple(i for i in o.indices if i.name not in o.agg_indices),
            inputs=(Access(grad_o, o.out_axes), Access(o.out, o.out_axes)),
            expr=bld.build(bld.neg(bld.mul(bld.node(Load(0)), bld.node(Load(1))))),
            aggop="+=",
            out_axes=o.inputs[l_pos].axes,
            guard=shadow,
            dtype=self.relations[grad_l].dtype,  # the log-sum-exp's
            origin=o.origin,
        )
        self._add(grad_l, self._guarded(rule))
        grad_p = self._gradient_named(p2.out, p.out)
        self._rule(o2, o2.inputs[0], [0], grad_o, None)
        self._rule_for(o2, 1, grad_o)
        self._finish(grad_l)
        self._finish(grad_p)
        # grad_sc = p' * (grad_p + grad_l), over the probabilities' cells.
        grad_sc = self._gradient_named(sc2.out, sc.out)
        bld = Builder()
        total = bld.add(bld.node(Load(1)), bld.node(Load(2)))
        rule = JoinAgg(
            name=f"{grad_sc}#{p.name}",
            out=grad_sc,
            indices=p.indices,
            inputs=(Access(p2.out, p.out_axes), Access(grad_p, p.out_axes), Access(grad_l, p.inputs[p_mx].axes)),
            expr=bld.build(bld.mul(bld.node(Load(0)), total)),
            aggop="+=",
            out_axes=p.out_axes,
            guard=p.guard,
            dtype=fwd.relation(sc.out).dtype,
            origin=p.origin,
        )
        self._add(grad_sc, self._guarded(rule))
        self._finish(grad_sc)
        for position in dict.fromkeys((chain.q, chain.k)):
            self._rule_for(sc2, position, grad_sc)
        return True

    def _log_sum_exp(self, p: JoinAgg, mx_in_p: Access, sums: JoinAgg) -> str:
        """The rows' log-sum-exp, ``lse = mx + log(l)``, as a rule over the probabilities' rows
        (named as ``p`` reads ``mx``; ``l`` has the same cells, :mod:`edatalog.ir.attention`), in
        f32 at least: a half-float lse would scale every row of the backward's probabilities by
        its rounding, where a max and a sum rounded alike cancel."""
        mx = self.fwd.relation(mx_in_p.relation)
        name = fresh_name(self._as_graph(), f"lse_{sums.out}")
        dtype = dtypes.compute_dtype(mx.dtype)
        self.relations[name] = dataclasses.replace(mx, name=name, kind="derived", sources=(), dtype=dtype, aggop="=")
        bld = Builder()
        expr = bld.build(bld.add(bld.node(Load(0)), bld.op("log", bld.node(Load(1)))))
        row = {v for ax in mx_in_p.axes for v in ax.indices}
        self.nodes.append(
            JoinAgg(
                name=name,
                out=name,
                indices=tuple(i for i in p.indices if i.name in row),
                inputs=(mx_in_p, Access(sums.out, mx_in_p.axes)),
                expr=expr,
                aggop="=",
                out_axes=mx_in_p.axes,
                guard=Guard.true(),
                dtype=dtype,
                origin=sums.origin,
            )
        )
        return name

    def _copy_relation(self, relation: str) -> str:
        """A derived relation of ``relation``'s shape, cells and dtype, under a fresh name."""
        name = fresh_name(self._as_graph(), f"bwd_{relation}")
        self.relations[name] = dataclasses.replace(self.fwd.relation(relation), name=name, kind="derived", sources=())
        return name

    def _gradient_named(self, relation: str, like: str) -> str:
        """The gradient relation of ``relation`` (a copy made for the backward), named after
        the forward's ``like``."""
        name = grad_name(self._as_graph(), like)
        self.grad[relation] = name
        self.pending[name] = []
        rel = self.relations[relation]
        self.relations[name] = Relation(
            name, "derived", rel.shape, rel.symbols, rel.dtype, rel.axis_names, Guard.true(), False, "+=", rel.origin
        )
        return name

    def _rule_for(self, node: JoinAgg, position: int, grad_out: str) -> None:
        """The rule sending ``grad_out`` back to ``node``'s input at ``position`` (with every
        load of the same access), when the loss needs that input's gradient."""
        acc = node.inputs[position]
        if acc.relation not in self.active or not _floats(self.fwd.relation(acc.relation)):
            return
        loads = [k for k, a in enumerate(node.inputs) if a == acc]
        self._rule(node, acc, loads, grad_out, None)

    def _softmax_sums(self, node: JoinAgg, acc: Access, grad_out: str) -> bool:
        """The gradient of an attention's sums ``l`` through its output ``o += p * v / l``,
        written with ``o`` itself: ``grad_l[s] += -grad_o[s, f] * o[s, f] / l[s]`` (summing
        ``p * v`` over the keys again is what ``o`` already did), at ``o``'s cells instead of its
        points, under the shadow of ``o``'s guard on its cells.  False (the general rule then)
        where that shadow is not exact."""
        shadow, exact = node.guard.project(list(node.out_indices), node.box)
        if not exact:
            return False
        bld = Builder()
        value = bld.div(bld.mul(bld.node(Load(0)), bld.node(Load(1))), bld.node(Load(2)))
        rule = JoinAgg(
            name=f"{self._gradient_of(acc.relation)}#{node.name}",
            out=self._gradient_of(acc.relation),
            indices=tuple(i for i in node.indices if i.name not in node.agg_indices),
            inputs=(Access(grad_out, node.out_axes), Access(node.out, node.out_axes), acc),
            expr=bld.build(bld.neg(value)),
            aggop="+=",
            out_axes=acc.axes,
            guard=shadow,
            dtype=self.fwd.relation(acc.relation).dtype,
            origin=node.origin,
        )
        self._add(rule.out, self._guarded(_unique_name(rule, self.pending[rule.out])))
        return True

    def _winners(self, node: JoinAgg) -> str:
        """A relation counting, per cell of ``node.out``, the points that reach its value (the
        gradient of a maximum is split between them).  One rule per producer of the cell."""
        name = grad_name(self._as_graph(), f"{node.out}_winners")
        if name in self.pending:
            return name
        out = self.fwd.relation(node.out)
        self.pending[name] = []
        self.relations[name] = Relation(
            name, "derived", out.shape, out.symbols, out.dtype, out.axis_names, Guard.true(), False, "+=", out.origin
        )
        for producer in self.fwd.producers(node.out):
            bld = Builder()
            n_in = len(producer.inputs)
            new = copy_into(bld, producer.expr, _loader(bld))
            at_max = bld.op("eq", new[producer.expr.root], bld.node(Load(n_in)))
            expr = bld.build(bld.where(at_max, bld.const(1.0), bld.const(0.0)))
            rule = dataclasses.replace(
                producer,
                name=f"{name}#{producer.name}",
                out=name,
                inputs=(*producer.inputs, Access(node.out, producer.out_axes)),
                expr=expr,
                aggop="+=",
            )
            self.pending[name].append(self._guarded(rule))
        self._finish(name)
        return name

    def _rule(self, node: JoinAgg, acc: Access, loads: list[int], grad_out: str, count: str | None) -> None:
        """The rule sending ``grad_out`` back through the loads ``loads`` of ``acc``."""
        bld = Builder()
        n_in = len(node.inputs)
        new = copy_into(bld, node.expr, _loader(bld))
        extra = [Access(grad_out, node.out_axes)]
        seed = bld.node(Load(n_in))
        if node.aggop == "=" and not node.agg_indices and isinstance(node.expr.nodes[node.expr.root], Op):
            # Each cell of an '=' rule is its body's value at one point: a derivative that needs
            # that value (exp's, rsqrt's, a quotient's) reads the cell instead of recomputing it.
            extra.append(Access(node.out, node.out_axes))
            new[node.expr.root] = bld.node(Load(n_in + 1))
        if count is not None:
            # The winners' share: 1 / count where the point reaches the head's value, else 0.
            extra += [Access(node.out, node.out_axes), Access(count, node.out_axes)]
            at_max = bld.op("eq", new[node.expr.root], bld.node(Load(n_in + 1)))
            share = bld.where(at_max, bld.div(bld.const(1.0), bld.node(Load(n_in + 2))), bld.const(0.0))
            seed = bld.mul(seed, share)
        try:
            partial = vjp(bld, node.expr, new, seed, loads)
        except NotDifferentiable as exc:
            raise GradError(
                f"rule '{node.name}' cannot be differentiated by {acc.relation}: {exc}", node.origin
            ) from None
        root = partial.get(loads[0])
        for k in loads[1:]:
            if k in partial:
                root = partial[k] if root is None else bld.add(root, partial[k])
        if root is None:
            return  # the body does not depend on it (a where's condition)
        grad_in = self._gradient_of(acc.relation)
        inputs: tuple[Access, ...] = (*node.inputs, *extra)
        indices, head, equal = self._head(node, acc)
        guard = node.guard & Guard.of(equal) if equal else node.guard
        expr = bld.build(root)
        # A looked-up index of the input's axes (the table of an embedding) stays looked up, now
        # in the head: a scatter-add, each point adding to the row its id names.
        rule = JoinAgg(
            name=f"{grad_in}#{node.name}" + (f"@{acc.relation}" if acc.relation == node.out else ""),
            out=grad_in,
            indices=indices,
            inputs=inputs,
            expr=expr,
            aggop="+=",
            out_axes=head,
            guard=guard,
            dtype=self.relations[acc.relation].dtype,
            origin=node.origin,
            lookups=node.lookups,
        )
        rule = _unique_name(rule, self.pending[grad_in])
        self._add(grad_in, self._unread_dropped(self._guarded(eliminate_defined(rule))))

    def _unread_dropped(self, node: JoinAgg) -> JoinAgg:
        """``node`` without the inputs its body does not load (a contraction's gradient by one
        factor does not read that factor; the forward's output, kept for derivatives that need
        it, may go unused): a block then neither fetches nor holds them.  An input stays when
        its absent cells are not all known from its support (its guard, already in ``node``'s,
        says where it exists only when exact) or when it alone spans an index."""
        live = node.expr.live()
        loaded = {n.input for k in live if isinstance(n := node.expr.nodes[k], Load)}
        keep = list(range(len(node.inputs)))
        head = {v for ax in node.out_axes for v in ax.indices}
        for k in reversed(range(len(node.inputs))):
            acc = node.inputs[k]
            if k in loaded or any(lk.input == k for lk in node.lookups):
                continue
            if not self.relations[acc.relation].support_exact:
                continue
            spanned = head.union(*(node.inputs[j].indices for j in keep if j != k))
            if set(acc.indices) <= spanned:
                keep.remove(k)
        if len(keep) == len(node.inputs):
            return node
        at = {old: new for new, old in enumerate(keep)}
        bld = Builder()
        copied = copy_into(bld, node.expr, lambda k: bld.node(Load(at[k])))
        return dataclasses.replace(
            node,
            inputs=tuple(node.inputs[k] for k in keep),
            expr=bld.build(copied[node.expr.root]),
            lookups=tuple(dataclasses.replace(lk, input=at[lk.input]) for lk in node.lookups),
        )

    def _head(self, node: JoinAgg, acc: Access) -> tuple[tuple[Index, ...], tuple[AxisMap, ...], list[Constraint]]:
        """The join indices, head and extra equalities of the rule writing ``acc``'s gradient:
        each part of ``acc`` that is not a plain index over its whole axis (``x[t - 1]``,
        ``wpe[s, d]`` with fewer positions than rows) becomes a fresh index equal to it."""
        box = node.box
        indices = list(node.indices)
        taken = {i.name for i in indices}
        used: set[str] = set()
        equal: list[Constraint] = []
        axes = []
        for ax in acc.axes:
            parts = []
            for p in ax.parts:
                plain = p.index is not None and box[p.index] == p.extent and p.index not in used
                if plain:
                    parts.append(p)
                    used.add(str(p.index))
                    continue
                if p.const is not None:
                    parts.append(p)
                    continue
                fresh, k = "t", 0
                while fresh in taken:
                    k += 1
                    fresh = f"t{k}"
                taken.add(fresh)
                indices.append(Index(fresh, p.extent, str(p.extent)))
                equal.append(Constraint(Affine.var(fresh) - p.expr, eq=True))
                parts.append(Part.of_index(fresh, p.extent))
            axes.append(AxisMap(tuple(parts)))
        return tuple(indices), tuple(axes), equal

    def _guarded(self, node: JoinAgg) -> JoinAgg:
        """``node`` with its effective guard: the supports of what it reads (the gradient of the
        head exists where the head does)."""
        return dataclasses.replace(node, guard=effective_guard(node, self.relations))


def _loader(bld: Builder) -> Callable[[int], int]:
    """Input ``k`` of a rule, as a load in ``bld``."""
    return lambda k: bld.node(Load(k))


def _unique_name(node: JoinAgg, others: list[JoinAgg]) -> JoinAgg:
    names = {n.name for n in others}
    name, k = node.name, 1
    while name in names:
        name, k = f"{node.name}.{k}", k + 1
    return dataclasses.replace(node, name=name)


def _const_expr(value: float) -> ScalarExpr:
    bld = Builder()
    return bld.build(bld.const(value))
