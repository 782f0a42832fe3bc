"""Tools for people reading a plan: why it costs what it costs (`explain`), and how two plans differ (`diff`).

`explain(state, report, hw)` attributes the step's communication to its causes. Every collective `lower`
infers is costed with the cost model's own formula (`cost.model.collective_time`, fold weights included, so
the rows add up to the report's communication time and bytes) and grouped by (kind, axis, what is moved,
from -> to). "What" is the value's name for parameters, gradients and optimizer states, and for an activation
the module and op that made it (`h.*.attn addmm`); repeated layers collapse to `*`. The memory side is the
report's top contributors at the peak.

`diff(a, b)` compares two saved plans (`ShardingPlan` JSON): the cost figures side by side and every
parameter, input and optimizer state whose spec changed, repeated layers collapsed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from partir_torch.capture.fold import weights
from partir_torch.cost.hardware import Hardware, format_bytes
from partir_torch.cost.model import CostReport, collective_time
from partir_torch.ir.program import Role
from partir_torch.plan import ShardingPlan
from partir_torch.propagate import ShardingState

_LAYER = re.compile(r"\.\d+(?=\.|\]|$)")


def collapse(name: str) -> str:
    """`h.3.attn.c_attn.weight` -> `h.*.attn.c_attn.weight`: the repeated layers of a model read as one."""
    return _LAYER.sub(".*", name)


@dataclass(frozen=True)
class CommRow:
    kind: str
    axis: str
    what: str
    change: str  # "P('batch', None) -> P(None, None)"
    count: int  # collectives, repeated layers counted
    bytes: int  # per device
    time_s: float


@dataclass(frozen=True)
class Explanation:
    step_time_s: float
    compute_time_s: float
    comm_time_s: float
    comm: tuple[CommRow, ...]  # largest time first
    memory_peak_bytes: int
    memory_top: tuple[tuple[str, str, int], ...]

    def to_json(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "compute_time_s": self.compute_time_s,
                "comm_time_s": self.comm_time_s, "comm": [r.__dict__ for r in self.comm],
                "memory_peak_bytes": self.memory_peak_bytes, "memory_top": [list(t) for t in self.memory_top]}

    def table(self, top: int = 12) -> str:
        ms = 1e3
        lines = [f"step {self.step_time_s * ms:.2f} ms = compute {self.compute_time_s * ms:.2f} ms + communication "
                 f"{self.comm_time_s * ms:.2f} ms"]
        if self.comm:
            lines.append("communication by cause (time, share of communication, bytes per device, count):")
            w = max(len(r.what) for r in self.comm[:top])
            for r in self.comm[:top]:
                share = r.time_s / self.comm_time_s if self.comm_time_s else 0.0
                lines.append(f"  {r.time_s * ms:9.3f} ms {share:6.1%}  {r.kind:<14} {r.axis:<8} {r.what:<{w}}  "
                             f"{format_bytes(r.bytes):>10}  x{r.count}  {r.change}")
            if len(self.comm) > top:
                rest = self.comm[top:]
                lines.append(f"  … {len(rest)} more causes, {sum(r.time_s for r in rest) * ms:.3f} ms")
        else:
            lines.append("no communication")
        lines.append(f"memory at the peak ({format_bytes(self.memory_peak_bytes)} per device), largest values:")
        lines += [f"  {n} ({role}) {format_bytes(b)}" for n, role, b in self.memory_top]
        return "\n".join(lines)


def explain(state: ShardingState, report: CostReport, hw: Hardware, *,
            dcn_axes: frozenset[str] = frozenset()) -> Explanation:
    program, mesh = state.program, state.mesh
    op_w, val_w = weights(program)
    rows: dict[tuple[str, str, str, str], list] = {}
    for c in report.collectives:
        n = mesh.size(c.axis)
        dcn = c.axis in dcn_axes
        measured = hw.link(c.axis, c.kind) if hw.links else None
        t = (collective_time(c, n, hw.dcn_bandwidth if dcn else hw.link_bandwidth,
                             hw.dcn_latency if dcn else hw.link_latency) if measured is None else
             (measured[0] + c.bytes / measured[1] if n > 1 else 0.0))
        w = op_w[c.op] if c.op >= 0 else val_w[c.value]
        key = (c.kind, c.axis, _what(program, c.value), f"{c.src} -> {c.dst}")
        acc = rows.setdefault(key, [0, 0, 0.0])
        acc[0] += w
        acc[1] += w * c.bytes
        acc[2] += w * t
    # reductions issued together (`lower/buckets.py`) pay one call's latency a bucket: the time saved is a row
    # of its own per axis, so the causes still add up to the report
    for axis, total in report.comm_time_by_axis.items():
        saved = total - sum(v[2] for k, v in rows.items() if k[1] == axis)
        if saved < -1e-12 * max(total, 1e-30):
            n_calls = sum(by.get(axis, 0) for by in report.calls.values())
            rows[("buckets", axis, f"latency saved: {n_calls} calls issue every collective", "")] = [0, 0, saved]
    comm = sorted((CommRow(*k, *v) for k, v in rows.items()), key=lambda r: (-r.time_s, -r.bytes, r.what))
    return Explanation(report.step_time_s, report.compute_time_s, report.comm_time_s, tuple(comm),
                       report.peak_memory_bytes, tuple(report.top_at_peak))


def _what(program, v: int) -> str:
    val = program.values[v]
    if val.role is not Role.ACTIVATION or val.producer < 0:
        return collapse(val.name)
    op = program.ops[val.producer]
    short = op.target.removeprefix("aten.").split(".")[0]
    return f"{collapse(op.module) if op.module else '(step)'} {short}"


# -- diff --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanDiff:
    mesh: tuple[dict[str, int], dict[str, int]]
    cost: dict[str, tuple[float, float]]  # figure -> (a, b)
    params: tuple[tuple[str, int, Any, Any], ...]  # (collapsed name, how many, spec in a, spec in b)
    inputs: tuple[tuple[int, Any, Any], ...]
    optimizer_state: tuple[tuple[str, int, Any, Any], ...]  # ("name[state]", how many, a, b)
    notes: tuple[str, ...] = field(default=())

    @property
    def same_specs(self) -> bool:
        return not (self.params or self.inputs or self.optimizer_state)

    def to_json(self) -> dict[str, Any]:
        return {"mesh": list(self.mesh), "cost": {k: list(v) for k, v in self.cost.items()},
                "params": [list(p) for p in self.params], "inputs": [list(i) for i in self.inputs],
                "optimizer_state": [list(s) for s in self.optimizer_state], "notes": list(self.notes)}

    def __str__(self) -> str:
        lines = list(self.notes)
        for k, (a, b) in self.cost.items():
            rel = f" ({(b - a) / a:+.1%})" if a else ""
            if k.endswith("_s"):
                lines.append(f"{k:<24} {a * 1e3:10.3f} ms -> {b * 1e3:10.3f} ms{rel}")
            else:
                lines.append(f"{k:<24} {format_bytes(a):>13} -> {format_bytes(b):>13}{rel}")
        if self.same_specs:
            lines.append("every parameter, input and optimizer state has the same spec")
        for title, rows in (("parameters", self.params), ("optimizer states", self.optimizer_state)):
            if rows:
                lines.append(f"{title} with another spec:")
                lines += [f"  {n}{f' (x{k})' if k > 1 else ''}: {json.dumps(a)} -> {json.dumps(b)}"
                          for n, k, a, b in rows]
        if self.inputs:
            lines.append("inputs with another spec:")
            lines += [f"  inputs[{i}]: {json.dumps(a)} -> {json.dumps(b)}" for i, a, b in self.inputs]
        return "\n".join(lines)


_COST_FIGURES = ("step_time_s", "compute_time_s", "comm_time_s", "peak_memory_bytes")


def diff(a: ShardingPlan, b: ShardingPlan) -> PlanDiff:
    """How plan `b` differs from plan `a` (both of the same model)."""
    notes = []
    if a.mesh != b.mesh:
        notes.append(f"different meshes: {a.mesh} -> {b.mesh}")
    if set(a.params) != set(b.params):
        only = sorted(set(a.params) ^ set(b.params))
        notes.append(f"the plans have different parameters (e.g. {only[0]}): are they of the same model?")
    cost = {k: (float(a.cost.get(k, 0.0)), float(b.cost.get(k, 0.0))) for k in _COST_FIGURES}
    kinds = sorted(set(a.cost.get("comm_bytes", {})) | set(b.cost.get("comm_bytes", {})))
    for k in kinds:
        cost[f"{k} bytes"] = (float(a.cost.get("comm_bytes", {}).get(k, 0)),
                              float(b.cost.get("comm_bytes", {}).get(k, 0)))
    params = _changed({n: (a.params[n], b.params[n]) for n in a.params if n in b.params})
    # a state whose spec changes as its parameter's does (ZeRO aside, the usual case) is not listed
    follow = {f"{n}[{s}]": (sa, b.optimizer_state[n][s]) for n, st in a.optimizer_state.items()
              for s, sa in st.items() if s in b.optimizer_state.get(n, {})}
    states = _changed({k: ab for k, ab in follow.items()
                       if ab != (a.params.get(k.rsplit("[", 1)[0]), b.params.get(k.rsplit("[", 1)[0]))})
    n_follow = sum(1 for k, (x, y) in follow.items() if x != y) - sum(k for _, k, _, _ in states)
    if n_follow:
        notes.append(f"{n_follow} optimizer states change as their parameters do (not listed)")
    inputs = tuple((i, x, y) for i, (x, y) in enumerate(zip(a.inputs, b.inputs)) if x != y)
    return PlanDiff((a.mesh, b.mesh), cost, params, inputs, states, tuple(notes))


def _changed(pairs: dict[str, tuple[Any, Any]]) -> tuple[tuple[str, int, Any, Any], ...]:
    groups: dict[tuple[str, str, str], int] = {}
    for n, (x, y) in pairs.items():
        if x != y:
            key = (collapse(n), json.dumps(x), json.dumps(y))
            groups[key] = groups.get(key, 0) + 1
    return tuple((n, k, json.loads(x), json.loads(y)) for (n, x, y), k in groups.items())
