"""Running device programs: the one interpreter behind every runtime that executes a plan.

A :class:`Device` runs one device's program (:mod:`edatalog.ir.program`) on an array namespace
(:mod:`edatalog.backend.kernels.arrays`: numpy for the simulator, torch for the torch runtimes), keeping
its buffers (:class:`Buffer`: a region's cells and, unless the buffer is *full*, which of them
exist) in a store of its own.  Data crosses devices only through a :class:`Transport`: a
:class:`Mailbox` when every device lives in this process, torch.distributed point-to-point ops
across processes (:mod:`edatalog.backend.running.spmd`).  Kernels are the reference algorithm
(:func:`edatalog.backend.kernels.joinagg.evaluate_node`) on each block, restricted once per block
(:class:`Kernels`) however often the programs run.

An op that reads what its device does not hold is an :class:`ExecutionError`: a bug in whatever
made the programs, never a user mistake.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from edatalog.backend.kernels import ops
from edatalog.backend.kernels.arrays import NUMPY, Array, ArrayOps
from edatalog.backend.kernels.attention import AttentionBackwardKernel, AttentionKernel
from edatalog.backend.kernels.joinagg import Known, evaluate_node, known_presence
from edatalog.backend.kernels.optimizer import AdamWKernel
from edatalog.backend.kernels.prepared import Layout, Prepared, layout_of, prepare_block
from edatalog.backend.kernels.reference import write_cells
from edatalog.backend.lowering.fusion import KIND, KIND_ADAMW, KIND_BACKWARD
from edatalog.backend.running import selection
from edatalog.ir import program as ir
from edatalog.ir.adamw import AdamWUpdate, adamw_updates
from edatalog.ir.attention import Chain, attention_chains
from edatalog.ir.attention_backward import Backward, attention_backwards
from edatalog.ir.graph import AGG_NAMES, Graph, JoinAgg
from edatalog.ir.regions import Region
from edatalog.ir.rewrite import restrict


class ExecutionError(Exception):
    """A device touched data it does not hold, or the devices wait for each other forever."""


@dataclasses.dataclass
class Buffer:
    region: Region
    data: Array
    present: Array | None  # None: every cell of the region exists


# Where a load's cells come from: the load -> its region's cells, laid out as the region.
Loader = Callable[[ir.Load], Array]


class Transport(Protocol):
    def send(self, device: int, op: ir.Send, piece: Buffer) -> None: ...

    def ready(self, device: int, op: ir.Recv) -> bool: ...

    def recv(self, device: int, op: ir.Recv) -> Buffer: ...


class Mailbox:
    """Messages between devices of one process: a send leaves a copy of its region under its
    tag, moved to the receiver's device by ``place``; the receive takes it."""

    def __init__(self, place: Callable[[int, Buffer], Buffer] | None = None) -> None:
        self.messages: dict[int, Buffer] = {}
        self.place = place

    def send(self, device: int, op: ir.Send, piece: Buffer) -> None:
        self.messages[op.tag] = piece

    def ready(self, device: int, op: ir.Recv) -> bool:
        return op.tag in self.messages

    def recv(self, device: int, op: ir.Recv) -> Buffer:
        piece = self.messages.pop(op.tag)
        return piece if self.place is None else self.place(device, piece)


