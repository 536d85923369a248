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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from edatalog.backend.arrays import Array, ArrayOps
from edatalog.backend.joinagg import prepare
from edatalog.backend.operands import access_view
from edatalog.ir import program as ir
from edatalog.ir.attention import Chain, attention_chains, exp_of_difference
from edatalog.ir.graph import Access, Graph, JoinAgg
from edatalog.ir.regions import Region

KIND = "attention"


# -- programs --------------------------------------------------------------------------------------


def fuse_programs(programs: ir.Programs, graph: Graph) -> ir.Programs:
    """The programs with each device's attention blocks (see the module docstring) fused."""
    chains = attention_chains(graph)
    if not chains:
        return programs
    devices = tuple(_fuse_device(p, graph, chains) for p in programs.devices)
    return ir.Programs(programs.graph, programs.relations, devices, programs.outputs)


def _fuse_device(program: ir.DeviceProgram, graph: Graph, chains: list[Chain]) -> ir.DeviceProgram:
    ops = list(program.ops)
    made = {op.buf: k for k, op in enumerate(ops) if isinstance(op, ir.DEFINES)}
    readers: dict[int, list[int]] = {}
    for k, op in enumerate(ops):
        for b in ir.reads(op):
            if not isinstance(op, ir.Free):
                readers.setdefault(b, []).append(k)
    replace: dict[int, ir.Op] = {}
    drop: set[int] = set()
    for chain in chains:
        for k, op in enumerate(ops):
            if isinstance(op, ir.Kernel) and op.node == chain.out and k not in drop:
                group = _group(graph, ops, k, chain, made, readers)
                if group is not None and _has_keys(graph, ops, group, chain):
                    inner = tuple(op for j in group if isinstance(op := ops[j], ir.Kernel | ir.Combine))
                    last = inner[-1]
                    assert isinstance(last, ir.Kernel)
                    fused = ir.Fused(last.buf, KIND, inner, last.relation, last.region, last.dtype, last.full)
                    replace[k] = fused
                    drop.update(j for j in group if j != k)
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
    inside = {op.buf for j in group if j != k_out and isinstance(op := ops[j], ir.Kernel | ir.Combine)}
    for b in inside:
        if any(r not in group for r in readers.get(b, [])):
            return None  # sent, or read elsewhere
    return sorted(group)


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
    from edatalog.ir.rewrite import restrict

    node = prepare(restrict(graph.node(kernel.node), kernel.range_map))
    out = [i.name for i in node.indices if i.name not in node.agg_indices]
    shadow, exact = node.guard.project(out, node.box)
    box = {v: node.box[v] for v in out}
    return exact and (shadow.is_true or shadow.count(box) == math.prod(box.values()))


# -- running -------------------------------------------------------------------------------------


