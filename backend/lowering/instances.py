"""Repeated layers synthesized once: the tasks of a layer copied, renamed, for the layers after it.

A program with a repeated module (``h = decoder(x0) repeat L as layers``) has ``L`` instances of
the same rules over renamed relations, and a solved plan tiles every instance alike (per
pipeline stage).  Exchange synthesis then makes the same tasks for every instance, up to
renaming: instance ``k`` reads instance ``k - 1``'s result where instance ``k - 1`` read
instance ``k - 2``'s, its own params where the other read its own, and the same shared relations
(rotary tables) from the same buffers once every device holds what it needs of them.  Whole-model
synthesis would cost ``L`` times a layer's; :class:`InstanceCopier` makes it cost a few layers':

- instances are synthesized as usual until two in a row are *copies*: instance ``k``'s tasks are
  exactly instance ``k - 1``'s translated (ids and buffers moved by the length of an instance,
  params mapped to the next instance's loads, names renamed), checked task for task;
- from then on each instance of the same stage (its rules tiled on the same devices) is made by
  translating the previous one's tasks, and with them the layouts of its relations and what
  each device received of them.

Nothing is assumed: an instance that differs (the first, which fetches the shared tables; one
that starts a new pipeline stage) is synthesized as usual, and the check must pass again before
copying resumes.  The programs are the same as synthesizing every instance in turn.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

from edatalog.backend.lowering.tasks import Buffer, Combine, Compute, Entry, Routed, RoutedRows, Selection, Send, Task
from edatalog.ir.forms import RouteKey
from edatalog.ir.graph import Graph, Repeat
from edatalog.solver.plan import Plan

if TYPE_CHECKING:  # the synthesizer's state, read and extended here; no import at run time
    from collections.abc import Callable


class InstanceCopier:
    """Which instances can be copied, and copying them (see the module docstring)."""

    def __init__(self, rep: Repeat, plan: Plan, graph: Graph) -> None:
        self.rep, self.graph = rep, graph
        self.index: dict[str, int] = {name: k for k in range(rep.count) for name in rep.instance(k)}
        self.start: dict[int, int] = {}  # instance -> its first task's id
        self.stop: dict[int, int] = {}  # instance -> one past its last task's id
        self.copies: set[int] = set()  # instances whose tasks are the previous one's, translated
        self.tiles = {k: _tiles(plan, rep, k) for k in range(rep.count)}

    @staticmethod
    def of(graph: Graph, plan: Plan) -> InstanceCopier | None:
        """A copier for the graph's most repeated module, when its instances' rules come one
        instance after the other in the graph (as modules are instantiated); else None."""
        reps = [r for r in graph.repeats if r.count >= 4]
        if not reps:
            return None
        rep = max(reps, key=lambda r: r.count * len(r.nodes))
        names = [n.name for n in graph.nodes]
        first = names.index(rep.node(0, rep.nodes[0])) if rep.node(0, rep.nodes[0]) in names else -1
        run = [name for k in range(rep.count) for name in rep.instance(k)]
        if first < 0 or names[first : first + len(run)] != run:
            return None
        return InstanceCopier(rep, plan, graph)

    def instance_of(self, node: str) -> int | None:
        return self.index.get(node)

    def begin(self, k: int, task: int) -> None:
        self.start[k] = task

    def end(self, synth: Any, k: int, task: int) -> None:
        """Instance ``k`` was synthesized; note whether it is a copy of the one before."""
        self.stop[k] = task
        if k >= 2 and k in self.renamed and self._same_stage(k) and self._length(k) == self._length(k - 1):
            made = synth.tasks[self.start[k] : task]
            if all(_same(a, b) for a, b in zip(self._translated(synth, k), made, strict=True)):
                self.copies.add(k)

    def copyable(self, k: int) -> bool:
        """Whether instance ``k`` can be made by translating instance ``k - 1``: the one before
        it was a copy in turn, all three on one stage's devices, and its relations are named as
        the other's, renamed (the last instance's result takes the module call's name)."""
        return k - 1 in self.copies and self._same_stage(k) and k in self.renamed

    @functools.cached_property
    def renamed(self) -> frozenset[int]:
        """The instances whose rules write the previous instance's relations, renamed."""
        graph = self.graph
        out = set()
        for k in range(1, self.rep.count):
            pairs = zip(self.rep.instance(k - 1), self.rep.instance(k), strict=True)
            if all(self._rename(k, graph.node(a).out) == graph.node(b).out for a, b in pairs):
                out.add(k)
        return frozenset(out)

    def copy(self, synth: Any, k: int) -> None:
        """Make instance ``k`` from instance ``k - 1``: its tasks, buffers, layouts, computed
        blocks and received pieces, as synthesizing it would."""
        delta = self._length(k - 1)
        new = self._translated(synth, k)
        for task in new:
            synth.tasks.append(task)
            buf = synth.buffers.get(task.id - delta)
            if buf is not None:
                synth.buffers[task.id] = Buffer(task.id, buf.device, self._rename(k, buf.relation), buf.region)
        move = self._mover(synth, k)
        rename = self._renamer(k)
        fresh_of: dict[Entry, Entry] = {}
        for name in self._relations(synth, k - 1):
            entries = synth.layout[name]
            moved = [Entry(e.region, {d: move(b) for d, b in e.holders.items()}, _routed(e, rename)) for e in entries]
            synth.layout[rename(name)] = moved
            fresh_of.update(zip(entries, moved, strict=True))
        for (d, old, rows), got in list(synth.received.items()):
            if old in fresh_of:
                fresh = None if rows is None else _rows(rows, rename)
                synth.received[(d, fresh_of[old], fresh)] = [(r, move(b)) for r, b in got]
        for node in self.rep.instance(k - 1):
            if node in synth.blocks:
                synth.blocks[rename(node)] = set(synth.blocks[node])
        self.start[k], self.stop[k] = self.start[k - 1] + delta, self.stop[k - 1] + delta
        self.copies.add(k)

    # -- translating ---------------------------------------------------------------------------------

    def _length(self, k: int) -> int:
        return self.stop[k] - self.start[k]

    def _same_stage(self, k: int) -> bool:
        """Whether instances ``k - 2`` to ``k`` are tiled alike, on the same devices."""
        return all(j in self.tiles and self.tiles[j] == self.tiles[k] for j in (k - 1, k - 2))

    def _renamer(self, k: int) -> Callable[[str], str]:
        return lambda name: self._rename(k, name)

    def _rename(self, k: int, name: str) -> str:
        """``name`` as instance ``k`` sees what instance ``k - 1`` saw: relations of instances
        ``k - 1`` and ``k - 2`` one instance on (``k - 1`` reads ``k - 2``'s result); other names
        unchanged."""
        for j in (k - 1, k - 2):
            old = f"{self.rep.prefix}.{j}."
            if name.startswith(old):
                return f"{self.rep.prefix}.{j + 1}.{name[len(old) :]}"
        return name

    def _relations(self, synth: Any, k: int) -> list[str]:
        """The relations instance ``k`` makes (their layouts come with it)."""
        return list(dict.fromkeys(synth.graph.node(name).out for name in self.rep.instance(k)))

    def _mover(self, synth: Any, k: int) -> Callable[[int], int]:
        """Buffer ids as instance ``k - 1`` reads them, as instance ``k`` does: the two instances
        before ``k`` move by an instance's length, the params of ``k - 1`` become ``k``'s loads,
        anything else (shared relations) stays."""
        delta = self._length(k - 1)
        low, high = self.start[k - 2], self.start[k - 1] + delta
        params: dict[int, int] = {}
        for p in synth.plan.inputs:
            fresh = self._rename(k, p.relation)
            if fresh == p.relation or fresh not in synth.layout:
                continue
            for old, new in zip(synth.layout[p.relation], synth.layout[fresh], strict=True):
                for d, b in old.holders.items():
                    params[b] = new.holders[d]

        def move(b: int) -> int:
            if low <= b < high:
                return b + delta
            return params.get(b, b)

        return move

    def _translated(self, synth: Any, k: int) -> list[Task]:
        """Instance ``k - 1``'s tasks, as instance ``k``'s."""
        move, rename = self._mover(synth, k), self._renamer(k)
        return [_translate(t, move, rename) for t in synth.tasks[self.start[k - 1] : self.stop[k - 1]]]


