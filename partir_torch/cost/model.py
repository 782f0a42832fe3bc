"""How `evaluate` computes the cost model of `cost/report.py` fast enough for the search.

Evaluation is incremental (the search evaluates thousands of states that differ by one action). What does
not depend on the sharding is computed once per analysis (`tables.Static`: each op's tensors, fold weights, the
liveness events). Results are memoized by content per analysis, i.e. program and mesh (`tables.Memo`): an op's
flops, bytes and
the shardings it needs by (rule structure, shapes, assignment, passed-through sums), so the repeated
layers share them; a value's local bytes by (shape, sharding); a reshard's collectives by (op slot, from,
to). Each evaluated state has a cache of arrays (`tables.Cache`): per value its local bytes and sharding id (shardings
interned as small ints), per op its flops and bytes, per op tensor (slot) the sharding id the op needs.
Propagation records what it changes (`ShardingState.record`, a chain of `Changes`); `evaluate` closes the
state's record, keys the cache by it (`Static.caches`) and, for a later state, starts from the cache of the
newest record on its chain and redoes only the entries changed since, cloning the cache first when a
`copy()` forked the chain there. The rest is whole-array numpy: the slots
whose value's sharding is not the one needed there, `lower`'s dedup (the first op needing a (value, to)
owns it; np.unique's first index over slots in `lower`'s order), the per-axis and per-kind sums, the
liveness scan as a cumulative sum over events sorted by op. Sums the per-op loop added in order use
np.cumsum (sequential), so the figures are those of that loop, to the bit.
"""

from __future__ import annotations

import gc
import math

import numpy as np

from partir_torch.cost.hardware import Hardware, check_mesh
from partir_torch.cost.report import COLLECTIVES, CostReport, collective_time, op_flops
from partir_torch.cost.tables import Cache, Memo, Static, op_compute, tables
from partir_torch.lower import op_needs, relayout_root
from partir_torch.lower.buckets import coalesced
from partir_torch.propagate import Changes, ShardingState

__all__ = ["CostReport", "collective_time", "evaluate", "op_flops"]

_SMALL = 48  # fewer changed values or ops than this: element by element, else whole arrays
_WALK = 32  # records walked back to find an evaluated one; beyond, the state is costed from scratch


def _refresh(state: ShardingState, st: Static, memo: Memo) -> Cache:
    """The state's cache brought up to date: redo only its dirty values and ops."""
    program = state.program
    mark = state.close_record()
    caches = st.caches
    cache = caches.get(mark)
    if cache is not None:
        return cache  # evaluated, and nothing changed since
    walked: list[Changes] = []  # the records since the newest one evaluated, newest first
    node: Changes | None = mark
    while node is not None and len(walked) < _WALK:
        cache = caches.get(node)
        if cache is not None:
            break
        walked.append(node)
        node = node.parent
    else:
        cache = None
    if cache is None:  # nothing evaluated on the way: from the replicated state
        cache = Cache.replicated(st)
        dirty_values: set[int] | list[int] = state.changed
        dirty_ops = [o for o, a in enumerate(state.assign) if a]
        dirty_ops += [o for o, p in enumerate(state.passthrough) if p and not state.assign[o]]
    else:
        if len(walked) == 1:
            dirty_values, dirty_ops = walked[0].values, walked[0].ops
        else:
            dirty_values = set().union(*(r.values for r in walked))
            dirty_ops = set().union(*(r.ops for r in walked))
        if node.forked:  # a copy of the state may still need it as it is
            cache = cache.clone()
        else:  # only this state's line of records leads through it: bring it up to date in place
            del caches[node]
    vals, shard, mesh = program.values, state.shard, state.mesh

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
                n = math.prod(sh.local_shape(vals[v].shape, mesh))
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
                flops, nbytes = op_compute(ops[o], st.tensors[o], a, mesh)
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
    caches[mark] = cache  # (after an error it is not kept: the next call walks past `mark` and redoes it)
    return cache



