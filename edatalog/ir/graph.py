"""The join-agg graph: what every rule of a program computes, in a form planners can split.

A :class:`JoinAgg` is one rule.  Its *join space* is the box of its :class:`Index` es; each input
is an :class:`Access` that maps the join indices to the axes of a relation (a composite axis such
as ``wq[(h,e),d]`` is a view over the finer indices ``h`` and ``e``, never a copy); a scalar DAG
combines the inputs at every point; the aggregation folds the indices that the head does not keep;
and the *effective guard* says which points exist at all (user guards plus the supports of the
relations read).  Planning later splits the join space into blocks.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from functools import cached_property

from edatalog.ir import affine, dtypes, scalar, serialize
from edatalog.ir.affine import Affine, Constraint, Guard
from edatalog.ir.cost import NodeCost, graph_costs
from edatalog.ir.printer import render_graph
from edatalog.ir.scalar import ScalarExpr

AGG_NAMES = {"=": None, "+=": "sum", "*=": "prod", "max=": "max", "min=": "min"}


class VerifyError(Exception):
    """An IR invariant is broken: a compiler bug, never a user mistake."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise VerifyError(msg)


@dataclass(frozen=True)
class Index:
    """A join index with its extent and the symbolic form of the extent (``S``, ``H*E``)."""

    name: str
    extent: int
    symbol: str

    def __str__(self) -> str:
        return f"{self.name}:{self.symbol}"


def _hash_once(self: object) -> int:
    """The hash of a frozen IR object's compared fields, computed once: runtimes look blocks and
    accesses up many times per call, and hashing the whole tree each time shows."""
    cached = getattr(self, "_hash", None)
    if cached is None:
        assert is_dataclass(self)
        cached = hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare))
        object.__setattr__(self, "_hash", cached)  # frozen: not a field, never compared
    return int(cached)


def _state_without_hash(self: object) -> dict[str, object]:
    # String hashes differ between processes: an unpickled object hashes itself afresh.
    return {k: v for k, v in self.__dict__.items() if k != "_hash"}


def _set_state(self: object, state: dict[str, object]) -> None:
    for k, v in state.items():
        object.__setattr__(self, k, v)


@dataclass(frozen=True)
class Part:
    """One component of an axis: the place ``expr`` along it, in ``0 .. extent - 1``.

    ``expr`` is an affine function of the join indices: a plain index (``s``), a fixed place
    (``0``), or an expression such as ``l + k`` or ``t - 1``.  An index whose extent is the
    part's, or a fixed place, always lands inside the part; otherwise a point where ``expr`` falls
    outside reads a cell that does not exist (a failed join), exactly as if the rule had a guard
    ``0 <= expr <= extent - 1`` (see :meth:`AxisMap.range_guard`).  Heads use only plain indices
    and fixed places."""

    expr: Affine
    extent: int

    @staticmethod
    def of_index(name: str, extent: int) -> Part:
        return Part(Affine.var(name), extent)

    @staticmethod
    def fixed(place: int, extent: int) -> Part:
        return Part(Affine((), place), extent)

    @property
    def index(self) -> str | None:
        """The join index, when the part is a plain index."""
        terms = self.expr.terms
        return terms[0][0] if len(terms) == 1 and terms[0][1] == 1 and self.expr.const == 0 else None

    @property
    def const(self) -> int | None:
        """The place, when the part is fixed."""
        return None if self.expr.terms else self.expr.const

    @cached_property
    def indices(self) -> tuple[str, ...]:
        return tuple(v for v, _ in self.expr.terms)

    def places(self, ranges: Mapping[str, tuple[int, int]]) -> tuple[int, int]:
        """The ``[lo, hi)`` places of the part that its indices reach while each runs over its
        ``[lo, hi)`` range in ``ranges``, within the part.  Exact for plain parts and for sums of
        unit multiples (``l + k``, ``t - 1``); for strides (``2 * l``) the hull of the places, a
        superset.  Empty (``lo == hi``) when every place falls outside."""
        lo = hi = self.expr.const
        for v, c in self.expr.terms:
            a, b = ranges[v]
            lo += min(c * a, c * (b - 1))
            hi += max(c * a, c * (b - 1))
        lo, hi = max(lo, 0), min(hi + 1, self.extent)
        return (lo, hi) if lo < hi else (lo, lo)

    def __str__(self) -> str:
        return str(self.expr)

    def render(self, order: Sequence[str]) -> str:
        return self.expr.render(order)


