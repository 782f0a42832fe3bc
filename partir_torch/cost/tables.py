"""The cost model's tables: what does not depend on the sharding (`Static`, once per analysis), results
memoized by content (`Memo`, shared by every state of the analysis) and each evaluated state's arrays
(`Cache`). `cost/model.py` describes how `evaluate` uses them.
"""

from __future__ import annotations

import math
import weakref
from itertools import chain

import numpy as np

from partir_torch.capture.fold import weights
from partir_torch.cost.hardware import Hardware
from partir_torch.cost.report import COLLECTIVES, FLOP_TARGETS, op_flops
from partir_torch.ir.mesh import Mesh
from partir_torch.ir.program import Op, Phase, Role
from partir_torch.ir.sharding import Sharding, local_dim
from partir_torch.lower import Collective, fused, made_by_reduction, op_signatures, relayouts, reshard
from partir_torch.propagate import Changes, ShardingState
from partir_torch.rules.tables import ATTENTION, VIEWS


class Static:
    """What does not depend on the sharding, computed once per analysis (`Analysis.stage`), and the
    incremental caches of the states evaluated, by their closed record of changes (`caches`)."""

    def __init__(self, state: ShardingState) -> None:
        program, rules = state.program, state.rules
        vals, ops = program.values, program.ops
        n_ops, n_vals = len(ops), len(vals)
        self.n_ops = n_ops
        self.caches: weakref.WeakKeyDictionary[Changes, Cache] = weakref.WeakKeyDictionary()
        self.checked: set[tuple] = set()  # (fast-domain size, DCN axes) pairs `check_mesh` accepted
        op_w, own_w = weights(program)
        self.op_w = np.array(op_w, dtype=np.float64)
        self.op_w_list = op_w
        # shardings as small ints (equal shardings, equal ids), so that whole states compare as arrays
        self.sh_ids: dict[tuple, int] = {}
        self.sh_list: list[Sharding] = []
        # compute: per op, its tensors as (value, factors per dim, shape, itemsize); flops only for matmuls etc.
        self.tensors = [
            (op.target in FLOP_TARGETS or op.flops is not None,
             tuple((t.value, t.dims, vals[t.value].shape, vals[t.value].dtype.itemsize) for t in r.operands),
             tuple((t.value, t.dims, vals[t.value].shape, vals[t.value].dtype.itemsize) for t in r.results))
            for op, r in zip(ops, rules)
        ]
        # ops with the same rule structure, tensor shapes and flop formula cost the same and need the same
        # shardings under the same assignment: their entries are memoized by this id
        lsig, ids = op_signatures(state), {}
        self.sig = [ids.setdefault((lsig[o], ops[o].target if t[0] else None, tuple(x[1:] for x in t[1]),
                                    tuple(x[1:] for x in t[2])), len(ids)) for o, t in enumerate(self.tensors)]
        self.itemsize_list = [vals[r.results[0].value].dtype.itemsize if r.results else 4 for r in rules]
        self.itemsize = np.array(self.itemsize_list, dtype=np.int64)
        # slots: every tensor of every op (operands, then results), then the end of the step (each updated
        # value back to its input's sharding, then the loss replicated): `lower`'s order
        slot_val, slot_res, slot_op, self.slot_start = [], [], [], [0]
        for o, r in enumerate(rules):
            for ts, res in ((r.operands, False), (r.results, True)):
                for t in ts:
                    slot_val.append(t.value)
                    slot_res.append(res)
                    slot_op.append(o)
            self.slot_start.append(len(slot_val))
        self.n_op_slots = len(slot_val)
        self.slot_start_arr = np.array(self.slot_start[:-1], dtype=np.int64)
        self.slot_len = np.diff(np.array(self.slot_start, dtype=np.int64))
        self.ends: list[tuple[int, int]] = list(program.updates.items())
        if program.loss is not None:
            self.ends.append((program.loss, -1))  # -1: replicated, rank 0
        # an end slot holds the updated value (as an operand slot its operand) and needs the old one's sharding
        self.end_of: dict[int, list[int]] = {}
        for k, (_, old) in enumerate(self.ends):
            if old >= 0:
                self.end_of.setdefault(old, []).append(self.n_op_slots + k)
        self.end_slots = np.array([self.n_op_slots + k for k, (_, old) in enumerate(self.ends) if old >= 0],
                                  dtype=np.int64)
        self.end_olds = np.array([old for _, old in self.ends if old >= 0], dtype=np.int64)
        self.n_slots = self.n_op_slots + len(self.ends)
        self.slot_res = np.array(slot_res + [False] * len(self.ends), dtype=bool)
        self.slot_vals = slot_val + [n for n, _ in self.ends]
        self.slot_val = np.array(self.slot_vals, dtype=np.int64)
        self.slot_op = [*slot_op, *([-1] * len(self.ends))]
        self.slot_op_arr = np.array(self.slot_op, dtype=np.int64)
        # the fold weight of a collective at a slot (op o, value v; o = -1: end of step)
        slot_w = []
        for o, v in zip(self.slot_op, self.slot_vals):
            prod = vals[v].producer
            if o >= 0 and (prod < 0 or ops[o].phase is not Phase.BACKWARD):
                slot_w.append(op_w[o])  # forward: the boundary into element 1 stands for N - 1 boundaries
            else:  # backward runs the other way: the boundary out of element 1 does
                slot_w.append(op_w[prod] if prod >= 0 else own_w[v])
        self.slot_w = np.array(slot_w, dtype=np.int64)
        # nothing assigned: replicated shapes and shardings
        self.flops0 = np.zeros(n_ops, dtype=np.float64)
        self.nbytes0 = np.zeros(n_ops, dtype=np.float64)
        for o in range(n_ops):
            self.flops0[o], self.nbytes0[o] = op_compute(ops[o], self.tensors[o], {}, None)
        self.sid0 = np.array([self.sid(Sharding.replicated(len(v.shape))) for v in vals], dtype=np.int64)
        need0 = [self.sid(Sharding.replicated(len(t.dims))) for r in rules for t in (*r.operands, *r.results)]
        need0 += [self.sid0[old] if old >= 0 else self.sid(Sharding.replicated(0)) for _, old in self.ends]
        self.need0 = np.array(need0, dtype=np.int64)
        self.nbytes_val = np.array([math.prod(v.shape) * v.dtype.itemsize for v in vals], dtype=np.int64)
        self.relay = relayouts(program, rules)  # lower.dedup_key: a re-layout's reshard is its operand's
        self.reduction = made_by_reduction(program, rules, self.relay)  # (`lower.fused`)
        kinds: dict[tuple, int] = {}
        self.vkind = [kinds.setdefault((v.shape, v.dtype.itemsize, r), len(kinds))
                      for v, r in zip(vals, self.reduction)]
        self.relaid = np.array([o >= 0 for o in self.relay], dtype=bool)

        # memory: aliasing (views), last uses, fold weights, lifetimes; all independent of the sharding
        root = list(range(n_vals))
        for op in ops:
            if op.target in VIEWS and op.inputs:
                for o in op.outputs:
                    if o >= 0:
                        root[o] = root[op.inputs[0]]
        last = [-1] * n_vals
        for op in ops:
            for i in op.inputs if rules[op.id].operands else ():  # (no operand: read for its dtype, `new_zeros`)
                r = root[i]
                last[r] = max(last[r], op.id)
        mem_w = [1] * n_vals
        for v in vals:
            if root[v.id] != v.id:
                continue
            outlives = v.producer >= 0 and last[v.id] >= 0 and ops[last[v.id]].phase is not ops[v.producer].phase
            if v.producer < 0 or v.role is Role.GRADIENT or outlives:
                mem_w[v.id] = own_w[v.id]
        outputs = {root[o] for o in program.outputs}
        donated = {root[n] for n in program.updates}
        span: dict[tuple[Phase, int], list[int]] = {}
        for op in ops:
            if op_w[op.id] > 1:
                sp = span.setdefault((op.phase, op_w[op.id]), [op.id, op.id])
                sp[1] = op.id
        self.fwd_span = {w: sp[0] for (phase, w), sp in span.items() if phase is Phase.FORWARD}  # folded blocks
        # per op in a folded block, the last op of its block in its phase (-1 elsewhere): a collective read
        # before it repeats once per element, one read after it is made N - 1 times before the first read
        block_end = [-1] * n_ops
        for (phase, w), (a, b) in span.items():
            for o in range(a, b + 1):
                if op_w[o] == w and ops[o].phase is phase:
                    block_end[o] = b
        self.block_end = np.array([*block_end, -1], dtype=np.int64)  # ([-1]: made by no op)
        # per value, for the buckets' runs (`lower.buckets.coalesced`): its producer, its first read (users in
        # op order), its dtype's index
        users = program.users
        self.v_producer = np.array([v.producer for v in vals], dtype=np.int64)
        self.v_first_read = np.array([u[0] if u else n_ops for u in users], dtype=np.int64)
        dtypes: dict = {}
        self.v_dtype = np.array([dtypes.setdefault(v.dtype, len(dtypes)) for v in vals], dtype=np.int64)
        # per op: its last position, or for a view op, the last use of the views made from its result (a
        # gathered weight's transposed view, read again by the backward, keeps the gathered copy alive)
        vend = [-1] * n_vals
        self.view_end = np.arange(n_ops, dtype=np.int64)
        for op in reversed(ops):
            for i in op.inputs:
                if i >= 0:
                    vend[i] = max(vend[i], op.id)
            if op.target in VIEWS and op.inputs:
                end = max([op.id] + [vend[o] for o in op.outputs if o >= 0])
                self.view_end[op.id] = end
                vend[op.inputs[0]] = max(vend[op.inputs[0]], end)
        self.op_bwd = np.array([op.phase is Phase.BACKWARD for op in ops], dtype=bool)
        # live(i) = base + the events at positions <= i, an event adding coef x the local bytes of a value
        ev_pos, ev_vid, ev_coef = [], [], []
        m_vid, m_pers, m_prod, m_end, m_extra = [], [], [], [], []
        for v in vals:
            if root[v.id] != v.id or v.id in donated:
                continue
            m_vid.append(v.id)
            if v.producer < 0:  # persistent: the whole step, in the base
                m_pers.append(True)
                m_prod.append(-1)
                m_end.append(n_ops)
                m_extra.append(0)
                continue
            end = n_ops if v.id in outputs else max(last[v.id], v.producer)
            stop = end + 1 if end < n_ops else n_ops
            ev_pos += [v.producer, stop]
            ev_vid += [v.id, v.id]
            ev_coef += [1, -1]
            start = 0  # extra_from
            if mem_w[v.id] > 1:
                phase = ops[v.producer].phase
                sp = span.get((phase, own_w[v.id]), [v.producer, v.producer])
                start = sp[0] if phase is Phase.FORWARD else min(sp[1] + 1, stop)
                ev_pos += [start, stop]
                ev_vid += [v.id, v.id]
                ev_coef += [mem_w[v.id] - 1, -(mem_w[v.id] - 1)]
            m_pers.append(False)
            m_prod.append(v.producer)
            m_end.append(end)
            m_extra.append(start)
        # without a flash kernel, attention saves its [B, H, T, S] probabilities for the backward: counted as
        # S times the [B, H, T] log-sum-exp the flash op saves (same sharding, its local bytes times S)
        self.attn_scale = np.ones(n_vals, dtype=np.int64)
        for op in ops:
            if op.target in ATTENTION and len(op.outputs) > 1 and op.outputs[1] >= 0:
                self.attn_scale[op.outputs[1]] = vals[op.inputs[1]].shape[-2]
        # an activation read only by one view op: where a state reshards it there, the view is made from the
        # reshard's copy (held as a collective buffer up to `view_end`), and the activation itself is free
        # after the view op (`model._evaluate`); its operand slot, the value, and [from, to) of that saving
        cut_slot, cut_val, cut_from, cut_to = [], [], [], []
        for v, end in zip(m_vid, m_end):
            val = vals[v]
            only = {u for u in program.users[v] if rules[u].operands}  # (not a read for its dtype: `new_zeros`)
            if (val.producer < 0 or end >= n_ops or mem_w[v] != 1 or self.attn_scale[v] != 1 or len(only) != 1):
                continue
            (o,) = only
            if ops[o].target in VIEWS and rules[o].operands and rules[o].operands[0].value == v and end > o:
                cut_slot.append(self.slot_start[o])
                cut_val.append(v)
                cut_from.append(o + 1)
                cut_to.append(end + 1)
        self.cut_slot = np.array(cut_slot, dtype=np.int64)
        self.cut_val = np.array(cut_val, dtype=np.int64)
        self.cut_from = np.array(cut_from, dtype=np.int64)
        self.cut_to = np.array(cut_to, dtype=np.int64)
        order = np.argsort(np.array(ev_pos, dtype=np.int64), kind="stable")
        pos = np.array(ev_pos, dtype=np.int64)[order]
        self.ev_vid = np.array(ev_vid, dtype=np.int64)[order]
        self.ev_coef = np.array(ev_coef, dtype=np.int64)[order]
        self.ev_coef_math = self.ev_coef * self.attn_scale[self.ev_vid]
        self.upto = np.searchsorted(pos, np.arange(n_ops), side="right")  # the events at positions <= op i
        self.m_vid = np.array(m_vid, dtype=np.int64)
        self.m_pers = np.array(m_pers, dtype=bool)
        self.m_prod = np.array(m_prod, dtype=np.int64)
        self.m_end = np.array(m_end, dtype=np.int64)
        self.m_extra = np.array(m_extra, dtype=np.int64)
        mem_w_arr = np.array(mem_w, dtype=np.int64)
        self.m_w = mem_w_arr[self.m_vid]
        self.pers_vid = self.m_vid[self.m_pers]
        self.pers_w = self.m_w[self.m_pers]
        self.role_names = [r.value for r in Role]
        codes = {r: i for i, r in enumerate(Role)}
        self.m_role = np.array([codes[vals[v].role] for v in m_vid], dtype=np.int64)
        self.names = [v.name for v in vals]
        self.param_vid = np.array(list(program.params.values()), dtype=np.int64)
        self.param_w = mem_w_arr[self.param_vid]
        self.opt_vid = np.array([v.id for v in vals if v.role is Role.OPT_STATE], dtype=np.int64)
        self.opt_w = mem_w_arr[self.opt_vid]

    def sid(self, sh: Sharding) -> int:
        key = (sh.dims, sh.partial, sh.chunks)
        i = self.sh_ids.get(key)
        if i is None:
            i = self.sh_ids[key] = len(self.sh_list)
            self.sh_list.append(sh)
        return i

    def sid_of(self, dims: tuple[tuple[str, ...], ...], partial: frozenset[str], chunks: tuple = ()) -> int:
        i = self.sh_ids.get((dims, partial, chunks))
        if i is None:
            sh = Sharding(dims, partial, chunks)
            i = self.sid(Sharding.replicated(len(dims)) if sh == Sharding.replicated(len(dims)) else sh)
        return i



