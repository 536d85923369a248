"""The fused AdamW block on torch: one pass of torch's fused AdamW kernel for the three rules of
a param's update (:mod:`edatalog.ir.adamw`) that the fusion pass
(:mod:`edatalog.backend.lowering.fusion`) put into one :class:`~edatalog.ir.program.Fused` op.

The rules make ``m'``, ``v'`` and ``p'`` as new relations, one pass per operator (about eleven
over the block); the kernel updates in place, reading ``p``, ``g``, ``m`` and ``v`` once.  Where
the runtime owns the block of ``p``, ``m`` or ``v`` and nothing reads it after the update
(``Fused.overwrites``; see :mod:`edatalog.backend.running.carry`), the kernel updates it in
place, as torch's optimizers do; any other it copies into its result first.  Under clipping the
gradient is scaled by the factor: by the kernel as it reads it (its ``grad_scale``, which
writes the scaled gradient back) where the gradient may be overwritten and is f32 (the kernel
takes the scale in f32), else first, as ``clip_grad_norm_`` does.  The kernel computes the
formula of the rules in a different order: results agree to rounding, not bit for bit.
"""

from __future__ import annotations

from edatalog.backend.kernels.arrays import Array, ArrayOps, torch_module
from edatalog.ir.adamw import AdamWUpdate

DTYPES = ("f32", "f64")  # the kernel's opmath is the param's own type: no half params here


class AdamWKernel:
    """One param block's update on torch, prepared once: ``__call__(p, g, m, v, t, s)`` takes
    the blocks of the param, its gradient and moments (same shape), the step and the clipping
    factor (0-d; ``s`` None without clipping) and returns the blocks of ``p'``, ``m'`` and
    ``v'``."""

    def __init__(self, update: AdamWUpdate) -> None:
        self.update = update

    @staticmethod
    def supports(xp: ArrayOps, dtype: str) -> bool:
        return xp.name == "torch" and dtype in DTYPES

    def __call__(
        self, p: Array, g: Array, m: Array, v: Array, t: Array, s: Array | None, over: tuple[bool, bool, bool, bool]
    ) -> tuple[Array, Array, Array]:
        """``over``: whether the block of ``p``, ``m``, ``v`` and ``g`` may be written over."""
        torch = torch_module()
        u = self.update
        scale = None
        if s is not None and over[3] and g.dtype == torch.float32 and g.is_contiguous():
            scale = torch.reciprocal(s).to(torch.float32)  # the kernel divides by it
        elif s is not None:
            g = torch.mul(g, s)  # a 0-d factor keeps the gradient's type
        g = g.contiguous()
        news = []
        for block, in_place in zip((p, m, v), over[:3], strict=True):
            if in_place and block.is_contiguous():
                news.append(block)
                continue
            new = torch.empty(block.shape, dtype=block.dtype, device=block.device)
            new.copy_(block)
            news.append(new)
        p2, m2, v2 = news
        torch._fused_adamw_(
            [p2], [g], [m2], [v2], [], [t],
            lr=u.lr, beta1=u.beta1, beta2=u.beta2, weight_decay=u.weight_decay, eps=u.eps,
            amsgrad=False, maximize=False, grad_scale=scale, found_inf=None,
        )  # fmt: skip
        return p2, m2, v2