class Kernels:
    """Each block of each rule as a join-agg of its own (:func:`restrict`), made once: the same
    programs run many times."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.nodes = {n.name: n for n in graph.nodes}
        self.blocks: dict[tuple[str, ir.Ranges], JoinAgg] = {}
        self.needs: dict[tuple[str, ir.Ranges], tuple[Region, ...]] = {}
        self.known: dict[tuple[str, ir.Ranges], Known | None] = {}
        self.direct: dict[tuple[str, ir.Ranges], bool] = {}
        self.permuted: dict[tuple[str, ir.Ranges], list[int] | None] = {}
        self.onto: dict[tuple[str, ir.Ranges], bool] = {}
        self.placed: dict[tuple[object, ...], Known] = {}
        self.attention: dict[tuple[object, ...], AttentionKernel | AttentionBackwardKernel] = {}
        self.tiling: dict[tuple[Region, tuple[Region, ...]], bool] = {}
        self._chains: list[Chain] | None = None
        self._updates: dict[str, AdamWUpdate] | None = None  # by the rule of p'
        self._backwards: list[Backward] | None = None
        self.prepared: dict[tuple[tuple[str, ir.Ranges], str, tuple[Layout, ...]], Prepared | None] = {}
        self.indexes: dict[tuple[object, ...], tuple[Any, ...]] = {}
        self.shapes: dict[tuple[str, ir.Ranges], list[int]] = {}
        self.static = static_nodes(graph)
        self.constants: dict[tuple[int, int], Buffer] = {}  # (device, buffer) -> a static block

    def fork(self) -> Kernels:
        """A copy that starts with everything made so far and keeps what it makes to itself: a
        tracer's, whose tensors must not reach later calls."""
        twin = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, dict):
                setattr(twin, name, dict(value))
        return twin

    def constant(self, device: int, op: ir.Kernel, make: Callable[[], Buffer]) -> Buffer:
        """The block ``op`` makes: computed by ``make``, and for a rule that reads no input or
        param (a rotary table, a mask), computed on the first call only and kept."""
        if op.node not in self.static:
            return make()
        key = (device, op.buf)
        if key not in self.constants:
            self.constants[key] = make()
        return self.constants[key]

    def block(self, op: ir.Kernel) -> tuple[JoinAgg, JoinAgg, tuple[Region, ...]]:
        """The rule, its block as a join-agg, and what the block reads of each input."""
        node = self.nodes[op.node]
        key = (op.node, op.ranges)
        if key not in self.blocks:
            ranges = op.range_map
            block = restrict(node, ranges)
            self.blocks[key] = block
            self.needs[key] = tuple(Region.through(acc.axes, ranges) for acc in node.inputs)
            # Supports decide presence when every relation read has an exact one.
            exact = all(self.graph.relation(acc.relation).support_exact for acc in node.inputs)
            self.known[key] = known_presence(block, exact)
            self.direct[key] = _head_is_result_layout(block)
            self.permuted[key] = _head_permutation(block)
            heads = [p.index for ax in block.out_axes for p in ax.parts if p.index is not None]
            self.onto[key] = len(heads) == len(set(heads))  # d[i, i] writes a diagonal only
        return node, self.blocks[key], self.needs[key]

    def backward_kernel(self, op: ir.Fused, xp: ArrayOps, device: Any) -> AttentionBackwardKernel | None:
        """The fast kernel of a fused attention backward on ``xp`` (torch's attention, forward
        and backward), made once per device; None where there is none."""
        if xp.name != "torch" or op.kind != KIND_BACKWARD:
            return None
        where = (tuple((k.node, k.ranges) for k in op.kernels), str(device))
        if where not in self.attention:
            names = {k.node for k in op.kernels}
            bw = next((b for b in self.backwards() if set(b.nodes) == names), None)
            if bw is None:
                return None
            by_rule = {k.node: k for k in op.kernels}
            grads = [(self.block(by_rule[r])[1], by_rule[r]) for r in bw.results]
            blocks = {r: self.block(by_rule[r])[1] for r in bw.inner}
            self.attention[where] = AttentionBackwardKernel(bw, blocks, grads, xp, device)
        kernel = self.attention[where]
        assert isinstance(kernel, AttentionBackwardKernel)
        return kernel

    def adamw_kernel(self, op: ir.Fused, xp: ArrayOps) -> AdamWKernel | None:
        """The fast kernel of a fused AdamW update on ``xp`` (torch's fused AdamW), where there is
        one and every block of the op is full (the kernel has no absent cells)."""
        if op.kind != KIND_ADAMW or not AdamWKernel.supports(xp, op.dtype) or not all(k.full for k in op.kernels):
            return None
        if self._updates is None:
            self._updates = {u.update: u for u in adamw_updates(self.graph)}
        update = self._updates.get(op.kernels[-1].node)
        return None if update is None else AdamWKernel(update)

    def backwards(self) -> list[Backward]:
        if self._backwards is None:
            self._backwards = attention_backwards(self.graph)
        return self._backwards

    def fused_kernel(self, op: ir.Fused, xp: ArrayOps, device: Any) -> AttentionKernel | None:
        """The fast kernel of a fused op on ``xp`` (torch's attention), made once per device; None
        where there is none."""
        if xp.name != "torch" or op.kind != KIND:
            return None
        where = (op.kernels[0].node, op.kernels[0].ranges, op.kernels[-1].ranges, str(device))
        if where not in self.attention:
            ends = (op.kernels[0].node, op.kernels[-1].node)
            chain = next((c for c in self.chains() if (c.scores, c.out) == ends), None)
            if chain is None:
                return None
            _, sc, _ = self.block(op.kernels[0])
            _, out, _ = self.block(op.kernels[-1])
            lse = next((k for k in op.exported if isinstance(k, ir.Kernel) and k.node == chain.lse), None)
            self.attention[where] = AttentionKernel(chain, op, sc, out, xp, device, lse)
        kernel = self.attention[where]
        assert isinstance(kernel, AttentionKernel)
        return kernel

    def tiles(self, need: Region, parts: Sequence[tuple[int, Region]]) -> bool:
        """Whether the parts of a read are disjoint and fill its need (decided once per read)."""
        key = (need, tuple(r for _, r in parts))
        if key not in self.tiling:
            regions = key[1]
            disjoint = all(a.intersect(b).empty for k, a in enumerate(regions) for b in regions[k + 1 :])
            self.tiling[key] = disjoint and sum(r.size for r in regions) == need.size
        return self.tiling[key]

    def prepared_for(
        self,
        key: tuple[str, ir.Ranges],
        block: JoinAgg,
        data: Sequence[Array],
        xp: ArrayOps,
        device: Any,
        known: Known | None,
    ) -> Prepared | None:
        """The block's evaluation prepared for these inputs' layouts (see ``prepare_block``),
        made once per layout and device; None where the general evaluation runs."""
        if xp.name != "torch" or known is None:
            return None
        where = (key, str(device), layout_of(data))
        if where not in self.prepared:
            self.prepared[where] = prepare_block(block, list(where[2]), xp, device, known)
        return self.prepared[where]

    def index_of(self, region: Region, outer: Region, xp: ArrayOps, device: Any) -> tuple[Any, ...]:
        """An index selecting ``region``'s cells in data laid out as ``outer``, worked out once
        per pair of regions (and device)."""
        key = (region, outer, xp.name, str(device))
        if key not in self.indexes:
            at = region.at(outer)
            if xp is not NUMPY and not all(isinstance(a, slice) for a in at):
                at = tuple(a if isinstance(a, slice) else xp.asarray(a, device=device) for a in at)
            self.indexes[key] = at
        return self.indexes[key]

    def chains(self) -> list[Chain]:
        if self._chains is None:
            self._chains = attention_chains(self.graph)
        return self._chains

    def known_on(self, key: tuple[str, ir.Ranges], xp: ArrayOps, device: Any) -> Known | None:
        """The block's decided presence (see ``known_presence``) as arrays of ``xp`` on ``device``,
        made once per device."""
        static = self.known[key]
        if static is None or static.present is None:
            return static
        where = (key, xp.name, str(device))
        if where not in self.placed:
            self.placed[where] = Known(xp.asarray(static.present, xp.bool_, device))
        return self.placed[where]


