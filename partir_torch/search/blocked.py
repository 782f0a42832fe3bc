"""Blocked axes, said: the dims that keep a mesh axis from splitting the work, and what would unblock them.

A plan that leaves an axis idle, or uses it only to store parameters sharded, is often not the search's
choice but the shapes': a batch of 4 cannot be split 16 ways, 12 heads cannot be split 8 ways, and the
search (or a manual tactic) then replicates without a word. `blocked_axes(state)` looks at the final plan,
per mesh axis, from roles and the search's action space only (never names):

- inputs: when no input is tiled on the axis, each input whose dim 0 (the batch, what `BatchParallel`
  splits) the axis, times the axes already on that dim, does not divide. An axis that splits at least half
  of the step's FLOPs otherwise (busy with model parallelism, or spending itself on a split over slow links)
  is reported only when no axis splits the batch, with that share;
- parameters: each parameter slot of the action space (`space.slots`: groups and large ungrouped parameters)
  not stored split on the axis, whose work (the ops that read it or write its gradient, seen through
  transposes, reshapes and casts) the plan does not split on the axis: if no dim of it divides, its dims;
  else, for each dim that divides, whether the tile would stop at a tensor dim the axis does not divide (the
  tile applied to an unsharded state, and propagation's divisibility conflicts read back): a head count that
  the model axis does not divide shows here, at the view that splits heads off the features;
- the plan's own tiles on the axis that propagation stopped at a dim the axis does not divide (its conflicts).

Only dims that do not divide are reported: an axis left idle by the search's choice is not blocked.
"""

from __future__ import annotations

import math
import re
from typing import Any

from partir_torch.capture.fold import weights
from partir_torch.cost.report import FLOP_TARGETS, op_flops
from partir_torch.errors import IllegalActionError
from partir_torch.ir.actions import Tile
from partir_torch.ir.program import Phase
from partir_torch.ir.sharding import divides, tile_count
from partir_torch.propagate import MOVES, ShardingState
from partir_torch.rules.tables import CASTS
from partir_torch.search.space import slots

BUSY = 0.5  # an axis that splits this share of the step's FLOPs is busy otherwise (model parallelism): said so


