"""The simulated multi-device executor: runs a plan's device programs in one process, on numpy.

Each device has its own store of buffers and runs its program in order; a send leaves a copy of
its region in a mailbox under its tag, and a receive waits until that tag is there.  Devices
take turns (in device order, or in a random order given a random generator: programs must not
rely on one global order), so a device blocked on a receive lets the others run.  An op that
reads a buffer its device does not hold, or programs that leave every device waiting, are a
:class:`SimError`: a bug in exchange synthesis.  Blocks are evaluated by the reference
evaluator (:mod:`edatalog.backend.running.interpreter` runs them), which makes the simulator's outputs
directly comparable with the reference.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np

from edatalog.backend.kernels.arrays import NUMPY
from edatalog.backend.kernels.reference import Value
from edatalog.backend.lowering.lowered import Lowered
from edatalog.backend.running.interpreter import Device, ExecutionError, Kernels, Mailbox, gather, run_devices, slicer


class SimError(ExecutionError):
    """A device touched data it does not hold, or the devices wait for each other forever:
    exchange synthesis is wrong."""


def run(
    lowered: Lowered, inputs: Mapping[str, np.ndarray], interleave: random.Random | None = None
) -> dict[str, Value]:
    """Execute the lowered plan's programs on the given inputs and params; returns the outputs,
    gathered.  With ``interleave``, devices take turns one op at a time in a random order."""
    graph = lowered.graph
    kernels = Kernels(graph)
    load = slicer(inputs)
    devices = [Device(p, graph, kernels, load) for p in lowered.programs.devices]
    try:
        with NUMPY.ignore_fp_errors():
            run_devices(devices, Mailbox(), interleave.choice if interleave is not None else None)
            out = {}
            for name, entries in lowered.outputs.items():
                pieces = []
                for e in entries:
                    if e.holders:
                        device, buf = next(iter(e.holders.items()))
                        pieces.append((e.region, devices[device].get(buf)))
                data, present = gather(graph, name, pieces)
                out[name] = Value(data, present)
    except ExecutionError as exc:
        raise SimError(str(exc)) from None
    return out