class Grow:
    """A numpy array that grows (the memo's tables): appends are buffered and written on the next read."""

    def __init__(self, dtype, shape: tuple[int, ...] = ()) -> None:
        self._a = np.zeros((64, *shape), dtype=dtype)
        self._n = 0
        self._new: list = []

    def append(self, x) -> None:
        self._new.append(x)

    def extend(self, xs) -> None:
        self._new.extend(xs)

    def __len__(self) -> int:
        return self._n + len(self._new)

    @property
    def a(self) -> np.ndarray:
        """The array (rows past len() are zeros)."""
        if self._new:
            end = self._n + len(self._new)
            if end > len(self._a):
                grown = np.zeros((max(end, 2 * len(self._a)), *self._a.shape[1:]), dtype=self._a.dtype)
                grown[: self._n] = self._a[: self._n]
                self._a = grown
            self._a[self._n : end] = self._new
            self._n, self._new = end, []
        return self._a



class Memo:
    """Results keyed by content, shared by every state of one analysis (`Analysis.stage`; dropped by
    `Analysis.clear_memos`, as `memo` says):
    op entries by (signature, assignment, passed-through sums); per value its sharding id and local bytes
    by (shape, itemsize, sharding); moves (a reshard's collectives) by (shape, itemsize, from, to), and per
    slot the move and collectives it had last; the distinct collectives (axis, kind, bytes) as rows."""

    memo = True

    def __init__(self, mesh: Mesh, st: Static) -> None:
        self.size = dict(mesh.axes)
        self.axes = {a: i for i, a in enumerate(mesh.names)}
        # op entries: flops, bytes, and the sharding ids needed at its slots (need[start:start + len])
        self.entry: dict[tuple, int] = {}
        self.e_py: list[tuple[float, int, tuple[int, ...]]] = []
        self.e_flops = Grow(np.float64)
        self.e_nbytes = Grow(np.float64)
        self.e_start = Grow(np.int64)
        self.e_need = Grow(np.int64)
        # value variants: sharding id and local bytes
        self.val: dict[tuple, int] = {}
        self.v_py: list[tuple[int, int]] = []
        self.v_sid = Grow(np.int64)
        self.v_lb = Grow(np.int64)
        # moves: (transitions, str(from), str(to)), all-gathered bytes, the row on each mesh axis (-1: none)
        self.moves: dict[tuple[int, int, int], int] = {}
        self.m_steps: list[tuple] = []
        self.m_ag = Grow(np.int64)
        self.m_rows = Grow(np.int64, (2 * len(mesh.names),))  # two slots per mesh axis (`move_ids`)
        self.m_fused = Grow(np.int64, (len(COLLECTIVES),))  # bytes per kind in the engine's form (`lower.fused`)
        # per slot: the move for the (from, to) it had last, and the collectives for the move they were made for
        self.slot_pair = np.full(st.n_slots, -1, dtype=np.int64)  # from << 32 | to
        self.slot_move = np.full(st.n_slots, -1, dtype=np.int64)
        self.colls: dict[tuple[int, int], tuple[Collective, ...]] = {}  # (slot, move) -> collectives
        self.roots: dict[tuple[int, int, int], tuple[int, int, int]] = {}  # lower.relayout_root, as sharding ids
        self.slot_colls: list[tuple[Collective, ...]] = [()] * st.n_slots
        self.colls_move = np.full(st.n_slots, -1, dtype=np.int64)
        self.rows: dict[tuple[str, str, int], int] = {}
        self.row_axis = Grow(np.int64)
        self.row_kind = Grow(np.int64)
        self.row_bytes = Grow(np.int64)
        self.row_f = Grow(np.float64)
        self.row_g = Grow(np.float64)
        self.times: tuple | None = None
        self.at_peak: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def row(self, axis: str, kind: str, nbytes: int) -> int:
        r = self.rows.get((axis, kind, nbytes))
        if r is None:
            r = self.rows[(axis, kind, nbytes)] = len(self.rows)
            n = self.size[axis]
            self.row_axis.append(self.axes[axis])
            self.row_kind.append(COLLECTIVES.index(kind))
            self.row_bytes.append(nbytes)
            # collective_time's ring factors: t = f · bytes / bw + g · α (0 for n = 1)
            self.row_f.append(2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n)
            self.row_g.append(2 * (n - 1) if kind == "all-reduce" else n - 1)
        return r

    def move_ids(self, state: ShardingState, st: Static, slots: list[int], srcs: list[int],
                 dsts: list[int]) -> list[int]:
        """Move ids of these slots' values from sharding ids srcs to dsts."""
        vkind, vals = st.vkind, st.slot_vals
        keys = [(vkind[vals[s]], a, b) for s, a, b in zip(slots, srcs, dsts)]
        ids = list(map(self.moves.get, keys))
        if None in ids:
            new = {k: j for j, (k, i) in enumerate(zip(keys, ids)) if i is None}  # each new key once
            for k, j in new.items():
                src, dst = st.sh_list[srcs[j]], st.sh_list[dsts[j]]
                steps, s, d = reshard(state, vals[slots[j]], src, dst)
                by_kind = fused(src, dst, steps, st.reduction[vals[slots[j]]])
                self.m_fused.append([by_kind.get(kind, 0) for kind in COLLECTIVES])
                rows = [-1] * (2 * len(self.axes))  # two per mesh axis: a reshard moves an axis at most twice
                for kind, axis, nbytes in steps:  # (a hierarchical all-reduce's reduce-scatter and gather back;
                    i = 2 * self.axes[axis]  # a reduce-scatter, then a misplaced gather)
                    i += rows[i] >= 0
                    if rows[i] >= 0:
                        raise AssertionError(f"reshard {s} -> {d} moves {axis!r} more than twice: {steps}")
                    rows[i] = self.row(axis, kind, nbytes)
                self.moves[k] = len(self.m_steps)
                self.m_steps.append((steps, s, d))
                self.m_ag.append(sum(nbytes for kind, _, nbytes in steps if kind == "all-gather"))
                self.m_rows.append(rows)
            ids = list(map(self.moves.__getitem__, keys))
        return ids

    def collectives(self, st: Static, slots: np.ndarray, moves: np.ndarray) -> list[Collective]:
        """The collectives of these slots' moves, in order."""
        stale = np.flatnonzero(self.colls_move[slots] != moves)
        if len(stale):
            memo, out = self.colls, self.slot_colls
            for slot, m in zip(slots[stale].tolist(), moves[stale].tolist()):
                cs = memo.get((slot, m))
                if cs is None:
                    steps, s, d = self.m_steps[m]
                    v, o = st.slot_vals[slot], st.slot_op[slot]
                    cs = memo[(slot, m)] = tuple(Collective.make(kind, axis, nbytes, v, o, s, d)
                                                 for kind, axis, nbytes in steps)
                out[slot] = cs
            self.colls_move[slots[stale]] = moves[stale]
        return list(chain.from_iterable(map(self.slot_colls.__getitem__, slots.tolist())))

    def row_time(self, hw: Hardware, dcn_axes: frozenset[str]) -> np.ndarray:
        """`collective_time` of every row (cached per hardware and DCN axes until rows are added)."""
        key = (hw, dcn_axes, len(self.row_axis))
        if self.times is None or self.times[0] != key:
            dcn = [a in dcn_axes for a in self.axes]
            bw = np.array([hw.dcn_bandwidth if d else hw.link_bandwidth for d in dcn], dtype=np.float64)
            alpha = np.array([hw.dcn_latency if d else hw.link_latency for d in dcn], dtype=np.float64)
            n = len(self.row_axis)
            ax = self.row_axis.a[:n]
            t = self.row_f.a[:n] * self.row_bytes.a[:n] / bw[ax] + self.row_g.a[:n] * alpha[ax]
            for (axis, kind, _), r in self.rows.items() if hw.links else ():
                got = hw.link(axis, kind)
                if got is not None:  # measured: one call's latency and the bytes' time, as `lower` counts bytes
                    t[r] = got[0] + self.row_bytes.a[r] / got[1] if self.size[axis] > 1 else 0.0
            self.times = (key, t)
        return self.times[1]