def _winners(state: ShardingState, st: Static, memo: Memo, cache: Cache
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slots, move ids, last ops) of `lower`'s reshards, in its order: every slot whose value's sharding is
    not the one needed there, the first of each (value, to) only; with the op of the last slot that reads
    the same (value, to) (-1: the end of the step), up to which the first's output stays live."""
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
        roots, sh = memo.roots, st.sh_list
        found = []
        for v, a, b in zip(vals[relaid].tolist(), src[relaid].tolist(), dst[relaid].tolist()):
            hit = roots.get((v, a, b))
            if hit is None:
                u, s2, d2 = relayout_root(state, st.relay, v, sh[a], sh[b])
                hit = roots[(v, a, b)] = (u, st.sid(s2), st.sid(d2))
            found.append(hit)
        u, s2, d2 = np.array(found, dtype=np.int64).T
        same = sid[u] == s2
        dst = dst.copy()
        vals[relaid[same]] = u[same]
        dst[relaid[same]] = d2[same]
    keys = vals * len(st.sh_list) + dst  # (value, to): the first slot of each (np.unique's index)
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    keep = np.empty(len(sk), dtype=bool)
    keep[:1] = True
    np.not_equal(sk[1:], sk[:-1], out=keep[1:])
    ends = np.empty(len(sk), dtype=bool)
    ends[-1:] = True
    ends[:-1] = keep[1:]
    first, last = order[keep], order[ends]  # (stable: each group's slots in slot order)
    by = np.argsort(first, kind="stable")
    win = mm[first[by]]
    return win, memo.slot_move[win], st.slot_op_arr[mm[last[by]]]


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


def op_times(state: ShardingState, hw: Hardware) -> np.ndarray:
    """Per op, the compute time `evaluate` charges it on `hw` (fold weight included): what a calibration holds
    against measured kernel times (`benchmarks/gpu.py`)."""
    evaluate(state, hw)
    st, memo = tables(state)
    return _refresh(state, st, memo).terms.copy()


