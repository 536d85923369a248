"""Fusing the softmax-attention chain into one kernel.

:func:`~edatalog.ir.attention.attention_chains` finds the chains of a graph (five rules that mean
exactly what ``scaled_dot_product_attention`` computes).  :func:`fuse_programs` replaces, on each
device, the five kernels of one block (each reading the previous ones' buffers whole, on that
device: no key index split across devices, no exchange in between) by one
:class:`~edatalog.ir.program.Fused` op.  The torch runtime runs it as one
``scaled_dot_product_attention`` call (flash attention where torch has it); every other runtime
runs the five kernels in order, which is exactly the rules.  The guard ``g(s, t)`` (causal or any
other) becomes the attention mask; a block whose guard leaves a query without keys is not fused
(softmax over nothing is absent in the rules, NaN in the kernel).

A training step's chain has a sixth rule, the rows' log-sum-exp (``lse = mx + log(l)``, read
by the backward): its kernel joins the block's fused op, which exports it beside ``o``, as flash
attention's forward returns it.

The backward of a chain (:mod:`edatalog.ir.attention_backward`: the scores and the normalized
probabilities made again from the kept log-sum-exp, the gradients of the rows, probabilities and
scores, and those of q, k and v) is fused the same way, one block per device into one op of kind
:data:`KIND_BACKWARD` that exports the gradients of k and v beside its own of q.  Torch on a CPU
runs it as flash attention's backward alone, from ``o`` and ``lse`` (the scores are made again
inside, never kept); elsewhere as torch's attention forward and backward; other runtimes run its
kernels.  A block is fused when each of its rules has one kernel on the device, each
intermediate is read whole by the block alone (no key index or feature split off), and nothing
reads the gradients before the fused op, which stands at the first of its kernels that comes
after everything it reads.

AdamW's update of a param (:mod:`edatalog.ir.adamw`: the rules of ``m'``, ``v'`` and ``p'``) is
fused too, one block per device into one op of kind :data:`KIND_ADAMW` that exports ``m'`` and
``v'`` beside ``p'``.  Torch runs it as one pass of its fused AdamW kernel over the block (the
rules make a pass per operator); other runtimes run the three kernels.  A block is fused when
the kernels of ``m'`` and ``v'`` have ``p'``'s region, ``p'``'s kernel reads them whole, and
nothing reads them before ``p'``'s kernel, where the fused op stands.
"""

from __future__ import annotations

import functools
import math

from edatalog.backend.kernels.joinagg import prepare
from edatalog.ir import program as ir
from edatalog.ir.adamw import AdamWUpdate, adamw_updates
from edatalog.ir.attention import Chain, attention_chains, exp_of_difference
from edatalog.ir.attention_backward import Backward, attention_backwards
from edatalog.ir.graph import Graph, JoinAgg
from edatalog.ir.regions import Region
from edatalog.ir.rewrite import restrict

KIND = "attention"
KIND_BACKWARD = "attention backward"
KIND_ADAMW = "adamw"


# -- programs --------------------------------------------------------------------------------------


def fuse_programs(programs: ir.Programs, graph: Graph) -> ir.Programs:
    """The programs with each device's attention blocks and AdamW updates (see the module
    docstring) fused."""
    chains = attention_chains(graph)
    updates = adamw_updates(graph)
    if not chains and not updates:
        return programs
    backwards = attention_backwards(graph) if chains else []
    devices = tuple(_fuse_device(p, graph, chains, backwards, updates) for p in programs.devices)
    return ir.Programs(programs.graph, programs.relations, devices, programs.outputs)