# entries, value variants, moves and collectives memoized per analysis: beyond, the memo starts over (caches
# keep no ids into it)
MEMO_LIMIT = 200_000


def tables(state: ShardingState) -> tuple[Static, Memo]:
    """The state's analysis's static tables and memo, built on first use (the memo anew past `MEMO_LIMIT`)."""
    an = state.analysis
    st = an.stage(Static, lambda: Static(state))
    memo = an.stage(Memo, lambda: Memo(state.mesh, st))
    if len(memo.entry) + len(memo.val) + len(memo.moves) + len(memo.colls) > MEMO_LIMIT:
        an.clear_memos()  # lower's memos grow alike
        memo = an.stage(Memo, lambda: Memo(state.mesh, st))
    return st, memo


def op_compute(op: Op, tensors, a: dict, mesh: Mesh | None) -> tuple[float, int]:
    """(flops, bytes read + written) of an op on its local shapes under factor assignment `a`."""
    is_flop, operands, results = tensors
    shapes = []
    nbytes = 0
    for group in (operands, results):
        local = []
        for _v, fdims, shape, itemsize in group:
            if a:  # the local shape of the sharding the op needs
                loc = tuple([s if f is None or f not in a else local_dim(s, mesh, a[f]) for s, f in zip(shape, fdims)])
            else:
                loc = shape[: len(fdims)]
            nbytes += math.prod(loc) * itemsize
            local.append(loc)
        shapes.append(local)
    return (op_flops(op.target, shapes[0], shapes[1], op.flops) if is_flop else 0.0), nbytes



