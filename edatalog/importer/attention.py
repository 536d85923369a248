"""``scaled_dot_product_attention`` as the five rules of an attention chain
(:mod:`edatalog.ir.attention`), which plans price and runtimes fuse into one kernel::

    sc[.., s, t] += q[.., s, e] * k[.., t, e] * scale   where t <= s   (is_causal)
    mx[.., s]   max= sc[.., s, t]
    p[.., s, t]    = exp(sc[.., s, t] - mx[.., s])
    l[.., s]      += p[.., s, t]
    o[.., s, f]   += p[.., s, t] * v[.., t, f] / l[.., s]

A causal flag, or a mask that is a band of the query and key positions (transformers' causal and
sliding-window masks, folded from shapes by :mod:`edatalog.importer.constants`), becomes a guard
of the scores: masked cells are not computed at all.  Any other mask is added to the scores (a
float mask) or selects them (a bool one).  Grouped-query attention (``enable_gqa``) splits the
query heads into key/value heads and groups, as composites.
"""

from __future__ import annotations

import math
from typing import Any

from edatalog.importer import terms as T
from edatalog.importer.ops import Context, Unsupported, contract, elementwise, op, whole


@op("aten.scaled_dot_product_attention.default")
def _sdpa(
    cx: Context,
    q: T.View,
    k: T.View,
    v: T.View,
    attn_mask: T.View | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> T.View:
    if dropout_p:
        raise Unsupported("attention dropout", "call module.eval() before importing")
    rank = len(q.shape)
    size_s, size_t, size_e = q.shape[-2], k.shape[-2], q.shape[-1]
    c = scale if scale is not None else 1.0 / math.sqrt(size_e)
    shared_k, shared_v = _unexpanded(k), _unexpanded(v)
    if shared_k is not None and shared_v is not None and shared_k[1] == shared_v[1]:
        # Key/value heads repeated for the query heads that share them (transformers' repeat_kv:
        # an expand and a reshape): attention with the heads grouped, as enable_gqa says.
        k, v, enable_gqa = shared_k[0], shared_v[0], True
    heads = None
    batch = "ABCDEFGH"[: rank - 2]
    shared = batch  # the batch letters of k and v
    if enable_gqa and rank >= 3 and q.shape[-3] != k.shape[-3]:
        # Query heads h = (g, r): key/value head g, and r of the query heads sharing it (k and v
        # have no r).
        groups, kv = q.shape[-3] // k.shape[-3], k.shape[-3]
        heads = q.shape[-3]
        q = T.reshape(q, [*q.shape[:-3], kv, groups, size_s, size_e])
        batch = "ABCDEFGH"[: rank - 1]
        shared = batch[:-1]
    # The five rules read q, k and v as relations of their own, whole (as the fused kernel reads
    # them): views of a projection are written out first.
    q, k, v = whole(cx, q), whole(cx, k), whole(cx, v)
    band = _band_guard(attn_mask, size_s, size_t) if attn_mask is not None else None
    if attn_mask is not None and band is None:
        scores = contract(cx, [(q, f"{batch}se"), (k, f"{shared}te")], f"{batch}st", "scores", scale=c)
        scores = _masked(cx, scores, attn_mask)
    else:

        def guard(atoms: dict[str, tuple[int, ...]]) -> list[T.Cmp]:
            (s,), (t,) = atoms["s"], atoms["t"]
            out = [T.Cmp("<=", T.Index(t), T.Index(s))] if is_causal else []
            return out + [_on(cmp, s, t) for cmp in band or []]

        scores = contract(cx, [(q, f"{batch}se"), (k, f"{shared}te")], f"{batch}st", "scores", scale=c, guard=guard)
    last = len(scores.shape) - 1
    top = cx.builder.aggregate(scores, [last], "max=", cx.name("max"), keep=True)
    probs = elementwise(cx, lambda a, m: T.Unary("exp", T.Binary("-", a, m)), scores, top)
    probs = cx.builder.materialize(probs, cx.name("probs"))
    sums = cx.builder.aggregate(probs, [last], "+=", cx.name("sums"))
    out = contract(
        cx, [(probs, f"{batch}st"), (v, f"{shared}tf"), (sums, f"{batch}s")], f"{batch}sf", "attention", divisor=2
    )
    if heads is not None:
        out = T.reshape(out, [*out.shape[:-4], heads, size_s, out.shape[-1]])
    return out


def _unexpanded(view: T.View) -> tuple[T.View, int] | None:
    """``view`` without the repetition of its heads (axis -3 read as ``(kv, g)`` with ``g``
    broadcast: each key/value head repeated ``g`` times), and ``g``; None if it has none."""
    if len(view.shape) < 3:
        return None
    group = [a for a in view.axes[-3] if view.extent[a] != 1]
    used = T.atoms_of(view.term)
    if len(group) != 2 or group[1] in used or group[0] not in used:
        return None
    axes = (*view.axes[:-3], (group[0],), *view.axes[-2:])
    return T.View(view.term, axes, view.extent, view.dtype), view.extent[group[1]]


# A band's comparisons, on placeholders for the query and key positions.
_S, _T = -1, -2


def _band_guard(mask: T.View, size_s: int, size_t: int) -> list[T.Cmp] | None:
    """The mask as comparisons of the query (``_S``) and key (``_T``) positions when it admits
    exactly a band of them (a bool mask's true cells, a float mask's zero cells, the others
    false or -inf), else None."""
    if len(mask.shape) < 2 or mask.shape[-2:] != (size_s, size_t):
        return None
    s_axis, t_axis = mask.axes[-2], mask.axes[-1]
    if len(s_axis) != 1 or len(t_axis) != 1:
        return None
    places = {s_axis[0]: _S, t_axis[0]: _T}
    if not T.atoms_of(mask.term) <= set(places):
        return None
    conds: list[T.Cmp] = []
    term = mask.term
    while isinstance(term, T.Where):
        conds.append(term.cond)
        if term.other not in (T.Num(0.0), T.Num(float("-inf"))):
            return None
        term = term.then
    admitted = term == T.Num(1.0) if mask.dtype == "bool" else term == T.Num(0.0)
    if not conds or not admitted:
        return None
    return [_renamed(c, places) for c in conds]


def _renamed(cmp: T.Cmp, places: dict[int, int]) -> T.Cmp:
    table: dict[int, T.Replacement] = {a: ((p, 0),) for a, p in places.items()}
    return T.Cmp(cmp.op, T.substitute(cmp.left, table), T.substitute(cmp.right, table))


def _on(cmp: T.Cmp, s: int, t: int) -> T.Cmp:
    """A band's comparison on the scores' own atoms."""
    table: dict[int, T.Replacement] = {_S: ((s, 0),), _T: ((t, 0),)}
    return T.Cmp(cmp.op, T.substitute(cmp.left, table), T.substitute(cmp.right, table))


def _masked(cx: Context, scores: T.View, mask: Any) -> T.View:
    """Scores with a mask that is not a band: added (float) or selecting (bool)."""
    if mask.dtype == "bool":
        return cx.builder.materialize(
            elementwise(
                cx,
                lambda m, x: T.Where(T.Cmp("!=", m, T.Num(0.0)), x, T.Num(float("-inf"))),
                mask,
                scores,
                dtype=scores.dtype,
            ),
            cx.name("masked"),
        )
    return cx.builder.materialize(elementwise(cx, lambda x, m: T.Binary("+", x, m), scores, mask), cx.name("masked"))