def _fuse_device(
    program: ir.DeviceProgram,
    graph: Graph,
    chains: list[Chain],
    backwards: list[Backward],
    updates: list[AdamWUpdate],
) -> ir.DeviceProgram:
    ops = list(program.ops)
    made = {op.buf: k for k, op in enumerate(ops) if isinstance(op, ir.DEFINES)}
    readers: dict[int, list[int]] = {}
    for k, op in enumerate(ops):
        for b in ir.reads(op):
            if not isinstance(op, ir.Free):
                readers.setdefault(b, []).append(k)
    replace: dict[int, ir.Op] = {}
    drop: set[int] = set()
    outs: dict[str, list[int]] = {}  # rule -> positions of its kernels (a whole model has many chains)
    for k, op in enumerate(ops):
        if isinstance(op, ir.Kernel):
            outs.setdefault(op.node, []).append(k)
    for chain in chains:
        for k in outs.get(chain.out, ()):
            op = ops[k]
            if k not in drop:
                group = _group(graph, ops, k, chain, made, readers)
                if group is not None and _has_keys(graph, ops, group, chain):
                    # The output's kernel last (the fused op's buffer), the log-sum-exp exported.
                    inner = tuple(x for j in group if j != k and isinstance(x := ops[j], ir.Kernel | ir.Combine))
                    assert isinstance(op, ir.Kernel)
                    exports = tuple(x.buf for x in inner if isinstance(x, ir.Kernel) and x.node == chain.lse)
                    fused = ir.Fused(op.buf, KIND, (*inner, op), op.relation, op.region, op.dtype, op.full, exports)
                    replace[k] = fused
                    drop.update(j for j in group if j != k)
    for backward in backwards:
        for k in outs.get(backward.results[0], ()):
            found = _backward_group(graph, ops, k, backward, made, readers)
            if found is not None and not drop.intersection(found[0]):
                group, host = found
                inner = tuple(op for j in group if isinstance(op := ops[j], ir.Kernel))
                last = inner[-1]
                results = [op.buf for op in inner if isinstance(op, ir.Kernel) and op.node in backward.results]
                exports = tuple(b for b in results if b != last.buf)
                replace[host] = ir.Fused(
                    last.buf, KIND_BACKWARD, inner, last.relation, last.region, last.dtype, last.full, exports
                )
                drop.update(j for j in group if j != host)
    for update in updates:
        for k in outs.get(update.update, ()):
            moments = _adamw_group(ops, k, update, made, readers)
            if moments is not None and not drop.intersection(moments):
                kernels = [ops[j] for j in (*moments, k)]
                trio = tuple(op for op in kernels if isinstance(op, ir.Kernel))
                assert len(trio) == 3
                last = trio[-1]
                exports = tuple(op.buf for op in trio[:2])
                # The param's and moments' blocks, and the gradient's made in this call (not
                # loaded), where nothing reads them after the update.
                overwrites = tuple(
                    dict.fromkeys(
                        b
                        for role in ("p", "m", "v", "g")
                        for b in _read_of(trio, update, role)
                        if all(r <= k for r in readers.get(b, ()))
                        and (role != "g" or not isinstance(ops[made[b]] if b in made else None, ir.Load | None))
                    )
                )
                replace[k] = ir.Fused(
                    last.buf, KIND_ADAMW, trio, last.relation, last.region, last.dtype, last.full, exports, overwrites
                )
                drop.update(moments)
    if not replace:
        return program
    freed = {op.buf for op in ops if isinstance(op, ir.Free)}
    body = [replace.get(k, op) for k, op in enumerate(ops) if k not in drop and not isinstance(op, ir.Free)]
    return ir.DeviceProgram(program.device, tuple(ir.with_frees(body, freed)))


def _group(
    graph: Graph, ops: list[ir.Op], k_out: int, chain: Chain, made: dict[int, int], readers: dict[int, list[int]]
) -> list[int] | None:
    """The positions of the kernels of one attention block ending at ``o``'s kernel at
    ``k_out``: one scores kernel covering exactly the block's queries and keys, then any number
    of kernels of the maxima, probabilities and sums (blocks the plan cut them into), every
    intermediate made by these kernels on this device and read by nothing else."""
    o = ops[k_out]
    assert isinstance(o, ir.Kernel)
    p_pos, l_pos = _input_positions(o, ops, made, chain)
    if p_pos is None or l_pos is None:
        return None
    p_sc, p_mx = exp_of_difference(graph.node(chain.probs)) or (0, 1)
    wanted = {  # per rule of the chain: which of its inputs are intermediates, made by which rule
        chain.out: ((p_pos, chain.probs), (l_pos, chain.sums)),
        chain.sums: ((0, chain.probs),),
        chain.probs: ((p_sc, chain.scores), (p_mx, chain.maxima)),
        chain.maxima: ((0, chain.scores),),
        chain.scores: (),
    }
    group, todo = {k_out}, [k_out]

    def take(buf: int, node: str) -> bool:
        """Whether ``buf`` is made on this device by a kernel of ``node``, or by combining
        partials that such kernels made; those ops join the group."""
        j = made.get(buf)
        maker = None if j is None else ops[j]
        if isinstance(maker, ir.Combine):
            if not all(take(b, node) for b in maker.sources):
                return False
        elif not isinstance(maker, ir.Kernel) or maker.node != node:
            return False  # received, or made otherwise
        assert j is not None
        if j not in group:
            group.add(j)
            if isinstance(maker, ir.Kernel):
                todo.append(j)
        return True

    while todo:
        kernel = ops[todo.pop()]
        assert isinstance(kernel, ir.Kernel)
        for position, node in wanted[kernel.node]:
            if not all(take(buf, node) for buf, _ in kernel.reads[position]):
                return None
    scores = [j for j in group if isinstance(op := ops[j], ir.Kernel) and op.node == chain.scores]
    if len(scores) != 1:
        return None
    sc = ops[scores[0]]
    assert isinstance(sc, ir.Kernel)
    # The scores block is exactly what the out block reads of the probabilities: same queries,
    # same keys (the chain's accesses line up, so the regions compare directly).
    if Region.through(graph.node(o.node).inputs[p_pos].axes, o.range_map) != sc.region:
        return None
    lse = None if chain.lse is None else _lse_kernel(graph, ops, k_out, l_pos, group, chain.lse, readers)
    if chain.lse is not None and lse is None:
        return None
    inside = {op.buf for j in group if j != k_out and isinstance(op := ops[j], ir.Kernel | ir.Combine)}
    for b in inside:
        if any(r not in group and r != lse for r in readers.get(b, [])):
            return None  # sent, or read elsewhere
    return sorted(group | ({lse} if lse is not None else set()))