class Cache:
    """What `evaluate` knows of one state: per value its local bytes and sharding id; per op its flops and
    bytes, and (for the hardware `t_key`) its weighted time and flops, stale at the ops in `t_ops`; per op
    slot the sharding id the op needs there. Kept in `Static.caches` by the state's closed record."""

    __slots__ = ("flops", "lb", "nbytes", "need", "sid", "t_key", "t_ops", "terms", "wflops")

    @classmethod
    def replicated(cls, st: Static) -> Cache:
        """The cache of a state with every value replicated."""
        new = object.__new__(cls)
        new.lb, new.sid = st.nbytes_val.copy(), st.sid0.copy()
        new.flops, new.nbytes, new.need = st.flops0.copy(), st.nbytes0.copy(), st.need0.copy()
        new.t_key, new.t_ops, new.terms, new.wflops = None, [], None, None
        return new

    def clone(self) -> Cache:
        new = object.__new__(Cache)
        new.lb, new.sid, new.flops, new.nbytes = self.lb.copy(), self.sid.copy(), self.flops.copy(), self.nbytes.copy()
        new.need = self.need.copy()
        new.t_key, new.t_ops = self.t_key, list(self.t_ops)
        new.terms = None if self.terms is None else self.terms.copy()
        new.wflops = None if self.wflops is None else self.wflops.copy()
        return new
