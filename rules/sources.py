"""Checkpoint names of params (``param w[..] : f32 from "NAME", ...``) and their placeholders.

A name may hold placeholders, names in braces:

- ``{i}``, in a module's params only, is the instance's number (``model.layers.{i}.w``): each
  instance's param is a tensor of its own (see :mod:`edatalog.rules.modules`);
- any other (``{e}``) stands for one leading axis of the param, in order of first appearance:
  ``param w1[E, F, D] : f32 from "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"`` is
  stacked along its axis 0 from the ``E`` tensors ``...experts.0.w1.weight`` ..., each ``[F, D]``.
  Mixture-of-experts checkpoints (transformers' Mixtral) save each expert as a tensor of its own,
  while a program computes best over one relation with an expert axis; the placeholders map one
  to the other without code per model (:mod:`edatalog.checkpoint` reads and writes them).

This module checks the names when a program compiles (so that a mistake is reported at its
string, not when a checkpoint fails to load), and turns them into patterns and names for the
checkpoint code.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from edatalog.errors import EdlError, Note, Span
from edatalog.lang import ast

PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
INSTANCE = "i"  # the placeholder of a repeated module's instance number
_INDEX = r"(0|[1-9][0-9]*)"  # an index as a checkpoint writes it: no leading zeros, so one name per index


def stacked(name: str) -> tuple[str, ...]:
    """The placeholders of ``name`` that stack axes (all but ``{i}``), in order of first
    appearance: the param's leading axes, in order."""
    return tuple(dict.fromkeys(m.group(1) for m in PLACEHOLDER.finditer(name) if m.group(1) != INSTANCE))


def filled(name: str, values: Mapping[str, int]) -> str:
    """``name`` with the placeholders of ``values`` replaced by their numbers (the others kept)."""
    return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), name)


def pattern(name: str, capture: bool = True) -> str:
    """A regular expression matching the names ``name`` stands for: each stacked placeholder an
    index (a group of its own when ``capture``, in the order of :func:`stacked`), the rest as
    written."""
    out: list[str] = []
    at = 0
    for m in PLACEHOLDER.finditer(name):
        out.append(re.escape(name[at : m.start()]))
        if m.group(1) == INSTANCE:
            out.append(re.escape(m.group(0)))
        else:
            out.append(_INDEX if capture else _INDEX.replace("(", "(?:", 1))
        at = m.end()
    out.append(re.escape(name[at:]))
    return "".join(out)


def check_sources(statements: Sequence[ast.Statement], in_module: bool) -> None:
    """Every checkpoint name's placeholders: ``{i}`` only in a module, other names at most once
    in a name, no more of them than the param has axes, and the same ones (in the same order)
    in each of a param's names."""
    for s in statements:
        if not isinstance(s, ast.RelationDecl):
            continue
        first: tuple[tuple[str, ...], str, Span] | None = None
        for text, span in s.sources:
            seen: list[str] = []
            for m in PLACEHOLDER.finditer(text):
                key = m.group(1)
                if key == INSTANCE and not in_module:
                    raise EdlError(
                        f"'{{{key}}}' in the checkpoint name of '{s.name}'",
                        span,
                        help="'{i}' stands for an instance's number, in a module's params only",
                    )
                if key != INSTANCE and not key.isidentifier():
                    raise EdlError(
                        f"'{{{key}}}' in the checkpoint name of '{s.name}'",
                        span,
                        help="a placeholder is a name in braces: '{i}' an instance's number (in a module), "
                        "any other ('{e}') a stacked leading axis of the param",
                    )
                if key in seen:
                    raise EdlError(
                        f"'{{{key}}}' twice in the checkpoint name of '{s.name}'",
                        span,
                        help="each placeholder stands for one stacked axis of the param: write it once, "
                        "and give another axis another name ('experts.{a}.part.{b}')",
                    )
                if key != INSTANCE:
                    seen.append(key)
            if len(seen) > len(s.shape):
                axes = ", ".join(f"'{{{k}}}'" for k in seen)
                raise EdlError(
                    f"the checkpoint name of '{s.name}' stacks {len(seen)} axes ({axes}), "
                    f"but '{s.name}' has {len(s.shape)}",
                    span,
                    help="each placeholder but '{i}' stands for one leading axis of the param, in order "
                    "('param w1[E, F, D] : f32 from \"experts.{e}.w1\"'): declare those axes, or drop a placeholder",
                )
            if first is None:
                first = (tuple(seen), text, span)
            elif tuple(seen) != first[0]:
                theirs = ", ".join(f"'{{{k}}}'" for k in first[0]) or "no placeholder"
                ours = ", ".join(f"'{{{k}}}'" for k in seen) or "no placeholder"
                raise EdlError(
                    f"the checkpoint names of '{s.name}' stack different axes: {ours} here, {theirs} in \"{first[1]}\"",
                    span,
                    help="every name of a param stacks the same leading axes: use the same placeholders, "
                    "in the same order, in each",
                    notes=[Note("the first name", first[2])],
                )