class Device:
    """One device running its program: ``step`` runs the next op."""

    def __init__(
        self,
        program: ir.DeviceProgram,
        graph: Graph,
        kernels: Kernels,
        loader: Loader,
        xp: ArrayOps = NUMPY,
        device: Any = None,
        on_op: Callable[[int, ir.Op, str], None] | None = None,
        owned: set[int] | None = None,
    ) -> None:
        self.program, self.graph, self.kernels, self.loader = program, graph, kernels, loader
        self.xp, self.device, self.on_op = xp, device, on_op
        # Loads whose memory this call owns (exclusive carried blocks it took: see
        # edatalog.backend.running.carry): a fused op may write over those it reads last.
        self.owned: set[int] = owned if owned is not None else set()
        self.store: dict[int, Buffer] = {}
        self.pending: dict[int, Callable[[], Buffer]] = {}  # see ``defer``
        self.position = 0
        self.live_bytes = 0  # of the buffers in the store (a buffer's cells, and its mask)
        self.peak_bytes = 0  # the most ``live_bytes`` has been

    @property
    def index(self) -> int:
        return self.program.device

    @property
    def done(self) -> bool:
        return self.position >= len(self.program.ops)

    def runnable(self, transport: Transport) -> bool:
        """Whether the next op can run now: not a receive whose message has not come, nor a
        collective (its members run it together: :func:`run_devices`)."""
        if self.done:
            return False
        op = self.program.ops[self.position]
        if isinstance(op, ir.Collective):
            return False
        return not isinstance(op, ir.Recv) or transport.ready(self.index, op)

    @property
    def waiting_at(self) -> ir.Collective | None:
        """The collective this device has come to, if its next op is one."""
        op = None if self.done else self.program.ops[self.position]
        return op if isinstance(op, ir.Collective) else None

    def step(self, transport: Transport) -> None:
        op = self.program.ops[self.position]
        if self.on_op is not None:
            self.on_op(self.position, op, "begin")
        self.execute(op, transport)
        if self.on_op is not None:
            self.on_op(self.position, op, "end")
        self.position += 1

    def keep(self, buf: int, piece: Buffer) -> None:
        """Hold ``piece`` as buffer ``buf`` (counted in this device's live and peak bytes)."""
        self.store[buf] = piece
        self.live_bytes += _nbytes(piece)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def execute(self, op: ir.Op, transport: Transport) -> None:
        xp = self.xp
        if isinstance(op, ir.Load):
            data = xp.asarray(self.loader(op), xp.dtype(op.dtype), self.device)
            self.keep(op.buf, Buffer(op.region, data, None))
        elif isinstance(op, ir.Kernel):
            self.keep(op.buf, self.kernels.constant(self.index, op, lambda: self.kernel(op)))
        elif isinstance(op, ir.Send):
            piece = self.cut(self.get(op.buf), op.region)
            if op.select is not None and xp.reads_back:  # only the rows the reader reads travel
                data, present = selection.pack(xp, piece.data, piece.present, self.rows(op.select))
                piece = Buffer(piece.region, data, present)
            transport.send(self.index, op, piece)
        elif isinstance(op, ir.Recv):
            piece = transport.recv(self.index, op)
            if piece.region != op.region:
                raise ExecutionError(f"device {self.index} receives {piece.region} for #{op.tag}, not {op.region}")
            if op.select is not None:
                piece = self.selected(op, piece)
            self.keep(op.buf, piece)
        elif isinstance(op, ir.Fused):
            self.keep(op.buf, self.fused(op))
        elif isinstance(op, ir.Combine):
            self.keep(op.buf, self.combined(op, [self.get(b) for b in op.sources]))
        else:
            assert isinstance(op, ir.Free)
            if op.buf not in self.store:
                raise ExecutionError(f"device {self.index} frees buffer %{op.buf}, which it does not hold")
            finish = self.pending.pop(op.buf, None)
            if finish is not None:  # under way and never read (a plan's dead partial): taken all the same
                finish()
            self.live_bytes -= _nbytes(self.store.pop(op.buf))

    # -- buffers -------------------------------------------------------------------------------

    def defer(self, buf: int, issued: Buffer, finish: Callable[[], Buffer]) -> None:
        """Hold ``issued`` (a collective's result, under way) as buffer ``buf`` until an op reads
        it; ``finish`` then waits for it and makes the buffer.  The ops in between run while it
        travels, as DDP overlaps its gradients' all-reduces with the rest of the backward.  A
        buffer freed unread is finished at its ``Free``: a message nobody waits for is never
        taken (gloo's sender then waits for it until the timeout), and a later call's receive of
        the same tag would take it."""
        self.keep(buf, issued)
        self.pending[buf] = finish

    def combine_later(self, op: ir.Combine) -> None:
        """Defer a combine of partials some of which are still under way (a received piece of a
        reduce-scatter): it runs, after waiting for them, where its result is first read, so a
        backward's gradient reductions travel while the rest of it runs.  The sources are taken
        as they stand, so that their ``Free`` right after does not wait for them."""
        sources = [(self.pending.pop(b, None), self.store[b]) for b in op.sources]

        def finish() -> Buffer:
            return self.combined(op, [later() if later is not None else held for later, held in sources])

        held = sources[0][1]  # counted as the combine's region of it (a view: nothing is copied)
        self.defer(op.buf, Buffer(op.region, held.data[self.index_of(op.region, held.region)], None), finish)

    def combined(self, op: ir.Combine, sources: Sequence[Buffer]) -> Buffer:
        """What a combine makes of its sources: their parts in its region, folded."""
        agg = AGG_NAMES[self.graph.relation(op.relation).aggop or "="]
        return self.fold([self.cut(b, op.region) for b in sources], agg, op.dtype, op.full)

    def rows(self, select: ir.Select) -> selection.Rows:
        """The rows of a selective message that travel, from this device's cells of the route."""
        route, _ = self.assemble(select.region, select.reads, self.graph.relation(select.relation).dtype)
        return selection.rows(self.xp, route, select)

    def selected(self, op: ir.Recv, piece: Buffer) -> Buffer:
        """A selective message as its buffer: its rows in place (packed, or the whole region
        while recording: see :mod:`edatalog.backend.running.selection`), the others absent."""
        assert op.select is not None
        rows = self.rows(op.select)
        if self.xp.reads_back:
            data, present = selection.unpack(self.xp, piece.data, piece.present, rows, op.region.shape, self.device)
        else:
            data, present = selection.masked(self.xp, piece.data, piece.present, rows)
        return Buffer(op.region, data, present)

    def get(self, buf: int) -> Buffer:
        if buf in self.pending:
            self.store[buf] = self.pending.pop(buf)()
        if buf not in self.store:
            raise ExecutionError(f"device {self.index} reads buffer %{buf}, which it does not hold")
        return self.store[buf]

    def cut(self, buf: Buffer, region: Region) -> Buffer:
        """The part of a buffer covering ``region`` (the buffer itself when it is all of it)."""
        if region == buf.region:
            return buf
        if not buf.region.contains(region):
            raise ExecutionError(f"a read of {region} falls outside the buffer's region {buf.region}")
        at = self.index_of(region, buf.region)
        data = self.xp.contiguous(buf.data[at])
        present = None if buf.present is None else self.xp.contiguous(buf.present[at])
        return Buffer(region, data, present)

    def index_of(self, region: Region, outer: Region) -> tuple[Any, ...]:
        """An index selecting ``region``'s cells in data laid out as ``outer``."""
        return self.kernels.index_of(region, outer, self.xp, self.device)

    def assemble(self, need: Region, parts: Sequence[tuple[int, Region]], dtype: str) -> tuple[Array, Array | None]:
        """A block's view of one input, its need, from the local buffers that cover it, in the
        relation's dtype (partials of half types are kept in f32 until they are read)."""
        xp = self.xp
        want = xp.dtype(dtype)
        if len(parts) == 1 and parts[0][1] == need:  # the usual case: one buffer holds the need
            buf = self.get(parts[0][0])
            if buf.region == need:
                return xp.cast(buf.data, want), buf.present
            if buf.present is None:  # a view, not a copy: the kernel reads it once
                return xp.cast(buf.data[self.index_of(need, buf.region)], want), None
        tiled = self.kernels.tiles(need, parts) and all(self.get(b).present is None for b, _ in parts)
        if tiled:  # disjoint full pieces that fill the need: no presence to track
            data = xp.empty(need.shape, want, self.device)
            for b, part in parts:
                buf = self.get(b)
                data[self.index_of(part, need)] = xp.cast(buf.data[self.index_of(part, buf.region)], want)
            return data, None
        data = xp.full(need.shape, 0, want, self.device)
        present = xp.full(need.shape, False, xp.bool_, self.device)
        for b, part in parts:
            piece = self.cut(self.get(b), part)
            at = self.index_of(part, need)
            # Pieces of a relation with several '=' rules can overlap, each present only on its own
            # cells: an absent cell must not hide another's.
            if piece.present is None:
                data[at] = xp.cast(piece.data, want)
                present[at] = True
            else:
                data[at] = xp.where(piece.present, xp.cast(piece.data, want), data[at])
                present[at] = xp.logical_or(present[at], piece.present)
        return data, (None if xp.all(present) else present)

    def kernel(self, op: ir.Kernel) -> Buffer:
        node, block, needs = self.kernels.block(op)
        key = (op.node, op.ranges)
        data, present = [], []
        for acc, parts, need in zip(node.inputs, op.reads, needs, strict=True):
            d, p = self.assemble(need, parts, self.graph.relation(acc.relation).dtype)
            data.append(d)
            present.append(p)
        xp = self.xp
        known = self.kernels.known_on(key, xp, self.device)
        fast = self.kernels.prepared_for(key, block, data, xp, self.device, known)
        value, pres, out_vars = fast(data) if fast is not None else evaluate_node(block, data, present, xp, known)
        dtype = xp.dtype(op.dtype)
        direct = self.kernels.direct[key]  # the result is laid out as the head: keep it
        # Else, where the head is the result's indices in another order and no cell is absent:
        # the result permuted (no fill, and no copy where it already lies in the head's order,
        # as a scatter-add's may).
        perm = None if direct else self.kernels.permuted[key]
        if direct or (perm is not None and (op.full or pres is None)):
            shape = self.kernels.shapes.get(key)
            if shape is None:  # composite heads: the same cells, row-major
                box = block.box
                shape = self.kernels.shapes[key] = [box[v] for v in out_vars]
            value = xp.broadcast_to(value, shape)
            if pres is not None:  # absent cells hold 0
                value = xp.where(pres, value, xp.constant(0, value.dtype))
            if perm is not None:
                value = xp.transpose(value, perm)
            out = xp.view(xp.contiguous(xp.cast(value, dtype)), op.region.shape)
            if op.full or pres is None:
                return Buffer(op.region, out, None)
            return Buffer(op.region, out, xp.view(xp.contiguous(xp.broadcast_to(pres, shape)), op.region.shape))
        out = xp.full(op.region.shape, 0, dtype, self.device)
        if op.full:  # every cell is known to exist: nothing to mark
            write_cells(out, None, block, value, pres, out_vars, None, xp)
            return Buffer(op.region, out, None)
        cells = xp.full(op.region.shape, False, xp.bool_, self.device)
        write_cells(out, cells, block, value, pres, out_vars, None, xp)
        if pres is None and self.kernels.onto[key]:
            return Buffer(op.region, out, None)
        return Buffer(op.region, out, None if xp.all(cells) else cells)

    def fused(self, op: ir.Fused) -> Buffer:
        """Fused ops: one fast kernel where this namespace has one, else each inner op in turn
        (exactly the rules), their inner buffers gone when the last one is made.  The buffers
        it exports are kept here; the last one is returned."""
        backward = self.kernels.backward_kernel(op, self.xp, self.device)
        if backward is not None:
            by_rule = {k.node: k for k in op.kernels}
            bw = backward.bw
            sc, gp, gl, probs = (by_rule[r] for r in (bw.scores, bw.grad_probs, bw.grad_sums, bw.probs))
            where = (
                (sc, bw.chain.q),
                (sc, bw.chain.k),
                (gp, backward.v_pos),
                (gp, backward.go_pos),
                (gl, backward.o_pos),
                (probs, backward.lse_pos),
            )
            operands = []
            for kernel, position in where:
                node, _, needs = self.kernels.block(kernel)
                dtype = self.graph.relation(node.inputs[position].relation).dtype
                operands.append(self.assemble(needs[position], kernel.reads[position], dtype)[0])
            last = None
            for rule, data in zip(bw.results, backward(*operands), strict=True):
                kernel = by_rule[rule]
                if kernel.buf == op.buf:
                    last = Buffer(op.region, data, None)
                else:
                    self.keep(kernel.buf, Buffer(kernel.region, data, None))
            assert last is not None
            return last
        adamw = self.kernels.adamw_kernel(op, self.xp)
        if adamw is not None:
            updated = self._adamw(op, adamw)
            if updated is not None:
                return updated
        fast = self.kernels.fused_kernel(op, self.xp, self.device)
        if fast is None:
            for k in op.body:
                self.execute(k, NO_MESSAGES)
            for b in op.internal:
                self.live_bytes -= _nbytes(self.store.pop(b))
            made = self.store.pop(op.buf)
            self.live_bytes -= _nbytes(made)  # kept again as the fused op's buffer
            return made
        sc, out = op.kernels[0], op.kernels[-1]
        chain = fast.chain
        operands = []
        for kernel, position in ((sc, chain.q), (sc, chain.k), (out, chain.v)):
            node, _, needs = self.kernels.block(kernel)
            relation = node.inputs[position].relation
            data, _ = self.assemble(needs[position], kernel.reads[position], self.graph.relation(relation).dtype)
            operands.append(data)
        out, lse = fast(*operands)
        for inner in op.exported:  # the log-sum-exp, where the block makes it
            assert lse is not None and isinstance(inner, ir.Kernel) and inner.node == chain.lse
            self.keep(inner.buf, Buffer(inner.region, lse, None))
        return Buffer(op.region, out, None)

    def _adamw(self, op: ir.Fused, kernel: AdamWKernel) -> Buffer | None:
        """A fused AdamW update by torch's kernel; None (the rules run instead) where a block it
        reads may lack cells."""
        operands: dict[str, Array | None] = {"s": None}
        whole: dict[str, int] = {}  # role -> the one buffer that holds the operand whole
        for role, (place, position) in kernel.update.operands.items():
            inner = op.kernels[place]
            node, _, needs = self.kernels.block(inner)
            parts = inner.reads[position]
            dtype = self.graph.relation(node.inputs[position].relation).dtype
            data, present = self.assemble(needs[position], parts, dtype)
            if present is not None:
                return None
            operands[role] = data
            if len(parts) == 1 and self.get(parts[0][0]).region == needs[position]:
                whole[role] = parts[0][0]
        # The state's blocks where this call owns them; the gradient's wherever it may (made in
        # this call, never a load).
        free = set(op.overwrites) & self.owned
        p_, m_, v_ = (whole.get(role) in free for role in ("p", "m", "v"))
        g_ = whole.get("g") in set(op.overwrites)
        p, g, m, v, t = (operands[n] for n in ("p", "g", "m", "v", "t"))
        p2, m2, v2 = kernel(p, g, m, v, t, operands["s"], (p_, m_, v_, g_))
        first, second, _ = op.kernels
        self.keep(first.buf, Buffer(first.region, m2, None))
        self.keep(second.buf, Buffer(second.region, v2, None))
        return Buffer(op.region, p2, None)

    def fold(self, parts: list[Buffer], agg: str | None, dtype: str, full: bool) -> Buffer:
        """Partials of one region folded with the aggregation; absent cells contribute nothing."""
        if len(parts) == 1:
            return parts[0]
        assert agg is not None, "only aggregations have partials"
        xp = self.xp
        cdt = xp.dtype(dtype)
        ident = ops.identity(agg, cdt, xp)
        acc, present = None, None
        for p in parts:
            vals = xp.cast(p.data, cdt) if p.present is None else xp.where(p.present, xp.cast(p.data, cdt), ident)
            acc = vals if acc is None else ops.fold(agg, acc, vals, xp)
            if p.present is None:
                present = True
            elif present is not True:
                present = p.present if present is None else xp.logical_or(present, p.present)
        assert acc is not None
        if present is True or full:
            return Buffer(parts[0].region, acc, None)
        assert present is not None
        acc = xp.where(present, acc, xp.constant(0, cdt))
        return Buffer(parts[0].region, acc, None if xp.all(present) else present)


