"""Which reductions of a sharded step go together, and when: the buckets the torch backend's rank program
issues (`backends/distributed/buckets.py`) and the cost model prices (one call each, `cost/model.py`).

A *reduction* is a reshard whose walk is one all-reduce, or one reduce-scatter whose blocks lie along one dim,
over one mesh axis, of a value an op makes: a gradient's (data parallelism; ZeRO-2 and FSDP scatter it), a
row-parallel output's (Megatron). Collectives cost a fixed time per call beside their bytes (on 4 gloo CPU
ranks 31 all-reduces of 16 KiB take ~160 ms, one of the same bytes ~6 ms), so, as DDP buckets gradients and
FSDP2 reduce-scatters a block's at once, reductions of one kind, mesh axis and dtype are planned into buckets:

    in the order their values are made, a reduction joins the open bucket of its key unless that would pass
    `cap` bytes, or a member of the bucket is read before this one is made (a bucket is issued when its last
    member is made and must be done before any member is read); otherwise it opens the next bucket.

Each member is copied into its bucket's buffer as it is made, the bucket's one collective is issued at its
last member, and each member is cut from the result where it is first read: the reduction overlaps what
runs in between, and the bytes are the walks' own. Megatron's forward all-reduces, read at once, stay buckets
of one. Pure functions of the state: the engine and the cost model get the same buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from partir_torch.ir.sharding import Sharding
from partir_torch.lower.collectives import dedup_key, relayouts, required_operand
from partir_torch.lower.layout import Step, scatter_dim, walk
from partir_torch.propagate import ShardingState

DEFAULT_CAP = 25 * 2**20  # DDP's bucket size, bytes


@dataclass(frozen=True)
class Reduction:
    """One reduction: of value `value` (laid out `src`) to `dst` by `step`; its slot is the walk's identity
    (`lower.dedup_key`), made by op `made`, first read (in `dst`) by op `read` (the step's end: n_ops)."""

    slot: tuple[int, Sharding]
    value: int
    src: Sharding
    dst: Sharding
    step: Step
    dim: int  # a reduce-scatter's: the dim its blocks lie along (an all-reduce's: -1)
    nbytes: int  # the local bytes reduced (the step's input)
    dtype: torch.dtype
    made: int
    read: int

    @property
    def key(self) -> tuple[str, str, torch.dtype]:
        return self.step.kind, self.step.axis, self.dtype  # (a reduce-scatter bucket's members may split any dim)


@dataclass(frozen=True)
class Bucket:
    """Reductions of one key issued as one collective when the last is made (`made`), done before `read`."""

    members: tuple[Reduction, ...]

    @property
    def kind(self) -> str:
        return self.members[0].step.kind

    @property
    def axis(self) -> str:
        return self.members[0].step.axis

    @property
    def made(self) -> int:
        return max(m.made for m in self.members)

    @property
    def read(self) -> int:
        return min(m.read for m in self.members)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.members)


def reductions(state: ShardingState) -> list[Reduction]:
    """Every reduction of the step (module docstring), in the order their values are made: a result's reshard
    to its value's sharding where the op makes it (read by the value's first reader), and an operand's reshard
    to the layout an op reads it in (of the value, or of the root it is a view of; read by that op)."""
    prog, mesh = state.program, state.mesh
    relay = relayouts(prog, state.rules)
    n_ops = len(prog.ops)
    first_read: dict[int, int] = {}
    for op in prog.ops:
        for t in state.rules[op.id].operands:
            first_read.setdefault(t.value, op.id)
    found: dict[tuple[int, Sharding], list] = {}  # slot -> [value, src, dst, made, read]
    for op in prog.ops:
        for r, v in enumerate(o for o in op.outputs if o >= 0):  # made, then resharded to its own sharding
            src, dst = state.op_output(op.id, r), state.shard[v]
            if src != dst and dedup_key(state, relay, v, src, dst)[0] == v:
                found.setdefault((v, dst), [v, src, dst, op.id, first_read.get(v, n_ops)])
        for i, t in enumerate(state.rules[op.id].operands):  # read by `op` in another layout
            v, need = t.value, required_operand(state, op.id, i)
            if need == state.shard[v]:
                continue
            u, d = dedup_key(state, relay, v, state.shard[v], need)
            if prog.values[u].producer < 0:
                continue
            got = found.setdefault((u, d), [u, state.shard[u], d, prog.values[u].producer, op.id])
            got[4] = min(got[4], op.id)
    out = []
    for (u, d), (v, src, dst, made, read) in found.items():
        val = prog.values[v]
        steps = walk(src, dst, val.shape, val.dtype.itemsize, mesh)
        if len(steps) != 1 or steps[0].flat or steps[0].kind not in ("all-reduce", "reduce-scatter") \
                or not val.dtype.is_floating_point or made >= read:
            continue
        dim = -1 if steps[0].kind == "all-reduce" else scatter_dim(steps[0], val.shape, mesh)
        if dim is None:
            continue
        nbytes = val.dtype.itemsize
        for size in src.local_shape(val.shape, mesh):
            nbytes *= size
        out.append(Reduction((u, d), v, src, dst, steps[0], dim, nbytes, val.dtype, made, read))
    out.sort(key=lambda r: (r.made, r.read))
    return out


