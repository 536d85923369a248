"""Symbolic extents such as ``H*E`` or ``E/2``, so that inferred extents print as the dims they
came from.  Symbols are monomials (products and quotients of dims and integers).  Each is reduced
to a canonical form over the base dims, expanding derived dims by their definitions (``E = D / H``),
and printed as a dim name whenever one has the same canonical form: the parts of ``(0, i)`` over an
axis ``E`` with ``i:E/2`` are ``2`` and ``E/2``, and ``H*E / (KVH*G)`` prints as ``E``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction

Monomial = tuple[Fraction, tuple[tuple[str, int], ...]]

_TOKEN = re.compile(r"\s*([*/])?\s*([A-Za-z_][A-Za-z0-9_]*|\d+)")


def parse(sym: str) -> Monomial | None:
    """``coef * prod(name ^ power)`` for products and quotients of names and integers, else None."""
    coef = Fraction(1)
    powers: dict[str, int] = {}
    pos = 0
    while pos < len(sym):
        m = _TOKEN.match(sym, pos)
        if m is None or (pos == 0) == bool(m.group(1)):
            return None
        sign = -1 if m.group(1) == "/" else 1
        tok = m.group(2)
        if tok.isdigit():
            coef = coef * int(tok) if sign > 0 else coef / int(tok)
        else:
            powers[tok] = powers.get(tok, 0) + sign
        pos = m.end()
    return _make(coef, powers)


def _make(coef: Fraction, powers: Mapping[str, int]) -> Monomial:
    return coef, tuple(sorted((k, v) for k, v in powers.items() if v))


def _mul(a: Monomial, b: Monomial, sign: int = 1) -> Monomial:
    powers = dict(a[1])
    for k, v in b[1]:
        powers[k] = powers.get(k, 0) + sign * v
    return _make(a[0] * b[0] if sign > 0 else a[0] / b[0], powers)


def render(mono: Monomial) -> str:
    coef, powers = mono
    num = [k for k, v in powers for _ in range(v)]
    den = [k for k, v in powers for _ in range(-v)]
    if coef.numerator != 1 or not num:
        num = [str(coef.numerator), *num]
    if coef.denominator != 1:
        den = [str(coef.denominator), *den]
    return "*".join(num) + "".join(f"/{d}" for d in den)


class Symbols:
    """Simplifies symbols against the program's dim definitions."""

    def __init__(self, definitions: Mapping[str, str | None]) -> None:
        # definitions: dim -> its defining expression text, or None for a base dim.  Dims set to a
        # number are base dims too: `S = 2048` must not turn S into 2048.
        parsed = {k: (parse(v) if v is not None else None) for k, v in definitions.items()}
        self.defs = {k: (m if m is not None and m[1] else None) for k, m in parsed.items()}
        self.names: dict[Monomial, str] = {}
        for name in definitions:  # declaration order: the first name of a canonical form wins
            self.names.setdefault(self.canon(_make(Fraction(1), {name: 1})), name)

    def canon(self, mono: Monomial, depth: int = 0) -> Monomial:
        out = _make(mono[0], {})
        for name, power in mono[1]:
            d = self.defs.get(name)
            term = _make(Fraction(1), {name: 1}) if d is None or depth > 32 else self.canon(d, depth + 1)
            for _ in range(abs(power)):
                out = _mul(out, term, 1 if power > 0 else -1)
        return out

    def show(self, mono: Monomial) -> str:
        c = self.canon(mono)
        return self.names.get(c) or render(mono if len(render(mono)) <= len(render(c)) else c)

    def simplify(self, sym: str) -> str:
        m = parse(sym)
        return sym if m is None else self.show(m)

    def product(self, symbols: list[str]) -> str | None:
        acc = _make(Fraction(1), {})
        for s in symbols:
            m = parse(s)
            if m is None:
                return None
            acc = _mul(acc, m)
        return self.show(acc)

    def quotient(self, a: str, parts: list[str]) -> str | None:
        """``a / prod(parts)``, or None when a symbol is not a monomial."""
        ma = parse(a)
        denom = self.product(parts)
        mb = parse(denom) if denom is not None else None
        if ma is None or mb is None:
            return None
        return self.show(_mul(ma, mb, -1))
