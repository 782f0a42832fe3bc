"""Blocked axes, said: the dims that keep a mesh axis from splitting the work, and what would unblock them.

A plan that leaves an axis idle, or uses it only to store parameters sharded, is often not the search's
choice but the shapes': a batch of 4 cannot be split 16 ways, 12 heads cannot be split 8 ways, and the
search (or a manual tactic) then replicates without a word. `blocked_axes(state)` looks at the final plan,
per mesh axis, from roles and the search's action space only (never names):

- inputs: when no input is tiled on the axis and the axis splits less than half of the step's FLOPs (it is
  not busy with model parallelism instead), each input whose dim 0 (the batch, what `BatchParallel` splits)
  the axis, times the axes already on that dim, does not divide;
- parameters: each parameter slot of the action space (`space.slots`: groups and large ungrouped parameters)
  whose forward ops the plan does not split on the axis: if no dim of it divides, its dims; else, for each
  dim that divides, whether the tile would stop at a tensor dim the axis does not divide (the tile applied
  to an unsharded state, and propagation's divisibility conflicts read back): a head count that the model
  axis does not divide shows here, at the view that splits heads off the features.

Only dims that do not divide are reported: an axis left idle by the search's choice is not blocked.
"""

from __future__ import annotations

import math
import re
from typing import Any

from partir_torch.cost.report import FLOP_TARGETS, op_flops
from partir_torch.errors import IllegalActionError
from partir_torch.ir.actions import Tile
from partir_torch.ir.program import Phase
from partir_torch.ir.sharding import divides, tile_count
from partir_torch.propagate import ShardingState
from partir_torch.search.space import slots

BUSY = 0.5  # an axis that splits this share of the step's FLOPs is doing model parallelism: no batch report


def split_flops(state: ShardingState) -> dict[str, float]:
    """Per mesh axis, the share of the step's matmul / convolution / attention FLOPs the plan splits over it."""
    p, total = state.program, 0.0
    share = dict.fromkeys(state.mesh.names, 0.0)
    for op in p.ops:
        if op.target not in FLOP_TARGETS:
            continue
        rule = state.rules[op.id]
        f = op_flops(op.target, [p.values[t.value].shape for t in rule.operands],
                     [p.values[t.value].shape for t in rule.results])
        total += f
        for a in {a for axes in state.assign[op.id].values() for a in axes}:
            share[a] += f
    return {a: (v / total if total else 0.0) for a, v in share.items()}