@dataclass(frozen=True)
class AxisMap:
    """How one axis of a relation is addressed: row-major over its parts (first part major)."""

    parts: tuple[Part, ...]

    @property
    def extent(self) -> int:
        return math.prod(p.extent for p in self.parts)

    @cached_property
    def indices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(v for p in self.parts for v in p.indices))

    def affine(self) -> Affine:
        """The axis coordinate as an affine function of the join indices."""
        out = Affine()
        stride = 1
        for p in reversed(self.parts):
            out = out + p.expr.scale(stride)
            stride *= p.extent
        return out

    def range_guard(self) -> Guard:
        """Where every part lands inside its range (simplify it against the join space's box:
        for a plain index of the part's extent, it is true)."""
        cons = []
        for p in self.parts:
            if p.expr.terms:
                cons += [Constraint(p.expr), Constraint(-p.expr + (p.extent - 1))]
            elif not 0 <= p.expr.const < p.extent:
                return Guard.false()  # a fixed place outside its axis: no point reads it
        return Guard.of(cons)

    def __str__(self) -> str:
        return self.render(())

    def render(self, order: Sequence[str]) -> str:
        inner = ",".join(p.render(order) for p in self.parts)
        return f"({inner})" if len(self.parts) > 1 else inner


@dataclass(frozen=True)
class Access:
    """An input of a join-agg: a relation read through one :class:`AxisMap` per axis."""

    relation: str
    axes: tuple[AxisMap, ...]

    __hash__ = _hash_once
    __getstate__ = _state_without_hash
    __setstate__ = _set_state

    @cached_property
    def indices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(i for ax in self.axes for i in ax.indices))

    def __str__(self) -> str:
        return self.render(())

    def render(self, order: Sequence[str]) -> str:
        """The access with index expressions' terms in ``order``."""
        return f"{self.relation}[{','.join(a.render(order) for a in self.axes)}]"


@dataclass(frozen=True)
class Lookup:
    """A value-to-index join: the join index ``index`` takes, at each point, the integer value
    that input ``input`` (an access of an integer relation, not over ``index``) holds there,
    less ``offset``: ``emb[b,s,d] += tok_emb[v,d] where ids[b,s] = v`` reads the row each token
    id names.  ``extent`` is the index's full range: a value outside ``0 .. extent - 1`` is an
    error when the rule runs, never a silent wrong row.  A block of the rule over part of the
    index's range (a vocabulary-sharded embedding) has the part's start as ``offset``; a value
    outside the part leaves its point absent there, and another block computes it."""

    index: str
    input: int
    extent: int
    offset: int = 0

    def render(self, node: JoinAgg) -> str:
        order = [i.name for i in node.indices]
        text = f"{node.inputs[self.input].render(order)} = {self.index}"
        if self.index in node.out_indices or any(self.index in acc.indices for acc in node.inputs):
            return text
        # No relation gives the index its range: written with it, as the language has it.
        return text + ":" + next(i.symbol for i in node.indices if i.name == self.index)


@dataclass(frozen=True)
class JoinAgg:
    """One rule, compiled.  ``name`` is unique in the graph; ``out`` is the relation written."""

    name: str
    out: str
    indices: tuple[Index, ...]
    inputs: tuple[Access, ...]
    expr: ScalarExpr
    aggop: str
    out_axes: tuple[AxisMap, ...]
    guard: Guard
    dtype: str
    origin: str = field(default="", compare=False)
    lookups: tuple[Lookup, ...] = field(default=(), metadata={serialize.OMIT_EMPTY: True})  # see Lookup

    __hash__ = _hash_once
    __getstate__ = _state_without_hash
    __setstate__ = _set_state

    @property
    def box(self) -> dict[str, int]:
        return {i.name: i.extent for i in self.indices}

    @cached_property
    def anonymous(self) -> JoinAgg:
        """This rule with its own name and the names of the relations it reads and writes
        blanked: the same for every instance of one rule of a repeated module, so that what is
        worked out for a block of one (its presence, its kernel's path, its flash cost) is
        worked out once for all of them."""
        inputs = tuple(replace(a, relation="") for a in self.inputs)
        return replace(self, name="", out="", inputs=inputs, origin="")

    @cached_property
    def looked_up(self) -> frozenset[str]:
        """The indices an input's values give (one value per point of the other indices)."""
        return frozenset(lk.index for lk in self.lookups)

    @cached_property
    def out_indices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(i for ax in self.out_axes for i in ax.indices))

    @cached_property
    def agg_indices(self) -> tuple[str, ...]:
        kept = set(self.out_indices)
        return tuple(i.name for i in self.indices if i.name not in kept)

    @cached_property
    def agg(self) -> str | None:
        """'sum', 'prod', 'max', 'min', or None for ``=``."""
        return AGG_NAMES[self.aggop]

    def head(self) -> str:
        return f"{self.out}[{','.join(str(a) for a in self.out_axes)}]"

    def body(self) -> str:
        order = [i.name for i in self.indices]
        return self.expr.render(lambda k: self.inputs[k].render(order))

    def __str__(self) -> str:
        conds = [lk.render(self) for lk in self.lookups] + ([] if self.guard.is_true else [str(self.guard)])
        where = f" where {', '.join(conds)}" if conds else ""
        return f"{self.head()} {self.aggop} {self.body()}{where}"


