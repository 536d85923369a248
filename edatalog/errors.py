"""Source locations and user-facing diagnostics.

Every mistake a user can make surfaces as an :class:`EdlError` that prints like a compiler
diagnostic: ``file:line:col: error: message``, the offending source line, a caret under the span,
and optional ``help:`` and ``note:`` lines.  Nothing in edatalog should show a user a traceback.
What is not a mistake but must not surprise a user (a compile that takes tens of seconds) is a
notice: :data:`NOTICES`, which the command line prints (:func:`show_notices`).
"""

from __future__ import annotations

import bisect
import difflib
import logging
import os
import sys
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any


@dataclass(frozen=True, eq=False)
class Source:
    """A named piece of program text. Compared by identity: two loads are two sources."""

    name: str
    text: str = field(repr=False)

    @cached_property
    def _line_starts(self) -> tuple[int, ...]:
        starts = [0]
        for i, ch in enumerate(self.text):
            if ch == "\n":
                starts.append(i + 1)
        return tuple(starts)

    def line_col(self, offset: int) -> tuple[int, int]:
        """1-based line and column of a character offset (a tab counts as one column)."""
        offset = max(0, min(offset, len(self.text)))
        line = bisect.bisect_right(self._line_starts, offset) - 1
        return line + 1, offset - self._line_starts[line] + 1

    def line_text(self, line: int) -> str:
        start = self._line_starts[line - 1]
        end = self.text.find("\n", start)
        return self.text[start:] if end < 0 else self.text[start:end]

    def span(self, start: int, end: int | None = None) -> Span:
        return Span(self, start, start if end is None else end)


@dataclass(frozen=True)
class Span:
    """A half-open character range ``[start, end)`` of a :class:`Source`."""

    source: Source
    start: int
    end: int

    @property
    def line(self) -> int:
        return self.source.line_col(self.start)[0]

    @property
    def col(self) -> int:
        return self.source.line_col(self.start)[1]

    @property
    def text(self) -> str:
        return self.source.text[self.start : self.end]

    def to(self, other: Span) -> Span:
        """The span covering both ``self`` and ``other``."""
        return Span(self.source, min(self.start, other.start), max(self.end, other.end))

    def __str__(self) -> str:
        line, col = self.source.line_col(self.start)
        return f"{self.source.name}:{line}:{col}"

    def __repr__(self) -> str:
        return f"Span({self}, {self.text!r})"

    def snippet(self) -> str:
        """The first source line of the span with a caret line under it."""
        line, col = self.source.line_col(self.start)
        text = self.source.line_text(line)
        end_line, end_col = self.source.line_col(max(self.start, self.end - 1))
        stop = (end_col if end_line == line else len(text)) if self.end > self.start else col
        width = max(1, sum(_cells(ch) for ch in text[col - 1 : stop]))
        # Reproduce tabs in the caret line so the caret stays aligned in any terminal; wide
        # characters take two columns, combining marks none.
        pad = "".join("\t" if ch == "\t" else " " * _cells(ch) for ch in text[: col - 1])
        shown = "".join(_visible(ch) for ch in text.removesuffix("\r"))
        gutter = f"{line:>5} | "
        return f"{gutter}{shown}\n{' ' * (len(gutter) - 2)}| {pad}^{'~' * (width - 1)}"


def _visible(ch: str) -> str:
    """``ch`` as shown in a snippet: characters that are invisible or that a terminal would act
    on (controls, format characters, line separators, lone surrogates) become U+FFFD."""
    return ch if ch == "\t" or ch.isprintable() else "\ufffd"


def _cells(ch: str) -> int:
    """Terminal columns ``ch`` takes in a snippet line."""
    if ch == "\t" or not ch.isprintable():
        return 1
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in "WF" else 1


@dataclass(frozen=True)
class Note:
    """A secondary message, optionally pointing at another place in the source."""

    message: str
    span: Span | None = None


@dataclass(frozen=True)
class Diagnostic:
    """An error or warning with a location, a suggested fix and notes."""

    severity: str  # "error" | "warning"
    message: str
    span: Span | None = None
    help: str | None = None
    notes: tuple[Note, ...] = field(default=())

    def render(self) -> str:
        head = f"{self.span}: " if self.span is not None else ""
        lines = [_printable(f"{head}{self.severity}: {self.message}")]
        if self.span is not None:
            lines.append(self.span.snippet())
        if self.help:
            lines.append(_printable(f"  help: {self.help}"))
        for note in self.notes:
            where = f"{note.span}: " if note.span is not None else ""
            lines.append(_printable(f"  note: {where}{note.message}"))
            if note.span is not None:
                lines.append(note.span.snippet())
        return "\n".join(lines)


def _printable(text: str) -> str:
    """Message text with invisible or unprintable characters written as ``U+XXXX``: a message that
    quotes a NUL, a no-break space or a lone surrogate stays readable and printable."""
    return "".join(ch if ch.isprintable() or ch in "\t\n" else f"U+{ord(ch):04X}" for ch in text)


class EdlError(Exception):
    """A user mistake: bad syntax, a type or shape error, a bad input value or flag.

    ``str(err)`` is the full rendered diagnostic; ``err.diagnostic`` keeps its parts.
    """

    def __init__(
        self,
        message: str,
        span: Span | None = None,
        *,
        help: str | None = None,
        notes: Iterable[Note] = (),
    ) -> None:
        self.diagnostic = Diagnostic("error", message, span, help, tuple(notes))
        super().__init__(self.diagnostic.render())

    @property
    def message(self) -> str:
        return self.diagnostic.message

    @property
    def span(self) -> Span | None:
        return self.diagnostic.span


class EdlWarning(UserWarning):
    """Category of the Python warnings edatalog emits for warning diagnostics."""


def did_you_mean(name: str, candidates: Sequence[str] | Iterable[str], what: str = "") -> str | None:
    """A ``help:`` text suggesting the closest known names, or None when nothing is close."""
    pool = sorted(set(candidates))
    close = difflib.get_close_matches(name, pool, n=3, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in pool}
        if name.lower() in lowered:
            close = [lowered[name.lower()]]
    if close:
        return "did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
    if pool and what:
        shown = ", ".join(pool[:8]) + (", ..." if len(pool) > 8 else "")
        return f"known {what}: {shown}"
    return None


NOTICES = logging.getLogger("edatalog.notice")  # what a user waiting on a call must be told


class _ToStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a notice comes (a test may have replaced it)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current stderr


def show_notices(prefix: str = "edl") -> None:
    """Print :data:`NOTICES` on stderr as ``PREFIX: message`` (once, however often called); in
    a job of several ranks (``RANK`` set), only rank 0 prints, so a notice is said once."""
    if os.environ.get("RANK", "0") != "0":
        return
    if not any(isinstance(h, _ToStderr) for h in NOTICES.handlers):
        handler = _ToStderr()
        handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
        NOTICES.addHandler(handler)
    NOTICES.setLevel(logging.INFO)
