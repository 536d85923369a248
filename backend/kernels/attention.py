"""The fused attention block on torch: one ``scaled_dot_product_attention`` call for the five
rules of an attention chain (:mod:`edatalog.ir.attention`) that the fusion pass
(:mod:`edatalog.backend.lowering.fusion`) put into one :class:`~edatalog.ir.program.Fused` op,
and one flash-attention backward call for the rules of its gradient.

A training step's chain also makes the rows' log-sum-exp for its backward.  On a CPU, torch's
flash attention returns it with the output, and its backward reads it instead of running the
forward again; elsewhere (no such entry point here) the log-sum-exp is computed from the scores
and the backward runs torch's attention forward and backward.

A bf16 forward without the log-sum-exp runs, on a CPU and from 256 query rows, as blocks of
GEMMs instead (:func:`gemm_attention`): torch's CPU flash kernel reached 140-150 GFLOP/s of
bf16 here where its GEMMs reach 800.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edatalog.backend.kernels.arrays import Array, ArrayOps
from edatalog.backend.kernels.operands import access_view
from edatalog.ir import program as ir
from edatalog.ir.attention import Chain, exp_of_difference
from edatalog.ir.attention_backward import Backward
from edatalog.ir.graph import Access, JoinAgg


class AttentionKernel:
    """One fused block on torch, prepared once: ``__call__(q, k, v)`` takes q and k laid out as
    the scores block reads them and v as the out block reads it, and returns the out block laid
    out as its region, and where the block exports the log-sum-exp (``lse``: its kernel, alike
    in every program whose block has these ranges) that block too."""

    def __init__(
        self,
        chain: Chain,
        fused: ir.Fused,
        sc: JoinAgg,
        o: JoinAgg,
        xp: ArrayOps,
        device: Any,
        lse: ir.Kernel | None = None,
    ) -> None:
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
        self.lse = lse
        self.additive = _additive(torch, self.mask, self.cdt)

    def __call__(self, q: Array, k: Array, v: Array) -> tuple[Array, Array | None]:
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
        nb, nh = _batch_heads(bsz)  # the 4-d form reaches torch's flash kernel
        qf, kf = qq.reshape(nb, nh, sc.box[s], sc.box[e]), kk.reshape(nb, nh, sc.box[t], sc.box[e])
        vf = vv.reshape(nb, nh, o.box[o_t], o.box[f])
        lse = None
        if self.lse is None and gemm_attention_takes(qf, kf, self.mask):
            res = gemm_attention(torch, qf, kf, vf, self.mask is True, self.chain.scale)
        elif self.lse is None:
            res = _sdpa(torch, qf, kf, vf, self.mask, self.chain.scale)
        elif flash_on_cpu(qf):
            res, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qf, kf, vf, 0.0, self.mask is True, attn_mask=self.additive, scale=self.chain.scale
            )
        else:
            res = _sdpa(torch, qf, kf, vf, self.mask, self.chain.scale)
            lse = _log_sum_exp(torch, qf, kf, self.mask, self.chain.scale)
        layout = [*self.o_batch, self.o_s, f]
        res = res.reshape([*o_bsz, o.box[self.o_s], o.box[f]]).permute([layout.index(v) for v in self.o_head])
        out = xp.contiguous(xp.cast(res, xp.dtype(self.fused.dtype))).reshape(self.fused.region.shape)
        if self.lse is None or lse is None:
            return out, None
        # (batch, heads, queries): the rows of the scores block, the log-sum-exp's cells.
        return out, xp.contiguous(xp.cast(lse, xp.dtype(self.lse.dtype))).reshape(self.lse.region.shape)


class AttentionBackwardKernel:
    """One block of an attention's backward (:mod:`edatalog.ir.attention_backward`) on torch,
    prepared once: ``__call__(q, k, v, go, o, lse)`` takes q and k laid out as the scores block
    reads them, v and the output's gradient ``go`` as the ``grad_p`` block reads them, the
    output ``o`` as the rows' gradient (``grad_l``) reads it and the log-sum-exp as the
    probabilities' block reads it, and returns the blocks of the gradients of q, k and v, each
    laid out as its region.  On a CPU, torch's flash attention backward runs from ``o`` and
    ``lse`` alone; elsewhere torch's attention runs forward and backward (``o`` and ``lse``
    unread).  The gradients of k and v come out summed over the query heads that share them, as
    the rules sum them."""

    def __init__(
        self,
        bw: Backward,
        blocks: Mapping[str, JoinAgg],
        grads: Sequence[tuple[JoinAgg, ir.Kernel]],
        xp: ArrayOps,
        device: Any,
    ) -> None:
        torch = _torch()
        self.bw, self.xp, self.device = bw, xp, device
        self.sc, self.gp, self.gl, self.p = (blocks[r] for r in (bw.scores, bw.grad_probs, bw.grad_sums, bw.probs))
        sc, gp = self.sc, self.gp
        head = [str(ax.parts[0].index) for ax in sc.out_axes]
        self.s, self.t, self.batch = head[-2], head[-1], head[:-2]
        self.e = sc.agg_indices[0]
        # grad_p's head is p as the output reads it: (batch.., s, t), the key last.
        self.o_s, self.o_t = str(gp.out_axes[-2].parts[0].index), str(gp.out_axes[-1].parts[0].index)
        self.o_batch = [str(ax.parts[0].index) for ax in gp.out_axes[:-2]]
        self.go_pos = next(k for k, a in enumerate(gp.inputs) if a.relation == bw.grad_out)
        self.v_pos = next(k for k, a in enumerate(gp.inputs) if k != self.go_pos and self.o_t in a.indices)
        self.o_pos = 1  # gl += -(go * o)
        self.lse_pos = (exp_of_difference(self.p) or (0, 1))[1]  # p' = exp(sc' - lse)
        self.lse_names = [str(ax.parts[0].index) for ax in self.p.inputs[self.lse_pos].axes]
        self.f = gp.agg_indices[0]
        self.mask = _mask(sc, self.s, self.t, torch, device)
        self.grads = grads  # (block, kernel) of each result, in the order of ``bw.results``
        self.additive = _additive(torch, self.mask, xp.dtype(grads[0][1].dtype))

    def __call__(self, q: Array, k: Array, v: Array, go: Array, o: Array, lse: Array) -> list[Array]:
        torch, xp = _torch(), self.xp
        sc, gp = self.sc, self.gp
        s, t, e, f, o_s, o_t = self.s, self.t, self.e, self.f, self.o_s, self.o_t
        cdt = xp.dtype(self.grads[0][1].dtype)
        chain = self.bw.chain

        def leaf(data: Array, block: JoinAgg, position: int, want: list[str], dtype: Any = cdt) -> Any:
            order = [i.name for i in block.indices]
            view = access_view(xp.asarray(data, dtype, self.device), block.inputs[position], order, block.box, xp=xp)
            picked = view.permute([order.index(n) for n in want] + [j for j, n in enumerate(order) if n not in want])
            return picked.reshape(list(picked.shape[: len(want)])).detach()

        q_names, k_names = [*self.batch, s, e], [*self.batch, t, e]
        v_names, go_names = [*self.o_batch, o_t, f], [*self.o_batch, o_s, f]
        ql, kl = leaf(q, sc, chain.q, q_names), leaf(k, sc, chain.k, k_names)
        vl, gol = leaf(v, gp, self.v_pos, v_names), leaf(go, gp, self.go_pos, go_names)
        bsz, o_bsz = [sc.box[b] for b in self.batch], [gp.box[b] for b in self.o_batch]
        nb, nh = _batch_heads(bsz)

        def heads(x: Any, sizes: list[int], rows: int, cols: int) -> Any:
            return x.expand(*sizes, rows, cols).reshape(nb, nh, rows, cols)

        qf, kf = heads(ql, bsz, sc.box[s], sc.box[e]), heads(kl, bsz, sc.box[t], sc.box[e])
        vf, gof = heads(vl, o_bsz, gp.box[o_t], gp.box[f]), heads(gol, o_bsz, gp.box[o_s], gp.box[f])
        if flash_on_cpu(qf):
            of = heads(leaf(o, self.gl, self.o_pos, go_names), o_bsz, gp.box[o_s], gp.box[f])
            wide = torch.promote_types(cdt, torch.float32)  # the type flash attention's lse has
            lsef = leaf(lse, self.p, self.lse_pos, self.lse_names, wide).reshape(nb, nh, sc.box[s])
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                gof.contiguous(),
                qf,
                kf,
                vf,
                of.contiguous(),
                lsef.contiguous(),
                0.0,
                self.mask is True,
                attn_mask=self.additive,
                scale=chain.scale,
            )
        else:
            with torch.enable_grad():
                qf, kf, vf = (x.detach().requires_grad_() for x in (qf, kf, vf))
                out = _sdpa(torch, qf, kf, vf, self.mask, chain.scale)
                dq, dk, dv = torch.autograd.grad(out, (qf, kf, vf), grad_outputs=gof)
        # Back to each leaf's shape: summed over the heads a leaf was broadcast to.
        made = {
            self.bw.grad_q: (dq.reshape(*bsz, sc.box[s], sc.box[e]).sum_to_size(ql.shape), q_names),
            self.bw.grad_k: (dk.reshape(*bsz, sc.box[t], sc.box[e]).sum_to_size(kl.shape), k_names),
            self.bw.grad_v: (dv.reshape(*o_bsz, gp.box[o_t], gp.box[f]).sum_to_size(vl.shape), v_names),
        }
        results = []
        for block, kernel in self.grads:
            grad, names = made[kernel.node]
            head = [str(ax.parts[0].index) for ax in block.out_axes]
            kept = [n for n in names if n in head]
            res = grad.reshape([grad.shape[j] for j, n in enumerate(names) if n in head])
            res = res.permute([kept.index(h) for h in head])
            results.append(xp.contiguous(xp.cast(res, xp.dtype(kernel.dtype))).reshape(kernel.region.shape))
        return results


def _batch_heads(sizes: Sequence[int]) -> tuple[int, int]:
    """The block's batch indices as flash attention's (batch, heads): the first, and the rest
    together.  Rules lay attention out as ``q[b, s, h, e]`` (the query between the batch and
    the heads, as transformers' projections do), so the (b, heads, s, e) views of q, k, v and
    o are strided views of the rules' blocks, as torch's kernels take them, with no copy."""
    return (sizes[0], math.prod(sizes[1:])) if sizes else (1, 1)


def flash_on_cpu(x: Any) -> bool:
    """Whether torch's CPU flash attention entry points (which take and return the log-sum-exp)
    serve tensors like ``x``."""
    return bool(x.device.type == "cpu")


GEMM_ATTENTION_MIN_ROWS = 256
"""From this many query rows a bf16 attention on a CPU runs as :func:`gemm_attention`.  Measured
on a 2-vCPU AMD EPYC (torch 2.13, causal, against its flash kernel; benchmarks/attention_kernels.py):
0.54-0.8x its time at 256-1024 rows of 64-wide heads, 0.83-0.89x at 2048 rows of 128-wide ones,
but 1.4-1.6x at 128 rows, where the blocks' per-op costs dominate."""

GEMM_ATTENTION_ROWS = 64
"""The query rows of one block of :func:`gemm_attention` (64 measured best of 64-256)."""

GEMM_ATTENTION_SCORES_BYTES = 4 << 20
"""The f32 scores of one block of :func:`gemm_attention` at most: the L2 caches of two cores
here; the heads of a block shrink to fit.  Whole-row blocks of 2048 keys and 32 heads took 1.3x
the flash kernel's time, blocks of at most this 0.8x."""


def gemm_attention_takes(q: Any, k: Any, mask: Any) -> bool:
    """Whether :func:`gemm_attention` runs an attention of these q and k (batch, heads, rows,
    width) under ``mask`` (None, or True for causal: other masks keep torch's kernel, which
    owns what a row with no admitted key yields)."""
    return bool(
        q.device.type == "cpu"
        and q.dtype == k.dtype == _torch().bfloat16
        and (mask is None or mask is True)
        and q.shape[-2] >= GEMM_ATTENTION_MIN_ROWS
        and not q.requires_grad
    )


def gemm_attention(torch: Any, q: Any, k: Any, v: Any, causal: bool, scale: float) -> Any:
    """Attention as blocks of query rows, each two batched GEMMs around an f32 softmax: scores
    in f32 (q and k widened once, so the scores are not rounded to bf16 as a bf16 GEMM's result
    would be, as in torch's flash kernel), probabilities rounded to v's dtype for the second
    GEMM, which accumulates in f32.  A causal block (``causal``: key t admitted for query s where
    t <= s, counted from the first of each) reads only the keys up to its last row.  Returns
    (batch, heads, rows, v's width) in v's dtype, laid out in memory as (batch, rows, heads,
    width) as torch's kernel lays it out, so that the rules' layout needs no copy."""
    nb, nh, rows, _ = q.shape
    keys = k.shape[-2]
    qw = q.to(torch.float32, copy=True).mul_(scale)  # a copy: q itself is never written
    kw = k.to(torch.float32).transpose(-1, -2)
    step = GEMM_ATTENTION_ROWS
    upper = torch.ones(step, step, dtype=torch.bool, device=q.device).triu(1)
    below = torch.zeros(step, step, device=q.device).masked_fill(upper, float("-inf"))
    blocks = []  # (batch, rows of the block, heads, width)
    for i in range(0, rows, step):
        j = min(i + step, rows)
        seen = j if causal else keys
        per_head = max(1, GEMM_ATTENTION_SCORES_BYTES // (nb * (j - i) * seen * 4))
        heads = []
        for h in range(0, nh, per_head):
            g = min(nh, h + per_head)
            scores = torch.matmul(qw[:, h:g, i:j], kw[:, h:g, :, :seen])
            if causal:
                scores[..., i:j].add_(below[: j - i, : j - i])
            probs = torch.softmax(scores, dim=-1).to(v.dtype)
            heads.append(torch.matmul(probs, v[:, h:g, :seen]).transpose(1, 2))
        blocks.append(heads[0] if len(heads) == 1 else torch.cat(heads, dim=2))
    return (blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)).contiguous().transpose(1, 2)


def _sdpa(torch: Any, q: Any, k: Any, v: Any, mask: Any, scale: float) -> Any:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if mask is True:
        return sdpa(q, k, v, is_causal=True, scale=scale)
    return sdpa(q, k, v, attn_mask=mask, scale=scale)


def _additive(torch: Any, mask: Any, dtype: Any) -> Any:
    """A bool mask (True: admitted) as the additive one torch's flash entry points take; None and
    True (causal, passed as a flag) stay."""
    if mask is None or mask is True:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _log_sum_exp(torch: Any, q: Any, k: Any, mask: Any, scale: float) -> Any:
    """The rows' log-sum-exp of the scores, in f32 at least (where no flash entry point returns
    it: the scores are made whole)."""
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(wide), k.to(wide).transpose(-1, -2)) * scale
    if mask is True:
        rows, cols = scores.shape[-2:]
        mask = torch.ones(rows, cols, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.logsumexp(scores, dim=-1)


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
