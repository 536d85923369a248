"""A training step as one program: the forward, its gradients, clipping and the optimizer's
update, all rules of one graph (so that one plan places all of it).

:func:`training_step` takes a program with a scalar loss and adds, after the gradient rules of
:mod:`edatalog.rules.grad`:

- global gradient-norm clipping (``clip > 0``), as torch's ``clip_grad_norm_``: the squares of
  every gradient summed into one cell, in the gradients' type as torch's norms are, and every
  gradient scaled by ``min(1, clip / (norm + 1e-6))``.  The factor is folded into the rules
  that read a gradient (``(1 - b1) s`` is a scalar): no scaled copy of the gradients is made,
  which would cost a pass over every param;
- the update of every param, as torch's optimizers compute it (single-tensor, not fused; the
  torch runtime runs each param block's AdamW rules as torch's fused kernel, found by what they
  compute: :mod:`edatalog.ir.adamw`):

  - :class:`AdamW`: ``p * (1 - lr * wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``
    with ``m = b1 m + (1 - b1) g`` and ``v = b2 v + (1 - b2) g^2``;
  - :class:`SGD`: ``g + wd * p`` into the momentum buffer ``b = momentum * b + g``, then
    ``p - lr * b`` (torch's first step sets ``b = g``: a zero buffer gives the same).

The optimizer's state (moments, buffers) and the step count ``t`` are inputs of the step, and
its new values outputs, named ``<state>_<param>`` and ``next_<name>``; the graph carries each
next value into its relation for the next call (``Graph.carries``; the runtimes keep them on
the devices).  The step's outputs are the loss, then for each param its next value, then each
state's next value.

**Mixed precision.**  Params of a half type (a program compiled ``--dtype bf16``) get master
weights (``master="f32"``, the default): the param itself becomes f32, as do its gradient, its
optimizer state and its update, and the rules of the program read a half copy of it
(``half_<param>``, rounded once per step), so the forward and backward compute in the half type
as before.  Updates smaller than the half type's resolution then accumulate, as torch's
mixed-precision training (autocast with f32 params) does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from edatalog.errors import EdlError
from edatalog.ir import dtypes
from edatalog.ir.affine import Guard
from edatalog.ir.graph import Access, AxisMap, Graph, Index, JoinAgg, Part, Relation
from edatalog.ir.scalar import Load
from edatalog.rules.derivative import Builder
from edatalog.rules.grad import gradient
from edatalog.rules.recompute import recompute_layers

STEP = "step"  # the scalar input counting steps from 1 (bias corrections read it)
NEXT = "next_"  # the prefix of a param's or a state's next value
CLIP_EPS = 1e-6  # torch's clip_grad_norm_ adds this to the norm


@dataclass(frozen=True)
class AdamW:
    """torch.optim.AdamW's update (defaults as torch's)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    state = ("adam_m", "adam_v")


