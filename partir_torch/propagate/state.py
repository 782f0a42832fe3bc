"""Fixpoint propagation of sharding decisions, per mesh axis, both ways along def-use edges (PartIR §3).

State: a `Sharding` per value and, per op, the axes assigned to each of its factors. Propagating axis `a`:

    worklist = ops touching the values just tiled
    for op in worklist:
        f = the factor `a` is assigned to in op, else the factors that op's tensors tiled on `a` carry:
            none -> nothing to do; two different ones, or a dim that carries no factor -> a conflict;
            a factor that needs replication (or does not divide) -> a conflict;
            one factor f -> assign a to f.
        a conflict, once every result of op is tiled on `a`: assign a to the factor all results carry (or
            sum over) that moves the fewest bytes (the others re-tiled by all-to-all), if no more than the
            replicated run gathers (`_settle`: what an SPMD partitioner does); else record a Conflict (the
            op runs replicated on `a`).
        every tensor of op that carries f, and is not yet decided on `a`, gets its dim tiled on `a`
        (if divisible and not locked by Replicate), and its other ops join the worklist, as do the
        same values of the other repeated layers (groups);
        a result that does not carry f while f is a reduction for it becomes partial on `a`.

Decisions are never undone: a value already decided on an axis keeps its sharding, and the mismatch is
resolved by a reshard at lowering. The order of actions is their priority.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from partir_torch.errors import IllegalActionError, PartirError
from partir_torch.ir.actions import Action, Replicate, ShardOptimizer, Tile, TileLate
from partir_torch.ir.mesh import Mesh
from partir_torch.ir.program import Phase, Program
from partir_torch.ir.sharding import Sharding, tile_count
from partir_torch.propagate.analysis import Analysis
from partir_torch.propagate.zero import apply_zero
from partir_torch.rules.base import OpRule


@dataclass(frozen=True)
class Conflict:
    """Propagation of `axis` stopped at `op`: `why`, with the values involved."""

    op: int
    axis: str
    why: str
    values: tuple[int, ...]

    def describe(self, program: Program) -> str:
        names = ", ".join(program.values[v].name for v in self.values)
        return f"op {self.op} {program.ops[self.op].target} on {self.axis!r}: {self.why} ({names})"


def program_rules(program: Program, mesh: Mesh, *, fallback: bool = False) -> list[OpRule]:
    """The rule of every op (`Analysis.rules`: built once per program and mesh)."""
    return Analysis.of(program, mesh, fallback=fallback).rules


MOVES = {"permute", "reshape"}  # rules of pure data movement, linear in their one operand
# rules a pending sum passes through: data movement, and the mixed-precision policy's widening cast of a gradient
# (`rules/pointwise.py::cast`), which is not a relayout (its result's bytes differ)
SUMS_PASS = MOVES | {"widen"}


class Changes:
    """A record of what a state's decisions changed: the values whose sharding was written and the ops whose
    factor assignment or passed-through sums were, since the record before (`parent`). A state writes to
    its open record; `ShardingState.close_record` closes it. Whoever computes something from a state (the cost
    model) keys it by the closed record and later catches up along the records after it. `forked`: a
    copy of the state continues from this record too."""

    __slots__ = ("__weakref__", "forked", "ops", "parent", "values")

    def __init__(self, parent: Changes | None = None) -> None:
        self.parent, self.forked = parent, False
        self.values: set[int] = set()
        self.ops: set[int] = set()


class ShardingState:
    """Shardings of every value and factor assignments of every op, for one program on one mesh: the
    program's `Analysis` (shared), the decisions (own), and the record of their changes."""

    def __init__(self, program: Program, mesh: Mesh, *, fallback: bool = False,
                 analysis: Analysis | None = None) -> None:
        an = analysis if analysis is not None else Analysis.of(program, mesh, fallback=fallback)
        self.analysis, self.program, self.mesh = an, an.program, an.mesh
        self.rules, self.ops_of, self.peers, self.templates = an.rules, an.ops_of, an.peers, an.templates
        self.shard = [Sharding.replicated(len(v.shape)) for v in program.values]
        self.assign: list[dict[int, tuple[str, ...]]] = [{} for _ in program.ops]
        self.passthrough: list[frozenset[str]] = [frozenset()] * len(program.ops)  # partial axes moved through
        self.locked: list[frozenset[str]] = [frozenset()] * len(program.values)
        self.gathered: dict[tuple[int, str], frozenset[int]] = {}  # (op, axis) -> parameters it reads gathered
        self.conflicts: list[Conflict] = []
        self.actions: list[Action] = []  # the decisions, in order: replaying them rebuilds this state
        self.changed: set[int] = set()  # values whose sharding left the replicated default
        self.record = Changes()  # the open record of changes (every write of shard[v] marks v; of assign[o] or
        # passthrough[o] marks o)

    def copy(self) -> ShardingState:
        """An independent state sharing the analysis (the search branches from it)."""
        new = object.__new__(ShardingState)
        new.analysis, new.program, new.mesh = self.analysis, self.program, self.mesh
        new.rules, new.ops_of, new.peers, new.templates = self.rules, self.ops_of, self.peers, self.templates
        new.shard, new.locked, new.passthrough = list(self.shard), list(self.locked), list(self.passthrough)
        new.assign = list(self.assign)  # the dicts are copied on write (`_step`)
        new.gathered = self.gathered  # (replaced, never changed in place: `gather_at_use`)
        new.conflicts, new.actions, new.changed = list(self.conflicts), list(self.actions), set(self.changed)
        sealed = self.close_record()
        sealed.forked = True
        new.record = Changes(sealed)
        return new

    def digest(self) -> str:
        """A hash of every decision's effect (shardings, factor assignments, passed-through sums, fences, the
        parameters read gathered): two states with the same digest lower to the same program."""
        import hashlib

        def canon(x):  # the same text in every process (a frozenset's order follows its strings' hashes)
            if isinstance(x, Sharding):
                return (x.dims, sorted(x.partial), x.chunks)
            if isinstance(x, frozenset | set):
                return sorted(x)
            if isinstance(x, dict):
                return sorted((k, canon(v)) for k, v in x.items())
            return x

        h = hashlib.sha256()
        for part in (self.shard, self.assign, self.passthrough, self.locked):
            h.update(repr([canon(x) for x in part]).encode())
        h.update(repr(canon(self.gathered)).encode())
        return h.hexdigest()[:16]

    def close_record(self) -> Changes:
        """Close the open record of changes and return it (the last closed one when nothing changed since)."""
        rec = self.record
        if rec.parent is not None and not rec.values and not rec.ops:
            return rec.parent
        self.record = Changes(rec)
        return rec

    # -- actions --------------------------------------------------------------------------------------
    def resolve(self, target: str) -> list[int]:
        """A value name, or a group template (`h.*.attn.c_attn.weight`, `opt.exp_avg[h.*.mlp.c_fc.weight]`)."""
        if target in self.templates:
            return list(self.templates[target])
        return [self.program.value(target).id]

    def apply(self, action: Action) -> None:
        """Apply one action and propagate its axis to a fixpoint; the state records it as one decision."""
        self.mesh.size(action.axis)  # unknown axis -> MeshError naming the mesh's axes
        if isinstance(action, ShardOptimizer | TileLate):
            made = len(self.actions)
            if isinstance(action, TileLate):
                self.apply(Tile(action.target, action.dim, action.axis))
            else:
                apply_zero(self, action)
            self.actions[made:] = [action]  # its tiles follow from it
            return
        vids = self.resolve(action.target)
        if isinstance(action, Replicate):
            for v in vids:
                if action.axis in self.shard[v].axes:
                    raise IllegalActionError(
                        f"cannot replicate {self.program.values[v].name} on {action.axis!r}: it is already "
                        f"sharded on it ({self.shard[v]})"
                    )
                self.locked[v] = self.locked[v] | {action.axis}
            self.actions.append(action)
            return
        tiled = []  # every member's new sharding first: an illegal member leaves the state as it was
        for v in vids:
            val = self.program.values[v]
            if action.axis in self.locked[v]:
                raise IllegalActionError(f"{val.name} is replicated on {action.axis!r} by an earlier action")
            dims = self.shard[v].dims
            if -len(dims) <= action.dim < len(dims) and action.axis in dims[action.dim]:
                continue  # already implied by propagation
            tiled.append((v, self.shard[v].tile(action.dim, action.axis, value=val.name, shape=val.shape,
                                                mesh=self.mesh)))
        changed = []
        for v, sh in tiled:
            self.shard[v] = sh
            self.changed.add(v)
            self.record.values.add(v)
            changed.append(v)
        self.actions.append(action)
        self.propagate(action.axis, changed)

    def lock(self, values: Iterable[int], axis: str) -> None:
        """Keep `values` replicated on `axis` where they are still undecided (a tactic's fence)."""
        for v in values:
            if axis not in self.shard[v].axes:
                self.locked[v] = self.locked[v] | {axis}

    def gather_at_use(self, params: Iterable[int], axis: str) -> None:
        """Each forward op reading one of `params` reads it gathered on `axis`: the parameter's tiling on `axis`
        does not decide the factor the op runs on (ZeRO-3: a parameter is gathered where it is used, as FSDP
        does, rather than its reader running on the parameter's tile and gathering the reader's other
        tensors: a column-parallel addmm from a tiled bias, its output gathered)."""
        p = self.program
        gathered = dict(self.gathered)
        for v in params:
            for o in p.users[v]:
                if p.ops[o].phase is Phase.FORWARD:
                    gathered[o, axis] = gathered.get((o, axis), frozenset()) | {v}
        self.gathered = gathered

    def try_apply(self, action: Action) -> bool:
        """Apply if legal; the search uses this to skip illegal actions."""
        try:
            self.apply(action)
        except (IllegalActionError, PartirError):
            return False
        return True

    # -- propagation ----------------------------------------------------------------------------------
    def _tile(self, v: int, d: int, axis: str) -> bool:
        if axis in self.locked[v]:
            return False
        new = self.shard[v].try_tile(d, axis, self.program.values[v].shape[d], self.mesh)
        if new is None:
            return False
        self.shard[v] = new
        self.changed.add(v)
        self.record.values.add(v)
        return True

    def propagate(self, axis: str, seeds: Iterable[int]) -> None:
        seeds = list(seeds)
        work: deque[int] = deque()
        queued: set[int] = set()

        def touched(v: int) -> None:
            for o in self.ops_of[v]:
                if o not in queued:
                    queued.add(o)
                    work.append(o)
            self._to_peers(v, axis, touched)

        for v in seeds:
            touched(v)
        while work:
            o = work.popleft()
            queued.discard(o)
            for v in self._step(o, axis):
                touched(v)

    def _to_peers(self, v: int, axis: str, touched) -> None:
        """The same value of the other repeated layers gets the same tiling (groups)."""
        peers = self.peers.get(v)
        if not peers:
            return
        dims = self.shard[v].dims
        d = next((i for i, ax in enumerate(dims) if axis in ax), None)
        if d is None:
            return
        for p in peers:
            if p != v and self._tile(p, d, axis):
                touched(p)

    def active_ops(self) -> list[int]:
        """Ops that can imply communication: those with a factor assignment or touching a sharded value."""
        ops = {o for o, a in enumerate(self.assign) if a}
        ops.update(o for o, p in enumerate(self.passthrough) if p)
        for v in self.changed:
            ops.update(self.ops_of[v])
        return sorted(ops)

    def factor_of(self, op: int, axis: str) -> int | None:
        for f, axes in self.assign[op].items():
            if axis in axes:
                return f
        return None

    def _step(self, o: int, axis: str) -> list[int]:
        rule = self.rules[o]
        if rule.name in SUMS_PASS and axis in self.shard[rule.operands[0].value].partial:
            # a pending sum moves through pure data movement (transposes, reshapes): reduce later, once
            if axis not in self.passthrough[o]:
                self.passthrough[o] = self.passthrough[o] | {axis}
                self.record.ops.add(o)
            changed = []
            for t in rule.results:
                sh = self.shard[t.value]
                if axis not in sh.axes and axis not in self.locked[t.value]:
                    self.shard[t.value] = Sharding(sh.dims, sh.partial | {axis})
                    self.changed.add(t.value)
                    self.record.values.add(t.value)
                    changed.append(t.value)
            return changed
        tensors, carriers = self.analysis.layout(o)
        f = self.factor_of(o, axis)
        if f is None:
            cands: dict[int, list[int]] = {}
            stray: list[tuple[int, int]] = []  # tensors tiled on `axis` on a dim that carries no factor
            shard = self.shard
            deaf = self.gathered.get((o, axis), ()) if self.gathered else ()  # (`gather_at_use`)
            for v, dims in tensors:
                d = shard[v]._dim_of.get(axis)
                if d is None or v in deaf:
                    continue
                fd = dims[d]
                if fd is None:
                    stray.append((v, d))
                else:
                    cands.setdefault(fd, []).append(v)
            if not cands and not stray:
                return []
            why, vals = self._why(o, axis, cands, stray, carriers)
            if why:
                f = self._settle(o, axis, tensors, carriers)
                if f is None:
                    self._conflict(o, axis, why, vals)
                    return []
                self.conflicts = [c for c in self.conflicts if c.op != o or c.axis != axis]
            else:
                ((f, _),) = cands.items()
            self.assign[o] = {**self.assign[o], f: (*self.assign[o].get(f, ()), axis)}  # copy on write (copy())
            self.record.ops.add(o)
        changed: list[int] = []
        shard, locked, values = self.shard, self.locked, self.program.values
        for v, d in carriers.get(f, ()):  # `_tile`, inlined: the inner loop of every search
            sh = shard[v]
            if axis in sh._axes or axis in locked[v]:
                continue
            new = sh.try_tile(d, axis, values[v].shape[d], self.mesh)
            if new is not None:
                shard[v] = new
                self.changed.add(v)
                self.record.values.add(v)
                changed.append(v)
        for t, red in zip(rule.results, rule.reduced):
            if f in red and f not in t.dims:
                v = t.value
                sh = self.shard[v]
                if axis not in sh.axes and axis not in self.locked[v]:
                    self.shard[v] = Sharding(sh.dims, sh.partial | {axis})
                    self.changed.add(v)
                    self.record.values.add(v)
                    changed.append(v)
        return changed

    def _why(self, o: int, axis: str, cands: dict[int, list[int]], stray: list[tuple[int, int]],
             carriers: dict[int, list[tuple[int, int]]]) -> tuple[str, tuple[int, ...]]:
        """Why op `o` cannot run on the one factor its tensors tiled on `axis` carry ("" if it can), and the
        values involved."""
        values = self.program.values
        if stray:
            v, d = stray[0]
            return f"{values[v].name} dim {d} carries no factor of the op", (v,)
        if len(cands) > 1:
            return "operands tiled on different factors", tuple(v for vs in cands.values() for v in vs)
        ((f, vals),) = cands.items()
        rule = self.rules[o]
        if f in rule.replicate:
            return f"factor {rule.letters[f]!r} needs replication", tuple(vals)
        axes = (*self.assign[o].get(f, ()), axis)
        blocker = self._blocker(o, f, axes, carriers)
        if blocker is not None:
            return (f"factor {rule.letters[f]!r} of {values[blocker].name} {list(values[blocker].shape)} does not "
                    f"divide by {tile_count(self.mesh, axes)}", (blocker,))
        return "", ()

    def _settle(self, o: int, axis: str, tensors: tuple, carriers: dict[int, list[tuple[int, int]]]) -> int | None:
        """The factor a conflicted op runs on along `axis`, once all its results are tiled on it, or None (it
        runs replicated on `axis`).

        Replicated, the op gathers every operand tiled on `axis`. Run on a factor every result carries or
        sums over, it keeps the operands tiled on that factor, re-tiles the others with an all-to-all of their
        local block (or gathers those that lack the factor), re-tiles the results it makes on another dim the
        same way and reduce-scatters those it makes as sums: what an SPMD partitioner does when the result's
        sharding is fixed (XLA re-tiles a skip connection's channel-tiled operand of a batch-tiled `cat`, and
        scatter-adds edge-tiled messages into node sums). The factor moving the fewest bytes wins, if no more
        than the replicated run's; the undecided operands carrying it are sliced (tiled, as by propagation)."""
        rule = self.rules[o]
        results = [(t, red) for t, red in zip(rule.results, rule.reduced) if t.value >= 0]
        shard, values, mesh = self.shard, self.program.values, self.mesh
        if not results or any(shard[t.value]._dim_of.get(axis) is None for t, _ in results):
            return None
        n = mesh.size(axis)
        out = {t.value for t, _ in results}
        local: dict[int, int] = {}
        for v, _ in tensors:
            if axis in shard[v].partial:
                return None
            if shard[v]._dim_of.get(axis) is not None:
                local[v] = math.prod(shard[v].local_shape(values[v].shape, mesh)) * values[v].dtype.itemsize
        gathered = sum(nb * n for v, nb in local.items() if v not in out)
        best: tuple[int, int] | None = None
        common = set.intersection(*({f for f in t.dims if f is not None} | set(red) for t, red in results))
        for f in sorted(common):
            axes = (*self.assign[o].get(f, ()), axis)
            if f in rule.replicate or self._blocker(o, f, axes, carriers) is not None:
                continue
            moved = 0
            for v, dims in tensors:
                d = shard[v]._dim_of.get(axis)
                if d is None or dims[d] == f:
                    continue
                # re-tiled (an all-to-all of the block), else gathered, or for a result summed and scattered
                moved += local[v] if f in dims else local[v] * n
            if moved <= gathered and (best is None or moved < best[0]):
                best = (moved, f)
        return None if best is None else best[1]

    def _blocker(self, o: int, f: int, axes: tuple[str, ...], carriers: dict[int, list[tuple[int, int]]]
                 ) -> int | None:
        """The first value carrying factor `f` of op `o` whose dim `axes` do not divide, or None; shapes only,
        so memoized in the analysis."""
        key = (o, f, axes)
        memo = self.analysis.blockers
        if key in memo:
            return memo[key]
        values, k = self.program.values, tile_count(self.mesh, axes)
        memo[key] = got = next((v for v, d in carriers.get(f, ()) if values[v].shape[d] % k), None)
        return got

    def _conflict(self, op: int, axis: str, why: str, values: tuple[int, ...]) -> None:
        if not any(c.op == op and c.axis == axis for c in self.conflicts[-8:]):
            self.conflicts.append(Conflict(op, axis, why, values))

    # -- views -----------------------------------------------------------------------------------------
    def required(self, o: int, t_dims: tuple[int | None, ...]) -> tuple[tuple[str, ...], ...]:
        """The dim axes an op needs for a tensor carrying `t_dims` factors."""
        a = self.assign[o]
        return tuple(a.get(f, ()) if f is not None else () for f in t_dims)

    def op_output(self, o: int, r: int) -> Sharding:
        """The sharding op `o` produces for its r-th result: tiled by assigned factors, partial over reduced ones."""
        rule = self.rules[o]
        t = rule.results[r]
        partial = frozenset(ax for f in rule.reduced[r] if f not in t.dims for ax in self.assign[o].get(f, ()))
        dims = self.required(o, t.dims)
        chunks = tuple(c for c in t.chunks if dims[c[0]]) if t.chunks else ()
        return Sharding(dims, partial | self.passthrough[o], chunks)

    def reduced_axes(self, o: int) -> frozenset[str]:
        rule = self.rules[o]
        return frozenset(ax for red in rule.reduced for f in red for ax in self.assign[o].get(f, ()))

    def mean_scale(self, o: int, r: int) -> int:
        k = 1
        for f in self.rules[o].mean_over[r]:
            for ax in self.assign[o].get(f, ()):
                k *= self.mesh.size(ax)
        return k