def _translate(task: Task, move: Callable[[int], int], rename: Callable[[str], str]) -> Task:
    deps = [move(d) for d in task.deps]
    if isinstance(task, Compute):
        reads = [[(move(b), r) for b, r in parts] for parts in task.reads]
        return dataclasses.replace(task, id=move(task.id), deps=deps, node=rename(task.node), reads=reads)
    if isinstance(task, Send):
        selection = task.selection
        if selection is not None:
            selection = Selection(
                _rows(selection.rows, rename),
                selection.region,
                tuple((move(b), r) for b, r in selection.at_source),
                tuple((move(b), r) for b, r in selection.at_dest),
            )
        return dataclasses.replace(
            task,
            id=move(task.id),
            deps=deps,
            source=move(task.source),
            relation=rename(task.relation),
            selection=selection,
        )
    if isinstance(task, Combine):
        sources = [move(b) for b in task.sources]
        return dataclasses.replace(task, id=move(task.id), deps=deps, relation=rename(task.relation), sources=sources)
    raise AssertionError(f"an instance made a {type(task).__name__} task")


def _same(a: Task, b: Task) -> bool:
    return type(a) is type(b) and vars(a) == vars(b)


def _tiles(plan: Plan, rep: Repeat, k: int) -> tuple[object, ...]:
    """How the plan tiles instance ``k``'s rules: splits, devices, reduction axis."""
    return tuple((plan.node(name).tile, plan.node(name).reduce_axis) for name in rep.instance(k))


def _rows(rows: RoutedRows, rename: Callable[[str], str]) -> RoutedRows:
    """Rows routed by the next instance's own route."""
    return dataclasses.replace(rows, route=rename(rows.route))


def _routed(entry: Entry, rename: Callable[[str], str]) -> Routed | None:
    """The entry's routed part, routed by the next instance's own route."""
    r = entry.routed
    return None if r is None else Routed(RouteKey(rename(r.key.relation), r.key.axes), r.lo, r.hi)
