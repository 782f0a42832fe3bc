"""The middle of the rule lookup chain: ops without a rule are decomposed into ops that have one.

`prepare(program)` re-traces the captured graph with torch's own decompositions (`torch._decomp`) for
exactly the ops that have no tile-mapping rule, until every op is covered or nothing more decomposes. What is
left raises `MissingRuleError` naming the ops — or, with `fallback=True`, runs replicated with a warning
(`rules.base.rule_for`). Values keep their names and roles; decomposed ops lose their module attribution.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from partir_torch.ir.program import Program
from partir_torch.rules.base import MissingRuleError, rule_name


def missing_ops(program: Program) -> set[str]:
    return {op.target for op in program.ops if rule_name(op.target) is None}


def prepare(program: Program, *, fallback: bool = False, rounds: int = 3) -> Program:
    """`program` with every op covered by a rule (decomposing where torch knows how)."""
    from torch._decomp import get_decompositions

    for _ in range(rounds):
        missing = missing_ops(program)
        if not missing:
            return program
        overloads = {op.overload for op in program.ops if op.target in missing}
        table = get_decompositions(list(overloads))
        if not table:
            break
        program = _retrace(program, table)
    missing = missing_ops(program)
    if missing and not fallback:
        raise MissingRuleError(
            f"no tile-mapping rule or decomposition for {sorted(missing)}; add rules in partir_torch/rules/<family>.py "
            "with @register(...), or run them replicated with fallback=True"
        )
    return program


def _retrace(program: Program, table) -> Program:
    from partir_torch.capture.trace import _assign_phases, _to_program

    gm = program.graph_module
    placeholders = gm.graph.find_nodes(op="placeholder")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [torch.empty(n.meta["val"].shape, dtype=n.meta["val"].dtype) for n in placeholders]
    new_gm = make_fx(gm, decomposition_table=table, tracing_mode="fake")(*fakes)

    ids = program._placeholder_ids()
    index = {v: i for i, v in enumerate(ids)}
    in_roles = [(program.values[v].role, program.values[v].name) for v in ids]
    out_roles = []
    for vid in program.outputs[: program.n_graph_outputs]:
        v = program.values[vid]
        src = program.updates.get(vid)
        out_roles.append((v.role, v.name, index[src] if src is not None else None))
    new = _to_program(new_gm, in_roles, out_roles, program.mode)
    if program.mode == "train":
        _assign_phases(new.ops, new.values, new.outputs)
    by_name = {v.name: v.id for v in new.values}
    new.params, new.buffers, new.inputs = dict(program.params), dict(program.buffers), list(program.inputs)
    new.shared_states = dict(program.shared_states)
    new.opt_states = {p: dict(s) for p, s in program.opt_states.items()}
    new.grads = {p: by_name[program.values[g].name] for p, g in program.grads.items()}
    new.loss = by_name["loss"] if program.loss is not None else None
    new.optimizer, new.capture_time_s = program.optimizer, program.capture_time_s
    new.groups = [type(g)(g.id, g.key, g.shape, g.params, tuple(by_name[program.values[m].name] for m in g.members
                                                               if program.values[m].name in by_name))
                  for g in program.groups]
    return new
