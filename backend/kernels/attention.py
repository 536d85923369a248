"""The fused attention block on torch: one ``scaled_dot_product_attention`` call for the five
rules of an attention chain (:mod:`edatalog.ir.attention`) that the fusion pass
(:mod:`edatalog.backend.lowering.fusion`) put into one :class:`~edatalog.ir.program.Fused` op.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from edatalog.backend.kernels.arrays import Array, ArrayOps
from edatalog.backend.kernels.operands import access_view
from edatalog.ir import program as ir
from edatalog.ir.attention import Chain
from edatalog.ir.attention_backward import Backward
from edatalog.ir.graph import Access, JoinAgg


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


class AttentionBackwardKernel:
    """One block of an attention's backward (:mod:`edatalog.ir.attention_backward`) on torch,
    prepared once: ``__call__(q, k, v, go)`` takes q and k laid out as the recomputed scores
    block reads them, v and the output's gradient ``go`` as the ``grad_p`` block reads them, and
    returns the blocks of the gradients of q, k and v, each laid out as its region.  Torch's
    attention runs forward and backward (flash attention's recomputation: nothing of the
    forward is kept); the gradients of k and v come out summed over the query heads that share
    them, as the rules sum them."""

    def __init__(
        self,
        bw: Backward,
        sc: JoinAgg,
        gp: JoinAgg,
        grads: Sequence[tuple[JoinAgg, ir.Kernel]],
        xp: ArrayOps,
        device: Any,
    ) -> None:
        torch = _torch()
        self.bw, self.xp, self.device = bw, xp, device
        self.sc, self.gp = sc, gp
        head = [str(ax.parts[0].index) for ax in sc.out_axes]
        self.s, self.t, self.batch = head[-2], head[-1], head[:-2]
        self.e = sc.agg_indices[0]
        # grad_p's head is p as the output reads it: (batch.., s, t), the key last.
        self.o_s, self.o_t = str(gp.out_axes[-2].parts[0].index), str(gp.out_axes[-1].parts[0].index)
        self.o_batch = [str(ax.parts[0].index) for ax in gp.out_axes[:-2]]
        self.go_pos = next(k for k, a in enumerate(gp.inputs) if a.relation == bw.grad_out)
        self.v_pos = next(k for k, a in enumerate(gp.inputs) if k != self.go_pos and self.o_t in a.indices)
        self.f = gp.agg_indices[0]
        self.mask = _mask(sc, self.s, self.t, torch, device)
        self.grads = grads  # (block, kernel) of each result, in the order of ``bw.results``

    def __call__(self, q: Array, k: Array, v: Array, go: Array) -> list[Array]:
        torch, xp = _torch(), self.xp
        sc, gp = self.sc, self.gp
        sc_order, gp_order = [i.name for i in sc.indices], [i.name for i in gp.indices]
        s, t, e, f, o_s, o_t = self.s, self.t, self.e, self.f, self.o_s, self.o_t
        cdt = xp.dtype(self.grads[0][1].dtype)
        bw = self.bw
        chain = bw.chain

        def leaf(data: Array, acc: Access, order: list[str], box: dict[str, int], want: list[str]) -> Any:
            view = access_view(xp.asarray(data, cdt, self.device), acc, order, box, xp=xp)
            picked = view.permute([order.index(n) for n in want] + [j for j, n in enumerate(order) if n not in want])
            return picked.reshape(list(picked.shape[: len(want)])).detach()

        q_names, k_names = [*self.batch, s, e], [*self.batch, t, e]
        v_names, go_names = [*self.o_batch, o_t, f], [*self.o_batch, o_s, f]
        ql = leaf(q, sc.inputs[chain.q], sc_order, sc.box, q_names).requires_grad_()
        kl = leaf(k, sc.inputs[chain.k], sc_order, sc.box, k_names).requires_grad_()
        vl = leaf(v, gp.inputs[self.v_pos], gp_order, gp.box, v_names).requires_grad_()
        gol = leaf(go, gp.inputs[self.go_pos], gp_order, gp.box, go_names)
        bsz = [sc.box[b] for b in self.batch]
        flat = math.prod(bsz)
        with torch.enable_grad():
            qf = ql.expand(*bsz, sc.box[s], sc.box[e]).reshape(1, flat, sc.box[s], sc.box[e])
            kf = kl.expand(*bsz, sc.box[t], sc.box[e]).reshape(1, flat, sc.box[t], sc.box[e])
            o_bsz = [gp.box[b] for b in self.o_batch]
            vf = vl.expand(*o_bsz, gp.box[o_t], gp.box[f]).reshape(1, flat, gp.box[o_t], gp.box[f])
            sdpa = torch.nn.functional.scaled_dot_product_attention
            if self.mask is True:
                out = sdpa(qf, kf, vf, is_causal=True, scale=chain.scale)
            else:
                out = sdpa(qf, kf, vf, attn_mask=self.mask, scale=chain.scale)
            grad_out = gol.expand(*o_bsz, gp.box[o_s], gp.box[f]).reshape(out.shape)
            dq, dk, dv = torch.autograd.grad(out, (ql, kl, vl), grad_outputs=grad_out)
        made = {bw.grad_q: (dq, q_names), bw.grad_k: (dk, k_names), bw.grad_v: (dv, v_names)}
        results = []
        for block, kernel in self.grads:
            grad, names = made[kernel.node]
            head = [str(ax.parts[0].index) for ax in block.out_axes]
            kept = [n for n in names if n in head]
            res = grad.reshape([grad.shape[j] for j, n in enumerate(names) if n in head])
            res = res.permute([kept.index(h) for h in head])
            results.append(xp.contiguous(xp.cast(res, xp.dtype(kernel.dtype))).reshape(kernel.region.shape))
        return results


def _torch() -> Any:
    from edatalog.backend.kernels.arrays import torch_module

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
