"""Pass 0: modules.  A program with modules compiles each module once, as a program of its own
over the program's dims and consts, and instantiates its compiled rules by renaming, so that
compiling a 32-layer model costs about one layer.

    module decoder.
      input x[B, S, D] : f32.              # its inputs: the carried one first, then shared ones,
      input rc[S, E / 2] : f32.            # then any left unbound (per instance: a KV cache)
      param wq[H * E, D] : f32 from "model.layers.{i}.self_attn.q_proj.weight".
      ...
      output y, kr.                        # its results: the carried one first
    end.

    h = decoder(h0, rc) repeat L as layers.

makes ``L`` instances ``layers.0`` .. ``layers.{L-1}``: instance 0 reads ``h0`` as ``x``,
instance ``k + 1`` reads instance ``k``'s ``y``, every instance reads ``rc``; instance ``k``'s
relations are ``layers.k.NAME`` (``{i}`` in a param's checkpoint names is ``k``; other
placeholders stack axes, see :mod:`edatalog.rules.sources`), and the last
instance's ``y`` is ``h``.  ``output layers.kr`` lists every instance's ``kr``.  Every rule
stays a join-agg: instances are the module's rules over renamed relations.

The rest of the program is compiled with each instance statement standing for an input (its
result, of the module's result's shape), then the instances are spliced in, in dependency
order.  Mistakes inside a module are reported at the module's line, with a note naming the
instance statement that made it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from edatalog.errors import Diagnostic, EdlError, Note, Span
from edatalog.ir.graph import Access, Graph, JoinAgg, Relation, Repeat
from edatalog.lang import ast
from edatalog.rules.scope import DimInfo, Scope, eval_dim
from edatalog.rules.sources import INSTANCE, check_sources

Compile = Callable[[ast.Program, Mapping[str, int] | None, Mapping[str, float] | None], tuple[Graph, list[Diagnostic]]]

_ALLOWED = (ast.RelationDecl, ast.Rule, ast.OutputDecl)


def has_modules(program: ast.Program) -> bool:
    return any(isinstance(s, ast.Module | ast.Instance) for s in program.statements)


@dataclass(frozen=True)
class _Use:
    """One instance statement, resolved: its module compiled, its count and prefix."""

    stmt: ast.Instance
    module: ast.Module
    graph: Graph  # the module, compiled
    count: int
    prefix: str

    @property
    def inputs(self) -> list[Relation]:
        order = [s.name for s in self.module.statements if isinstance(s, ast.RelationDecl) and s.kind == "input"]
        return [self.graph.relation(n) for n in order]

    @property
    def result(self) -> Relation:
        return self.graph.relation(self.graph.outputs[0])


def instantiate(
    program: ast.Program,
    dims: Mapping[str, int] | None,
    consts: Mapping[str, float] | None,
    compile_program: Compile,
) -> tuple[Graph, list[Diagnostic]]:
    """The program's graph with every module instance spliced in (see the module docstring)."""
    modules = _modules(program)
    header = tuple(s for s in program.statements if isinstance(s, ast.DimDecl | ast.ConstDecl))
    top = [s for s in program.statements if not isinstance(s, ast.Module)]
    check_sources(top, in_module=False)
    warnings: list[Diagnostic] = []
    compiled: dict[str, tuple[Graph, list[Diagnostic]]] = {}
    uses: list[_Use] = []
    prefixes: dict[str, Span] = {}
    for stmt in (s for s in top if isinstance(s, ast.Instance)):
        module = modules.get(stmt.module)
        if module is None:
            raise EdlError(
                f"unknown module '{stmt.module}'",
                stmt.module_span,
                help=f"modules: {', '.join(modules)}" if modules else "define it first: 'module NAME.' ... 'end.'",
            )
        note = Note(f"in module '{module.name}', instantiated here", stmt.span)
        if module.name not in compiled:
            body = ast.Program(program.source, (*header, *module.statements))
            try:
                compiled[module.name] = compile_program(body, dims, consts)
            except EdlError as err:
                raise _with_note(err, note) from None
            warnings += [dataclasses.replace(w, notes=(*w.notes, note)) for w in compiled[module.name][1]]
        graph = compiled[module.name][0]
        count = 1 if stmt.count is None else eval_dim(stmt.count, _dim_scope(graph), "the number of instances")
        prefix = stmt.prefix or stmt.module
        span = stmt.prefix_span or stmt.module_span
        if prefix in prefixes:
            raise EdlError(
                f"instances named '{prefix}' twice",
                span,
                help="give each instance statement its own name with 'as NAME'",
                notes=[Note("first named here", prefixes[prefix])],
            )
        prefixes[prefix] = span
        uses.append(_Use(stmt, module, graph, count, prefix))
    for name, module in modules.items():
        if not any(u.module.name == name for u in uses):
            warnings.append(
                Diagnostic(
                    "warning",
                    f"module '{name}' is never instantiated",
                    module.name_span,
                    help=f"use it: 'y = {name}(x).', or remove it",
                )
            )
    outer, outer_warnings = _compile_outer(program, top, uses, dims, consts, compile_program)
    graph = _splice(outer, uses, [s for s in top if isinstance(s, ast.OutputDecl)])
    return graph, [*outer_warnings, *warnings]


