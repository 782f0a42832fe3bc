"""Lowering: the collectives a propagated sharding implies (PartIR §4).

Between the sharding a value has and the one an op needs, per mesh axis:
    partial  -> replicated : all-reduce        partial -> tiled    : reduce-scatter (all-reduce + slice, fused)
    tiled d  -> replicated : all-gather        tiled d -> tiled d' : all-to-all
    tiled d in blocks <-> tiled d in n chunks (`Sharding.chunks`, a split / concat of n equal parts): all-to-all
    replicated -> tiled    : local slice (free) replicated/partial -> partial : free (one device keeps it)
    tiled d by (a, b) -> tiled d by (b) or (b, a): all-gather b, then a local slice (`misplaced`)
Bytes are per device: for all-reduce and reduce-scatter the (partial) input held, for all-gather the
gathered output, for all-to-all the local block. The same value resharded to the same sharding by several
ops is one collective (the compiler's CSE): the first op (in op order) that needs it owns it. Updated
parameters and optimizer states are resharded back to their input sharding at the end of the step (ZeRO's
parameter all-gather). `op_shardings` is what an op needs of each of its tensors (memoized by the op's rule
structure and assignment); the cost model (`cost/model.py`) compares whole states against it as arrays of
sharding ids and redoes `lower`'s dedup in the same order, so that its collectives are exactly these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from partir_torch.capture.fold import weights
from partir_torch.ir.mesh import Mesh
from partir_torch.ir.sharding import Sharding
from partir_torch.lower.layout import misplaced, walk
from partir_torch.propagate import MOVES, ShardingState


@dataclass(frozen=True)
class Collective:
    kind: str  # all-reduce | reduce-scatter | all-gather | all-to-all
    axis: str
    bytes: int  # per device
    value: int
    op: int  # the consuming op, or -1 for the end-of-step reshard of an updated value
    src: str
    dst: str

    @classmethod
    def make(cls, kind: str, axis: str, nbytes: int, value: int, op: int, src: str, dst: str) -> Collective:
        """`Collective(...)` at under half the cost (the frozen __init__ sets its fields one by one; the
        cost model makes thousands)."""
        c = object.__new__(cls)
        c.__dict__.update(kind=kind, axis=axis, bytes=nbytes, value=value, op=op, src=src, dst=dst)
        return c

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
    """[(kind, axis, bytes per device)] to turn `src` into `dst`: the collectives of `layout.walk`, the steps a
    rank program runs (pending sums first, then the tiling moves axis by axis; see there)."""
    return [(s.kind, s.axis, s.nbytes) for s in walk(src, dst, shape, itemsize, mesh) if s.collective]


CONTRACTIONS = frozenset({"mm", "bmm", "addmm", "convolution", "convolution_backward"})  # rules XLA partitions
# as dots: their sums reach the engine's dot handler, the others' its reduce or scatter handler (`fused`)


def fused(src: Sharding, dst: Sharding, steps, reduction: bool = False) -> dict[str, int]:
    """{kind: bytes per device} of one reshard's `transitions` steps as an SPMD compiler (XLA) emits them:
    the reduction over several axes of one kind one collective over their devices (at its largest step's
    bytes), the gathers off one dim one all-gather (its last step's output). A dot's sum reduced to a tiling
    over some of its axes (a reduce-scatter over `model`, an all-reduce over `batch`) stays two collectives;
    a sum made by a reduction (`reduction`: a `sum`, a `scatter_add`, a norm's parameter gradients) is one
    all-reduce over all its axes, then sliced: GSPMD's reduce and scatter handlers reduce every partitioned
    dim at once. What `verify` holds against the compiled HLO; the time model keeps the per-axis steps (the
    same bytes cross the links either way)."""
    out: dict[str, int] = {}
    groups: dict[object, tuple[str, int]] = {}
    for kind, axis, nbytes in steps:
        if axis in src.partial and dst.dim_of(axis) is None and kind != "all-to-all":
            if kind == "all-gather":  # a hierarchical all-reduce's gather back (`layout.walk`): one all-reduce
                continue
            key: object = "all-reduce"  # (its flat reduce-scatters too)
        elif kind in ("reduce-scatter", "all-reduce"):
            key = "all-reduce" if reduction else kind
        elif kind == "all-gather":
            key = ("gather", src.dim_of(axis))
        else:
            out[kind] = out.get(kind, 0) + nbytes
            continue
        first, most = groups.get(key, ("all-reduce" if key == "all-reduce" else kind, 0))
        groups[key] = (first, max(most, nbytes))
    for kind, nbytes in groups.values():
        out[kind] = out.get(kind, 0) + nbytes
    return out


def _chunked(chunks: tuple[tuple[int, int], ...], dims: tuple[tuple[str, ...], ...]) -> tuple[tuple[int, int], ...]:
    """A tensor's chunked dims that are tiled (a chunked layout of a replicated dim is the same tensor)."""
    return tuple(c for c in chunks if dims[c[0]]) if chunks else ()


def required_operand(state: ShardingState, o: int, i: int) -> Sharding:
    """The sharding op `o` reads its i-th tensor operand in."""
    rule = state.rules[o]
    t = rule.operands[i]
    partial = state.reduced_axes(o) if i in rule.partialize else frozenset()
    dims = state.required(o, t.dims)
    partial = frozenset(a for a in partial if all(a not in ax for ax in dims))
    return Sharding(dims, partial | state.passthrough[o], _chunked(t.chunks, dims))


def op_needs(rule, a: dict, pt: frozenset[str]) -> list[tuple[tuple[tuple[str, ...], ...], frozenset[str], tuple]]:
    """(dims, partial, chunks) of `required_operand` for each operand, then of `ShardingState.op_output` for each
    result, of an op with `rule`, factor assignment `a` and passed-through sums `pt`, without building
    Shardings (the cost model's path; tests check it against `lower`)."""
    out = []
    red = None
    for i, t in enumerate(rule.operands):
        dims = tuple([a.get(f, ()) if f is not None else () for f in t.dims])
        if i in rule.partialize:
            if red is None:
                red = frozenset(ax for r in rule.reduced for f in r for ax in a.get(f, ()))
            out.append((dims, frozenset(x for x in red if all(x not in ax for ax in dims)) | pt,
                        _chunked(t.chunks, dims)))
        else:
            out.append((dims, pt, _chunked(t.chunks, dims)))
    for t, r in zip(rule.results, rule.reduced):
        dims = tuple([a.get(f, ()) if f is not None else () for f in t.dims])
        out.append((dims, frozenset(ax for f in r if f not in t.dims for ax in a.get(f, ())) | pt,
                    _chunked(t.chunks, dims)))
    return out


def op_signatures(state: ShardingState) -> list[int]:
    """Per op, an id equal for ops whose rules give the same shardings under the same assignment (the
    factors each tensor carries, reductions, partialized operands): the repeated layers' ops share one."""
    an = state.analysis
    sigs = an.lower_sigs
    if sigs is None:
        ids: dict[tuple, int] = {}
        sigs = an.lower_sigs = [ids.setdefault((tuple((t.dims, t.chunks) for t in r.operands),
                                                 tuple((t.dims, t.chunks) for t in r.results), r.partialize,
                                                 r.reduced), len(ids)) for r in an.rules]
    return sigs


def op_shardings(state: ShardingState, o: int) -> tuple[tuple[Sharding, ...], tuple[Sharding, ...]]:
    """(`required_operand` of each operand, `op_output` of each result) of op `o`, memoized per analysis by
    (op signature, assignment, passed-through sums)."""
    sig = op_signatures(state)[o]
    a, pt = state.assign[o], state.passthrough[o]
    key = (sig, tuple(a.items()), pt)
    memo = state.analysis.lower_memo
    hit = memo.get(key)
    if hit is None:
        rule = state.rules[o]
        hit = memo[key] = (tuple(_canonical(required_operand(state, o, i)) for i in range(len(rule.operands))),
                           tuple(_canonical(state.op_output(o, r)) for r in range(len(rule.results))))
    return hit


def _canonical(sh: Sharding) -> Sharding:
    """The shared replicated instance for a replicated sharding (most values are: compared by identity first)."""
    return Sharding.replicated(len(sh.dims)) if not sh.partial and not any(sh.dims) else sh


def op_reshards(state: ShardingState, o: int) -> list[tuple[int, Sharding, Sharding]]:
    """[(value, src, dst)] for the tensors of op `o` whose sharding is not the one the op reads
    (`required_operand`: src the value's, dst the op's) or writes (`op_output`: src the op's, dst the
    value's); operands then results."""
    rule = state.rules[o]
    need_in, need_out = op_shardings(state, o)
    shard = state.shard
    out: list[tuple[int, Sharding, Sharding]] = []
    for t, need in zip(rule.operands, need_in):
        sh = shard[t.value]
        if sh is not need and sh != need:
            out.append((t.value, sh, need))
    for t, need in zip(rule.results, need_out):
        sh = shard[t.value]
        if sh is not need and sh != need:
            out.append((t.value, need, sh))
    return out


def reshard(state: ShardingState, v: int, src: Sharding, dst: Sharding
            ) -> tuple[tuple[tuple[str, str, int], ...], str, str]:
    """(`transitions` of value `v` from `src` to `dst`, str(src), str(dst)), memoized per analysis (program
    and mesh) by shape, itemsize and the two shardings."""
    program, mesh = state.program, state.mesh
    memo = state.analysis.reshard_memo
    val = program.values[v]
    key = (val.shape, val.dtype.itemsize, src, dst)
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = (tuple(transitions(src, dst, val.shape, val.dtype.itemsize, mesh)), str(src), str(dst))
    return hit


def end_reshards(state: ShardingState) -> list[tuple[int, Sharding, Sharding]]:
    """[(value, src, dst)] at the end of the step: updated values back to their input's sharding, the loss
    replicated (the candidates `lower` lists after every op's, with op -1)."""
    program, shard = state.program, state.shard
    out = [(new, shard[new], shard[old]) for new, old in program.updates.items()]
    if program.loss is not None:
        out.append((program.loss, shard[program.loss], Sharding.replicated(0)))
    return [c for c in out if c[1] != c[2]]


def made_by_reduction(program, rules, relay: list[int]) -> list[bool]:
    """Per value, whether it is (a re-layout of) the result of a reducing op that is not a contraction
    (`CONTRACTIONS`): how the engine reduces it when it is a pending sum (`fused`)."""
    out = []
    for v in range(len(program.values)):
        while relay[v] >= 0:
            v = rules[relay[v]].operands[0].value
        o = program.values[v].producer
        out.append(o >= 0 and rules[o].name not in CONTRACTIONS and any(rules[o].reduced))
    return out


def relayouts(program, rules) -> list[int]:
    """Per value, the op that made it by re-laying out one operand (a view, reshape or transpose), or -1."""
    out = [-1] * len(program.values)
    for r in rules:
        if r.name in MOVES and len(r.operands) == 1 and len(r.results) == 1:
            out[r.results[0].value] = program.values[r.results[0].value].producer
    return out


def pull_back(state: ShardingState, rule, sh: Sharding) -> Sharding | None:
    """The operand's sharding that a re-layout op `rule` turns into `sh` of its result (each tiled result dim
    to the operand dim of its factor), or None when a tiled dim has no factor on the operand side or its
    factor's dim does not divide into its devices: a merged dim `heads x head_dim` of 2 x 16 tiled over 4
    devices holds half a head on each, which no tiling of the 2 heads is."""
    if sh.chunks:
        return None
    src, dst = rule.operands[0].dims, rule.results[0].dims
    dims: list[tuple[str, ...]] = [() for _ in src]
    for d, axes in enumerate(sh.dims):
        if axes:
            f = dst[d]
            if f is None or f not in src:
                return None
            dims[src.index(f)] += axes
    shape, mesh = state.program.values[rule.operands[0].value].shape, state.mesh
    if any(axes and shape[d] % math.prod(mesh.size(a) for a in axes) for d, axes in enumerate(dims)):
        return None
    return Sharding(tuple(dims), sh.partial)


def relayout_root(state: ShardingState, relay: list[int], v: int, src: Sharding, dst: Sharding
                  ) -> tuple[int, Sharding, Sharding]:
    """(u, src', dst'): the reshard of `v` from `src` to `dst` as a reshard of the value `u` that `v` re-lays
    out (through views and transposes): the same elements moved the same way. A program that gathers a value
    and its transpose gathers once (GSPMD propagates one gathered copy to both; XLA's CSE merges the rest). So
    for a pending sum and its views: the engine reduces the sum where the plan's first reader constrains it,
    and autograd saves that reduced copy for the backward's reads through a transpose (MoE's dispatched
    tokens; before the call constraints, XLA reduced a sum and its view apart)."""
    while (o := relay[v]) >= 0:
        rule = state.rules[o]
        s, d = pull_back(state, rule, src), pull_back(state, rule, dst)
        if s is None or d is None:
            break
        v, src, dst = rule.operands[0].value, s, d
    return v, src, dst


def dedup_key(state: ShardingState, relay: list[int], v: int, src: Sharding, dst: Sharding) -> tuple[int, Sharding]:
    """`lower`'s identity of a reshard: (value, dst), or (u, dst') when it re-lays out a value `u` that the
    reshard moves from u's own sharding (`relayout_root`)."""
    if relay[v] < 0:
        return v, dst
    u, s, d = relayout_root(state, relay, v, src, dst)
    return (u, d) if u != v and s == state.shard[u] else (v, dst)


def lower(state: ShardingState) -> list[Collective]:
    """The collectives of `state`: each op's reshards (operands, then results) in op order, then the end of the
    step; each reshard once (`dedup_key`: a value's, or its re-layout's, to one sharding), owned by the first
    op that needs it."""
    out: list[Collective] = []
    seen: set[tuple[int, Sharding]] = set()
    relay = relayouts(state.program, state.rules)

    def add(v: int, src: Sharding, dst: Sharding, op: int) -> None:
        key = dedup_key(state, relay, v, src, dst)
        if key in seen:
            return
        seen.add(key)
        steps, s, d = reshard(state, v, src, dst)
        for kind, axis, nbytes in steps:
            out.append(Collective.make(kind, axis, nbytes, v, op, s, d))

    for o in state.active_ops():  # an op with only replicated tensors and no assignment implies nothing
        for v, src, dst in op_reshards(state, o):
            add(v, src, dst, o)
    for v, src, dst in end_reshards(state):
        add(v, src, dst, -1)
    return out


def misplaced_reads(state: ShardingState) -> dict[tuple[str, str], list[tuple[str, Sharding, Sharding, int]]]:
    """The reshards that gather a value whole because an axis kept on a dim changes its place in the dim's
    order (`misplaced`), named by the value they re-lay out (a parameter, not its transpose), grouped by
    (the axis the read wants further ahead, the axis held ahead of it): [(value name, held, read, bytes per
    device a step)], the bytes counted with the fold weight of the reading op."""
    if not any(len(d) > 1 for sh in state.shard for d in sh.dims):
        return {}
    names, relay = state.program.values, relayouts(state.program, state.rules)
    op_w, own_w = weights(state.program)  # a folded program's element stands for several layers
    seen: set[tuple[int, Sharding, Sharding]] = set()
    by: dict[tuple[str, str], list[tuple[str, Sharding, Sharding, int]]] = {}
    found = [(o, *r) for o in state.active_ops() for r in op_reshards(state, o)]
    found += [(-1, *r) for r in end_reshards(state)]
    for o, v, src, dst in found:
        if not misplaced(src, dst):
            continue
        v, src, dst = relayout_root(state, relay, v, src, dst)
        moved = misplaced(src, dst)
        if not moved or (v, src, dst) in seen:
            continue
        seen.add((v, src, dst))
        nbytes = (op_w[o] if o >= 0 else own_w[v]) * sum(b for _, _, b in reshard(state, v, src, dst)[0])
        for s, d in zip(src.dims, dst.dims):
            first = next((a for a in d if a in moved), None)  # the axis the read wants further ahead
            before = s[:s.index(first)] if first in s else ()
            if before:
                by.setdefault((first, before[-1]), []).append((names[v].name, src, dst, nbytes))
    return by


def summarize(collectives: list[Collective]) -> dict[str, dict[str, int]]:
    """{kind: {axis: bytes per device}}."""
    acc: dict[str, dict[str, int]] = {}
    for c in collectives:
        acc.setdefault(c.kind, {}).setdefault(c.axis, 0)
        acc[c.kind][c.axis] += c.bytes
    return acc
