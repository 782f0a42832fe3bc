"""Cost analysis of a partitioned program: compute, communication per mesh axis, per-device peak memory.

Compute, per op, on its *local* (per-device) shapes after sharding:
    flops: mm/addmm 2mkn; bmm 2bmkn; convolution 2·|out|·|w|/C_out; its backward twice that;
           flash attention 4·B·H·L·S·E forward, 2.5x that backward; an opaque module's op (capture
           fallback=True, always replicated) its FLOPs counted on a real run at capture; everything else 0
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
their producing op to their last use; views (transposes, reshapes, broadcasts) alias their base; an
all-gather's output lives from the op that needs it to the last op that reads the same gathered value (a
weight gathered in the forward and saved by autograd: into the backward); attention saves its log-sum-exp for the
backward (a flash kernel) or, on hardware without one (`Hardware.flash_attention`), its [B, H, T, S]
probabilities. The peak and its top contributors are reported; a plan above the device memory (or the
user's limit) is infeasible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from partir_torch.lower import Collective


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
    calls: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> axis -> calls, buckets coalesced
    # {kind: bytes per device} with each reshard's steps fused as an SPMD compiler emits them (`lower.fused`)
    comm_bytes_fused: dict[str, int] = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return self.peak_memory_bytes <= self.memory_limit

    def to_json(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s, "compute_time_s": self.compute_time_s, "comm_time_s": self.comm_time_s,
            "comm_time_by_axis": self.comm_time_by_axis,
            "comm_bytes": {k: sum(v.values()) for k, v in self.comm_bytes.items()},
            "comm_bytes_by_axis": self.comm_bytes, "comm_bytes_fused": self.comm_bytes_fused,
            "flops_per_device": self.flops_per_device,
            "peak_memory_bytes": self.peak_memory_bytes, "memory_by_role": self.memory_by_role,
            "top_at_peak": [list(t) for t in self.top_at_peak], "param_bytes_per_device": self.param_bytes_per_device,
            "opt_state_bytes_per_device": self.opt_state_bytes_per_device, "memory_limit": self.memory_limit,
            "feasible": self.feasible, "calls": self.calls,
        }

    def __str__(self) -> str:
        from partir_torch.cost.hardware import format_bytes as fmt

        comm = ", ".join(f"{k} {fmt(sum(v.values()))}" for k, v in self.comm_bytes.items()) or "none"
        by_axis = ", ".join(f"{a} {t * 1e3:.2f} ms" for a, t in self.comm_time_by_axis.items()) or "-"
        lines = [
            f"step {self.step_time_s * 1e3:.2f} ms = compute {self.compute_time_s * 1e3:.2f} ms + communication "
            f"{self.comm_time_s * 1e3:.2f} ms ({by_axis})",
            f"communication per device: {comm}",
            f"peak memory per device {fmt(self.peak_memory_bytes)} of {fmt(self.memory_limit)}"
            f" ({'fits' if self.feasible else 'DOES NOT FIT'}): "
            + ", ".join(f"{r} {fmt(b)}" for r, b in sorted(self.memory_by_role.items(), key=lambda kv: -kv[1])),
        ]
        lines += [f"  {n} ({r}) {fmt(b)}" for n, r, b in self.top_at_peak[:5]]
        return "\n".join(lines)


def collective_time(c: Collective, n: int, bw: float, alpha: float) -> float:
    return transfer_time(c.kind, c.bytes, n, bw, alpha)


def transfer_time(kind: str, nbytes: float, n: int, bw: float, alpha: float, count: int = 1) -> float:
    """Seconds of `count` collectives of `kind` moving `nbytes` in all over a group of `n` devices (ring
    algorithms: an all-reduce sends twice what a gather does; a collective-permute, an engine's re-layout,
    sends its bytes once)."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * nbytes / bw + count * 2 * (n - 1) * alpha
    if kind == "collective-permute":
        return nbytes / bw + count * alpha
    return (n - 1) / n * nbytes / bw + count * (n - 1) * alpha


def op_flops(target: str, operands: list[tuple[int, ...]], results: list[tuple[int, ...]],
             measured: float | None = None) -> float:
    """FLOPs of one call; `measured`: an opaque op's, measured at capture (`Op.flops`)."""
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
    return measured or 0.0


# op_flops' non-zero targets
FLOP_TARGETS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.convolution.default",
                          "aten.convolution_backward.default",
                          "aten._scaled_dot_product_flash_attention_for_cpu.default",
                          "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"})
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")  # the collectives, as the tables index them
