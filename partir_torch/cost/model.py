"""Cost analysis of a partitioned program: compute, communication per mesh axis, per-device peak memory.

Compute, per op, on its *local* (per-device) shapes after sharding:
    flops: mm/addmm 2mkn; bmm 2bmkn; convolution 2·|out|·|w|/C_out; its backward twice that;
           flash attention 4·B·H·L·S·E forward, 2.5x that backward; everything else 0
    bytes: local operands read + local results written
    time  = max(flops / (peak(dtype) · matmul_efficiency), bytes / HBM bandwidth) + launch_floor
Communication, per collective from `lower`, on a ring of n = the axis size, bandwidth bw and latency α of
that axis (fast link, or DCN/InfiniBand for axes marked as crossing slices/nodes), B bytes per device:
    all-reduce      2(n-1)/n · B/bw + 2(n-1)α
    all-gather      (n-1)/n · B/bw + (n-1)α     (B: the gathered size)
    reduce-scatter  (n-1)/n · B/bw + (n-1)α     (B: the size before the scatter)
    all-to-all      (n-1)/n · B/bw + (n-1)α
A sum over several axes is reduced hierarchically (`lower.transitions`: reduce-scatters first, then the
all-reduces minor axis first, each on 1/n of the bytes of the one before): 2(N-1)/N · B over N = n1·n2·…
on the fast links, as one ring over the product would cost, with the slow axis moving the least.
A folded program (`capture/fold.py`) is costed as the full model: each op, collective and value counts with
its fold weight (element 1 of a folded container stands for elements 1..N-1).
Step time = compute + communication (no overlap is modelled: an upper bound; see docs/cost-model.md).
Memory, per device, by liveness over the op order: parameters, buffers, optimizer states and inputs live
the whole step; updated values reuse their input's buffer (donation); gradients and activations live from
their producing op to their last use; views (transposes, reshapes, broadcasts) alias their base; a
collective's output buffer is a temporary at the op that needs it; attention saves its log-sum-exp for the
backward (a flash kernel) or, on hardware without one (`Hardware.flash_attention`), its [B, H, T, S]
probabilities. The peak and its top contributors are reported; a plan above the device memory (or the
user's limit) is infeasible.

Evaluation is incremental (the search evaluates thousands of states that differ by one action). What does
not depend on the sharding is computed once per program (`_Static`: each op's tensors, fold weights, the
liveness events). Results are memoized by content per program and mesh (`_Memo`): an op's flops, bytes and
the shardings it needs by (rule structure, shapes, assignment, passed-through sums), so the repeated
layers share them; a value's local bytes by (shape, sharding); a reshard's collectives by (op slot, from,
to). Each state holds a cache of arrays (`_Cache`): per value its local bytes and sharding id (shardings
interned as small ints), per op its flops and bytes, per op tensor (slot) the sharding id the op needs.
Propagation marks what it changes (`ShardingState.dirty_values`, `dirty_ops`); `evaluate` redoes only
those entries, cloning the cache first when a `copy()` shares it. The rest is whole-array numpy: the slots
whose value's sharding is not the one needed there, `lower`'s dedup (the first op needing a (value, to)
owns it; np.unique's first index over slots in `lower`'s order), the per-axis and per-kind sums, the
liveness scan as a cumulative sum over events sorted by op. Sums the per-op loop added in order use
np.cumsum (sequential), so the figures are those of that loop, to the bit.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from partir_torch.capture.fold import weights
from partir_torch.cost.hardware import Hardware, check_mesh
from partir_torch.ir.mesh import Mesh
from partir_torch.ir.program import Phase, Role
from partir_torch.ir.sharding import Sharding
from partir_torch.lower import Collective, op_needs, op_signatures, relayout_root, relayouts, reshard
from partir_torch.propagate import ShardingState

_VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.t.default", "aten.transpose.int",
          "aten.permute.default", "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dim",
          "aten.alias.default", "aten.select.int", "aten.slice.Tensor"}


@dataclass
class CostReport:
    step_time_s: float
    compute_time_s: float
    comm_time_s: float
    comm_time_by_axis: dict[str, float]
    comm_bytes: dict[str, dict[str, int]]  # kind -> axis -> bytes per device
    flops_per_device: float
    peak_memory_bytes: int
    memory_by_role: dict[str, int]  # at the peak
    top_at_peak: list[tuple[str, str, int]]  # (value, role, bytes)
    param_bytes_per_device: int
    opt_state_bytes_per_device: int
    memory_limit: float
    collectives: list[Collective] = field(default_factory=list, repr=False)

    @property
    def feasible(self) -> bool:
        return self.peak_memory_bytes <= self.memory_limit

    def to_json(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s, "compute_time_s": self.compute_time_s, "comm_time_s": self.comm_time_s,
            "comm_time_by_axis": self.comm_time_by_axis,
            "comm_bytes": {k: sum(v.values()) for k, v in self.comm_bytes.items()},
            "comm_bytes_by_axis": self.comm_bytes, "flops_per_device": self.flops_per_device,
            "peak_memory_bytes": self.peak_memory_bytes, "memory_by_role": self.memory_by_role,
            "top_at_peak": [list(t) for t in self.top_at_peak], "param_bytes_per_device": self.param_bytes_per_device,
            "opt_state_bytes_per_device": self.opt_state_bytes_per_device, "memory_limit": self.memory_limit,
            "feasible": self.feasible,
        }

    def __str__(self) -> str:
        gib = 2**30
        comm = ", ".join(f"{k} {sum(v.values()) / 2**20:.1f} MiB" for k, v in self.comm_bytes.items()) or "none"
        lines = [
            f"step {self.step_time_s * 1e3:.2f} ms = compute {self.compute_time_s * 1e3:.2f} ms + communication "
            f"{self.comm_time_s * 1e3:.2f} ms ({', '.join(f'{a} {t * 1e3:.2f} ms' for a, t in self.comm_time_by_axis.items()) or '-'})",
            f"communication per device: {comm}",
            f"peak memory per device {self.peak_memory_bytes / gib:.2f} GiB of {self.memory_limit / gib:.1f} GiB"
            f" ({'fits' if self.feasible else 'DOES NOT FIT'}): "
            + ", ".join(f"{r} {b / gib:.2f}" for r, b in sorted(self.memory_by_role.items(), key=lambda kv: -kv[1])),
        ]
        lines += [f"  {n} ({r}) {b / 2**20:.1f} MiB" for n, r, b in self.top_at_peak[:5]]
        return "\n".join(lines)


def collective_time(c: Collective, n: int, bw: float, alpha: float) -> float:
    if n <= 1:
        return 0.0
    if c.kind == "all-reduce":
        return 2 * (n - 1) / n * c.bytes / bw + 2 * (n - 1) * alpha
    return (n - 1) / n * c.bytes / bw + (n - 1) * alpha


def op_flops(target: str, operands: list[tuple[int, ...]], results: list[tuple[int, ...]]) -> float:
    if target == "aten.mm.default":
        (m, k), (_, n) = operands[0], operands[1]
        return 2.0 * m * k * n
    if target == "aten.addmm.default":
        (m, k), (_, n) = operands[1], operands[2]
        return 2.0 * m * k * n
    if target == "aten.bmm.default":
        (b, m, k), (_, _, n) = operands[0], operands[1]
        return 2.0 * b * m * k * n
    if target == "aten.convolution.default":
        return 2.0 * math.prod(results[0]) * math.prod(operands[1][1:])
    if target == "aten.convolution_backward.default":
        return 4.0 * math.prod(operands[0]) * math.prod(operands[2][1:])
    if target == "aten._scaled_dot_product_flash_attention_for_cpu.default":
        (b, h, L, e), (_, _, s, _) = operands[0], operands[1]
        return 4.0 * b * h * L * s * e
    if target == "aten._scaled_dot_product_flash_attention_for_cpu_backward.default":
        (b, h, L, e), (_, _, s, _) = operands[1], operands[2]
        return 10.0 * b * h * L * s * e
    return 0.0


# -- per-program tables ---------------------------------------------------------------------------------
_FLOP_TARGETS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.convolution.default",
                 "aten.convolution_backward.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
                 "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"}  # op_flops' non-zero targets
_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")
_ATTENTION = {"aten._scaled_dot_product_flash_attention_for_cpu.default",
              "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_efficient_attention.default"}


class _Static:
    """What does not depend on the sharding, computed once per program (`program._cost_static`)."""

    def __init__(self, state: ShardingState) -> None:
        program, rules = state.program, state.rules
        vals, ops = program.values, program.ops
        n_ops, n_vals = len(ops), len(vals)
        self.n_ops = n_ops
        op_w, own_w = weights(program)
        self.op_w = np.array(op_w, dtype=np.float64)
        self.op_w_list = op_w
        # shardings as small ints (equal shardings, equal ids), so that whole states compare as arrays
        self.sh_ids: dict[tuple, int] = {}
        self.sh_list: list[Sharding] = []
        # compute: per op, its tensors as (value, factors per dim, shape, itemsize); flops only for matmuls etc.
        self.tensors = [
            (op.target in _FLOP_TARGETS,
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
            self.flops0[o], self.nbytes0[o] = _op_compute(ops[o].target, self.tensors[o], {}, {})
        self.sid0 = np.array([self.sid(Sharding.replicated(len(v.shape))) for v in vals], dtype=np.int64)
        need0 = [self.sid(Sharding.replicated(len(t.dims))) for r in rules for t in (*r.operands, *r.results)]
        need0 += [self.sid0[old] if old >= 0 else self.sid(Sharding.replicated(0)) for _, old in self.ends]
        self.need0 = np.array(need0, dtype=np.int64)
        self.nbytes_val = np.array([math.prod(v.shape) * v.dtype.itemsize for v in vals], dtype=np.int64)
        kinds: dict[tuple, int] = {}
        self.vkind = [kinds.setdefault((v.shape, v.dtype.itemsize), len(kinds)) for v in vals]
        self.relay = relayouts(program, rules)  # lower.dedup_key: a re-layout's reshard is its operand's
        self.relaid = np.array([o >= 0 for o in self.relay], dtype=bool)

        # memory: aliasing (views), last uses, fold weights, lifetimes; all independent of the sharding
        root = list(range(n_vals))
        for op in ops:
            if op.target in _VIEWS and op.inputs:
                for o in op.outputs:
                    if o >= 0:
                        root[o] = root[op.inputs[0]]
        last = [-1] * n_vals
        for op in ops:
            for i in op.inputs:
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
            if op.target in _ATTENTION and len(op.outputs) > 1 and op.outputs[1] >= 0:
                self.attn_scale[op.outputs[1]] = vals[op.inputs[1]].shape[-2]
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


class _Grow:
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


class _Memo:
    """Results keyed by content, shared by every state of one program on one mesh (`program._cost_memo`):
    op entries by (signature, assignment, passed-through sums); per value its sharding id and local bytes
    by (shape, itemsize, sharding); moves (a reshard's collectives) by (shape, itemsize, from, to), and per
    slot the move and collectives it had last; the distinct collectives (axis, kind, bytes) as rows."""

    def __init__(self, mesh: Mesh, st: _Static) -> None:
        self.size = dict(mesh.axes)
        self.axes = {a: i for i, a in enumerate(mesh.names)}
        # op entries: flops, bytes, and the sharding ids needed at its slots (need[start:start + len])
        self.entry: dict[tuple, int] = {}
        self.e_py: list[tuple[float, int, tuple[int, ...]]] = []
        self.e_flops = _Grow(np.float64)
        self.e_nbytes = _Grow(np.float64)
        self.e_start = _Grow(np.int64)
        self.e_need = _Grow(np.int64)
        # value variants: sharding id and local bytes
        self.val: dict[tuple, int] = {}
        self.v_py: list[tuple[int, int]] = []
        self.v_sid = _Grow(np.int64)
        self.v_lb = _Grow(np.int64)
        # moves: (transitions, str(from), str(to)), all-gathered bytes, the row on each mesh axis (-1: none)
        self.moves: dict[tuple[int, int, int], int] = {}
        self.m_steps: list[tuple] = []
        self.m_ag = _Grow(np.int64)
        self.m_rows = _Grow(np.int64, (len(mesh.names),))
        # per slot: the move for the (from, to) it had last, and the collectives for the move they were made for
        self.slot_pair = np.full(st.n_slots, -1, dtype=np.int64)  # from << 32 | to
        self.slot_move = np.full(st.n_slots, -1, dtype=np.int64)
        self.colls: dict[tuple[int, int], tuple[Collective, ...]] = {}  # (slot, move) -> collectives
        self.roots: dict[tuple[int, int, int], tuple[int, int, int]] = {}  # lower.relayout_root, as sharding ids
        self.slot_colls: list[tuple[Collective, ...]] = [()] * st.n_slots
        self.colls_move = np.full(st.n_slots, -1, dtype=np.int64)
        self.rows: dict[tuple[str, str, int], int] = {}
        self.row_axis = _Grow(np.int64)
        self.row_kind = _Grow(np.int64)
        self.row_bytes = _Grow(np.int64)
        self.row_f = _Grow(np.float64)
        self.row_g = _Grow(np.float64)
        self.times: tuple | None = None
        self.at_peak: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def row(self, axis: str, kind: str, nbytes: int) -> int:
        r = self.rows.get((axis, kind, nbytes))
        if r is None:
            r = self.rows[(axis, kind, nbytes)] = len(self.rows)
            n = self.size[axis]
            self.row_axis.append(self.axes[axis])
            self.row_kind.append(_KINDS.index(kind))
            self.row_bytes.append(nbytes)
            # collective_time's ring factors: t = f · bytes / bw + g · α (0 for n = 1)
            self.row_f.append(2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n)
            self.row_g.append(2 * (n - 1) if kind == "all-reduce" else n - 1)
        return r

    def move_ids(self, state: ShardingState, st: _Static, slots: list[int], srcs: list[int],
                 dsts: list[int]) -> list[int]:
        """Move ids of these slots' values from sharding ids srcs to dsts."""
        vkind, vals = st.vkind, st.slot_vals
        keys = [(vkind[vals[s]], a, b) for s, a, b in zip(slots, srcs, dsts)]
        ids = list(map(self.moves.get, keys))
        if None in ids:
            new = {k: j for j, (k, i) in enumerate(zip(keys, ids)) if i is None}  # each new key once
            for k, j in new.items():
                steps, s, d = reshard(state, vals[slots[j]], st.sh_list[srcs[j]], st.sh_list[dsts[j]])
                rows = [-1] * len(self.axes)  # by mesh axis (a reshard moves an axis at most once, in mesh order)
                for kind, axis, nbytes in steps:
                    rows[self.axes[axis]] = self.row(axis, kind, nbytes)
                self.moves[k] = len(self.m_steps)
                self.m_steps.append((steps, s, d))
                self.m_ag.append(sum(nbytes for kind, _, nbytes in steps if kind == "all-gather"))
                self.m_rows.append(rows)
            ids = list(map(self.moves.__getitem__, keys))
        return ids

    def collectives(self, st: _Static, slots: np.ndarray, moves: np.ndarray) -> list[Collective]:
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
            self.times = (key, t)
        return self.times[1]


_CHECKED: dict[Mesh, set] = {}


def memo_checked(mesh: Mesh) -> set:
    """(fast-domain size, DCN axes) pairs `check_mesh` accepted for `mesh`: checked once, not per state."""
    return _CHECKED.setdefault(mesh, set())


def clear_memo(program) -> None:
    """Forget the results memoized for `program` (the next evaluations compute them again; for benchmarks
    and tests). The per-program tables and the states' own caches stay valid."""
    program.__dict__.pop("_cost_memo", None)
    for name in ("_lower_memo", "_reshard_memo"):
        getattr(program, name, {}).clear()


# entries, value variants, moves and collectives memoized per program: beyond, the memo starts over (states
# keep no ids into it)
_MEMO_LIMIT = 200_000


def _tables(state: ShardingState) -> tuple[_Static, _Memo]:
    program = state.program
    st = getattr(program, "_cost_static", None)
    if st is None:
        st = program._cost_static = _Static(state)  # type: ignore[attr-defined]
    memos = getattr(program, "_cost_memo", None)
    memo = None if memos is None else memos.get(state.mesh)
    if memo is not None and len(memo.entry) + len(memo.val) + len(memo.moves) + len(memo.colls) > _MEMO_LIMIT:
        clear_memo(program)  # lower's memos grow alike
        memos = memo = None
    if memos is None:
        memos = program._cost_memo = {}  # type: ignore[attr-defined]
    if memo is None:
        memo = memos[state.mesh] = _Memo(state.mesh, st)
    return st, memo


def _op_compute(target: str, tensors, a: dict, size: dict[str, int]) -> tuple[float, int]:
    """(flops, bytes read + written) of an op on its local shapes under factor assignment `a`."""
    is_flop, operands, results = tensors
    shapes = []
    nbytes = 0
    for group in (operands, results):
        local = []
        for _v, fdims, shape, itemsize in group:
            if a:
                loc = []
                for s, f in zip(shape, fdims):  # Sharding.local_shape of the required sharding
                    if f is not None:
                        for ax in a.get(f, ()):
                            s //= size[ax]
                    loc.append(s)
                loc = tuple(loc)
            else:
                loc = shape[: len(fdims)]
            nbytes += math.prod(loc) * itemsize
            local.append(loc)
        shapes.append(local)
    return (op_flops(target, shapes[0], shapes[1]) if is_flop else 0.0), nbytes


# -- per-state cache ------------------------------------------------------------------------------------
class _Cache:
    """What `evaluate` knows of one state: per value its local bytes and sharding id; per op its flops and
    bytes, and (for the hardware `t_key`) its weighted time and flops, stale at the ops in `t_ops`; per op
    slot the sharding id the op needs there. Copies of the state share it (`shared`) until one of them
    evaluates with something changed: that one clones it first."""

    __slots__ = ("flops", "lb", "mesh", "nbytes", "need", "program", "shared", "sid", "t_key", "t_ops", "terms",
                 "wflops")

    def clone(self) -> _Cache:
        new = object.__new__(_Cache)
        new.program, new.mesh, new.shared = self.program, self.mesh, False
        new.lb, new.sid, new.flops, new.nbytes = self.lb.copy(), self.sid.copy(), self.flops.copy(), self.nbytes.copy()
        new.need = self.need.copy()
        new.t_key, new.t_ops = self.t_key, list(self.t_ops)
        new.terms = None if self.terms is None else self.terms.copy()
        new.wflops = None if self.wflops is None else self.wflops.copy()
        return new


_SMALL = 48  # fewer changed values or ops than this: element by element, else whole arrays


def _refresh(state: ShardingState, st: _Static, memo: _Memo) -> _Cache:
    """The state's cache brought up to date: redo only its dirty values and ops."""
    program, mesh = state.program, state.mesh
    cache = state.cost_cache
    if cache is None or cache.program is not program or cache.mesh is not mesh:
        cache = object.__new__(_Cache)
        cache.program, cache.mesh, cache.shared = program, mesh, False
        cache.lb, cache.sid = st.nbytes_val.copy(), st.sid0.copy()
        cache.flops, cache.nbytes, cache.need = st.flops0.copy(), st.nbytes0.copy(), st.need0.copy()
        cache.t_key, cache.t_ops, cache.terms, cache.wflops = None, [], None, None
        dirty_values = state.changed  # a fresh cache holds the replicated state
        dirty_ops = [o for o, a in enumerate(state.assign) if a]
        dirty_ops += [o for o, p in enumerate(state.passthrough) if p and not state.assign[o]]
    else:
        dirty_values, dirty_ops = state.dirty_values, state.dirty_ops
        if not dirty_values and not dirty_ops:
            return cache
        if cache.shared:
            cache = cache.clone()
    vals, shard, size = program.values, state.shard, memo.size

    # per value: sharding id and local bytes
    if dirty_values:
        val_memo, vkind = memo.val, st.vkind
        vl = list(dirty_values)
        keys = [(vkind[v], sh.dims, sh.partial) for v, sh in zip(vl, map(shard.__getitem__, vl))]
        ids = list(map(val_memo.get, keys))
        if None in ids:
            new = {k: v for k, v, i in zip(keys, vl, ids) if i is None}  # each new key once
            for k, v in new.items():
                sh = shard[v]
                n = 1
                for d, axes in zip(vals[v].shape, sh.dims):  # Sharding.local_shape
                    for ax in axes:
                        d //= size[ax]
                    n *= d
                val_memo[k] = len(memo.v_py)
                memo.v_py.append((st.sid(sh), n * vals[v].dtype.itemsize))
                memo.v_sid.append(memo.v_py[-1][0])
                memo.v_lb.append(memo.v_py[-1][1])
            ids = list(map(val_memo.__getitem__, keys))
        if len(vl) < _SMALL:
            sid, lb, v_py, end_of = cache.sid, cache.lb, memo.v_py, st.end_of
            for v, i in zip(vl, ids):
                sid[v], lb[v] = v_py[i]
                for slot in end_of.get(v, ()):  # the end of the step needs the old values' shardings
                    cache.need[slot] = v_py[i][0]
        else:
            ids = np.array(ids, dtype=np.int64)
            cache.sid[vl] = memo.v_sid.a[ids]
            cache.lb[vl] = memo.v_lb.a[ids]
            cache.need[st.end_slots] = cache.sid[st.end_olds]

    # per op: flops, bytes and the sharding ids it needs, from its assignment and passed-through sums
    if dirty_ops:
        assign, passthrough, sig, entries = state.assign, state.passthrough, st.sig, memo.entry
        ol = list(dirty_ops)
        keys = [(sig[o], tuple(assign[o].items()), passthrough[o]) for o in ol]
        ids = list(map(entries.get, keys))
        if None in ids:
            new = {k: o for k, o, i in zip(keys, ol, ids) if i is None}  # each new key once
            rules, ops, sid_of = state.rules, program.ops, st.sid_of
            for k, o in new.items():
                a = assign[o]
                flops, nbytes = _op_compute(ops[o].target, st.tensors[o], a, size)
                entries[k] = len(memo.e_py)
                needs = op_needs(rules[o], a, passthrough[o])
                memo.e_py.append((flops, nbytes, tuple([sid_of(d, p, c) for d, p, c in needs])))
                memo.e_flops.append(flops)
                memo.e_nbytes.append(nbytes)
                memo.e_start.append(len(memo.e_need))
                memo.e_need.extend(memo.e_py[-1][2])
            ids = list(map(entries.__getitem__, keys))
        cache.t_ops.extend(ol)
        if len(ol) < _SMALL:
            flops_, nbytes_, need, e_py, start = cache.flops, cache.nbytes, cache.need, memo.e_py, st.slot_start
            for o, i in zip(ol, ids):
                flops_[o], nbytes_[o], nd = e_py[i]
                need[start[o] : start[o + 1]] = nd
        else:
            ids = np.array(ids, dtype=np.int64)
            ol = np.array(ol, dtype=np.int64)
            cache.flops[ol] = memo.e_flops.a[ids]
            cache.nbytes[ol] = memo.e_nbytes.a[ids]
            n = st.slot_len[ol]  # copy each entry's needs to the op's slots
            k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            cache.need[np.repeat(st.slot_start_arr[ol], n) + k] = memo.e_need.a[np.repeat(memo.e_start.a[ids], n) + k]
    state.cost_cache = cache  # (the updates above are idempotent: after an error, the next call redoes them)
    state.dirty_values, state.dirty_ops = set(), set()
    return cache


def _winners(state: ShardingState, st: _Static, memo: _Memo, cache: _Cache) -> tuple[np.ndarray, np.ndarray]:
    """(slots, move ids) of `lower`'s reshards, in its order: every slot whose value's sharding is not the
    one needed there, the first of each (value, to) only."""
    sid, need = cache.sid, cache.need
    have = sid[st.slot_val]
    mm = np.flatnonzero(have != need)
    res, h, n = st.slot_res[mm], have[mm], need[mm]
    src, dst = np.where(res, n, h), np.where(res, h, n)  # a result slot: from what the op makes
    pair = (src << 32) | dst
    stale = np.flatnonzero(memo.slot_pair[mm] != pair)
    if len(stale):
        slots = mm[stale]
        memo.slot_move[slots] = memo.move_ids(state, st, slots.tolist(), src[stale].tolist(), dst[stale].tolist())
        memo.slot_pair[slots] = pair[stale]
    vals = st.slot_val[mm]
    relaid = np.flatnonzero(st.relaid[vals])
    if len(relaid):  # lower.dedup_key: (u, to') for a re-layout of u moved from u's own sharding
        roots, rules, sh = memo.roots, state.rules, st.sh_list
        found = []
        for v, a, b in zip(vals[relaid].tolist(), src[relaid].tolist(), dst[relaid].tolist()):
            hit = roots.get((v, a, b))
            if hit is None:
                u, s2, d2 = relayout_root(rules, st.relay, v, sh[a], sh[b])
                hit = roots[(v, a, b)] = (u, st.sid(s2), st.sid(d2))
            found.append(hit)
        u, s2, d2 = np.array(found, dtype=np.int64).T
        same = sid[u] == s2
        vals = vals.copy()
        dst = dst.copy()
        vals[relaid[same]] = u[same]
        dst[relaid[same]] = d2[same]
    keys = vals * len(st.sh_list) + dst  # (value, to): the first slot of each (np.unique's index)
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    keep = np.empty(len(sk), dtype=bool)
    keep[:1] = True
    np.not_equal(sk[1:], sk[:-1], out=keep[1:])
    first = order[keep]
    first.sort()
    win = mm[first]
    return win, memo.slot_move[win]


def evaluate(state: ShardingState, hw: Hardware, *, dcn_axes: frozenset[str] = frozenset(),
             memory_limit: float | None = None) -> CostReport:
    """The cost of `state` on `hw`; `dcn_axes` cross slices/nodes; `memory_limit` defaults to the device's."""
    # the temporaries below (keys, lists) are freed on return: cyclic garbage collections they would
    # trigger (and that scan every live state) are wasted work, so they are held off meanwhile
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _evaluate(state, hw, dcn_axes, memory_limit)
    finally:
        if enabled:
            gc.enable()


def _evaluate(state: ShardingState, hw: Hardware, dcn_axes: frozenset[str], memory_limit: float | None) -> CostReport:
    if (hw.max_fast_devices, dcn_axes) not in memo_checked(state.mesh):
        check_mesh(hw, state.mesh.axes, dcn_axes)
        memo_checked(state.mesh).add((hw.max_fast_devices, dcn_axes))
    st, memo = _tables(state)
    cache = _refresh(state, st, memo)
    n_ops = st.n_ops
    lb = cache.lb

    # compute: per op w · (max(flops / peak, bytes / bw) + floor), redone where flops or bytes changed; the
    # totals add in op order (np.cumsum), as a loop does
    if n_ops:
        key = (hw.peak_flops_fp32, hw.peak_flops_bf16, hw.matmul_efficiency, hw.hbm_bandwidth, hw.launch_floor)
        if cache.t_key != key:
            pe = np.where(st.itemsize >= 4, hw.peak_flops_fp32, hw.peak_flops_bf16) * hw.matmul_efficiency
            cache.terms = st.op_w * (np.maximum(cache.flops / pe, cache.nbytes / hw.hbm_bandwidth) + hw.launch_floor)
            cache.wflops = st.op_w * cache.flops
            cache.t_key, cache.t_ops = key, []
        elif cache.t_ops:
            terms, wflops, flops, nbytes = cache.terms, cache.wflops, cache.flops, cache.nbytes
            for o in set(cache.t_ops):
                w = st.op_w_list[o]
                pe = (hw.peak_flops_fp32 if st.itemsize_list[o] >= 4 else hw.peak_flops_bf16) * hw.matmul_efficiency
                f = flops.item(o)
                terms[o] = w * (max(f / pe, nbytes.item(o) / hw.hbm_bandwidth) + hw.launch_floor)
                wflops[o] = w * f
            cache.t_ops = []
        compute = float(np.cumsum(cache.terms)[-1])
        flops_total = float(np.cumsum(cache.wflops)[-1])
    else:
        compute, flops_total = 0.0, 0.0

    # communication
    win, moves = _winners(state, st, memo, cache)
    colls = memo.collectives(st, win, moves)
    by_axis: dict[str, float] = {}
    comm_bytes: dict[str, dict[str, int]] = {}
    temps = np.zeros(n_ops, dtype=np.int64)  # collective output buffers (all-gathers) at the op needing them
    if colls:
        names = state.mesh.names
        n_ax = len(names)
        flat = memo.m_rows.a[moves].ravel()  # each move's row per mesh axis: the collectives in order
        sel = np.flatnonzero(flat >= 0)
        r = flat[sel]
        ax = sel % n_ax
        w = st.slot_w[win][sel // n_ax]
        wt = w * memo.row_time(hw, dcn_axes)[r]  # w · collective_time
        for a in dict.fromkeys(ax.tolist()):  # first appearance
            by_axis[names[a]] = float(np.cumsum(wt[ax == a])[-1])  # in order, as a loop adds
        combo = memo.row_kind.a[r] * n_ax + ax
        wb = w * memo.row_bytes.a[r]
        if int(wb.sum()) < 2**53:  # float sums of integers below 2^53 are exact
            totals = np.bincount(combo, weights=wb, minlength=len(_KINDS) * n_ax).tolist()
        else:
            totals = [int(wb[combo == c].sum()) for c in range(len(_KINDS) * n_ax)]
        for c in dict.fromkeys(combo.tolist()):
            comm_bytes.setdefault(_KINDS[c // n_ax], {})[names[c % n_ax]] = int(totals[c])
        ops = st.slot_op_arr[win]
        ag = memo.m_ag.a[moves]
        has = np.flatnonzero((ag > 0) & (ops >= 0))
        if len(has):
            np.add.at(temps, ops[has], ag[has])

    # memory by liveness
    base = int((lb[st.pers_vid] * st.pers_w).sum())
    peak, peak_at = base, -1
    if n_ops:
        cs0 = np.zeros(len(st.ev_vid) + 1, dtype=np.int64)
        np.cumsum(lb[st.ev_vid] * (st.ev_coef if hw.flash_attention else st.ev_coef_math), out=cs0[1:])
        cur = cs0[st.upto]
        cur += temps
        i = int(np.argmax(cur))  # the first maximum
        if cur[i] > 0:
            peak, peak_at = base + int(cur[i]), i
    # what is live at the peak (which values, and in how many copies, depends on the position only)
    at = memo.at_peak.get(peak_at)
    if at is None:
        if len(memo.at_peak) > 64:
            memo.at_peak.clear()
        i = np.flatnonzero(st.m_pers | ((st.m_prod <= peak_at) & (peak_at <= st.m_end)))
        at = memo.at_peak[peak_at] = (st.m_vid[i], np.where(st.m_pers[i] | (st.m_extra[i] <= peak_at), st.m_w[i], 1),
                                      st.m_role[i])
    vid, copies, codes = at
    mlb = lb[vid]
    nz = np.flatnonzero(mlb)
    vid, copies, codes = vid[nz], copies[nz], codes[nz]
    b = mlb[nz] * copies
    if not hw.flash_attention:
        b = b * st.attn_scale[vid]
    roles: dict[str, int] = {}
    if len(b):
        if int(b.sum()) < 2**53:
            totals = np.bincount(codes, weights=b, minlength=len(st.role_names)).tolist()
        else:
            totals = [int(b[codes == c].sum()) for c in range(len(st.role_names))]
        for c in dict.fromkeys(codes.tolist()):
            roles[st.role_names[c]] = int(totals[c])
    if peak_at >= 0 and temps[peak_at]:
        roles["collective_buffers"] = int(temps[peak_at])
    top = np.argsort(-b, kind="stable")[:10]
    contributors = [(st.names[v] + (f" (x{k})" if k > 1 else ""), st.role_names[c], nb) for v, k, c, nb in
                    zip(vid[top].tolist(), copies[top].tolist(), codes[top].tolist(), b[top].tolist())]

    comm = sum(by_axis.values())
    return CostReport(
        step_time_s=compute + comm, compute_time_s=compute, comm_time_s=comm, comm_time_by_axis=by_axis,
        comm_bytes=comm_bytes, flops_per_device=flops_total, peak_memory_bytes=int(peak), memory_by_role=roles,
        top_at_peak=contributors,
        param_bytes_per_device=int((lb[st.param_vid] * st.param_w).sum()),
        opt_state_bytes_per_device=int((lb[st.opt_vid] * st.opt_w).sum()),
        memory_limit=hw.memory if memory_limit is None else memory_limit, collectives=colls,
    )