def plan(found: list[Reduction], cap: int = DEFAULT_CAP) -> list[Bucket]:
    """The buckets of `found` (in the order made), each closed at `cap` bytes or before a member is read."""
    open_: dict[tuple, list[Reduction]] = {}
    out: list[Bucket] = []
    for r in found:
        cur = open_.get(r.key)
        if cur and (sum(m.nbytes for m in cur) + r.nbytes > cap or min(m.read for m in cur) <= r.made):
            out.append(Bucket(tuple(cur)))
            cur = None
        if cur is None:
            cur = open_[r.key] = []
        cur.append(r)
    out += [Bucket(tuple(b)) for b in open_.values() if b]
    out.sort(key=lambda b: b.made)
    return out


def coalesced(value: np.ndarray, op: np.ndarray, move: np.ndarray, kind: np.ndarray, axis: np.ndarray,
              nbytes: np.ndarray, weight: np.ndarray, static, cap: int = DEFAULT_CAP
              ) -> tuple[dict[tuple[int, int], int], list[tuple[int, int]]]:
    """What `plan` makes of a cost report's collectives, fast enough for the search (arrays, no walk redone):
    the number of calls per (kind, axis) (indices of `cost.report.COLLECTIVES` and the mesh's axes), and where
    a bucket's buffer is made [(op, bytes)]. One entry per collective: the value it moves, the op it is
    issued at (-1: the end of the step), its move (`cost.tables`: a value's (source, destination) pair),
    kind, axis, bytes and fold weight; `static` (`cost.tables.Static`) gives each value's producer, first
    read and dtype and each op's folded block.

    A collective that is its value's only one for that move, an all-reduce or reduce-scatter, joins the run
    of its kind, axis and dtype (in the order the values are made) that no member's read interrupts; a run
    of B bytes is max(1, ceil(B / cap)) calls. In a folded program (`capture/fold.py`) a collective of
    weight W stands for W copies, one per element: read after its block (a gradient read by the optimizer)
    the copies join one run of W times its bytes; read within it, each element's copy closes its own run,
    so the run is W runs. Approximate where `plan` also checks what `cost` does not see (a reduce-scatter's
    blocks along one dim, a walk's local steps)."""
    made = static.v_producer[value]
    pair = value * (int(move.max(initial=0)) + 1) + move
    _, inv, count = np.unique(pair, return_inverse=True, return_counts=True)
    read = np.where(op != made, op, static.v_first_read[value])
    cand = (kind <= 1) & (made >= 0) & (count[inv] == 1) & (read > made)  # (COLLECTIVES: all-reduce, r-s first)
    n_ax = int(axis.max(initial=0)) + 1
    combo = kind * n_ax + axis
    calls: dict[tuple[int, int], int] = {}
    rest = np.flatnonzero(~cand)
    if len(rest):
        by = np.bincount(combo[rest], weights=weight[rest])
        calls = {(int(c) // n_ax, int(c) % n_ax): int(by[c]) for c in np.flatnonzero(by)}
    buffers: list[tuple[int, int]] = []
    idx = np.flatnonzero(cand)
    if not len(idx):
        return calls, buffers
    repeat = np.where((weight > 1) & (read <= static.block_end[made]), weight, 1)
    group = combo[idx] * (int(static.v_dtype.max(initial=0)) + 1) + static.v_dtype[value[idx]]
    order = np.lexsort((made[idx], group))  # by group, then made (stable: as the values are made)
    idx, group = idx[order], group[order]
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    ends = np.r_[starts[1:], len(idx)]
    wbytes, once = weight * nbytes, nbytes
    for g0, g1 in zip(starts.tolist(), ends.tolist()):
        m, r = made[idx[g0:g1]], read[idx[g0:g1]]
        key = (int(kind[idx[g0]]), int(axis[idx[g0]]))
        i = 0
        while i < len(m):  # a run: until a member is made at or after the run's first read
            first = np.minimum.accumulate(r[i:])
            stop = np.flatnonzero(m[i + 1:] >= first[:-1])
            j = i + 1 + int(stop[0]) if len(stop) else len(m)
            members = idx[g0 + i:g0 + j]
            copies = int(repeat[members].max())
            b = int(once[members].sum()) if copies > 1 else int(wbytes[members].sum())
            calls[key] = calls.get(key, 0) + copies * max(1, -(-b // cap))
            buffers.append((int(m[i:j].max()), min(b, max(cap, int(nbytes[members].max())))))
            i = j
    return calls, buffers