def _evaluate(state: ShardingState, hw: Hardware, dcn_axes: frozenset[str], memory_limit: float | None) -> CostReport:
    st, memo = tables(state)
    if (hw.max_fast_devices, dcn_axes) not in st.checked:  # once per analysis, not per state
        check_mesh(hw, state.mesh.axes, dcn_axes)
        st.checked.add((hw.max_fast_devices, dcn_axes))
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
    win, moves, last = _winners(state, st, memo, cache)
    colls = memo.collectives(st, win, moves)
    by_axis: dict[str, float] = {}
    comm_bytes: dict[str, dict[str, int]] = {}
    temps = np.zeros(n_ops, dtype=np.int64)  # collective output buffers (all-gathers) at the op needing them
    comm_fused: dict[str, int] = {}
    n_calls_by: dict[str, dict[str, int]] = {}  # kind -> axis -> collective calls, buckets coalesced
    if colls:
        names = state.mesh.names
        n_ax = len(names)
        flat = memo.m_rows.a[moves].ravel()  # each move's rows, two per mesh axis: the collectives in order
        sel = np.flatnonzero(flat >= 0)
        r = flat[sel]
        ax = (sel % (2 * n_ax)) // 2
        w = st.slot_w[win][sel // (2 * n_ax)]
        wt = w * memo.row_time(hw, dcn_axes)[r]  # w · collective_time
        for a in dict.fromkeys(ax.tolist()):  # first appearance
            by_axis[names[a]] = float(np.cumsum(wt[ax == a])[-1])  # in order, as a loop adds
        combo = memo.row_kind.a[r] * n_ax + ax
        wb = w * memo.row_bytes.a[r]
        if int(wb.sum()) < 2**53:  # float sums of integers below 2^53 are exact
            totals = np.bincount(combo, weights=wb, minlength=len(COLLECTIVES) * n_ax).tolist()
        else:
            totals = [int(wb[combo == c].sum()) for c in range(len(COLLECTIVES) * n_ax)]
        for c in dict.fromkeys(combo.tolist()):
            comm_bytes.setdefault(COLLECTIVES[c // n_ax], {})[names[c % n_ax]] = int(totals[c])
        fused = (st.slot_w[win][:, None] * memo.m_fused.a[moves]).sum(axis=0).tolist()
        comm_fused = {k: int(b) for k, b in zip(COLLECTIVES, fused) if b}
        ops = st.slot_op_arr[win]
        ag = memo.m_ag.a[moves]
        has = np.flatnonzero((ag > 0) & (ops >= 0))
        if len(has):  # a gathered copy lives from the op that gathers to the last that reads it (a backward
            # op: autograd saved it; in a folded block, all its elements' copies, as an activation's)
            a0, b, w = ops[has], ag[has], st.slot_w[win][has]
            a1 = np.maximum(st.view_end[np.maximum(last[has], a0)], st.view_end[a0])
            d = np.zeros(n_ops + 1, dtype=np.int64)
            np.add.at(d, a0, b)
            np.add.at(d, a1 + 1, -b)
            many = np.flatnonzero((w > 1) & (st.op_bwd[a1] & ~st.op_bwd[a0]))
            if len(many):
                start = np.array([st.fwd_span.get(int(x), int(y)) for x, y in zip(w[many], a0[many])], dtype=np.int64)
                extra = (w[many] - 1) * b[many]
                np.add.at(d, np.minimum(start, a0[many]), extra)
                np.add.at(d, a1[many] + 1, -extra)
            temps = np.cumsum(d[:n_ops])
        # the torch backend's buckets (`lower/buckets.py`): one call a bucket, not one a reduction (each call
        # pays the axis's latency: it is the bytes' time that adds up), and a bucket's buffer where it is issued
        per_slot = sel // (2 * n_ax)
        slot, cw = win[per_slot], st.slot_w[win][per_slot]  # each collective's slot and fold weight
        calls, buffers = coalesced(st.slot_val[slot], st.slot_op_arr[slot], moves[per_slot], memo.row_kind.a[r],
                                   ax, memo.row_bytes.a[r], cw, st, hw.bucket_cap)
        counted = np.bincount(combo, weights=cw, minlength=len(COLLECTIVES) * n_ax)
        for (k, a), n_calls in calls.items():
            kind, axis = COLLECTIVES[k], names[a]
            n, fewer = state.mesh.size(axis), int(counted[k * n_ax + a]) - n_calls
            if fewer and n > 1:
                measured = hw.link(axis, kind)
                alpha = hw.dcn_latency if axis in dcn_axes else hw.link_latency
                by_axis[axis] -= fewer * (measured[0] if measured else
                                          alpha * (2 * (n - 1) if kind == "all-reduce" else n - 1))
        for (k, a), n_calls in calls.items():
            n_calls_by.setdefault(COLLECTIVES[k], {})[names[a]] = n_calls
        if buffers and n_ops:
            spike = np.zeros(n_ops + 1, dtype=np.int64)
            for at, nb in buffers:
                spike[min(at, n_ops - 1)] += nb
                spike[min(at, n_ops - 1) + 1] -= nb
            temps = temps + np.cumsum(spike[:n_ops])

    # memory by liveness
    base = int((lb[st.pers_vid] * st.pers_w).sum())
    peak, peak_at = base, -1
    cut: np.ndarray | tuple = ()
    if n_ops:
        cs0 = np.zeros(len(st.ev_vid) + 1, dtype=np.int64)
        np.cumsum(lb[st.ev_vid] * (st.ev_coef if hw.flash_attention else st.ev_coef_math), out=cs0[1:])
        cur = cs0[st.upto]
        cur += temps
        cut = np.flatnonzero(cache.sid[st.cut_val] != cache.need[st.cut_slot]) if len(st.cut_val) else ()
        if len(cut):  # activations resharded by the one view that reads them: free after it (`Static.cut_*`)
            d = np.zeros(n_ops + 1, dtype=np.int64)
            np.add.at(d, st.cut_from[cut], -lb[st.cut_val[cut]])
            np.add.at(d, st.cut_to[cut], lb[st.cut_val[cut]])
            cur += np.cumsum(d[:n_ops])
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
    if len(cut):
        gone = st.cut_val[cut][(st.cut_from[cut] <= peak_at) & (peak_at < st.cut_to[cut])]
        if len(gone):
            keep = ~np.isin(vid, gone)
            vid, copies, codes = vid[keep], copies[keep], codes[keep]
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
        comm_bytes_fused=comm_fused, calls=n_calls_by,
    )