@dataclass(frozen=True)
class SGD:
    """torch.optim.SGD's update, with momentum and weight decay (no dampening, not Nesterov)."""

    lr: float = 1e-3
    momentum: float = 0.0
    weight_decay: float = 0.0

    @property
    def state(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()


Optimizer = AdamW | SGD


@dataclass(frozen=True)
class StepNames:
    """What a training step reads and writes, by role."""

    loss: str
    params: tuple[str, ...]
    state: tuple[tuple[str, str], ...]  # (state relation, the param it belongs to)
    step: str | None  # the step-count input, when the optimizer reads it

    def next(self, name: str) -> str:
        return f"{NEXT}{name}"


def training_step(
    graph: Graph,
    loss: str,
    optimizer: Optimizer,
    clip: float = 0.0,
    params: Sequence[str] | None = None,
    master: str | None = "f32",
    recompute: bool = False,
) -> tuple[Graph, StepNames]:
    """``graph`` with its gradients (:func:`edatalog.rules.grad.gradient`), clipping and the
    optimizer's update of ``params`` (default: every float param) as more rules; half params
    get ``master`` weights (None: they are updated in their own type); with ``recompute``, the
    backward reads each layer's intermediates made again (:mod:`edatalog.rules.recompute`)."""
    if clip < 0 or not math.isfinite(clip):
        raise EdlError(f"the clipping norm must be 0 (no clipping) or positive, not {clip}")
    if optimizer.lr <= 0:
        raise EdlError(f"the learning rate must be positive, not {optimizer.lr}")
    if params is None:
        params = [r.name for r in graph.relations if r.kind == "param" and dtypes.kind(r.dtype) == "float"]
    params_ = tuple(params)
    if master is not None:
        graph = master_weights(graph, params_, master, loss)
    with_grads = gradient(graph, loss, params_)
    grads = dict(zip(params_, with_grads.outputs[1:], strict=True))  # in the order asked
    if recompute:
        with_grads = recompute_layers(with_grads, len(graph.nodes))
    with_grads = earliest(with_grads, set(grads.values()))
    b = _Rules(with_grads)
    coef: str | None = None  # the clipping factor, folded into the rules that read a gradient
    if clip > 0:
        widest = max((b.relations[g].dtype for g in grads.values()), key=lambda d: dtypes.itemsize(d))
        norm = b.scalar("grad_norm_sq", widest, aggop="+=")  # as torch's norms: in the gradients' type
        for p in params_:
            b.reduce_squares(norm, grads[p])
        coef = b.scalar("clip_coef", "f64")

        def clip_coef(e: Builder, n: int) -> int:
            return e.op("min", e.const(1.0), e.div(e.const(clip), e.add(e.op("sqrt", n), e.const(CLIP_EPS))))

        b.scalar_rule(coef, [norm], clip_coef)
    scales = [coef] if coef is not None else []  # the scalars of a rule reading a gradient

    def clipped(e: Builder, g: int, c: Sequence[int]) -> int:
        return e.mul(g, c[0]) if c else g

    def scaled(e: Builder, k: float, c: Sequence[int]) -> int:
        """``k`` times the clipping factor: a scalar, computed once per block."""
        return e.mul(e.const(k), c[0]) if c else e.const(k)

    state: list[tuple[str, str]] = []
    step: str | None = None
    outputs = [loss]
    if isinstance(optimizer, AdamW):
        step = b.input_scalar(STEP, "f64")
        b1, b2 = optimizer.betas
        lr, eps, wd = optimizer.lr, optimizer.eps, optimizer.weight_decay

        def first_moment(e: Builder, m_: int, g: int, *c: int) -> int:  # b1 m + (1 - b1) s g
            return e.add(e.mul(e.const(b1), m_), e.mul(scaled(e, 1 - b1, c), g))

        def second_moment(e: Builder, v_: int, g: int, *c: int) -> int:  # b2 v + (1 - b2) s^2 g^2
            k = e.mul(scaled(e, 1 - b2, c), c[0]) if c else e.const(1 - b2)
            return e.add(e.mul(e.const(b2), v_), e.mul(k, e.mul(g, g)))

        def update(e: Builder, p_: int, m_: int, v_: int, t: int) -> int:
            # The bias corrections 1 - b^t are scalars of the rule (computed once per block): the
            # update reads the step itself, as torch's fused kernel does.
            c1 = e.sub(e.const(1.0), e.op("pow", e.const(b1), t))
            c2 = e.sub(e.const(1.0), e.op("pow", e.const(b2), t))
            decayed = e.mul(p_, e.const(1 - lr * wd))
            denom = e.add(e.div(e.op("sqrt", v_), e.op("sqrt", c2)), e.const(eps))
            return e.sub(decayed, e.mul(e.div(e.const(lr), c1), e.div(m_, denom)))

        for p in params_:
            m, v = b.input_like(f"adam_m_{p}", p), b.input_like(f"adam_v_{p}", p)
            state += [(m, p), (v, p)]
            m2, v2, p2 = b.like(NEXT + m, p), b.like(NEXT + v, p), b.like(NEXT + p, p)
            b.elementwise(m2, [m, grads[p]], scales, first_moment)
            b.elementwise(v2, [v, grads[p]], scales, second_moment)
            b.elementwise(p2, [p, m2, v2], [step], update)
    else:
        lr, mom, wd = optimizer.lr, optimizer.momentum, optimizer.weight_decay
        for p in params_:
            g, gs = grads[p], scales  # gs: the clipping factor, until a rule has applied it
            if wd:
                decayed = b.like(f"decayed_{p}", p)
                b.elementwise(
                    decayed, [g, p], gs, lambda e, g_, p_, *c: e.add(clipped(e, g_, c), e.mul(e.const(wd), p_))
                )
                g, gs = decayed, []
            if mom:
                buf = b.input_like(f"momentum_{p}", p)
                state.append((buf, p))
                buf2 = b.like(NEXT + buf, p)
                b.elementwise(
                    buf2, [buf, g], gs, lambda e, b_, g_, *c: e.add(e.mul(e.const(mom), b_), clipped(e, g_, c))
                )
                g, gs = buf2, []
            p2 = b.like(NEXT + p, p)
            b.elementwise(p2, [p, g], gs, lambda e, p_, g_, *c: e.sub(p_, e.mul(e.const(lr), clipped(e, g_, c))))
    outputs += [NEXT + p for p in params_] + [NEXT + s for s, _ in state]
    carries = tuple((NEXT + r, r) for r in (*params_, *(s for s, _ in state)))
    out = dataclasses.replace(b.graph(), outputs=tuple(outputs), carries=carries)
    out.verify()
    return out, StepNames(loss, params_, tuple(state), step)


def earliest(graph: Graph, relations: set[str]) -> Graph:
    """``graph`` with the rules writing ``relations`` (the params' gradients) moved to just
    after the rules they read, in order otherwise.  The rules' order is the programs' schedule:
    a layer's weight gradients then follow its activations' gradients, as autograd computes
    them, so each step frees what a layer's backward read as it goes, and the gradients'
    reductions (an all-reduce under data parallelism) start while the backward goes on,
    instead of all of it waiting for the end."""
    order: list[JoinAgg] = [n for n in graph.nodes if n.out not in relations]
    for node in (n for n in graph.nodes if n.out in relations):
        reads = {a.relation for a in node.inputs}
        after = max((k for k, n in enumerate(order) if n.out in reads), default=-1)
        # After the rules already moved there: the producers of one relation keep their order.
        while after + 1 < len(order) and order[after + 1].out in relations:
            after += 1
        order.insert(after + 1, node)
    return dataclasses.replace(graph, nodes=tuple(order))


HALF = ("bf16", "f16")
HALF_PREFIX = "half_"  # a master weight's copy in the half type, which the program's rules read


def master_weights(graph: Graph, params: Sequence[str], master: str = "f32", loss: str | None = None) -> Graph:
    """``graph`` with each half-typed param of ``params`` made ``master`` (f32): a rule
    ``half_<p>[i...] = <p>[i...]`` in the param's own type comes first, and every rule that read
    the param reads that copy instead (their types and results unchanged).  A half ``loss`` is
    summed in ``master`` too (as autocast computes a loss in f32)."""
    if dtypes.kind(master) != "float" or master in HALF:
        raise EdlError(f"master weights must be f32 or f64, not {master}")
    halves = [p for p in params if graph.relation(p).dtype in HALF]
    if not halves:
        return graph
    if loss is not None and graph.relation(loss).dtype in HALF:
        relations = tuple(dataclasses.replace(r, dtype=master) if r.name == loss else r for r in graph.relations)
        summed = tuple(dataclasses.replace(n, dtype=master) if n.out == loss else n for n in graph.nodes)
        graph = dataclasses.replace(graph, relations=relations, nodes=summed)
    renamed = {p: HALF_PREFIX + p for p in halves}
    nodes = [
        dataclasses.replace(
            n, inputs=tuple(dataclasses.replace(a, relation=renamed.get(a.relation, a.relation)) for a in n.inputs)
        )
        for n in graph.nodes
    ]
    b = _Rules(dataclasses.replace(graph, nodes=()))
    for p in halves:
        rel = graph.relation(p)
        b.relations[p] = dataclasses.replace(rel, dtype=master)
        b._new(renamed[p], "derived", rel, rel.dtype, "=")
        b.elementwise(renamed[p], [p], [], lambda e, w: w)
    b.nodes.extend(nodes)
    return b.graph()


class _Rules:
    """Adds relations and elementwise rules over whole relations to a graph."""

    def __init__(self, graph: Graph) -> None:
        self.base = graph
        self.relations = {r.name: r for r in graph.relations}
        self.nodes: list[JoinAgg] = list(graph.nodes)

    def graph(self) -> Graph:
        return dataclasses.replace(self.base, relations=tuple(self.relations.values()), nodes=tuple(self.nodes))

    def _new(self, name: str, kind: str, like: Relation | None, dtype: str, aggop: str | None) -> str:
        if name in self.relations:
            raise EdlError(
                f"the training step needs a relation '{name}', which the program already has",
                help="rename the program's relation",
            )
        shape, symbols, axes = (like.shape, like.symbols, like.axis_names) if like else ((), (), ())
        self.relations[name] = Relation(name, kind, shape, symbols, dtype, axes, Guard.true(), True, aggop)
        return name

    def like(self, name: str, of: str) -> str:
        rel = self.relations[of]
        return self._new(name, "derived", rel, rel.dtype, "=")

    def input_like(self, name: str, of: str) -> str:
        rel = self.relations[of]
        return self._new(name, "input", rel, rel.dtype, None)

    def input_scalar(self, name: str, dtype: str) -> str:
        return self._new(name, "input", None, dtype, None)

    def scalar(self, name: str, dtype: str, aggop: str = "=") -> str:
        return self._new(name, "derived", None, dtype, aggop)

    def scalar_rule(self, out: str, reads: list[str], body: Callable[..., int]) -> None:
        self._rule(out, (), reads, [], body)

    def elementwise(self, out: str, whole: list[str], scalars: list[str], body: Callable[..., int]) -> None:
        """``out[i...] = body(whole[k][i...] ..., scalars[k][] ...)`` over ``out``'s box."""
        self._rule(out, self.relations[out].shape, whole, scalars, body)

    def reduce_squares(self, out: str, of: str) -> None:
        """``out[] += of[i...] ^ 2``: one more rule of a sum over several relations."""
        self._rule(out, self.relations[of].shape, [of], [], lambda e, g: e.mul(g, g), head=False)

    def _rule(
        self,
        out: str,
        shape: tuple[int, ...],
        whole: list[str],
        scalars: list[str],
        body: Callable[..., int],
        head: bool = True,
    ) -> None:
        idx = tuple(Index(f"i{k}", n, str(n)) for k, n in enumerate(shape))
        axes = tuple(AxisMap((Part.of_index(i.name, i.extent),)) for i in idx)
        inputs = tuple(Access(r, axes) for r in whole) + tuple(Access(r, ()) for r in scalars)
        e = Builder()
        root = body(e, *(e.node(Load(k)) for k in range(len(inputs))))
        count = sum(1 for n in self.nodes if n.out == out)
        rel = self.relations[out]
        self.nodes.append(
            JoinAgg(
                name=out if count == 0 else f"{out}#{count + 1}",
                out=out,
                indices=idx,
                inputs=inputs,
                expr=e.build(root),
                aggop=rel.aggop or "=",
                out_axes=axes if head else (),
                guard=Guard.true(),
                dtype=rel.dtype,
            )
        )