class AttentionKernel:
    """One fused block on torch, prepared once: ``__call__(q, k, v)`` takes q and k laid out as
    the scores block reads them and v as the out block reads it, and returns the out block laid
    out as its region."""

    def __init__(self, chain: Chain, fused: ir.Fused, sc: JoinAgg, o: JoinAgg, xp: ArrayOps, device: Any) -> None:
        torch = _torch()
        self.chain, self.fused, self.xp, self.device = chain, fused, xp, device
        # The blocks as the rules write them: evaluators re-index narrow bands (``prepare``), which
        # would move the key index of ``o``'s reads; the chain's accesses are plain, so no index
        # reaches outside its relation and nothing needs re-indexing here.
        self.sc, self.o = sc, o
        head = [ax.parts[0].index for ax in self.sc.out_axes]
        self.s, self.t = str(head[-2]), str(head[-1])
        self.batch = [str(b) for b in head[:-2]]
        self.e = self.sc.agg_indices[0]
        self.o_s = _query_index(self.o, chain)
        self.o_batch = _batch_of(self.o, chain, self.o_s)
        self.o_head = [str(ax.parts[0].index) for ax in self.o.out_axes]
        self.f = next(v for v in self.o_head if v != self.o_s and v not in self.o_batch)
        self.mask = _mask(self.sc, self.s, self.t, torch, device)
        # The attention's dtype is its result's: a bf16 block runs torch's bf16 kernel (which
        # accumulates in f32), a partial one (split keys, combined later) the f32 kernel.
        self.cdt = xp.dtype(fused.dtype)

    def __call__(self, q: Array, k: Array, v: Array) -> Array:
        torch, xp = _torch(), self.xp
        sc, o = self.sc, self.o
        sc_order, o_order = [i.name for i in sc.indices], [i.name for i in o.indices]
        s, t, e, f, o_t = self.s, self.t, self.e, self.f, o.agg_indices[0]
        bsz = [sc.box[b] for b in self.batch]
        qv = access_view(xp.asarray(q, self.cdt, self.device), sc.inputs[self.chain.q], sc_order, sc.box, xp=xp)
        kv = access_view(xp.asarray(k, self.cdt, self.device), sc.inputs[self.chain.k], sc_order, sc.box, xp=xp)
        vv = access_view(xp.asarray(v, self.cdt, self.device), o.inputs[self.chain.v], o_order, o.box, xp=xp)
        # (batch.., s, e), (batch.., t, e), (batch.., t, f): axes moved, missing batch indices broadcast.
        qq = _arrange(qv, sc_order, [*self.batch, s, e], [*bsz, sc.box[s], sc.box[e]])
        kk = _arrange(kv, sc_order, [*self.batch, t, e], [*bsz, sc.box[t], sc.box[e]])
        o_bsz = [o.box[b] for b in self.o_batch]
        vv = _arrange(vv, o_order, [*self.o_batch, o_t, f], [*o_bsz, o.box[o_t], o.box[f]])
        flat = math.prod(bsz)  # as (1, heads, sequence, features): the 4-d form reaches torch's flash kernel
        qf, kf = qq.reshape(1, flat, sc.box[s], sc.box[e]), kk.reshape(1, flat, sc.box[t], sc.box[e])
        vf = vv.reshape(1, flat, o.box[o_t], o.box[f])
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if self.mask is True:
            res = sdpa(qf, kf, vf, is_causal=True, scale=self.chain.scale)
        else:
            res = sdpa(qf, kf, vf, attn_mask=self.mask, scale=self.chain.scale)
        layout = [*self.o_batch, self.o_s, f]
        res = res.reshape([*o_bsz, o.box[self.o_s], o.box[f]]).permute([layout.index(v) for v in self.o_head])
        return xp.contiguous(xp.cast(res, xp.dtype(self.fused.dtype))).reshape(self.fused.region.shape)


def _torch() -> Any:
    from edatalog.backend.arrays import torch_module

    return torch_module()


def _arrange(view: Array, order: Sequence[str], want: Sequence[str], shape: Sequence[int]) -> Array:
    """A join-space view (size 1 along indices it lacks) with axes ``want``, broadcast to
    ``shape``: a strided view where no index is broadcast (torch's attention kernels take
    strides, and a copy costs more than it saves), else a contiguous copy."""
    picked = view.permute([list(order).index(v) for v in want] + [k for k, v in enumerate(order) if v not in want])
    picked = picked.reshape(list(picked.shape[: len(want)]))
    if list(picked.shape) == list(shape):
        return picked
    return picked.expand(*shape).contiguous()


def _p_read(o: JoinAgg, chain: Chain) -> Access:
    """The out rule's read of ``p``: the input, not ``v``, whose last index is the summed key."""
    return next(
        acc
        for k, acc in enumerate(o.inputs)
        if k != chain.v and len(acc.axes) >= 2 and acc.axes[-1].parts[0].index == o.agg_indices[0]
    )


def _query_index(o: JoinAgg, chain: Chain) -> str:
    """The query index of the out rule: the one before the key index in its read of ``p``."""
    index = _p_read(o, chain).axes[-2].parts[0].index
    assert index is not None
    return index


def _batch_of(o: JoinAgg, chain: Chain, s: str) -> list[str]:
    """The out rule's batch indices: those of its read of ``p`` before the query index."""
    names = [ax.parts[0].index for ax in _p_read(o, chain).axes]
    return [n for n in names[: names.index(s)] if n is not None]


def _mask(sc: JoinAgg, s: str, t: str, torch: Any, device: Any) -> Any:
    """The guard over (s, t) as an attention mask: True for a plain causal one (``t <= s`` from
    the block's corner), else a bool (s, t) array, or None when every key is admitted."""
    if sc.guard.is_true:
        return None
    box = {s: sc.box[s], t: sc.box[t]}
    mask = np.broadcast_to(np.asarray(sc.guard.mask([s, t], box)), (box[s], box[t]))
    if box[s] == box[t] and np.array_equal(mask, np.tril(np.ones((box[s], box[t]), dtype=bool))):
        return True
    return torch.tensor(np.array(mask, dtype=bool), device=device)