def _modules(program: ast.Program) -> dict[str, ast.Module]:
    out: dict[str, ast.Module] = {}
    for m in (s for s in program.statements if isinstance(s, ast.Module)):
        if m.name in out:
            raise EdlError(
                f"module '{m.name}' is defined twice",
                m.name_span,
                help="rename one of them",
                notes=[Note("first defined here", out[m.name].name_span)],
            )
        for s in m.statements:
            if not isinstance(s, _ALLOWED):
                what = {ast.DimDecl: "dims", ast.ConstDecl: "consts", ast.Instance: "module instances"}
                raise EdlError(
                    f"{what.get(type(s), 'this statement')} inside module '{m.name}'",
                    s.span,
                    help="declare dims and consts at the top of the file (modules see them); "
                    "modules hold inputs, params, rules and outputs, and do not instantiate modules",
                )
        if not any(isinstance(s, ast.RelationDecl) and s.kind == "input" for s in m.statements):
            raise EdlError(
                f"module '{m.name}' has no input",
                m.name_span,
                help="declare what it reads: 'input x[B, S, D] : f32.' (the first is what a chain carries)",
            )
        if not any(isinstance(s, ast.OutputDecl) for s in m.statements):
            raise EdlError(
                f"module '{m.name}' has no output",
                m.name_span,
                help="name its results: 'output y.' (the first is an instance's result)",
            )
        check_sources(list(m.statements), in_module=True)
        out[m.name] = m
    return out


def _dim_scope(graph: Graph) -> Scope:
    scope = Scope()
    scope.dims = {name: DimInfo(name, value, None) for name, value in graph.dims}
    return scope


def _with_note(err: EdlError, note: Note) -> EdlError:
    d = err.diagnostic
    return EdlError(d.message, d.span, help=d.help, notes=[*d.notes, note])


def _compile_outer(
    program: ast.Program,
    top: Sequence[ast.Statement],
    uses: list[_Use],
    dims: Mapping[str, int] | None,
    consts: Mapping[str, float] | None,
    compile_program: Compile,
) -> tuple[Graph, list[Diagnostic]]:
    """The program outside its modules, each instance statement standing for an input that
    holds its result; the relations passed to instances are kept as outputs (nothing else in
    it reads them)."""
    by_stmt = {id(u.stmt): u for u in uses}
    statements: list[ast.Statement] = []
    passed: list[tuple[str, Span]] = []
    for s in top:
        if isinstance(s, ast.Instance):
            use = by_stmt[id(s)]
            res = use.result
            shape = tuple(ast.Num(n, sym, s.result_span) for n, sym in zip(res.shape, res.symbols, strict=True))
            statements.append(
                ast.RelationDecl("input", s.result, shape, res.dtype, s.span, s.result_span, s.result_span)
            )
            passed += [a for a in s.args if a[0] not in {n for n, _ in passed}]
        elif isinstance(s, ast.OutputDecl):
            plain = tuple((n, sp) for n, sp in s.names if "." not in n)
            if plain:
                statements.append(ast.OutputDecl(plain, s.span))
        else:
            statements.append(s)
    listed = {n for s in statements if isinstance(s, ast.OutputDecl) for n, _ in s.names}
    if any(isinstance(s, ast.OutputDecl) for s in top):
        extra = tuple((n, sp) for n, sp in passed if n not in listed)
        if extra:
            statements.append(ast.OutputDecl(extra, extra[0][1]))
    graph, warnings = compile_program(ast.Program(program.source, tuple(statements)), dims, consts)
    # Said of the stand-ins, not of anything the user wrote: an instance's result read by no rule
    # (it is an output), a program whose only work is its instances.
    stand_ins = {u.stmt.result_span for u in uses}
    kept = [w for w in warnings if w.span not in stand_ins and not w.message.startswith("the program has no rules")]
    return graph, kept