@dataclass(frozen=True)
class Relation:
    """A tensor relation.  ``support`` (over ``axis_names``) is where its cells exist."""

    name: str
    kind: str  # "input" | "param" | "derived"
    shape: tuple[int, ...]
    symbols: tuple[str, ...]
    dtype: str
    axis_names: tuple[str, ...]
    support: Guard
    support_exact: bool = True
    aggop: str | None = None  # how several rules for it combine; None for inputs and params
    origin: str = field(default="", compare=False)
    # The checkpoint names a param (or input) is loaded from, the first found (see
    # edatalog.checkpoint); its own name is always one.
    sources: tuple[str, ...] = field(default=(), metadata={serialize.OMIT_EMPTY: True})

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def box(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.shape, strict=True))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)

    def __str__(self) -> str:
        dims = ", ".join(self.symbols)
        sup = "" if self.support.is_true else f"  support {self.support}"
        return f"{self.kind} {self.name}[{dims}] : {self.dtype}{sup}"


@dataclass(frozen=True)
class Repeat:
    """``count`` instances of one module: instance ``k``'s nodes are ``prefix.k.NAME`` for each
    ``NAME`` of ``nodes`` (the module's own, in order), the same rules over relations renamed so,
    instance ``k + 1`` reading instance ``k``'s result.  Planners solve one and reuse it."""

    prefix: str
    module: str
    count: int
    nodes: tuple[str, ...]
    first: str  # what instance 0 reads (the chain's first argument)
    result: str  # the last instance's result

    def node(self, k: int, name: str) -> str:
        return f"{self.prefix}.{k}.{name}"

    def instance(self, k: int) -> tuple[str, ...]:
        return tuple(self.node(k, n) for n in self.nodes)