def _lse_kernel(
    graph: Graph, ops: list[ir.Op], k_out: int, l_pos: int, group: set[int], rule: str, readers: dict[int, list[int]]
) -> int | None:
    """The position of the one kernel of the log-sum-exp ``rule`` that reads the block's maxima
    and sums: made by the fused op (at ``k_out``) over the block's rows, read only after it."""
    o = ops[k_out]
    assert isinstance(o, ir.Kernel)
    rows = Region.through(graph.node(o.node).inputs[l_pos].axes, o.range_map)
    found = {j for b, _ in o.reads[l_pos] for j in readers.get(b, []) if _kernel_of(ops[j], rule)}
    if len(found) != 1:
        return None
    j = found.pop()
    kernel = ops[j]
    assert isinstance(kernel, ir.Kernel)
    inside = {op.buf for g in group if isinstance(op := ops[g], ir.Kernel | ir.Combine)}
    if kernel.region != rows or not all(b in inside for parts in kernel.reads for b, _ in parts):
        return None
    if any(r <= k_out for r in readers.get(kernel.buf, [])):
        return None
    return j


def _backward_group(
    graph: Graph, ops: list[ir.Op], k_first: int, bw: Backward, made: dict[int, int], readers: dict[int, list[int]]
) -> tuple[list[int], int] | None:
    """The positions of the kernels of one block of an attention's backward
    (:mod:`edatalog.ir.attention_backward`) whose first result (the gradient of q, else of k,
    else of v) is the kernel at ``k_first``, and where the fused op stands: one kernel per rule,
    each intermediate read whole by the block's kernels only, every query of the block with a
    key, and every reader of the results after the fused op."""
    inner = {graph.node(n).out: n for n in bw.inner}  # intermediate relation -> its rule
    group: dict[str, int] = {bw.results[0]: k_first}
    todo = [k_first]
    while todo:
        kernel = ops[todo.pop()]
        assert isinstance(kernel, ir.Kernel)
        node = graph.node(kernel.node)
        for acc, parts in zip(node.inputs, kernel.reads, strict=True):
            rule = inner.get(acc.relation)
            if rule is None:
                continue  # read from outside the block
            bufs = {b for b, _ in parts}
            if len(bufs) != 1:
                return None
            buf, need = bufs.pop(), Region.through(acc.axes, kernel.range_map)
            j = made.get(buf)
            maker = None if j is None else ops[j]
            if not isinstance(maker, ir.Kernel) or maker.node != rule or maker.region != need:
                return None
            assert j is not None
            if rule not in group:
                group[rule] = j
                todo.append(j)
            elif group[rule] != j:
                return None
    # The other results: the one kernel of each that reads this block's gsc or p'.
    for rule in bw.results[1:]:
        source = bw.source(rule)
        if source not in group:
            return None
        found = [j for j in readers.get(ops[group[source]].buf, []) if _kernel_of(ops[j], rule)]
        if len(found) != 1:
            return None
        group[rule] = found[0]
        kernel = ops[found[0]]
        assert isinstance(kernel, ir.Kernel)
        for acc, parts in zip(graph.node(rule).inputs, kernel.reads, strict=True):
            if acc.relation in inner:
                want = group.get(inner[acc.relation])
                if want is None or {made.get(b) for b, _ in parts} != {want}:
                    return None
                if ops[want].region != Region.through(acc.axes, kernel.range_map):  # type: ignore[union-attr]
                    return None
    if set(group) != set(bw.nodes):
        return None
    positions = sorted(group.values())
    inside = set(positions)
    # The fused op stands at the first kernel of the group after everything it reads from outside
    # is made: before any other op reads what it exports (a combine of partials of k's gradient
    # may come right after that kernel, before the gradient of q).
    made_inside = {b for j in positions for b in _bufs(ops[j])}
    outer = {b for j in positions for b in ir.reads(ops[j]) if b not in made_inside}
    ready = max((made[b] for b in outer if b in made), default=-1)
    host = next((j for j in positions if j > ready), None)
    if host is None:
        return None
    for rule, j in group.items():
        outside = [r for b in _bufs(ops[j]) for r in readers.get(b, []) if r not in inside]
        if rule in bw.results:
            if any(r < host for r in outside):
                return None  # read before the fused op would make it
        elif outside:
            return None
    # The gradients are of what the kernel reads: q and k as the scores block reads them, v as
    # grad_p's block does (no feature index split off).
    kernels = {rule: ops[j] for rule, j in group.items()}
    sc, gp = kernels[bw.scores], kernels[bw.grad_probs]
    assert isinstance(sc, ir.Kernel) and isinstance(gp, ir.Kernel)
    chain = bw.chain
    o = graph.node(chain.out)
    scores = graph.node(bw.scores)
    for rule, axes, block in (
        (bw.grad_q, scores.inputs[chain.q].axes, sc),
        (bw.grad_k, scores.inputs[chain.k].axes, sc),
        (bw.grad_v, o.inputs[chain.v].axes, gp),
    ):
        if rule is not None and kernels[rule].region != Region.through(axes, block.range_map):  # type: ignore[union-attr]
            return None
    rows = kernels[bw.grad_sums]
    assert isinstance(rows, ir.Kernel)
    if not (rows.full or _all_rows(graph, rows)):
        return None  # a query without keys: absent in the rules, NaN in the kernel
    return positions, host