def static_nodes(graph: Graph) -> frozenset[str]:
    """The rules whose results depend on no input or param (those reading only relations that
    such rules alone write; a rule reading nothing is one), and that write no output: a caller
    may change the outputs it is given, and these blocks are kept from call to call."""
    static: set[str] = set()
    while True:
        fixed = {r.name for r in graph.relations if r.kind == "derived"}
        fixed = {r for r in fixed if all(p.name in static for p in graph.producers(r))}
        grown = {n.name for n in graph.nodes if all(acc.relation in fixed for acc in n.inputs)}
        if grown == static:
            return frozenset(n for n in static if graph.node(n).out not in graph.outputs)
        static = grown


def _nbytes(piece: Buffer) -> int:
    return int(piece.data.nbytes) + (0 if piece.present is None else int(piece.present.nbytes))


def run_devices(
    devices: Sequence[Device], transport: Transport, choose: Callable[[list[int]], int] | None = None
) -> None:
    """Run every device's program to its end, in turns: each device runs until it waits on a
    receive or a collective (or, with ``choose``, the chosen one of the runnable devices runs one
    op); a collective runs once every member of its group has come to it (:func:`meet`)."""
    while True:
        ready = [k for k, d in enumerate(devices) if d.runnable(transport)]
        if not ready:
            if _meet_any(devices):
                continue
            break
        for k in [choose(ready)] if choose is not None else ready:
            dev = devices[k]
            while dev.runnable(transport):
                dev.step(transport)
                if choose is not None:
                    break
    stuck = [d for d in devices if not d.done]
    if stuck:
        where = ", ".join(f"device {d.index} at {d.program.ops[d.position]}" for d in stuck)
        raise ExecutionError(f"devices wait forever: {where}")


