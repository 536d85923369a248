"""A recorded graph replayed as a CUDA graph: every kernel of a call launched by one replay.

A simplified ``torch.fx`` graph (:mod:`edatalog.backend.running.compiled`) still launches its
kernels one by one from Python: a few microseconds each, which on a GPU is often more than the
kernel itself (a decode step of a small model is hundreds of tiny kernels).  A CUDA graph
records those launches once and replays them with one call, so a call costs about one launch.

What a capture fixes, and how this module keeps calls correct around it:

- **Addresses.** The captured kernels read and write fixed memory.  The params (the executable's
  held blocks) are captured where they are, by reference: a call that hands other param
  tensors (new weights loaded) captures again, after letting the old capture go.  The other
  inputs are copied into buffers of the capture's own (small: token ids, positions; a KV cache
  is copied whole, as the attention reads it whole anyway).
- **Outputs.** A replay writes its outputs into the capture's memory pool, which the next
  replay overwrites: each call returns copies, so results a caller keeps stay theirs.
- **Device and streams.** Capture and replay run with the capture's GPU current, the capture on
  a stream of that GPU after a warm-up on another (cuBLAS and the allocator set themselves up on
  first use); the caller's stream is current again afterwards, also when a capture fails.
  Replays run on the caller's current stream, after whatever it queued there: a caller that
  switches streams between calls orders them itself.
- **Memory.** A replay allocates nothing (its intermediates live in the capture's pool), so the
  peak a call holds is measured once, over the warm-up.

Where a capture fails (an op that waits on the host cannot be captured) the graph runs op by
op, said once in the log.  Only a program on one CUDA device without carried state is captured
(carried state is read and rewritten by the same call, which a fixed-address replay would
alias): elsewhere the runtime runs the plain graph, or inductor's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from edatalog.backend.kernels.arrays import torch_module

LOG = logging.getLogger("edatalog")
WARMUP = 2  # calls on a side stream before the capture


class CudaGraphed:
    """``run`` (state tensors, then inputs -> a list of outputs) captured on ``args`` on the
    CUDA ``device``, the first ``n_state`` arguments held by reference (see the module
    docstring).  ``captured``: whether calls replay (False: the capture failed; ``run`` runs)."""

    def __init__(self, run: Callable[..., Any], args: Sequence[Any], n_state: int, device: Any) -> None:
        self.run, self.n_state, self.device = run, n_state, device
        self.graph: Any = None
        self.static: list[Any] = []
        self.outputs: list[Any] = []
        self.peak = 0  # bytes the device had allocated at most during the warm-up (a call's peak)
        self.captured = self._capture(list(args))

    def _capture(self, args: list[Any]) -> bool:
        torch = torch_module()
        self.graph, self.static, self.outputs = None, [], []  # the old capture's pool goes first
        with torch.cuda.device(self.device):
            caller = torch.cuda.current_stream()
            state = args[: self.n_state]
            inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args[self.n_state :]]
            static = [*state, *inputs]
            side = torch.cuda.Stream()
            side.wait_stream(caller)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            try:
                with torch.no_grad(), torch.cuda.stream(side):
                    for _ in range(WARMUP):
                        self.run(*static)
                caller.wait_stream(side)
                torch.cuda.synchronize()
                peak = int(torch.cuda.max_memory_allocated())
                graph = torch.cuda.CUDAGraph()
                with torch.no_grad(), torch.cuda.graph(graph, stream=torch.cuda.Stream()):
                    outputs = self.run(*static)
            except RuntimeError as exc:
                LOG.warning("not captured as a CUDA graph (%s): its ops run one by one", str(exc).splitlines()[0])
                return False
            finally:
                torch.cuda.set_stream(caller)  # a failed capture must not leave its stream current
        self.graph, self.static, self.outputs, self.peak = graph, static, list(outputs), peak
        return True

    def __call__(self, *args: Any) -> list[Any]:
        if not self.captured:
            return list(self.run(*args))
        torch = torch_module()
        state, inputs = args[: self.n_state], args[self.n_state :]
        if any(a is not s for a, s in zip(state, self.static[: self.n_state], strict=True)):
            self.captured = self._capture(list(args))  # other params: their addresses are the graph's
            if not self.captured:
                return list(self.run(*args))
        with torch.cuda.device(self.device):
            for buf, given in zip(self.static[self.n_state :], inputs, strict=True):
                if isinstance(buf, torch.Tensor) and given is not buf:
                    buf.copy_(given, non_blocking=True)
            self.graph.replay()
            return [o.clone() if isinstance(o, torch.Tensor) else o for o in self.outputs]


def capturable(devices: Sequence[Any], carries: bool) -> bool:
    """Whether a program on ``devices`` (torch devices, one per logical device) can replay as a
    CUDA graph: every logical device on the same CUDA device, and no carried state."""
    if carries or any(d.type != "cuda" for d in devices):
        return False
    current = torch_module().cuda.current_device()
    return len({current if d.index is None else d.index for d in devices}) == 1
