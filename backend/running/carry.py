"""State carried from call to call (``Graph.carries``: a training step's params and optimizer
state): after a call, each carried output's pieces become the blocks that its relation's loads
take on the next call, on the devices that made them.  Nothing leaves a device when the plan
places the relation where its next value is made (what
:func:`edatalog.solver.strategies.plan_of` does); a plan that places it elsewhere gets the output
gathered and cut into the blocks (correct, and slower).

Runtimes hold the carried blocks between calls; a call reading one takes it out of the held
blocks, so that the device frees it after its last read, as an update in place would.  A block
that nothing outside the runtime holds (not handed to it by the caller, nor returned to the
caller as an output) is *exclusive*: a call that takes one owns its memory, and a fused op that
is its last reader (``Fused.overwrites``: an AdamW update) may write its results over it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from edatalog.backend.kernels.arrays import torch_module
from edatalog.backend.lowering.lowered import Lowered
from edatalog.ir import program as ir
from edatalog.ir.graph import Graph


@dataclass(frozen=True)
class CarriedLoad:
    """One load of a carried relation on one device, and where that device holds the load's
    region of the output carried into it (``source``: its buffer; None: not on this device)."""

    target: str
    output: str
    device: int
    load: ir.Load
    source: int | None


def carried_loads(graph: Graph, lowered: Lowered) -> tuple[CarriedLoad, ...]:
    """Every load of every carried relation, on every device, with its source."""
    made = {m.buf: m for _, _, op in lowered.programs.ops() for m in ir.made(op)}
    loads = []
    for out, target in graph.carries:
        entries = lowered.outputs[out]
        for prog in lowered.programs.devices:
            d = prog.device
            for op in prog.ops:
                if not isinstance(op, ir.Load) or op.relation != target:
                    continue
                source = next(
                    (e.holders[d] for e in entries if d in e.holders and e.region.contains(op.region)),
                    None,
                )
                if source is not None and (not made[source].full or made[source].dtype != op.dtype):
                    source = None  # cells that may be absent, or another dtype: gathered instead
                loads.append(CarriedLoad(target, out, d, op, source))
    return tuple(loads)


def all_local(loads: tuple[CarriedLoad, ...]) -> bool:
    """Whether every device finds its carried blocks in its own outputs (decided from the
    programs alone: every rank of a group decides alike)."""
    return all(c.source is not None for c in loads)


def own(data: Any) -> Any:
    """A carried block as its own contiguous storage (compiled graphs address blocks by storage
    offset; a view would also keep the whole output it was cut from alive)."""
    if data.is_contiguous() and data.storage_offset() == 0:
        return data
    return data.clone(memory_format=torch_module().contiguous_format)


def taking(
    load: Callable[[ir.Load], Any],
    blocks: dict[int, Any],
    carried: Collection[int],
    owned: set[int] | None = None,
    exclusive: Collection[int] = (),
) -> Callable[[ir.Load], Any]:
    """``load``, taking each carried block out of ``blocks`` as it is loaded: the device then
    holds the only reference and frees it after its last read.  (A call that fails after
    that has lost the state: :class:`edatalog.executable.Executable` asks for it again.)  The
    loads of ``exclusive`` blocks taken so go into ``owned``."""

    def take(op: ir.Load) -> Any:
        data = load(op)
        if op.buf in carried:
            held = blocks.pop(op.buf, None)
            if owned is not None and held is data and op.buf in exclusive:
                owned.add(op.buf)
        return data

    return take