def _meet_any(devices: Sequence[Device]) -> bool:
    """Run every collective whose members all wait at it; whether one ran."""
    at: dict[int, list[Device]] = {}
    for d in devices:
        op = d.waiting_at
        if op is not None:
            at.setdefault(op.tag, []).append(d)
    met = False
    for members in at.values():
        op = members[0].waiting_at
        assert op is not None
        if sorted(d.index for d in members) == list(op.group):
            meet(members)
            met = True
    return met


def meet(members: Sequence[Device]) -> None:
    """One collective run by all its members in this process (each a :class:`Device` waiting
    at it): every member folds the partials (or assembles the pieces) in group order, on its
    own device, so that every member gets the same cells."""
    ops_ = {d.index: d.waiting_at for d in members}
    by_index = {d.index: d for d in members}
    first = ops_[members[0].index]
    assert first is not None
    for d in members:
        op = ops_[d.index]
        assert op is not None
        if d.on_op is not None:
            d.on_op(d.position, op, "begin")
        parts = []
        for m in op.group:
            src = by_index[m]
            m_op = ops_[m]
            assert m_op is not None
            piece = src.cut(src.get(m_op.source), m_op.part(m))
            parts.append(Buffer(piece.region, d.xp.asarray(piece.data, device=d.device), None))
        if op.kind is ir.CollectiveKind.ALL_GATHER:
            whole = d.xp.empty(op.whole.shape, d.xp.dtype(op.dtype), d.device)
            for piece in parts:
                whole[d.index_of(piece.region, op.whole)] = piece.data
            made = Buffer(op.whole, whole, None)
        else:
            made = d.fold(parts, op.reduce, op.dtype, True)
            if op.region != op.whole:
                made = d.cut(made, op.region)
        d.keep(op.buf, made)
    for d in members:
        if d.on_op is not None:
            d.on_op(d.position, ops_[d.index], "end")  # type: ignore[arg-type]
        d.position += 1


