"""The middle of the rule lookup chain: ops without a rule are decomposed into ops that have one.

`prepare(program)` re-traces the captured graph with torch's own decompositions (`torch._decomp`) for
exactly the ops that have no tile-mapping rule, until every op is covered or nothing more decomposes. The
re-trace runs the old graph node by node (`fx.Interpreter` under `preserve_node_meta`), so the ops a
decomposition emits keep the module path and source line of the op they replace. What is left raises
`MissingRuleError` listing every op with its module and source line — or, with `fallback=True`, runs
replicated (`rules.base.replicated_rule`; `tactics.warn_fallbacks` names each op and the cost it adds).
`coverage(program)` is the same chain run for a report (`partir-torch coverage`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from partir_torch import _compat
from partir_torch.ir.program import Op, Program
from partir_torch.rules.base import MissingRuleError, rule_name, where


def missing_ops(program: Program) -> set[str]:
    return {op.target for op in program.ops if rule_name(op.target) is None}


@dataclass(frozen=True)
class Uncovered:
    """One aten op with no rule after decomposition: how often and where (module, source line)."""

    target: str
    count: int
    places: tuple[str, ...]  # `module h.0.attn (modeling_gpt2.py:123)`, distinct, in program order

    def __str__(self) -> str:
        more = f", … {len(self.places) - 3} more" if len(self.places) > 3 else ""
        return f"{self.target} ×{self.count} in {'; '.join(self.places[:3])}{more}"


def uncovered(program: Program) -> list[Uncovered]:
    """The ops of `program` without a rule, each with the places it comes from."""
    by: dict[str, list[Op]] = {}
    for op in program.ops:
        if rule_name(op.target) is None:
            by.setdefault(op.target, []).append(op)
    return [Uncovered(t, len(ops), tuple(dict.fromkeys(where(o) for o in ops))) for t, ops in sorted(by.items())]


def prepare(program: Program, *, fallback: bool = False, rounds: int = 3) -> Program:
    """`program` with every op covered by a rule (decomposing where torch knows how)."""

    for _ in range(rounds):
        missing = missing_ops(program)
        if not missing:
            return program
        overloads = {op.overload for op in program.ops if op.target in missing}
        table = _compat.get_decompositions(list(overloads))
        if not table:
            break
        program = _retrace(program, table)
    left = uncovered(program)
    if left and not fallback:
        raise MissingRuleError(
            "no tile-mapping rule or decomposition for:\n  " + "\n  ".join(map(str, left)) + "\nadd rules in "
            "partir_torch/rules/<family>.py with @register(...), or run these ops replicated with fallback=True "
            "(CLI --fallback, search(..., fallback=True), or a schedule starting `fallback;`)"
        )
    return program


def _retrace(program: Program, table) -> Program:
    from partir_torch.capture.convert import assign_phases, to_program

    gm = program.graph_module
    placeholders = gm.graph.find_nodes(op="placeholder")
    mode = _compat.FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [torch.empty(n.meta["val"].shape, dtype=n.meta["val"].dtype) for n in placeholders]

    def run(*args: torch.Tensor):
        return torch.fx.Interpreter(gm).run(*args)

    with fx_traceback.preserve_node_meta():  # new nodes copy the replaced node's meta["custom"]
        new_gm = make_fx(run, decomposition_table=table, tracing_mode="fake")(*fakes)

    ids = program._placeholder_ids()
    index = {v: i for i, v in enumerate(ids)}
    in_roles = [(program.values[v].role, program.values[v].name) for v in ids]
    out_roles = []
    for vid in program.outputs[: program.n_graph_outputs]:
        v = program.values[vid]
        src = program.updates.get(vid)
        out_roles.append((v.role, v.name, index[src] if src is not None else None))
    new = to_program(new_gm, in_roles, out_roles, program.mode,
                     {op.target: op.flops for op in program.ops if op.flops is not None})
    if program.mode == "train":
        assign_phases(new.ops, new.values, new.outputs)
    by_name = {v.name: v.id for v in new.values}
    new.params, new.buffers, new.inputs = dict(program.params), dict(program.buffers), list(program.inputs)
    new.shared_states = dict(program.shared_states)
    new.hypers, new.hyper_values = dict(program.hypers), dict(program.hyper_values)
    new.opt_states = {p: dict(s) for p, s in program.opt_states.items()}
    new.grads = {p: by_name[program.values[g].name] for p, g in program.grads.items()}
    new.loss = by_name["loss"] if program.loss is not None else None
    new.optimizer, new.capture_time_s = program.optimizer, program.capture_time_s
    new.fold = dict(program.fold)
    new.groups = [type(g)(g.id, g.key, g.shape, g.params, tuple(by_name[program.values[m].name] for m in g.members
                                                               if program.values[m].name in by_name))
                  for g in program.groups]
    return new


@dataclass
class Coverage:
    """What `plan` will meet: per aten op of the captured step its rule (or `decomposed`), and what is
    left after the same decomposition and rule lookup `plan` runs — each with its module and source line."""

    ops: dict[str, str | None]  # captured aten op -> rule name, "decomposed", or None (fails / falls back)
    counts: dict[str, int]
    missing: list[Uncovered]  # after decomposition: ops that fail without fallback, run replicated with it
    errors: list[str]  # rules that raised on an op (a bug in a rule: plan fails the same way)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.errors

    def to_json(self) -> dict:
        covered = sum(r is not None for r in self.ops.values())
        return {"ops": self.ops, "counts": self.counts, "covered": covered, "total": len(self.ops),
                "missing": [{"op": u.target, "count": u.count, "places": list(u.places)} for u in self.missing],
                "errors": self.errors}


def coverage(program: Program) -> Coverage:
    """Run the chain `plan` runs (`prepare`, then every op's rule as `propagate.program_rules` builds it)
    and report instead of raising."""
    from partir_torch.rules.base import rule_for

    ready = prepare(program, fallback=True)
    left = uncovered(ready)
    missing_after = {u.target for u in left}
    counts = dict(sorted(program.op_counts().items()))
    ops: dict[str, str | None] = {}
    for t in counts:
        name = rule_name(t)
        ops[t] = name if name else (None if t in missing_after else "decomposed")
    errors = []
    for op in ready.ops:
        if op.target in missing_after:
            continue
        try:
            rule_for(op, ready)
        except Exception as e:
            errors.append(f"{op.target} (op {op.id}, {where(op)}): rule {rule_name(op.target)} raised {e!r}")
    return Coverage(ops, counts, left, errors)
