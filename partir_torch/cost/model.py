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
A folded program (`capture/fold.py`) is costed as the full model: each op, collective and value counts with
its fold weight (element 1 of a folded container stands for elements 1..N-1).
Step time = compute + communication (no overlap is modelled: an upper bound; see docs/cost-model.md).
Memory, per device, by liveness over the op order: parameters, buffers, optimizer states and inputs live
the whole step; updated values reuse their input's buffer (donation); gradients and activations live from
their producing op to their last use; views (transposes, reshapes, broadcasts) alias their base; a
collective's output buffer is a temporary at the op that needs it. The peak and its top contributors are
reported; a plan above the device memory (or the user's limit) is infeasible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from partir_torch.capture.fold import weights
from partir_torch.cost.hardware import Hardware
from partir_torch.ir.program import Phase, Role
from partir_torch.lower import Collective, lower, required_operand
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


def evaluate(state: ShardingState, hw: Hardware, *, dcn_axes: frozenset[str] = frozenset(),
             memory_limit: float | None = None) -> CostReport:
    program, mesh = state.program, state.mesh
    vals = program.values
    op_w, own_w = weights(program)
    local_bytes = [math.prod(state.shard[v.id].local_shape(v.shape, mesh)) * v.dtype.itemsize for v in vals]

    # compute
    compute, flops_total = 0.0, 0.0
    for op in program.ops:
        rule = state.rules[op.id]
        ins = [required_operand(state, op.id, i).local_shape(vals[t.value].shape, mesh) for i, t in enumerate(rule.operands)]
        outs = [state.op_output(op.id, r).local_shape(vals[t.value].shape, mesh) for r, t in enumerate(rule.results)]
        flops = op_flops(op.target, ins, outs)
        nbytes = sum(math.prod(s) * vals[t.value].dtype.itemsize for s, t in zip(ins, rule.operands))
        nbytes += sum(math.prod(s) * vals[t.value].dtype.itemsize for s, t in zip(outs, rule.results))
        itemsize = vals[rule.results[0].value].dtype.itemsize if rule.results else 4
        w = op_w[op.id]
        compute += w * (max(flops / (hw.peak(itemsize) * hw.matmul_efficiency), nbytes / hw.hbm_bandwidth) + hw.launch_floor)
        flops_total += w * flops

    # communication
    colls = lower(state)
    by_axis: dict[str, float] = {}
    comm_bytes: dict[str, dict[str, int]] = {}
    temps: dict[int, int] = {}
    for c in colls:
        dcn = c.axis in dcn_axes
        t = collective_time(c, mesh.size(c.axis), hw.dcn_bandwidth if dcn else hw.link_bandwidth,
                            hw.dcn_latency if dcn else hw.link_latency)
        prod = vals[c.value].producer
        if c.op >= 0 and (prod < 0 or program.ops[c.op].phase is not Phase.BACKWARD):
            w = op_w[c.op]  # forward: the boundary into element 1 stands for N - 1 boundaries
        else:  # backward runs the other way: the boundary out of element 1 does
            w = op_w[prod] if prod >= 0 else own_w[c.value]
        by_axis[c.axis] = by_axis.get(c.axis, 0.0) + w * t
        comm_bytes.setdefault(c.kind, {}).setdefault(c.axis, 0)
        comm_bytes[c.kind][c.axis] += w * c.bytes
        if c.kind == "all-gather" and c.op >= 0:
            temps[c.op] = temps.get(c.op, 0) + c.bytes

    # memory by liveness
    n_ops = len(program.ops)
    root = list(range(len(vals)))
    for op in program.ops:
        if op.target in _VIEWS and op.inputs:
            for o in op.outputs:
                if o >= 0:
                    root[o] = root[op.inputs[0]]
    last = [-1] * len(vals)
    for op in program.ops:
        for i in op.inputs:
            r = root[i]
            last[r] = max(last[r], op.id)
    # fold weights in memory: persistent values and gradients, and activations alive beyond their phase
    mem_w = [1] * len(vals)
    for v in vals:
        if root[v.id] != v.id:
            continue
        outlives = v.producer >= 0 and last[v.id] >= 0 and program.ops[last[v.id]].phase is not program.ops[v.producer].phase
        if v.producer < 0 or v.role is Role.GRADIENT or outlives:
            mem_w[v.id] = own_w[v.id]
    outputs = {root[o] for o in program.outputs}
    persistent = {v.id for v in vals if v.producer < 0}
    donated = {root[n] for n in program.updates}
    # A folded element-1 value that outlives its phase stands for N - 1 copies, but they are not all live at
    # once inside element 1's own span: forward copies (earlier layers' saved activations) exist from the
    # start of element 1's forward; backward copies (later-processed layers' gradients) from its end.
    span: dict[tuple[Phase, int], list[int]] = {}
    for op in program.ops:
        if op_w[op.id] > 1:
            sp = span.setdefault((op.phase, op_w[op.id]), [op.id, op.id])
            sp[1] = op.id
    extra_from = [0] * len(vals)
    delta = [0] * (n_ops + 1)
    base = 0
    for v in vals:
        if root[v.id] != v.id or v.id in donated:
            continue
        if v.id in persistent:
            base += local_bytes[v.id] * mem_w[v.id]
            continue
        end = n_ops if v.id in outputs else max(last[v.id], v.producer)
        stop = end + 1 if end < n_ops else n_ops
        delta[v.producer] += local_bytes[v.id]
        delta[stop] -= local_bytes[v.id]
        if mem_w[v.id] > 1:
            phase = program.ops[v.producer].phase
            sp = span.get((phase, own_w[v.id]), [v.producer, v.producer])
            start = sp[0] if phase is Phase.FORWARD else min(sp[1] + 1, stop)
            extra_from[v.id] = start
            delta[start] += local_bytes[v.id] * (mem_w[v.id] - 1)
            delta[stop] -= local_bytes[v.id] * (mem_w[v.id] - 1)
    live, peak, peak_at = base, base, -1
    for i in range(n_ops):
        live += delta[i]
        cur = live + temps.get(i, 0)
        if cur > peak:
            peak, peak_at = cur, i
    # what is live at the peak
    roles: dict[str, int] = {}
    contributors = []
    for v in vals:
        if root[v.id] != v.id or v.id in donated:
            continue
        if v.id in persistent:
            alive = True
        else:
            end = n_ops if v.id in outputs else max(last[v.id], v.producer)
            alive = v.producer <= peak_at <= end
        if alive and local_bytes[v.id]:
            copies = mem_w[v.id] if v.id in persistent or extra_from[v.id] <= peak_at else 1
            role, b = v.role.value, local_bytes[v.id] * copies
            roles[role] = roles.get(role, 0) + b
            contributors.append((v.name + (f" (x{copies})" if copies > 1 else ""), role, b))
    if temps.get(peak_at):
        roles["collective_buffers"] = temps[peak_at]
    contributors.sort(key=lambda t: -t[2])

    comm = sum(by_axis.values())
    return CostReport(
        step_time_s=compute + comm, compute_time_s=compute, comm_time_s=comm, comm_time_by_axis=by_axis,
        comm_bytes=comm_bytes, flops_per_device=flops_total, peak_memory_bytes=int(peak), memory_by_role=roles,
        top_at_peak=contributors[:10],
        param_bytes_per_device=sum(local_bytes[v] * mem_w[v] for v in program.params.values()),
        opt_state_bytes_per_device=sum(local_bytes[v.id] * mem_w[v.id] for v in vals if v.role is Role.OPT_STATE),
        memory_limit=hw.memory if memory_limit is None else memory_limit, collectives=colls,
    )