def split_flops(state: ShardingState) -> dict[str, float]:
    """Per mesh axis, the share of the step's matmul / convolution / attention FLOPs the plan splits over it."""
    p, total = state.program, 0.0
    share = dict.fromkeys(state.mesh.names, 0.0)
    weight, _ = weights(p)  # a folded program's repeated element counts N - 1 times
    for op in p.ops:
        if op.target not in FLOP_TARGETS:
            continue
        rule = state.rules[op.id]
        f = weight[op.id] * op_flops(op.target, [p.values[t.value].shape for t in rule.operands],
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
    """The inputs' batch dims (dim 0) that `axis` does not divide, one entry per size and axes."""
    p = state.program
    by: dict[tuple[int, tuple[str, ...]], list[str]] = {}
    for i, v in enumerate(p.inputs):
        val, sh = p.values[v], state.shard[v]
        if not val.shape or axis in sh.axes:
            continue
        axes = (*sh.dims[0], axis)
        if not divides(val.shape[0], state.mesh, axes):
            by.setdefault((val.shape[0], axes), []).append(f"{i} {list(val.shape)}")
    out = []
    for (n, axes), which in by.items():
        k = tile_count(state.mesh, axes)
        out.append({"axis": axis, "what": f"dim 0 of input{'s' * (len(which) > 1)} {', '.join(which)}", "size": n,
                    "divisor": k,
                    "text": f"the batch (dim 0 of input{'s' * (len(which) > 1)} {', '.join(which)}) has size {n}, "
                            f"not divisible by {_divisor(state, axes)}: no data parallelism over {axis!r}; "
                            + _fix(n, k, axis, state.mesh.size(axis), k // state.mesh.size(axis))})
    return out


def _param_blocks(state: ShardingState, axis: str) -> list[dict[str, Any]]:
    p, out = state.program, []
    found: dict[tuple, dict[str, Any]] = {}
    whole: list[str] = []  # parameters with no dim the axis divides
    _stops(state, axis, "the plan's split", found)  # where the plan's own tiles on the axis stopped
    for s in slots(p):
        if s.kind != "param":
            continue
        v, val = s.value, p.values[s.value]
        if axis in state.shard[v].axes:
            continue  # stored split on the axis (ZeRO-3, FSDP): a dim divides
        if any(axis in axes for o in _work(state, v) for axes in state.assign[o].values()):
            continue  # its work is split on the axis already
        dims = [d for d in range(len(val.shape)) if divides(val.shape[d], state.mesh, (*state.shard[v].dims[d], axis))]
        if not dims:
            whole.append(f"{s.target} {list(val.shape)}")
            continue
        for d in dims:
            probe = ShardingState(p, state.mesh, analysis=state.analysis)
            try:
                probe.apply(Tile(s.target, d, axis))
            except IllegalActionError:
                continue
            _stops(probe, axis, f"splitting {s.target}", found)
    if whole:
        n = state.mesh.size(axis)
        out.append({"axis": axis, "what": f"parameter{'s' * (len(whole) > 1)} {', '.join(whole)}", "divisor": n,
                    "text": f"no dim of parameter{'s' * (len(whole) > 1)} {_names(whole)} is divisible by {axis}={n}, "
                            f"so {'they' if len(whole) > 1 else 'it'} cannot be split over {axis!r}; make a dim a "
                            f"multiple of {n} or shrink {axis!r}"})
    for b in found.values():
        who = list(b.pop("who"))
        names = who[0] + (f" (and {len(who) - 1} more)" if len(who) > 1 else "")
        b["text"] = (f"{names} over {axis!r} stops at {b['op']} in {b['where']}: "
                     f"{b['what']} of {b['shape']} has size {b['size']}, not divisible by {b.pop('by')}; "
                     f"{b.pop('fix')}")
        out.append(b)
    return out


def _work(state: ShardingState, v: int) -> list[int]:
    """The ops that do parameter `v`'s work: those that read it or write its gradient, seen through the
    transposes, reshapes and casts between (a linear reads its weight transposed, and its gradient too)."""
    p = state.program
    grad = p.grads.get(p.values[v].name)
    todo, seen, out = [u for u in (v, grad) if u is not None], set(), []
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        for o in state.ops_of[u]:
            r = state.rules[o]
            if p.ops[o].phase is Phase.OPTIMIZER:
                continue
            if (r.name in MOVES or p.ops[o].target in CASTS) and len(r.operands) == 1 and len(r.results) == 1:
                todo += [r.operands[0].value, r.results[0].value]
            else:
                out.append(o)
    return out


def _names(names: list[str], top: int = 6) -> str:
    return ", ".join(names[:top]) + (f" … ({len(names) - top} more)" if len(names) > top else "")


def _stops(st: ShardingState, axis: str, who: str, found: dict[tuple, dict[str, Any]]) -> None:
    """Add to `found` each tensor dim at which the propagation of `axis` in `st` stopped, as it does not divide."""
    p = st.program
    for c in st.conflicts:
        hit = _stopped_at(st, c.op, axis) if c.axis == axis else None
        if hit is None:
            continue
        w, wd, axes = hit
        op, n, k = p.ops[c.op], p.values[w].shape[wd], tile_count(st.mesh, axes)
        where = re.sub(r"\.\d+(?=\.|$)", ".*", op.module or "the top level")
        key = (where, p.values[w].shape, wd)  # one entry per tensor dim, whichever of its ops met it
        if key not in found:
            found[key] = {"axis": axis, "what": f"{p.values[w].name} dim {wd}", "size": n, "divisor": k,
                          "by": _divisor(st, axes), "who": {}, "where": where, "op": op.target,
                          "shape": list(p.values[w].shape),
                          "fix": _fix(n, k, axis, st.mesh.size(axis), k // st.mesh.size(axis))}
        found[key]["who"].setdefault(who)


def _stopped_at(st: ShardingState, o: int, axis: str) -> tuple[int, int, tuple[str, ...]] | None:
    """(value, dim, the axes it would be split over) where propagation of `axis` through op `o` met a dim that
    those axes do not divide (None if the op is split on `axis` after all, or stopped for another reason)."""
    if any(axis in axes for axes in st.assign[o].values()):
        return None
    tensors, carriers = st.analysis.layout(o)
    for v, fdims in tensors:
        d = st.shard[v].dim_of(axis)
        if d is None or fdims[d] is None:
            continue
        axes = (*st.assign[o].get(fdims[d], ()), axis)
        for w, wd in carriers.get(fdims[d], ()):
            if not divides(st.program.values[w].shape[wd], st.mesh, axes):
                return w, wd, axes
    return None


def blocked_axes(state: ShardingState) -> list[dict[str, Any]]:
    """Every dim that keeps a mesh axis from splitting the plan's work, with what would unblock it (`text`)."""
    share = split_flops(state)
    out: list[dict[str, Any]] = []
    inputs = [state.shard[v] for v in state.program.inputs if state.program.values[v].shape]
    data_parallel = any(sh.dims[0] for sh in inputs)  # some axis splits the batch
    for axis in state.mesh.names:
        if not any(axis in sh.axes for sh in inputs) and (share[axis] < BUSY or not data_parallel):
            for b in _input_blocks(state, axis):
                if share[axis] >= BUSY:  # said all the same when nothing splits the batch, with what the axis does
                    b["text"] += f" (the plan splits {share[axis]:.0%} of the step's FLOPs over {axis!r} otherwise)"
                out.append(b)
        out += _param_blocks(state, axis)
    batch: dict[tuple, list[dict[str, Any]]] = {}
    for b in out:
        if b["what"].startswith("dim 0 of input") and share[b["axis"]] < BUSY:
            batch.setdefault((b["what"], b["size"]), []).append(b)
    for (_, n), bs in batch.items():
        if len(bs) > 1:  # the batch blocks several idle axes: what would let all of them split it
            k = math.prod(state.mesh.size(b["axis"]) for b in bs)
            bs[-1]["text"] += (f"; {' and '.join(repr(b['axis']) for b in bs)} together need a multiple of {k} "
                               f"(e.g. {n + (-n) % k})")
    return out