def slicer(values: Mapping[str, Array], blocks: Mapping[int, Array] | None = None) -> Loader:
    """A loader cutting each load's region out of whole relations, or taking the block already
    loaded for it (``blocks``, by buffer)."""

    def load(op: ir.Load) -> Array:
        if blocks is not None and op.buf in blocks:
            return blocks[op.buf]
        full = values[op.relation]
        return full[op.region.at(Region.whole(tuple(full.shape)))]

    return load


def gather(
    graph: Graph,
    name: str,
    pieces: Sequence[tuple[Region, Buffer]],
    xp: ArrayOps = NUMPY,
    device: Any = None,
) -> tuple[Array, Array | None]:
    """A whole relation from the pieces of it that some device holds: its cells (0 where absent)
    in the relation's dtype, and which exist (None: all)."""
    rel = graph.relation(name)
    whole = Region.whole(rel.shape)
    if len(pieces) == 1 and pieces[0][0] == whole == pieces[0][1].region and pieces[0][1].present is None:
        # One device made all of it (every one-device program): its buffer, as it is.  (Blocks
        # kept from call to call are never outputs: see ``static_nodes``.)
        return xp.cast(xp.asarray(pieces[0][1].data, device=device), xp.dtype(rel.dtype)), None
    regions = [r for r, _ in pieces]
    if all(buf.present is None for _, buf in pieces) and _tile(whole, regions):
        # Full pieces that fill the relation, disjoint: no presence to track (decided by the
        # regions alone, never by looking at cells).
        data = xp.empty(rel.shape, xp.dtype(rel.dtype), device)
        for region, buf in pieces:
            piece = buf if buf.region == region else _cut_any(buf, region, xp, device)
            data[_index(region.at(whole), xp, device)] = xp.cast(xp.asarray(piece.data, device=device), data.dtype)
        return data, None
    data = xp.full(rel.shape, 0, xp.dtype(rel.dtype), device)
    present = xp.full(rel.shape, False, xp.bool_, device)
    for region, buf in pieces:
        piece = buf if buf.region == region else _cut_any(buf, region, xp, device)
        at = region.at(whole)
        if xp is not NUMPY:
            at = tuple(a if isinstance(a, slice) else xp.asarray(a, device=device) for a in at)
        vals = xp.cast(xp.asarray(piece.data, device=device), xp.dtype(rel.dtype))
        if piece.present is None:
            data[at] = vals
            present[at] = True
        else:
            p = xp.asarray(piece.present, device=device)
            data[at] = xp.where(p, vals, data[at])
            present[at] = xp.logical_or(present[at], p)
    if xp.all(present):
        return data, None
    return xp.where(present, data, xp.constant(0, data.dtype)), present


