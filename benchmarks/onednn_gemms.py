"""The baselines' f32 GEMMs on a CPU, run as edatalog's torch runtime runs its own.

edatalog's torch runtime runs an f32 GEMM of at least ``ONEDNN_F32_MIN_MACS`` multiply-adds on
a CPU as oneDNN's linear, not as ATen's ``mm`` (MKL's sgemm), which took 2.0-2.3x oneDNN's time
on this project's AMD EPYC (:func:`edatalog.backend.kernels.arrays.onednn_linear_op`).  A baseline
gets every trick edatalog gets: :func:`route` re-registers ATen's CPU ``mm`` and ``addmm`` so
that, while :attr:`Routing.enabled`, every torch program in the process (transformers' layers,
DTensor's local GEMMs, DDP's and FSDP2's forward and backward, a hand-written tensor-parallel
block) takes oneDNN by the same rule, and ATen's own kernel (through its ``out=`` variant, a
separate registration) otherwise.  Autograd sits above the CPU kernels, so gradients take the
same route.

  routing = route()          # once per process; enabled from the start
  routing.enabled = False    # the stock kernels again (a few microseconds more per GEMM)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

_ROUTING: Routing | None = None


@dataclass
class Routing:
    """The registered override; ``enabled`` switches it without unregistering."""

    library: Any
    enabled: bool = True


def any_routed(rows: int, width: int, widest: int) -> bool:
    """Whether a block whose GEMMs are at most ``rows`` x ``width`` x ``widest`` has one that
    oneDNN would run (else :func:`route` would only add its few microseconds a call)."""
    from edatalog.backend.kernels.arrays import ONEDNN_F32_MIN_MACS

    return rows * width * widest >= ONEDNN_F32_MIN_MACS


def route() -> Routing:
    """Install the override in this process (once; later calls return the same one)."""
    global _ROUTING
    if _ROUTING is not None:
        return _ROUTING
    import torch

    from edatalog.backend.kernels.arrays import onednn_linear_op, onednn_takes

    linear = onednn_linear_op()  # None only where onednn_takes never holds
    mm_out, addmm_out = torch.ops.aten.mm.out, torch.ops.aten.addmm.out

    def pays(a: Any, b: Any) -> bool:
        return routing.enabled and onednn_takes(a, b)

    def mm(a: Any, b: Any) -> Any:
        if pays(a, b):
            return linear(a, b.mT, None, "none", [], "")
        return mm_out(a, b, out=a.new_empty((a.shape[0], b.shape[1]), dtype=torch.promote_types(a.dtype, b.dtype)))

    def addmm(bias: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
        # oneDNN reads a bias as one contiguous f32 row: any other goes to ATen.
        row = bias.dim() == 1 and bias.shape[0] == b.shape[1] and bias.is_contiguous() and bias.dtype == torch.float32
        if pays(a, b) and beta == 1 and alpha == 1 and row:
            return linear(a, b.mT, bias, "none", [], "")
        out = a.new_empty((a.shape[0], b.shape[1]), dtype=torch.promote_types(a.dtype, b.dtype))
        return addmm_out(bias, a, b, beta=beta, alpha=alpha, out=out)

    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": the point
        library.impl("mm", mm, "CPU")
        library.impl("addmm", addmm, "CPU")
    routing = Routing(library)
    _ROUTING = routing
    return routing
