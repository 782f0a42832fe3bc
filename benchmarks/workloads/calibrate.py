"""Calibration: the cost model's predictions against what XLA compiles for the same plan.

For a zoo model, a mesh and a schedule: propagate and cost the plan, apply the same parameter / input /
optimizer-state shardings through torch_xla, compile one training step, and compare per collective kind the
bytes per device, and the per-device memory (our liveness peak vs XLA's buffer assignment total).

XLA's CPU pipeline never emits reduce-scatter: a gradient that is reduced and then sliced stays an all-reduce
of the full size followed by a slice. `as_cpu` maps our predictions to that form (reduce-scatter B bytes ->
all-reduce B bytes) so the two can be compared; `predicted` is what a TPU/GPU pipeline emits.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from partir_torch.backends.xla_worker import run_step
from partir_torch.cost import evaluate, hardware
from partir_torch.ir.mesh import Mesh
from partir_torch.plan import PlanSpecs, specs


@dataclass
class Calibration:
    model: str
    mesh: str
    schedule: str
    predicted: dict[str, int]  # kind -> bytes per device (TPU/GPU form)
    as_cpu: dict[str, int]  # the same, in XLA CPU's form
    xla: dict[str, int]
    predicted_memory: int
    xla_memory: int | None
    loss: float
    compile_s: float
    xla_memory_breakdown: dict[str, int] | None = None
    constrained: bool = True
    plain_layer_norm: bool = True

    def ratio(self, kind: str) -> float | None:
        p, x = self.as_cpu.get(kind, 0), self.xla.get(kind, 0)
        return None if p == 0 and x == 0 else (p / x if x else float("inf"))

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "ratios": {k: self.ratio(k) for k in sorted(set(self.as_cpu) | set(self.xla))},
                "memory_ratio": self.predicted_memory / self.xla_memory if self.xla_memory else None}


def calibrate(model: str, mesh: str, schedule: str, *, overrides: dict[str, str] | None = None,
              optimizer: str = "adamw", constrain: bool = True, plain_layer_norm: bool = True) -> Calibration:
    """`constrain`: also give XLA the plan's constraints on activations and gradients (module outputs and
    inputs, parameters' reads, calls inside forwards, the model's output: what `auto_shard` applies), so that
    GSPMD partitions the activations as the plan does instead of by its own heuristics. `plain_layer_norm`: run
    `nn.LayerNorm` as reductions (see `backends.xla`), not as torch_xla's batch-norm lowering."""
    from partir_torch import workload
    from partir_torch.capture import capture
    from partir_torch.tactics import apply_schedule

    m = Mesh.parse(mesh)
    net, inputs, loss_fn = workload.load(model, overrides, device="meta")
    program = capture(net, inputs, loss_fn, optimizer)
    state = apply_schedule(program, m, schedule)
    report = evaluate(state, hardware("cpu-virtual"))
    predicted = {k: sum(v.values()) for k, v in report.comm_bytes.items()}
    as_cpu: dict[str, int] = defaultdict(int)
    for k, b in predicted.items():
        as_cpu["all-reduce" if k == "reduce-scatter" else k] += b
    sp = specs(state)
    bare = PlanSpecs(sp.params, sp.inputs, sp.optimizer_state)  # parameters, inputs and states only
    step = run_step(model, m, sp if constrain else bare,
                    overrides=overrides, optimizer=optimizer, plain_layer_norm=plain_layer_norm)
    xla: dict[str, int] = defaultdict(int)
    for c in step.collectives:
        xla[c.kind] += c.bytes
    return Calibration(model, mesh, schedule, predicted, dict(as_cpu), dict(xla), report.peak_memory_bytes,
                       step.memory_total, step.loss, step.compile_s, step.memory_breakdown, constrain,
                       plain_layer_norm)
