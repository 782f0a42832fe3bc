"""Lowering: the collectives a propagated sharding implies (PartIR §4).

Between the sharding a value has and the one an op needs, per mesh axis:
    partial  -> replicated : all-reduce        partial -> tiled    : reduce-scatter (all-reduce + slice, fused)
    tiled d  -> replicated : all-gather        tiled d -> tiled d' : all-to-all
    replicated -> tiled    : local slice (free) replicated/partial -> partial : free (one device keeps it)
Bytes are per device: for all-reduce and reduce-scatter the (partial) input held, for all-gather the
gathered output, for all-to-all the local block. The same value resharded to the same sharding by several
ops is one collective (the compiler's CSE). Updated parameters and optimizer states are resharded back to
their input sharding at the end of the step (ZeRO's parameter all-gather).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from partir_torch.ir.mesh import Mesh
from partir_torch.ir.sharding import Sharding
from partir_torch.propagate import ShardingState


@dataclass(frozen=True)
class Collective:
    kind: str  # all-reduce | reduce-scatter | all-gather | all-to-all
    axis: str
    bytes: int  # per device
    value: int
    op: int  # the consuming op, or -1 for the end-of-step reshard of an updated value
    src: str
    dst: str

    def to_json(self, state: ShardingState | None = None) -> dict:
        d = {"kind": self.kind, "axis": self.axis, "bytes": self.bytes, "value": self.value, "op": self.op,
             "from": self.src, "to": self.dst}
        if state is not None:
            d["value_name"] = state.program.values[self.value].name
            if self.op >= 0:
                d["target"] = state.program.ops[self.op].target
        return d


def local_numel(shape: tuple[int, ...], sh: Sharding, mesh: Mesh) -> int:
    return math.prod(sh.local_shape(shape, mesh))


def transitions(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, mesh: Mesh
                ) -> list[tuple[str, str, int]]:
    """[(kind, axis, bytes per device)] to turn `src` into `dst`, axis by axis in mesh order."""
    out: list[tuple[str, str, int]] = []
    cur = src
    for axis in mesh.names:
        s_dim = next((i for i, ax in enumerate(cur.dims) if axis in ax), None)
        d_dim = next((i for i, ax in enumerate(dst.dims) if axis in ax), None)
        s_part, d_part = axis in cur.partial, axis in dst.partial
        before = local_numel(shape, cur, mesh) * itemsize
        nxt = _move(cur, axis, d_dim, d_part)
        after = local_numel(shape, nxt, mesh) * itemsize
        if s_part and not d_part:
            out.append(("reduce-scatter" if d_dim is not None else "all-reduce", axis, before))
        elif s_dim is not None and s_dim != d_dim:
            if d_dim is not None:
                out.append(("all-to-all", axis, before))
            else:
                out.append(("all-gather", axis, after))
        cur = nxt
    return out


def _move(sh: Sharding, axis: str, dim: int | None, partial: bool) -> Sharding:
    dims = [tuple(a for a in ax if a != axis) for ax in sh.dims]
    if dim is not None:
        dims[dim] = (*dims[dim], axis)
    part = (sh.partial - {axis}) | ({axis} if partial else set())
    return Sharding(tuple(dims), frozenset(part))


def required_operand(state: ShardingState, o: int, i: int) -> Sharding:
    """The sharding op `o` reads its i-th tensor operand in."""
    rule = state.rules[o]
    t = rule.operands[i]
    partial = state.reduced_axes(o) if i in rule.partialize else frozenset()
    partial = frozenset(a for a in partial if all(a not in ax for ax in state.required(o, t.dims)))
    return Sharding(state.required(o, t.dims), partial | state.passthrough[o])


def lower(state: ShardingState) -> list[Collective]:
    program, mesh = state.program, state.mesh
    out: list[Collective] = []
    seen: set[tuple[int, Sharding]] = set()

    def add(v: int, src: Sharding, dst: Sharding, op: int) -> None:
        if src == dst or (v, dst) in seen:
            return
        seen.add((v, dst))
        val = program.values[v]
        for kind, axis, nbytes in transitions(src, dst, val.shape, val.dtype.itemsize, mesh):
            out.append(Collective(kind, axis, nbytes, v, op, str(src), str(dst)))

    for o in state.active_ops():  # an op with only replicated tensors and no assignment implies nothing
        rule = state.rules[o]
        for i, t in enumerate(rule.operands):
            add(t.value, state.shard[t.value], required_operand(state, o, i), o)
        for r, t in enumerate(rule.results):
            add(t.value, state.op_output(o, r), state.shard[t.value], o)
    for new, old in program.updates.items():
        add(new, state.shard[new], state.shard[old], -1)
    if program.loss is not None:
        add(program.loss, state.shard[program.loss], Sharding.replicated(0), -1)
    return out


def summarize(collectives: list[Collective]) -> dict[str, dict[str, int]]:
    """{kind: {axis: bytes per device}}."""
    acc: dict[str, dict[str, int]] = {}
    for c in collectives:
        acc.setdefault(c.kind, {}).setdefault(c.axis, 0)
        acc[c.kind][c.axis] += c.bytes
    return acc