def _adamw_group(
    ops: list[ir.Op], k: int, update: AdamWUpdate, made: dict[int, int], readers: dict[int, list[int]]
) -> tuple[int, int] | None:
    """The positions of the kernels of ``m'`` and ``v'`` that the kernel of ``p'`` at ``k``
    reads, if the three fuse (see the module docstring)."""
    last = ops[k]
    assert isinstance(last, ir.Kernel)
    found = []
    for rule in (update.first, update.second):
        out = [
            j for parts in last.reads for b, _ in parts if (j := made.get(b)) is not None and _kernel_of(ops[j], rule)
        ]
        if len(out) != 1:
            return None
        j = out[0]
        kernel = ops[j]
        assert isinstance(kernel, ir.Kernel)
        if kernel.region != last.region or any(r < k for r in readers.get(kernel.buf, []) if r != k):
            return None
        found.append(j)
    if not all(len(parts) == 1 for parts in last.reads):
        return None
    return found[0], found[1]


def _read_of(inner: tuple[ir.Kernel, ...], update: AdamWUpdate, role: str) -> tuple[int, ...]:
    """The buffers an AdamW block reads for one operand (see ``AdamWUpdate.operands``)."""
    place, position = update.operands[role]
    return tuple(b for b, _ in inner[place].reads[position])


def _bufs(op: ir.Op) -> tuple[int, ...]:
    return tuple(m.buf for m in ir.made(op))


def _kernel_of(op: ir.Op, rule: str) -> bool:
    return isinstance(op, ir.Kernel) and op.node == rule


def _input_positions(
    o: ir.Kernel, ops: list[ir.Op], made: dict[int, int], chain: Chain
) -> tuple[int | None, int | None]:
    """Which inputs of ``o``'s kernel are ``p`` and ``l`` (by the kernels that made them)."""
    found: dict[str, int] = {}
    for pos, parts in enumerate(o.reads):
        for buf, _ in parts:
            j = made.get(buf)
            if j is not None and isinstance(ops[j], ir.Kernel):
                found.setdefault(ops[j].node, pos)  # type: ignore[union-attr]
    return found.get(chain.probs), found.get(chain.sums)


def _has_keys(graph: Graph, ops: list[ir.Op], group: list[int], chain: Chain) -> bool:
    """Whether every query of the block has a key its guard admits (the sums' blocks are then
    full): softmax over no key is absent in the rules and NaN in the fused kernel."""
    sums = [op for j in group if isinstance(op := ops[j], ir.Kernel) and op.node == chain.sums]
    return all(k.full or _all_rows(graph, k) for k in sums)


def _all_rows(graph: Graph, kernel: ir.Kernel) -> bool:
    return _every_row(graph.node(kernel.node).anonymous, kernel.ranges)


@functools.lru_cache(maxsize=1 << 14)
def _every_row(rule: JoinAgg, ranges: ir.Ranges) -> bool:
    """Whether the guard leaves every output cell of the block a point (by rule structure)."""
    node = prepare(restrict(rule, {i: (lo, hi) for i, lo, hi in ranges}))
    out = [i.name for i in node.indices if i.name not in node.agg_indices]
    shadow, exact = node.guard.project(out, node.box)
    box = {v: node.box[v] for v in out}
    return exact and (shadow.is_true or shadow.count(box) == math.prod(box.values()))
