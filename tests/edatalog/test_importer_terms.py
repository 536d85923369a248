"""The importer's views against numpy: random chains of reshapes, permutes, slices and
broadcasts, written as rules by the builder, compiled and run by the reference, equal what
numpy computes with the same ops (no torch.export involved)."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import edatalog
from edatalog.importer import terms as T
from edatalog.importer.builder import Builder

FACTORS = [2, 3, 2, 2]


def _grouping(factors: list[int], cuts: list[int]) -> list[int]:
    bounds = [0, *sorted(cuts), len(factors)]
    return [math.prod(factors[a:b]) for a, b in itertools.pairwise(bounds)]


@settings(max_examples=25, deadline=None)
@given(
    st.permutations(FACTORS),
    st.sets(st.integers(1, len(FACTORS) - 1)),
    st.lists(st.sampled_from(["reshape", "permute", "slice", "unsqueeze_expand"]), min_size=1, max_size=4),
    st.integers(0, 2**16),
)
def test_layout_chains_equal_numpy(factors: list[int], cuts: set[int], steps: list[str], seed: int) -> None:
    r = random.Random(seed)
    shape = _grouping(list(factors), list(cuts))
    x = np.arange(math.prod(shape), dtype=np.float64).reshape(shape) + 1.0
    b = Builder()
    view = b.declare("input", "x", shape, "f64")
    want = x
    for kind in steps:
        if kind == "reshape":
            target = [want.size] if r.random() < 0.3 else _regroup(r, want.shape)
            try:
                view = T.reshape(view, target)
            except T.Unfoldable:
                view = T.reshape(b.materialize(view, "m", apart=False), target)
            want = want.reshape(target)
        elif kind == "permute":
            order = list(range(want.ndim))
            r.shuffle(order)
            view, want = T.permute(view, order), want.transpose(order)
        elif kind == "slice":
            axis = r.randrange(want.ndim)
            size = want.shape[axis]
            if size < 2:
                continue
            lo = r.randrange(size - 1)
            hi = r.randrange(lo + 1, size + 1)
            try:
                view = T.narrow(view, axis, lo, hi)
            except T.Unfoldable:
                view = T.narrow(b.materialize(view, "m", apart=False), axis, lo, hi)
            want = np.take(want, range(lo, hi), axis=axis)
        else:
            axis = r.randrange(want.ndim + 1)
            view = T.expand(T.unsqueeze(view, axis), [*want.shape[:axis], 3, *want.shape[axis:]])
            want = np.repeat(np.expand_dims(want, axis), 3, axis=axis)
    b.output(T.View(T.Binary("*", view.term, T.Num(2.0)), view.axes, view.extent, view.dtype), "y")
    prog = edatalog.compile_string(b.text("chain"))
    got = prog.run({"x": x})["y"]
    np.testing.assert_array_equal(got, 2.0 * want)


def _regroup(r: random.Random, shape: tuple[int, ...]) -> list[int]:
    """``shape``'s size as a random grouping of its prime factors, in order."""
    primes = [p for s in shape for p in _primes(s)]
    cuts = r.sample(range(1, len(primes)), r.randrange(len(primes))) if len(primes) > 1 else []
    return _grouping(primes, cuts) or [1]


def _primes(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out