def _splice(outer: Graph, uses: list[_Use], output_decls: list[ast.OutputDecl]) -> Graph:
    """``outer`` with each instance's relations and rules in place of the input standing for
    its result."""
    relations = {r.name: r for r in outer.relations}
    nodes_of: dict[str, list[JoinAgg]] = {}  # instance prefix -> its renamed nodes, in order
    made_by: dict[str, str] = {}  # relation -> the prefix of the instances that make it
    repeats = []
    for use in uses:
        inputs = use.inputs
        stmt = use.stmt
        if len(stmt.args) > len(inputs):
            raise EdlError(
                f"module '{use.module.name}' takes at most {len(inputs)} argument{'s' * (len(inputs) > 1)}, "
                f"not {len(stmt.args)}",
                stmt.args[len(inputs)][1],
                help="its inputs, in order: " + ", ".join(r.name for r in inputs),
            )
        if not stmt.args:
            raise EdlError(
                f"instance of '{use.module.name}' without an argument",
                stmt.span,
                help=f"pass what its first input '{inputs[0].name}' reads: '{stmt.result} = {use.module.name}(x).'",
            )
        for (arg, span), inp in zip(stmt.args, inputs, strict=False):
            _check_argument(relations, arg, span, inp, use)
        result = use.result
        if use.count > 1 and (result.shape, result.dtype) != (inputs[0].shape, inputs[0].dtype):
            raise EdlError(
                f"module '{use.module.name}' cannot repeat: its result '{result.name}' is "
                f"{_typed(result)}, but its first input '{inputs[0].name}' is {_typed(inputs[0])}",
                stmt.count.span if stmt.count is not None else stmt.span,
                help="a chain feeds each instance's first output to the next instance's first input: "
                "make them the same shape and dtype",
            )
        if not result.support.is_true:
            raise EdlError(
                f"the result '{result.name}' of module '{use.module.name}' has cells that do not exist "
                f"({result.support})",
                stmt.span,
                help="a module's first output must exist everywhere; return a relation every cell of "
                "which a rule defines",
            )
        del relations[stmt.result]  # the standing input: the last instance makes it
        nodes: list[JoinAgg] = []
        for k in range(use.count):
            names = _names(use, k)
            for rel in use.graph.relations:
                new = names[rel.name]
                if new in relations:
                    continue  # an argument, defined outside
                renamed = dataclasses.replace(
                    rel, name=new, sources=tuple(s.replace(f"{{{INSTANCE}}}", str(k)) for s in rel.sources)
                )
                relations[new] = renamed
                made_by[new] = use.prefix
            for node in use.graph.nodes:
                nodes.append(_renamed(node, f"{use.prefix}.{k}.{node.name}", names))
        nodes_of[use.prefix] = nodes
        first = stmt.args[0][0]
        repeats.append(
            Repeat(use.prefix, use.module.name, use.count, tuple(n.name for n in use.graph.nodes), first, stmt.result)
        )
    order = _ordered(outer, uses, nodes_of)
    outputs = _outputs(outer, uses, output_decls, relations)
    kept = [r for r in relations.values() if r.kind != "derived"] + [
        relations[n] for n in dict.fromkeys(node.out for node in order)
    ]
    graph = Graph(
        tuple(kept), tuple(order), tuple(outputs), outer.dims, outer.consts, outer.source_name, tuple(repeats)
    )
    graph.verify()
    return graph


def _typed(rel: Relation) -> str:
    return f"[{', '.join(rel.symbols)}] {rel.dtype}"


def _check_argument(relations: Mapping[str, Relation], arg: str, span: Span, inp: Relation, use: _Use) -> None:
    rel = relations.get(arg)
    if rel is None:
        raise EdlError(
            f"undefined relation '{arg}'",
            span,
            help="pass a relation the program declares or defines (defined before, or anywhere: order is free)",
        )
    if rel.shape != inp.shape or rel.dtype != inp.dtype:
        raise EdlError(
            f"'{arg}' is {_typed(rel)}, but module '{use.module.name}' reads it as its input '{inp.name}', "
            f"{_typed(inp)}",
            span,
            help="pass a relation of the shape and dtype the module declares",
            notes=[Note(f"'{inp.name}' is declared here", _decl_span(use.module, inp.name))],
        )


def _decl_span(module: ast.Module, name: str) -> Span | None:
    return next((s.name_span for s in module.statements if isinstance(s, ast.RelationDecl) and s.name == name), None)


