"""The rule compiler: parsed program in, verified join-agg graph out.

    (modules) -> conversions -> selections -> scope -> check -> extents -> lower -> eliminate -> support
    -> routes -> verify

Each pass lives in its own module and raises :class:`~edatalog.errors.EdlError` for the
mistakes it is the first to see.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from edatalog.errors import Diagnostic, EdlError
from edatalog.ir import dtypes
from edatalog.ir.affine import Guard
from edatalog.ir.graph import Graph, JoinAgg, Relation
from edatalog.lang import ast
from edatalog.rules.check import Checked, aggregated_by_assignment, check_rules
from edatalog.rules.convert import check_conversions, expand_conversions
from edatalog.rules.eliminate import eliminate_defined
from edatalog.rules.extents import Extents, infer_extents
from edatalog.rules.lower import lower_rule
from edatalog.rules.modules import has_modules, instantiate
from edatalog.rules.routes import follow_routes
from edatalog.rules.scope import build_scope
from edatalog.rules.select import check_ranks, expand_selections
from edatalog.rules.sources import check_sources
from edatalog.rules.support import check_disjoint, effective_guard, head_support


def compile_program(
    program: ast.Program,
    dims: Mapping[str, int] | None = None,
    consts: Mapping[str, float] | None = None,
) -> tuple[Graph, list[Diagnostic]]:
    if has_modules(program):
        return instantiate(program, dims, consts, _compile_plain)
    check_sources(program.statements, in_module=False)
    return _compile_plain(program, dims, consts)


def _compile_plain(
    program: ast.Program,
    dims: Mapping[str, int] | None = None,
    consts: Mapping[str, float] | None = None,
) -> tuple[Graph, list[Diagnostic]]:
    """The passes, for a program without modules whose checkpoint names are checked already:
    by :func:`compile_program`, or for a module's body and the rest of a program by
    :func:`instantiate` (which knows where ``{i}`` may stand)."""
    program, conversions = expand_conversions(program)
    program, selections = expand_selections(program)
    scope = build_scope(program, dims, consts)
    checked = check_rules(scope)
    extents = infer_extents(checked)
    graph = _build_graph(checked, extents, program.source.name)
    check_conversions(graph, conversions)
    check_ranks(graph, selections)
    graph = follow_routes(graph)
    graph.verify()
    return graph, checked.warnings


def _default_float(checked: Checked) -> str:
    """The float type of rules that read no float relation: the declared floats promoted, else f32."""
    out: str | None = None
    for d in checked.scope.decls.values():
        if dtypes.kind(d.dtype) == "float":
            out = d.dtype if out is None else dtypes.promote(out, d.dtype)
    return out or "f32"


def _axis_names(names: list[str | None]) -> tuple[str, ...]:
    out: list[str] = []
    for k, n in enumerate(names):
        out.append(n if n is not None and n not in out else f"a{k}")
    # A generated name could collide with a kept one; fall back to positional names then.
    return tuple(out) if len(set(out)) == len(out) else tuple(f"a{k}" for k in range(len(out)))


def _build_graph(checked: Checked, ext: Extents, source_name: str) -> Graph:
    scope = checked.scope
    relations: dict[str, Relation] = {}
    for name, d in scope.decls.items():
        guesses = [s.lower() if s.isidentifier() else None for s in d.symbols]
        relations[name] = Relation(
            name,
            d.kind,
            d.shape,
            d.symbols,
            d.dtype,
            _axis_names(guesses),
            Guard.true(),
            origin=str(d.span),
            sources=tuple(text for text, _ in d.decl.sources),
        )
    rel_dtype = {n: r.dtype for n, r in relations.items()}
    default_float = _default_float(checked)
    nodes: list[JoinAgg] = []
    for rel in checked.order:  # each relation after everything it reads
        relations[rel], rel_nodes = _derive(rel, checked, ext, relations, rel_dtype, default_float)
        rel_dtype[rel] = relations[rel].dtype
        nodes.extend(rel_nodes)
    return Graph(
        tuple(relations[n] for n in [*scope.decls, *checked.order]),
        tuple(nodes),
        tuple(checked.outputs),
        tuple((k, v.value) for k, v in scope.dims.items()),
        tuple((k, v.value) for k, v in scope.consts.items()),
        source_name,
    )


def _derive(
    rel: str,
    checked: Checked,
    ext: Extents,
    relations: Mapping[str, Relation],
    rel_dtype: Mapping[str, str],
    default_float: str,
) -> tuple[Relation, list[JoinAgg]]:
    """A derived relation and the nodes of its rules: dtype, effective guards, support."""
    group = checked.by_head[rel]
    names = [rel] if len(group) == 1 else [f"{rel}#{k + 1}" for k in range(len(group))]
    lowered = [
        lower_rule(info, n, checked.scope, ext, rel_dtype, default_float) for info, n in zip(group, names, strict=True)
    ]
    lowered = [dataclasses.replace(lw, node=eliminate_defined(lw.node)) for lw in lowered]
    for lw in lowered:
        if lw.node.aggop == "=" and lw.node.agg_indices:  # an equality guard did not define it
            raise aggregated_by_assignment(lw.info, lw.node.agg_indices[0], in_equality=True)
    if len(lowered) > 1 and any(lw.node.lookups for lw in lowered) and group[0].rule.aggop == "=":
        lw = next(lw for lw in lowered if lw.node.lookups)
        raise EdlError(
            f"a rule with a lookup cannot share its head with other '=' rules for '{rel}'",
            lw.info.rule.span,
            help="give the looked-up part a relation of its own and combine the two in a further rule",
        )
    dtype = lowered[0].node.dtype
    for lw in lowered[1:]:
        dtype = dtypes.promote(dtype, lw.node.dtype)
    head = group[0].head
    axis_names = _axis_names(
        [p.components[0].var if not p.composite and p.components[0].var else None for p in head.positions]
    )
    nodes = []
    support = Guard.false()
    exact = True
    for lw in lowered:
        node = dataclasses.replace(lw.node, dtype=dtype)
        node = dataclasses.replace(node, guard=effective_guard(node, relations))
        if node.guard.is_false:
            checked.warnings.append(
                Diagnostic(
                    "warning",
                    "this rule never contributes: its guards and the cells it reads leave no point",
                    lw.info.rule.span,
                    help="check the guards against the extents, and where the relations it reads exist",
                )
            )
        piece, ok = head_support(node, axis_names)
        # A support is exact only if its own projection is and so are the supports it reads.
        reads_exact = all(relations[acc.relation].support_exact for acc in node.inputs)
        support, exact = support | piece, exact and ok and reads_exact
        nodes.append(node)
    shape = tuple(ext.axis[(rel, k)][0] for k in range(checked.arity[rel]))
    symbols = tuple(ext.axis[(rel, k)][1] for k in range(checked.arity[rel]))
    if group[0].rule.aggop == "=" and len(nodes) > 1:
        reads_exact = all(relations[acc.relation].support_exact for n in nodes for acc in n.inputs)
        checked.warnings.extend(check_disjoint(rel, nodes, [info.head.span for info in group], reads_exact))
    relation = Relation(
        rel,
        "derived",
        shape,
        symbols,
        dtype,
        axis_names,
        support.simplify(dict(zip(axis_names, shape, strict=True))),
        exact,
        nodes[0].aggop,
        origin=str(head.span),
    )
    return relation, nodes
