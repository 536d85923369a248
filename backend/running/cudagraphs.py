"""A recorded graph replayed as a CUDA graph: every kernel of a call launched by one replay.

A simplified ``torch.fx`` graph (:mod:`edatalog.backend.running.compiled`) still launches its
kernels one by one from Python: a few microseconds each, which on a GPU is often more than the
kernel itself (a decode step of a small model is hundreds of tiny kernels).  A CUDA graph
records those launches once and replays them with one call, so a call costs about one launch.

What a capture fixes, and how this module keeps calls correct around it:

- **Addresses.** The captured kernels read and write fixed memory.  The params (the executable's
  held blocks) are captured where they are, by reference: a call that hands other param
  tensors (new weights loaded) captures again.  The other inputs are copied into buffers of
  the capture's own (small: token ids, positions; a KV cache is copied whole, as the attention
  reads it whole anyway).
- **Outputs.** A replay writes its outputs into the capture's memory pool, which the next
  replay overwrites: each call returns copies, so results a caller keeps stay theirs.
- **Streams.** Capture must follow a warm-up on a side stream (cuBLAS and the allocator set
  themselves up on first use); replay runs on the current stream, after whatever the caller
  queued there.

Only a program on one CUDA device without carried state is captured (carried state is read and
rewritten by the same call, which a fixed-address replay would alias): elsewhere the runtime
keeps the ``graph`` mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from edatalog.backend.kernels.arrays import torch_module

WARMUP = 2  # calls on a side stream before the capture


class CudaGraphed:
    """``run`` (state tensors, then inputs -> a list of outputs) captured on ``args``, the first
    ``n_state`` of them held by reference (see the module docstring)."""

    def __init__(self, run: Callable[..., Any], args: Sequence[Any], n_state: int) -> None:
        self.run, self.n_state = run, n_state
        self._capture(list(args))

    def _capture(self, args: list[Any]) -> None:
        torch = torch_module()
        state = args[: self.n_state]
        inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args[self.n_state :]]
        static = [*state, *inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(WARMUP):
                self.run(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            outputs = self.run(*static)
        self.graph, self.static, self.outputs = graph, static, list(outputs)

    def __call__(self, *args: Any) -> list[Any]:
        torch = torch_module()
        state, inputs = args[: self.n_state], args[self.n_state :]
        if any(a is not s for a, s in zip(state, self.static[: self.n_state], strict=True)):
            self._capture(list(args))  # other params: their addresses are the graph's
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
