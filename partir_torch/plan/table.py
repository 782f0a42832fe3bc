"""A plan as a practitioner reads it first: what each mesh axis does (in the words of the field), the inputs,
the sharded parameters and optimizer states (repeated layers collapsed), the cost, and what blocks an axis.

Roles come from the specs, never from names: an axis that splits an input's first dim is data parallel (a
later dim: sequence); one that splits parameters that modules read split is tensor parallel (over the
experts when it splits a 3-D weight's first dim); one that splits parameters stored split but read whole is
FSDP / ZeRO-3; one that splits optimizer states beyond their parameters is ZeRO-1/2. An axis that splits
neither an input nor a parameter's read splits no compute: every device of it repeats the same work.
"""

from __future__ import annotations

import json
import re
from typing import Any

from partir_torch.cost.hardware import format_bytes


def _axes(spec: list | None) -> list[tuple[int, str]]:
    return [(d, a) for d, e in enumerate(spec or []) if e for a in ([e] if isinstance(e, str) else e)]


def roles(plan: Any) -> dict[str, list[str]]:
    """Per mesh axis, what it does (possibly several roles)."""
    out: dict[str, list[str]] = {a: [] for a in plan.mesh}
    shapes = plan.shapes.get("params", {})
    for axis in plan.mesh:
        dims = {d for spec in plan.inputs for d, a in _axes(spec) if a == axis}
        if 0 in dims:
            out[axis].append("data parallel")
        if dims - {0}:
            out[axis].append("sequence parallel")
        read = [n for n, s in plan.params.items() if any(a == axis for _, a in _axes(plan.param_reads.get(n, s)))]
        stored = [n for n, s in plan.params.items() if any(a == axis for _, a in _axes(s))]
        experts = [n for n in read if len(shapes.get(n, [])) == 3 and any(d == 0 and a == axis for d, a in
                                                                          _axes(plan.params[n]))]
        if experts:
            out[axis].append("expert parallel")
        if set(read) - set(experts):
            out[axis].append("tensor parallel")
        if set(stored) - set(read):
            out[axis].append("FSDP / ZeRO-3")
        beyond = [n for n, st in plan.optimizer_state.items() for s in st.values()
                  if any(a == axis for _, a in _axes(s)) and not any(a == axis for _, a in _axes(plan.params.get(n)))]
        if beyond and not stored:
            out[axis].append("ZeRO-1/2 (optimizer states)")
        elif beyond:
            out[axis].append("optimizer states")
    return out


def _collapse(rows: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Repeated layers with one spec as one row: `h.*.attn.c_attn.weight (x12)`."""
    collapsed: dict[tuple[str, str], list[str]] = {}
    for n, sp in rows:
        collapsed.setdefault((re.sub(r"\.\d+\.", ".*.", n), json.dumps(sp)), []).append(n)
    return [(f"{k} (x{len(ns)})" if len(ns) > 1 else ns[0], json.loads(sp)) for (k, sp), ns in collapsed.items()]


def table(plan: Any, top: int = 20) -> str:
    """The plan in a terminal (module docstring)."""
    lines = [f"mesh {plan.mesh}" + (f" (dcn: {', '.join(plan.dcn_axes)})" if plan.dcn_axes else "")
             + (f", schedule {plan.schedule}" if plan.schedule else "")
             + (f", hardware {plan.hardware}" if plan.hardware else "")]
    idle = []
    for axis, what in roles(plan).items():
        computes = [r for r in what if r not in ("FSDP / ZeRO-3", "ZeRO-1/2 (optimizer states)", "optimizer states")]
        lines.append(f"  {axis} ({plan.mesh[axis]}): {', '.join(what) or 'nothing'}")
        if not computes:
            idle.append(axis)
    if plan.loop:  # what the step does beyond one update: the plan is for that step
        lines.append("step: " + ", ".join(f"{k}={v}" for k, v in plan.loop.items()
                                          if v not in (None, 1) or (k == "accumulate" and v != 1)))
    shapes = plan.shapes.get("inputs", [])
    ins = [f"{i} {shapes[i] if i < len(shapes) else ''} {spec if spec and any(spec) else 'replicated'}"
           for i, spec in enumerate(plan.inputs)]
    lines.append("inputs: " + "; ".join(ins))
    sharded = [(n, s) for n, s in plan.params.items() if any(x is not None for x in s)]
    rows = _collapse(sharded)
    w = max((len(n) for n, _ in rows[:top]), default=10)
    lines.append(f"{len(sharded)} of {len(plan.params)} parameters sharded:")
    lines += [f"  {n:<{w}}  {s}" for n, s in rows[:top]]
    if len(rows) > top:
        lines.append(f"  … {len(rows) - top} more")
    beyond: list[tuple[str, Any]] = []
    for n, st in plan.optimizer_state.items():  # (ZeRO: states split where their parameter is not)
        by_spec: dict[str, list[str]] = {}
        for s, spec in st.items():
            if spec != plan.params.get(n):
                by_spec.setdefault(json.dumps(spec), []).append(s)
        beyond += [(f"{n} [{', '.join(sorted(ss))}]", json.loads(sp)) for sp, ss in by_spec.items()]
    if beyond:
        states = _collapse(beyond)
        lines.append(f"optimizer states sharded beyond their parameters ({len(beyond)}):")
        lines += [f"  {n}  {s}" for n, s in states[:top]] + ([f"  … {len(states) - top} more"] if len(states) > top
                                                               else [])
    c = plan.cost
    lines.append(f"step {c['step_time_s'] * 1e3:.2f} ms (compute {c['compute_time_s'] * 1e3:.2f}, communication "
                 f"{c['comm_time_s'] * 1e3:.2f}); peak memory {format_bytes(c['peak_memory_bytes'])} per device "
                 f"({'fits' if c['feasible'] else 'DOES NOT FIT'} in {format_bytes(c['memory_limit'])})")
    comm = ", ".join(f"{k} {format_bytes(v)}" for k, v in c["comm_bytes"].items())
    lines.append("communication per device: " + (comm or "none"))
    lines += [f"warning: axis {a!r} splits no compute: its {plan.mesh[a]} devices each repeat the same work"
              for a in idle if plan.mesh[a] > 1]
    lines += [f"blocked: {b['text']}" for b in plan.blocked]
    if plan.cache is not None:
        lines.append(f"plan from the cache ({plan.cache['level']} key {plan.cache['key']}, {plan.cache['file']}); "
                     "--no-cache (cache=False) plans again")
    return "\n".join(lines)


def episodes(search: dict) -> str:
    """The tree episodes a search ran, and why that is not its episode budget: the budget's last shares go to
    the refinement (local search from the best plans and the expert composites, counted in evaluations), and
    a tree stops early once every state of its axes is explored."""
    n, budget = search["episodes"], (search.get("budget") or {}).get("episodes")
    if budget is None or n >= budget:
        return f"{n} episodes"
    return (f"{n} tree episodes of a {budget}-episode budget (the rest refines the best plans and the expert "
            "composites, or the trees ran out of states)")
