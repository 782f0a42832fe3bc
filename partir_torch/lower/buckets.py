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


def coalesced(colls: list, weights: list[int], program, cap: int = DEFAULT_CAP, block_end: list[int] | None = None
              ) -> tuple[dict[tuple[str, str], int], list[tuple[int, int]]]:
    """What `plan` makes of a cost report's collectives, fast enough for the search (no walk is redone): the
    number of calls per (kind, axis), and where a bucket's buffer is made [(op, bytes)]. A collective that is
    a value's only one, an all-reduce or reduce-scatter, joins the run of its kind and axis (in the order the
    values are made) that no member's read interrupts; a run of B bytes is max(1, ceil(B / cap)) calls.
    In a folded program (`capture/fold.py`) a collective of weight W stands for W copies, one per element:
    read after its block (`block_end`: a gradient read by the optimizer) the copies join one run of W times
    its bytes; read within it, each element's copy closes its own run, so the run is W runs. Approximate
    where `plan` also checks what `cost` does not see (a reduce-scatter's blocks along one dim, a walk's
    local steps)."""
    users = program.users
    per: dict[tuple, int] = {}
    for c in colls:
        k = (c.value, c.src, c.dst)
        per[k] = per.get(k, 0) + 1
    calls: dict[tuple[str, str], int] = {}
    cands = []
    for c, w in zip(colls, weights):
        made = program.values[c.value].producer
        if c.kind in ("all-reduce", "reduce-scatter") and per[(c.value, c.src, c.dst)] == 1 and made >= 0:
            read = c.op if c.op != made else min(users[c.value], default=len(program.ops))
            if read > made:
                cands.append((made, read, c, w))
                continue
        calls[(c.kind, c.axis)] = calls.get((c.kind, c.axis), 0) + w
    cands.sort(key=lambda x: x[0])
    runs: dict[tuple, list] = {}  # (kind, axis, dtype) -> [bytes, first read, last made, largest, copies, bytes once]
    buffers: list[tuple[int, int]] = []

    def close(key: tuple, run: list) -> None:
        n = run[4] * max(1, -(-run[5] // cap)) if run[4] > 1 else max(1, -(-run[0] // cap))
        calls[key[:2]] = calls.get(key[:2], 0) + n
        buffers.append((run[2], min(run[5] if run[4] > 1 else run[0], max(cap, run[3]))))  # up to cap, >= a member

    for made, read, c, w in cands:
        key = (c.kind, c.axis, program.values[c.value].dtype)
        run = runs.get(key)
        if run is not None and run[1] <= made:
            close(key, run)
            run = None
        if run is None:
            run = runs[key] = [0, read, made, 0, 1, 0]
        run[0] += w * c.bytes
        run[5] += c.bytes
        if w > 1 and block_end is not None and 0 <= read <= block_end[made]:
            run[4] = max(run[4], w)
        run[1], run[2], run[3] = min(run[1], read), max(run[2], made), max(run[3], c.bytes)
    for key, run in runs.items():
        close(key, run)
    return calls, buffers