def _fix(n: int, k: int, axis: str, size: int, others: int) -> str:
    """What would unblock size `n` over `k` devices (`others` of them from axes already on the dim)."""
    up = n + (-n) % k
    room = math.gcd(n // others, size) if n % others == 0 else 1
    shrink = f"shrink {axis!r} to {room}" if room > 1 else f"leave {axis!r} out of the mesh"
    return f"make it a multiple of {k} (e.g. {up}) or {shrink}"


def _divisor(state: ShardingState, axes: tuple[str, ...]) -> str:
    k = tile_count(state.mesh, axes)
    return f"{k} ({' x '.join(f'{a}={state.mesh.size(a)}' for a in axes)})" if len(axes) > 1 else \
        f"{axes[0]}={state.mesh.size(axes[0])}"


def _input_blocks(state: ShardingState, axis: str) -> list[dict[str, Any]]:
    p, out = state.program, []
    for i, v in enumerate(p.inputs):
        val, sh = p.values[v], state.shard[v]
        if not val.shape or axis in sh.axes:
            continue
        axes = (*sh.dims[0], axis)
        if divides(val.shape[0], state.mesh, axes):
            continue
        n, k = val.shape[0], tile_count(state.mesh, axes)
        out.append({"axis": axis, "what": f"input {i} dim 0", "size": n, "divisor": k,
                    "text": f"input {i} ({val.name} {list(val.shape)}) dim 0, the batch, has size {n}, not divisible "
                            f"by {_divisor(state, axes)}: no data parallelism over {axis!r}; "
                            + _fix(n, k, axis, state.mesh.size(axis), k // state.mesh.size(axis))})
    return out


def _param_blocks(state: ShardingState, axis: str) -> list[dict[str, Any]]:
    p, out = state.program, []
    found: dict[tuple, dict[str, Any]] = {}
    for s in slots(p):
        if s.kind != "param":
            continue
        v, val = s.value, p.values[s.value]
        forward = [o for o in state.touch[v] if p.ops[o].phase is Phase.FORWARD]
        if any(axis in axes for o in forward for axes in state.assign[o].values()):
            continue  # its work is split on the axis already
        dims = [d for d in range(len(val.shape)) if divides(val.shape[d], state.mesh, (*state.shard[v].dims[d], axis))]
        if not dims:
            sizes = ", ".join(map(str, val.shape))
            out.append({"axis": axis, "what": f"parameter {s.target}", "size": list(val.shape),
                        "divisor": state.mesh.size(axis),
                        "text": f"parameter {s.target} {list(val.shape)}: no dim divisible by {axis}="
                                f"{state.mesh.size(axis)} (sizes {sizes}), so it cannot be split over {axis!r}; "
                                f"make one a multiple of {state.mesh.size(axis)} or shrink {axis!r}"})
            continue
        for d in dims:
            probe = ShardingState(p, state.mesh, analysis=state.analysis)
            try:
                probe.apply(Tile(s.target, d, axis))
            except IllegalActionError:
                continue
            for c in probe.conflicts:
                hit = _stopped_at(probe, c.op, axis)
                if hit is None:
                    continue
                w, wd, axes = hit
                k = tile_count(state.mesh, axes)
                op = p.ops[c.op]
                where = re.sub(r"\.\d+(?=\.|$)", ".*", op.module or "the top level")
                key = (where, op.target, p.values[w].shape, wd)
                if key in found:
                    found[key]["params"].setdefault(s.target)
                    continue
                n = p.values[w].shape[wd]
                found[key] = {"axis": axis, "what": f"{p.values[w].name} dim {wd}", "size": n, "divisor": k,
                              "by": _divisor(state, axes),
                              "params": {s.target: None}, "where": where, "op": op.target, "shape": list(p.values[w].shape),
                              "fix": _fix(n, k, axis, state.mesh.size(axis), k // state.mesh.size(axis))}
    for b in found.values():
        ps = list(b.pop("params"))
        names = ps[0] + (f" (and {len(ps) - 1} more)" if len(ps) > 1 else "")
        b["text"] = (f"splitting {names} over {axis!r} stops at {b['op']} in {b['where']}: "
                     f"{b['what']} of {b['shape']} has size {b['size']}, not divisible by {b.pop('by')}; "
                     f"{b.pop('fix')}")
        out.append(b)
    return out


def _stopped_at(probe: ShardingState, o: int, axis: str) -> tuple[int, int, tuple[str, ...]] | None:
    """(value, dim, the axes it would be split over) where propagation of `axis` through op `o` met a dim it does not divide."""
    tensors, carriers = probe.analysis.layout(o)
    for v, fdims in tensors:
        d = probe.shard[v].dim_of(axis)
        if d is None or fdims[d] is None:
            continue
        axes = (*probe.assign[o].get(fdims[d], ()), axis)
        for w, wd in carriers.get(fdims[d], ()):
            if not divides(probe.program.values[w].shape[wd], probe.mesh, axes):
                return w, wd, axes
    return None


def blocked_axes(state: ShardingState) -> list[dict[str, Any]]:
    """Every dim that keeps a mesh axis from splitting the plan's work, with what would unblock it (`text`)."""
    share = split_flops(state)
    out: list[dict[str, Any]] = []
    for axis in state.mesh.names:
        if share[axis] < BUSY and not any(axis in state.shard[v].axes for v in state.program.inputs):
            out += _input_blocks(state, axis)
        out += _param_blocks(state, axis)
    return out