@dataclass(frozen=True)
class Graph:
    """A compiled program: relations, join-agg nodes in dependency order, and outputs."""

    relations: tuple[Relation, ...]
    nodes: tuple[JoinAgg, ...]
    outputs: tuple[str, ...]
    dims: tuple[tuple[str, int], ...] = ()
    consts: tuple[tuple[str, float], ...] = ()
    source_name: str = field(default="", compare=False)
    # Repeated modules (layers): their nodes and names.
    repeats: tuple[Repeat, ...] = field(default=(), metadata={serialize.OMIT_EMPTY: True})
    # State carried from call to call: (output, relation) pairs, the output being what the
    # relation (an input or param) holds on the next call.  A training step carries each
    # param's and each optimizer state's next value; runtimes keep them where they are made.
    carries: tuple[tuple[str, str], ...] = field(default=(), metadata={serialize.OMIT_EMPTY: True})

    @cached_property
    def _by_name(self) -> dict[str, Relation]:
        return {r.name: r for r in self.relations}

    def relation(self, name: str) -> Relation:
        return self._by_name[name]

    @cached_property
    def _nodes_by_name(self) -> dict[str, JoinAgg]:
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> JoinAgg:
        """The rule ``name`` (KeyError: none such)."""
        return self._nodes_by_name[name]

    @cached_property
    def _producers(self) -> dict[str, tuple[JoinAgg, ...]]:
        out: dict[str, list[JoinAgg]] = {}
        for n in self.nodes:
            out.setdefault(n.out, []).append(n)
        return {k: tuple(v) for k, v in out.items()}

    @property
    def carried(self) -> dict[str, str]:
        """The relations the next call takes from an output, by relation: ``{target: output}``."""
        return {target: out for out, target in self.carries}

    def producers(self, relation: str) -> tuple[JoinAgg, ...]:
        """The nodes (rules) that write ``relation``, in order."""
        return self._producers.get(relation, ())

    @cached_property
    def costs(self) -> dict[str, NodeCost]:
        """FLOPs and bytes of every node, over the points and cells that exist."""
        return graph_costs(self)

    # -- invariants ------------------------------------------------------------------------------

    def verify(self) -> None:
        """Check every structural invariant; raises :class:`VerifyError` on the first broken one."""
        names = [r.name for r in self.relations]
        _check(len(set(names)) == len(names), "duplicate relation names")
        node_names = [n.name for n in self.nodes]
        _check(len(set(node_names)) == len(node_names), "duplicate node names")
        for r in self.relations:
            _check(r.kind in ("input", "param", "derived"), f"{r.name}: bad kind {r.kind}")
            _check(r.dtype in dtypes.DTYPES, f"{r.name}: bad dtype {r.dtype}")
            _check(all(n > 0 for n in r.shape), f"{r.name}: non-positive extent")
            _check(len(r.symbols) == len(r.shape) == len(r.axis_names), f"{r.name}: rank mismatch")
            _check(len(set(r.axis_names)) == len(r.axis_names), f"{r.name}: repeated axis names")
            _check(r.support.vars <= set(r.axis_names), f"{r.name}: support names unknown axes")
            producers = self.producers(r.name)
            if r.kind == "derived":
                _check(bool(producers), f"{r.name}: derived relation without a rule")
                _check(all(p.aggop == r.aggop for p in producers), f"{r.name}: mixed aggops")
            else:
                _check(not producers, f"{r.name}: {r.kind} written by a rule")
        done = {r.name for r in self.relations if r.kind != "derived"}
        pending = {r.name: len(self.producers(r.name)) for r in self.relations if r.kind == "derived"}
        for n in self.nodes:
            self._verify_node(n, done)
            pending[n.out] -= 1
            if pending[n.out] == 0:
                done.add(n.out)
        for o in self.outputs:
            _check(o in self._by_name, f"output {o} is not a relation")
        targets = [t for _, t in self.carries]
        _check(len(set(targets)) == len(targets), "a relation carried into twice")
        for out, target in self.carries:
            _check(out in self.outputs, f"carried {out} is not an output")
            _check(target in self._by_name and self.relation(target).kind != "derived", f"carried into {target}")
            if out in self._by_name and target in self._by_name:
                a, b = self.relation(out), self.relation(target)
                _check(a.shape == b.shape and a.dtype == b.dtype, f"{out} carried into {target}: shape or dtype")
        every = set(node_names)
        for rep in self.repeats:
            _check(rep.count >= 1, f"repeat {rep.prefix}: count {rep.count}")
            for k in range(rep.count):
                _check(set(rep.instance(k)) <= every, f"repeat {rep.prefix}: instance {k} lacks nodes")

    def _verify_node(self, n: JoinAgg, done: set[str]) -> None:
        where = f"node {n.name}"
        box = n.box
        _check(len(box) == len(n.indices), f"{where}: repeated index")
        _check(all(i.extent > 0 for i in n.indices), f"{where}: non-positive index extent")
        _check(n.aggop in AGG_NAMES, f"{where}: bad aggop {n.aggop}")
        _check(n.out in self._by_name, f"{where}: writes unknown relation {n.out}")
        out = self.relation(n.out)
        _check(out.kind == "derived", f"{where}: writes {out.kind} {out.name}")
        _check(n.dtype == out.dtype, f"{where}: dtype {n.dtype} but {out.name} is {out.dtype}")
        # A looked-up index uses its place even where no relation reads it: ``where route[t, k] =
        # e:X`` then keeps the points whose value falls in the block's part (a filter).
        used: set[str] = set(n.expr.index_values()) | n.guard.vars | {lk.index for lk in n.lookups}
        for acc in (*n.inputs, Access(n.out, n.out_axes)):
            _check(acc.relation in self._by_name, f"{where}: unknown relation {acc.relation}")
            rel = self.relation(acc.relation)
            _check(len(acc.axes) == rel.rank, f"{where}: {acc} has {len(acc.axes)} axes, {rel.name} has {rel.rank}")
            for k, ax in enumerate(acc.axes):
                _check(ax.extent == rel.shape[k], f"{where}: axis {k} of {acc} spans {ax.extent}, not {rel.shape[k]}")
                for p in ax.parts:
                    _check(p.extent > 0, f"{where}: part {p} of {acc} has a non-positive extent")
                    _check(set(p.indices) <= set(box), f"{where}: unknown index in {p}")
                    if acc.relation != n.out:
                        pass  # any affine place: where it falls outside, the read is absent
                    elif p.const is not None:
                        _check(0 <= p.const < p.extent, f"{where}: bad constant part")
                    else:  # heads address cells with plain indices
                        index = p.index
                        _check(index is not None, f"{where}: the head {acc} has an index expression")
                        _check(box[str(index)] == p.extent, f"{where}: {index} used with extent {p.extent}")
                    used.update(p.indices)
        for acc in n.inputs:
            _check(acc.relation in done, f"{where}: reads {acc.relation} before it is complete")
        _check(set(box) <= used, f"{where}: unused index {set(box) - used}")
        _check(n.guard.vars <= set(box), f"{where}: guard names unknown indices")
        if n.aggop == "=":
            _check(not n.agg_indices, f"{where}: '=' with aggregated indices {n.agg_indices}")
        for lk in n.lookups:
            _check(lk.index in box, f"{where}: lookup of unknown index {lk.index}")
            scatter = lk.index in n.out_indices  # each point adds to the cell its value names
            _check(not scatter or n.aggop == "+=", f"{where}: looked-up {lk.index} in the head of a {n.aggop} rule")
            _check(0 <= lk.input < len(n.inputs), f"{where}: lookup reads input {lk.input}")
            acc = n.inputs[lk.input]
            _check(dtypes.kind(self.relation(acc.relation).dtype) == "int", f"{where}: lookup of a non-integer {acc}")
            _check(lk.index not in acc.indices, f"{where}: {acc} looks up {lk.index} by itself")
            _check(lk.index not in n.guard.vars, f"{where}: the guard names looked-up index {lk.index}")
            _check(lk.offset >= 0 and box[lk.index] + lk.offset <= lk.extent, f"{where}: lookup range")
            for other in n.inputs:
                for ax in other.axes:
                    for p in ax.parts:
                        plain = p.index == lk.index or lk.index not in p.indices
                        _check(plain, f"{where}: looked-up index {lk.index} in the expression {p}")
        _check(len({lk.index for lk in n.lookups}) == len(n.lookups), f"{where}: an index looked up twice")
        n.expr.verify(len(n.inputs), list(box))

    # -- text -------------------------------------------------------------------------------------

    def __str__(self) -> str:
        return render_graph(self)

    # -- JSON -------------------------------------------------------------------------------------

    def to_json(self) -> str:
        return serialize.dumps(self)

    @staticmethod
    def from_json(text: str) -> Graph:
        """The graph written by :meth:`to_json`, verified; ValueError for anything else."""
        try:
            graph = serialize.loads(text, IR_CLASSES)
        except TypeError as exc:  # a field the class does not have, or one missing
            raise ValueError(f"malformed IR: {exc}") from None
        if not isinstance(graph, Graph):
            raise ValueError("JSON does not hold a join-agg graph")
        try:
            graph.verify()
        except VerifyError as exc:
            raise ValueError(f"the graph in this JSON is inconsistent: {exc}") from None
        return graph

    def fingerprint(self) -> str:
        """A hash of what the graph computes (source locations excluded)."""
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:
        # Once per graph: plans and programs name their graph by it, and the planner checks
        # dozens of plans of one graph.
        blob = json.dumps(serialize.encode(self, with_origins=False), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# Every class a graph is made of: what ``Graph.from_json`` may build, and nothing else.
IR_CLASSES: tuple[type, ...] = (
    affine.Affine,
    affine.Constraint,
    affine.Conj,
    affine.Guard,
    scalar.ScalarExpr,
    scalar.Load,
    scalar.Const,
    scalar.IndexValue,
    scalar.Op,
    Index,
    Part,
    AxisMap,
    Access,
    Lookup,
    JoinAgg,
    Relation,
    Repeat,
    Graph,
)