def _names(use: _Use, k: int) -> dict[str, str]:
    """Module relation names -> program names, for instance ``k``."""
    inputs = use.inputs
    args = [a for a, _ in use.stmt.args]
    out = {r.name: f"{use.prefix}.{k}.{r.name}" for r in use.graph.relations}
    carried, result = inputs[0].name, use.graph.outputs[0]
    out[carried] = args[0] if k == 0 else f"{use.prefix}.{k - 1}.{result}"
    for inp, arg in zip(inputs[1:], args[1:], strict=False):
        out[inp.name] = arg
    if k == use.count - 1:
        out[result] = use.stmt.result
    return out


def _renamed(node: JoinAgg, name: str, names: Mapping[str, str]) -> JoinAgg:
    return dataclasses.replace(
        node,
        name=name,
        out=names[node.out],
        inputs=tuple(Access(names[a.relation], a.axes) for a in node.inputs),
    )


def _ordered(outer: Graph, uses: list[_Use], nodes_of: dict[str, list[JoinAgg]]) -> list[JoinAgg]:
    """The outer rules and the instances, each after what it reads (stable: outer rules keep
    their order, an instance comes as late as its first reader allows)."""
    makes = {u.stmt.result: u for u in uses}
    producer: dict[str, list[object]] = {}
    for n in outer.nodes:
        producer.setdefault(n.out, []).append(n)
    out: list[JoinAgg] = []
    state: dict[int, int] = {}  # id(unit) -> 1 visiting, 2 done

    def reads(unit: object) -> list[str]:
        if isinstance(unit, JoinAgg):
            return [a.relation for a in unit.inputs]
        assert isinstance(unit, _Use)
        return [a for a, _ in unit.stmt.args]

    def visit(unit: object) -> None:
        stack: list[tuple[object, int]] = [(unit, 0)]
        while stack:
            cur, k = stack[-1]
            if k == 0:
                if state.get(id(cur)) == 2:
                    stack.pop()
                    continue
                state[id(cur)] = 1
            deps = [d for r in reads(cur) for d in ([makes[r]] if r in makes else producer.get(r, []))]
            if k < len(deps):
                stack[-1] = (cur, k + 1)
                dep = deps[k]
                if state.get(id(dep)) == 1:
                    assert isinstance(cur, _Use | JoinAgg)
                    use = cur if isinstance(cur, _Use) else dep
                    assert isinstance(use, _Use)
                    raise EdlError(
                        f"dependency cycle through instance '{use.prefix}': what it reads depends on its result",
                        use.stmt.span,
                        help="an instance's arguments must be computed without its result",
                    )
                if state.get(id(dep)) != 2:
                    stack.append((dep, 0))
                continue
            stack.pop()
            state[id(cur)] = 2
            if isinstance(cur, JoinAgg):
                out.append(cur)
            else:
                assert isinstance(cur, _Use)
                out.extend(nodes_of[cur.prefix])

    for n in outer.nodes:
        visit(n)
    for u in uses:
        visit(u)
    return out


def _outputs(
    outer: Graph, uses: list[_Use], output_decls: list[ast.OutputDecl], relations: Mapping[str, Relation]
) -> list[str]:
    """The outputs as listed, ``prefix.NAME`` standing for every instance's ``NAME``; without
    an output statement, what no rule reads."""
    if not output_decls:
        passed = {a for u in uses for a, _ in u.stmt.args}
        outs = [o for o in outer.outputs if o not in passed]
        return outs or [uses[-1].stmt.result]
    by_prefix = {u.prefix: u for u in uses}
    out: list[str] = []
    for decl in output_decls:
        for name, span in decl.names:
            if "." not in name:
                out.append(name)
                continue
            prefix, _, local = name.partition(".")
            use = by_prefix.get(prefix)
            if use is None or "." in local:
                raise EdlError(
                    f"no instances named '{prefix}'",
                    span,
                    help=f"'NAME.rel' lists relation 'rel' of every instance named NAME ({', '.join(by_prefix)})"
                    if by_prefix
                    else "'NAME.rel' lists relation 'rel' of every instance named NAME",
                )
            if local not in {r.name for r in use.graph.relations}:
                raise EdlError(
                    f"module '{use.module.name}' has no relation '{local}'",
                    span,
                    help=f"its outputs: {', '.join(use.graph.outputs)}",
                )
            names = [_names(use, k)[local] for k in range(use.count)]
            out.extend(n for n in names if n in relations)
    return list(dict.fromkeys(out))
