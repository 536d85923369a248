"""What Megatron-LM splits, recognized by structure (never by dim or relation names).

- **Heads** are what attention keeps apart: the dims of indices that every contraction of two
  activations (the scores ``q . k``, the weighted sum ``p . v``) keeps in its head, and that a
  projection's weights also carry (``wq[(h, e), d]``): the batch and sequence indices are kept
  too, but no projection's weights have them.  The *major* head dim is the one both operands of those
  contractions read (key/value heads), the *minor* one the rest (the query heads that share a
  key/value head, in grouped-query attention).
- **FFN columns** are the dims of a pair of contractions with weights, the first keeping the
  index (column-parallel ``up[s, f] += x[s, d] * w_up[f, d]``), the second summing it
  (row-parallel ``down[s, d] += act[s, f] * w_down[d, f]``), joined by elementwise rules that
  carry the index in everything they read.  The model dim ``d`` is not one: the norm between
  the attention's output and the next projection reduces over it.

A conv2d (one contraction with weights) has neither: its height is never "heads".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from edatalog.ir.cost import gemm_roles
from edatalog.ir.forms import routed_form, without_full_filters
from edatalog.ir.graph import Access, Graph, Index, JoinAgg


@dataclass(frozen=True)
class Transformer:
    """The dims (symbols) that Megatron splits in one program."""

    major: str | None  # the key/value head dim (or the head dim)
    minor: str | None  # the query heads per key/value head, in grouped-query attention
    ffn: frozenset[str]  # the column dims of weight-contraction pairs


def transformer_dims(graph: Graph) -> Transformer:
    params = {r.name for r in graph.relations if r.kind == "param"}
    # Dims of the weights of projections (contractions with a param): not a position table's.
    weighted = {
        i.symbol
        for n in graph.nodes
        if _with_weights(n, params)
        for acc in n.inputs
        if acc.relation in params
        for i in _of(n, acc)
    }
    kept: set[str] | None = None
    both: set[str] | None = None
    for node in graph.nodes:
        pair = _operands(node)
        if pair is None or any(acc.relation in params for acc in pair):
            continue  # not a contraction of two activations
        by_name = {i.name: i.symbol for i in node.indices}
        held = {by_name[i] for i in node.out_indices} & weighted
        shared = {by_name[i] for i in node.out_indices if i in pair[0].indices and i in pair[1].indices} & weighted
        kept = held if kept is None else kept & held
        both = shared if both is None else both & shared
    heads = kept or set()
    majors = sorted((both or set()) & heads)
    major = majors[0] if majors else None
    minors = sorted(heads - {major})
    minor = minors[0] if major is not None and minors else None
    return Transformer(major, minor, frozenset(_ffn(graph, params) - heads))


def _of(node: JoinAgg, acc: Access) -> list[Index]:
    """The join indices an access reads."""
    names = set(acc.indices)
    return [i for i in node.indices if i.name in names]


def _operands(node: JoinAgg) -> tuple[Access, Access] | None:
    """The two widest inputs of a contraction (a GEMM's operands), or None."""
    if gemm_roles(node) is None:
        return None
    distinct = list(dict.fromkeys(node.inputs))
    a, b = sorted(distinct, key=lambda acc: -len(acc.indices))[:2]
    return a, b


def _ffn(graph: Graph, params: set[str]) -> set[str]:
    """Dims that a contraction with weights keeps and a later one sums, through rules that keep
    the dim and read it in every input that depends on it."""
    readers: dict[str, list[JoinAgg]] = {}
    for n in graph.nodes:
        for acc in n.inputs:
            readers.setdefault(acc.relation, []).append(n)
    makers: dict[str, list[JoinAgg]] = {}
    for n in graph.nodes:
        makers.setdefault(n.out, []).append(n)

    @functools.cache
    def depends(relation: str, dim: str) -> bool:
        """Whether ``relation``'s values are computed over ``dim`` (an index of that dim in a
        rule that makes it, or in one that makes what it reads)."""
        return any(
            any(i.symbol == dim for i in n.indices) or any(depends(acc.relation, dim) for acc in n.inputs)
            for n in makers.get(relation, [])
        )

    out: set[str] = set()
    for node in graph.nodes:
        if not _with_weights(node, params):
            continue
        symbols = {i.name: i.symbol for i in node.indices}
        for name in node.out_indices:
            dim = symbols[name]
            if dim not in out and _reaches_sum(node.out, dim, readers, params, set(), depends):
                out.add(dim)
    return out


def _with_weights(node: JoinAgg, params: set[str]) -> bool:
    """A contraction with weights: a GEMM, or a routed one (a mixture of experts' layer)."""
    gemm = gemm_roles(node) is not None or (bool(node.lookups) and routed_form(node) is not None)
    return gemm and any(acc.relation in params for acc in node.inputs)


def _reaches_sum(
    relation: str,
    dim: str,
    readers: dict[str, list[JoinAgg]],
    params: set[str],
    seen: set[str],
    depends: Callable[[str, str], bool],
) -> bool:
    if relation in seen:
        return False
    seen.add(relation)
    for reader in readers.get(relation, []):
        symbols = {i.name: i.symbol for i in reader.indices}
        if _with_weights(reader, params) and any(symbols[i] == dim for i in reader.agg_indices):
            return True
        # (A rule that carries a route sums over one expert a point: elementwise too.)
        summed = without_full_filters(reader).agg_indices
        elementwise = not summed and any(symbols[i] == dim for i in reader.out_indices)
        # Every input carries the dim, or does not depend on it at all (a mixture of experts'
        # gates scale each expert's columns); a norm's sum over the dim breaks the chain.
        carried = all(
            any(symbols[i] == dim for i in acc.indices) or not depends(acc.relation, dim) for acc in reader.inputs
        )
        if elementwise and carried and _reaches_sum(reader.out, dim, readers, params, seen, depends):
            return True
    return False
