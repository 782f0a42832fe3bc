"""Sharding plans: per-parameter / input / optimizer-state partition specs with their cost, as JSON.

Specs are torch_xla's form: one entry per tensor dim, `None`, an axis name, or a list of axis names (major
to minor). `ShardingPlan.to_json()` keeps at least `mesh.axes`, `params`, `inputs`, `optimizer_state`,
`cost` (`step_time_s`, `peak_memory_bytes`, `comm_bytes` by collective kind) and, for searched plans,
`search`; `ShardingPlan.from_json` reads it back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from partir_torch.capture.fold import full_names
from partir_torch.propagate import ShardingState

Spec = list  # one entry per dim: None, an axis name, or a list of axis names (major to minor)


@dataclass(frozen=True)
class PlanSpecs:
    params: dict[str, Spec]
    inputs: list[Spec]
    optimizer_state: dict[str, dict[str, Spec]]  # per parameter, per per-parameter state
    activations: dict[str, Spec] = field(default_factory=dict)  # module path -> spec of its output
    grads: dict[str, Spec] = field(default_factory=dict)  # parameter -> spec of its gradient


def module_outputs(program) -> dict[str, int]:
    """The value each module's forward returns, by module path: the one forward activation made inside the
    module (its ops or its submodules') and used outside it. Modules whose output is not one such value
    (several outputs, tuples, modules called more than once) are left out."""
    from partir_torch.ir.program import Phase, Role

    made: dict[str, set[int]] = {}
    calls: dict[str, int] = {}
    prev = ""
    for op in program.ops:
        if op.phase is not Phase.FORWARD or not op.module:
            prev = ""
            continue
        parts = op.module.split(".")
        for i in range(1, len(parts) + 1):
            path = ".".join(parts[:i])
            if not (prev == path or prev.startswith(path + ".")):  # entered from outside: a call
                calls[path] = calls.get(path, 0) + 1
            made.setdefault(path, set()).update(o for o in op.outputs if o >= 0)
        prev = op.module
    users, ops = program.users, program.ops
    out: dict[str, int] = {}
    for path, vals in made.items():
        sub = path + "."
        escaping = []
        for v in sorted(vals):
            if program.values[v].role is not Role.ACTIVATION:
                continue
            if any(not (m := ops[u].module) or not (m == path or m.startswith(sub)) for u in users[v]):
                escaping.append(v)
        if len(escaping) == 1:
            out[path] = escaping[0]
    return {p: v for p, v in out.items() if calls.get(p, 1) <= 1}


def specs(state: ShardingState) -> PlanSpecs:
    """Specs of the full model: for a folded program, element 1's specs stand for elements 1..N-1."""
    p = state.program
    fold = p.fold

    def expand(d: dict[str, Any]) -> dict[str, Any]:
        return {full: spec for n, spec in d.items() for full in full_names(n, fold)} if fold else d

    return PlanSpecs(
        expand({n: state.shard[v].to_spec() for n, v in p.params.items()}),
        [state.shard[v].to_spec() for v in p.inputs],
        expand({n: {s: state.shard[v].to_spec() for s, v in st.items() if s not in p.shared_states}
                for n, st in p.opt_states.items()}),
        {k.removesuffix("."): spec for path, v in module_outputs(p).items()
         for k in full_names(path + ".", fold) for spec in [state.shard[v].to_spec()]},
        expand({n: state.shard[v].to_spec() for n, v in p.grads.items()}),
    )


@dataclass
class ShardingPlan:
    mesh: dict[str, int]
    params: dict[str, Spec]
    inputs: list[Spec]
    optimizer_state: dict[str, dict[str, Spec]]
    cost: dict[str, Any]
    schedule: str | None = None
    hardware: str | None = None
    dcn_axes: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    search: dict[str, Any] | None = None

    @classmethod
    def from_state(cls, state: ShardingState, cost, *, schedule: str | None = None, hardware: str | None = None,
                   dcn_axes=(), search: dict[str, Any] | None = None) -> ShardingPlan:
        sp = specs(state)
        return cls(dict(state.mesh.axes), sp.params, sp.inputs, sp.optimizer_state, cost.to_json(), schedule,
                   hardware, sorted(dcn_axes), [c.describe(state.program) for c in state.conflicts], search)

    def to_json(self) -> dict[str, Any]:
        out = {"mesh": {"axes": self.mesh, "dcn": self.dcn_axes}, "schedule": self.schedule, "hardware": self.hardware,
               "params": self.params, "inputs": self.inputs, "optimizer_state": self.optimizer_state,
               "cost": self.cost, "conflicts": self.conflicts}
        if self.search is not None:
            out["search"] = self.search
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any] | str) -> ShardingPlan:
        d = json.loads(d) if isinstance(d, str) else d
        return cls(dict(d["mesh"]["axes"]), d["params"], d["inputs"], d["optimizer_state"], d["cost"],
                   d.get("schedule"), d.get("hardware"), list(d["mesh"].get("dcn", [])), d.get("conflicts", []),
                   d.get("search"))

    def table(self, top: int = 20) -> str:
        """Sharded parameters, one line each, then the cost: readable in a terminal."""
        sharded = [(n, s) for n, s in self.params.items() if any(x is not None for x in s)]
        # repeated layers with one spec collapse to one row: h.*.attn.c_attn.weight (x12)
        collapsed: dict[tuple[str, str], list[str]] = {}
        for n, sp in sharded:
            collapsed.setdefault((re.sub(r"\.\d+\.", ".*.", n), json.dumps(sp)), []).append(n)
        rows = [(f"{k} (x{len(ns)})" if len(ns) > 1 else ns[0], json.loads(sp)) for (k, sp), ns in collapsed.items()]
        w = max((len(n) for n, _ in rows[:top]), default=10)
        lines = [f"mesh {self.mesh}" + (f" (dcn: {', '.join(self.dcn_axes)})" if self.dcn_axes else "")
                 + (f", schedule {self.schedule}" if self.schedule else "") + (f", hardware {self.hardware}" if self.hardware else ""),
                 f"{len(sharded)} of {len(self.params)} parameters sharded:"]
        lines += [f"  {n:<{w}}  {s}" for n, s in rows[:top]]
        if len(rows) > top:
            lines.append(f"  … {len(rows) - top} more")
        c = self.cost
        lines.append(f"step {c['step_time_s'] * 1e3:.2f} ms (compute {c['compute_time_s'] * 1e3:.2f}, communication "
                     f"{c['comm_time_s'] * 1e3:.2f}); peak memory {c['peak_memory_bytes'] / 2**30:.2f} GiB "
                     f"({'fits' if c['feasible'] else 'DOES NOT FIT'} in {c['memory_limit'] / 2**30:.1f} GiB)")
        lines.append("communication per device: " + (", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in c["comm_bytes"].items()) or "none"))
        return "\n".join(lines)