def _tile(whole: Region, regions: Sequence[Region]) -> bool:
    """Whether ``regions`` are disjoint and fill ``whole``."""
    disjoint = all(a.intersect(b).empty for k, a in enumerate(regions) for b in regions[k + 1 :])
    return disjoint and sum(r.size for r in regions) == whole.size


def _index(at: tuple[Any, ...], xp: ArrayOps, device: Any) -> tuple[Any, ...]:
    if xp is NUMPY:
        return at
    return tuple(a if isinstance(a, slice) else xp.asarray(a, device=device) for a in at)


def _cut_any(buf: Buffer, region: Region, xp: ArrayOps, device: Any) -> Buffer:
    at = region.at(buf.region)
    if xp is not NUMPY:
        at = tuple(a if isinstance(a, slice) else xp.asarray(a, device=xp.device_of([buf.data])) for a in at)
    return Buffer(region, buf.data[at], None if buf.present is None else buf.present[at])


def _head_is_result_layout(block: JoinAgg) -> bool:
    """Whether the evaluator's result (over the output indices, in join order) already is the
    head's layout: plain indices in that order, no fixed places but ones of a single place (the
    block of ``qr[s, (0, i)]`` holds only the cells of place 0: an axis of size 1 to its layout)."""
    parts = [p for ax in block.out_axes for p in ax.parts if not (p.index is None and p.extent == 1)]
    out_vars = [i.name for i in block.indices if i.name not in block.agg_indices]
    return all(p.index is not None for p in parts) and [p.index for p in parts] == out_vars


def _head_permutation(block: JoinAgg) -> list[int] | None:
    """Where the head is the evaluator's result indices (in join order) in another order, one
    plain index per axis: the permutation taking the result to the head's layout; else None."""
    parts = [ax.parts[0] for ax in block.out_axes if len(ax.parts) == 1]
    head = [p.index for p in parts if p.index is not None]
    out_vars = [i.name for i in block.indices if i.name not in block.agg_indices]
    if len(head) != len(block.out_axes) or sorted(head) != sorted(out_vars) or len(set(head)) != len(head):
        return None
    return [out_vars.index(h) for h in head]


class _NoMessages:
    """The transport of ops that never send or receive: those inside a fused op, and an SPMD
    rank's kernels (its messages go in batches)."""

    def send(self, device: int, op: ir.Send, piece: Buffer) -> None:
        raise AssertionError("an unexpected send")

    def ready(self, device: int, op: ir.Recv) -> bool:
        raise AssertionError("an unexpected receive")

    def recv(self, device: int, op: ir.Recv) -> Buffer:
        raise AssertionError("an unexpected receive")


NO_MESSAGES = _NoMessages()
