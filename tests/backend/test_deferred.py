"""Receives, and the combines of received partials, run where their results are first read
(:func:`edatalog.backend.running.spmd.exchanged`, :meth:`Device.combine_later`): a rank posts its
messages and goes on, as the timeline predicts it does.  Whether the ranks then compute the
reference is the SPMD tests' work (tests/backend/test_spmd.py: random plans on 2 and 3 ranks,
their reduce-scatters point-to-point); these tests check what waits, and when."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

import edatalog
from edatalog.backend.lowering.lowered import Collectives, Options
from edatalog.backend.running.interpreter import NO_MESSAGES, Buffer, Device, Kernels, slicer
from edatalog.backend.running.segments import segments
from edatalog.backend.running.spmd import exchanged
from edatalog.ir import program as ir

ROOT = Path(__file__).resolve().parents[2]
DIMS = {"B": 1, "S": 16, "D": 32, "H": 4, "KVH": 4, "F": 48}


@functools.cache
def _megatron() -> tuple[edatalog.Program, ir.Programs]:
    """A LLaMA block's Megatron plan on 2 devices, its two reductions left point-to-point."""
    prog = edatalog.compile(ROOT / "programs" / "llama_block.edl", dims=DIMS)
    plan = edatalog.plan(prog, topology="cpux2", strategy="megatron")
    return prog, plan.lowering(Options(Collectives.OFF)).programs


def _reductions(program: ir.DeviceProgram) -> list[tuple[int, ir.Combine]]:
    received = {op.buf for op in program.ops if isinstance(op, ir.Recv)}
    return [
        (k, op)
        for k, op in enumerate(program.ops)
        if isinstance(op, ir.Combine) and not received.isdisjoint(op.sources)
    ]


def test_the_combines_of_received_partials_run_with_the_exchanges_outside_every_graph() -> None:
    _, programs = _megatron()
    for program in programs.devices:
        outside = exchanged(program)
        reductions = _reductions(program)
        assert {op.relation for _, op in reductions} == {"attn", "down"}  # Megatron's two
        for k, op in enumerate(program.ops):
            if isinstance(op, ir.Send | ir.Recv) or k in dict(reductions):
                assert outside[k], (program.device, k, op)
            elif isinstance(op, ir.Kernel | ir.Fused | ir.Load):
                assert not outside[k], (program.device, k, op)
        for seg in segments(program):
            ops = program.ops[seg.start : seg.stop]
            assert seg.exchange == outside[seg.start]
            if not seg.exchange:  # a graph: no message, no combine of one, and some work
                assert not any(isinstance(op, ir.Send | ir.Recv) for op in ops)
                assert all(k not in dict(reductions) for k in range(seg.start, seg.stop))
                assert not all(isinstance(op, ir.Free) for op in ops)


def test_a_deferred_combine_waits_for_its_received_partial_only_where_it_is_read() -> None:
    prog, programs = _megatron()
    program = programs.devices[0]
    _, combine = _reductions(program)[0]
    device = Device(program, prog.graph, Kernels(prog.graph), slicer({}))
    rng = np.random.default_rng(0)
    waits: list[int] = []
    values = {}
    for b in combine.sources:
        data = rng.standard_normal(combine.region.shape).astype(np.float32)
        values[b] = data
        piece = Buffer(combine.region, data, None)
        if isinstance(next(op for op in program.ops if b in {m.buf for m in ir.made(op)}), ir.Recv):

            def arrived(piece: Buffer = piece, b: int = b) -> Buffer:
                waits.append(b)
                return piece

            device.defer(b, Buffer(combine.region, np.empty_like(data), None), arrived)
        else:
            device.keep(b, piece)
    before = device.live_bytes
    device.combine_later(combine)
    for b in combine.sources:  # the programs free the partials right after their combine
        device.execute(ir.Free(b), NO_MESSAGES)
    assert waits == [] and combine.buf in device.pending
    got = device.get(combine.buf)
    assert len(waits) == 1 and combine.buf not in device.pending
    np.testing.assert_allclose(got.data, sum(values.values()), rtol=1e-6)
    assert device.live_bytes == before + values[combine.sources[0]].nbytes - sum(v.nbytes for v in values.values())
