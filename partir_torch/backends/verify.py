"""`verify`: compile the training step as `auto_shard` applies a plan, and hold XLA's partitioned program
against what the cost model predicted for it.

The step runs in a fresh torch_xla process with the HLO dump on (`xla_worker`); the per-device program's
collectives (kind, mesh axes, bytes per device) and its buffer assignment are read back (`hlo`). Reported
beside the prediction: bytes per collective kind, per-device memory (XLA's buffer-assignment total against
our liveness peak), and every collective of a kind (or over mesh axes) the plan did not predict.

XLA's CPU pipeline has no reduce-scatter (it all-reduces, then slices), so the comparison is in that form:
predicted reduce-scatter bytes count as all-reduce bytes (`docs/cost-model.md`, item 1). With `numerics`,
the same steps run unsharded on the CPU from the same start and the largest difference of the losses and
parameters is reported.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from partir_torch.cost.hardware import format_bytes
from partir_torch.errors import PartirError
from partir_torch.plan import ShardingPlan

# Collectives XLA's CPU pipeline inserts for its own reasons, by kind: shown beside the unexpected ones
# with the documented cause (docs/cost-model.md), not counted as the plan's.
KNOWN_CPU = {
    "collective-permute": "XLA CPU's re-layouts (fused QKV, idle-axis routing): docs/cost-model.md items 2 and 3",
}


@dataclass
class VerifyReport:
    mesh: dict[str, int]
    predicted: dict[str, Any]  # comm_bytes {kind: bytes per device} (XLA CPU's form), peak_memory_bytes
    measured: dict[str, Any]  # comm_bytes, peak_memory_bytes, collectives [{kind, axes, count, bytes}],
    # memory_breakdown, donated_copies {count, donated, peak_bytes} (`hlo.DonatedCopies`)
    unexpected_collectives: list[dict[str, Any]] = field(default_factory=list)
    known_deviations: list[dict[str, Any]] = field(default_factory=list)
    compile_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] | None = None
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    notes: list[str] = field(default_factory=list)
    # per (kind, mesh axes): {"kind", "axes", "predicted", "measured"} bytes per device, XLA CPU's form; the
    # prediction before fusion (a gather over two axes is a row per axis; XLA's is one row over both)
    by_axis: list[dict[str, Any]] = field(default_factory=list)
    engine: str = "xla"  # which engine measured: "xla" (its compiled HLO) or "torch" (the rank program)

    def ratio(self, kind: str) -> float | None:
        """measured / predicted bytes of one kind (None when both are zero)."""
        p, m = self.predicted["comm_bytes"].get(kind, 0), self.measured["comm_bytes"].get(kind, 0)
        return None if p == m == 0 else (m / p if p else float("inf"))

    @property
    def memory_ratio(self) -> float | None:
        m, p = self.measured["peak_memory_bytes"], self.predicted["peak_memory_bytes"]
        return m / p if m and p else None

    def to_json(self) -> dict[str, Any]:
        kinds = sorted(set(self.predicted["comm_bytes"]) | set(self.measured["comm_bytes"]))
        return {**asdict(self), "ratios": {k: self.ratio(k) for k in kinds}, "memory_ratio": self.memory_ratio}

    def table(self) -> str:
        """Predicted against measured, one row per collective kind and one for memory (rich, as text)."""
        from rich.console import Console
        from rich.table import Table

        how, col = (("as XLA compiled it (bytes per device; XLA CPU's form)", "measured (XLA)") if self.engine == "xla"
                    else ("as the torch backend's rank program ran it (bytes per device)", "measured (rank)"))
        t = Table(title=f"verify: the plan on {self.mesh} {how}")
        for c in ("", "predicted", col, "measured / predicted"):
            t.add_column(c, justify="right" if c else "left")
        kinds = sorted(set(self.predicted["comm_bytes"]) | set(self.measured["comm_bytes"]))
        for k in kinds:
            r = self.ratio(k)
            t.add_row(k, format_bytes(self.predicted["comm_bytes"].get(k, 0)),
                      format_bytes(self.measured["comm_bytes"].get(k, 0)), "-" if r is None else f"{r:.2f}")
        mr = self.memory_ratio
        t.add_row("peak memory", format_bytes(self.predicted["peak_memory_bytes"]),
                  format_bytes(self.measured["peak_memory_bytes"] or 0), "-" if mr is None else f"{mr:.2f}")
        con = Console(width=110, record=True, file=open(os.devnull, "w"))  # noqa: SIM115 (rich needs a file)
        con.print(t)
        lines = [con.export_text().rstrip()]
        if len(self.by_axis) > 1:
            rows = [f"{r['kind']} over {','.join(r['axes'])}: {format_bytes(r['predicted'])} predicted, "
                    f"{format_bytes(r['measured'])} measured"
                    + (f" ({r['measured'] / r['predicted']:.2f})" if r["predicted"] else "")
                    + (f", {r['measured_calls']} calls ({r['predicted_calls']} predicted)"
                       if "measured_calls" in r else "") for r in self.by_axis]
            lines.append("by mesh axis: " + "; ".join(rows))
        for u in self.unexpected_collectives:
            lines.append(f"UNEXPECTED: {u['count']} x {u['kind']} over {','.join(u['axes']) or '-'}: "
                         f"{format_bytes(u['bytes'])} (the plan predicts no {u['kind']} there)")
        for u in self.known_deviations:
            lines.append(f"known XLA CPU deviation: {u['count']} x {u['kind']} over {','.join(u['axes']) or '-'}: "
                         f"{format_bytes(u['bytes'])} ({u['cause']})")
        if not self.unexpected_collectives:
            lines.append("no collective the plan did not predict")
        if self.max_abs_diff is not None:
            lines.append(f"numerics over {len(self.losses)} steps: losses {[f'{x:.6f}' for x in self.losses]}, "
                         f"max |sharded - unsharded| {self.max_abs_diff:.3g} (relative {self.max_rel_diff:.3g})")
        lines += self.notes
        return "\n".join(lines)


def compare(plan: ShardingPlan, step) -> VerifyReport:
    """The report for one compiled step (`xla_worker.XlaStep`) of `plan`."""
    by_axis = plan.cost.get("comm_bytes_by_axis", {})
    predicted: dict[str, int] = defaultdict(int)
    axes_of: dict[str, set[str]] = defaultdict(set)
    # bytes in the engine's form (a sum over several axes one collective, `lower.fused`) when the plan has it
    fused = plan.cost.get("comm_bytes_fused")
    for kind, per in by_axis.items():
        k = "all-reduce" if kind == "reduce-scatter" else kind
        for axis, b in per.items():
            predicted[k] += b if fused is None else 0
            if b:
                axes_of[k].update(axis.split(","))
    for kind, b in (fused or {}).items():
        predicted["all-reduce" if kind == "reduce-scatter" else kind] += b
    measured: dict[str, int] = defaultdict(int)
    groups: dict[tuple[str, tuple[str, ...]], list[int]] = defaultdict(list)
    for c in step.collectives:
        measured[c.kind] += c.bytes
        groups[(c.kind, c.axes)].append(c.bytes)
    rows = [{"kind": k, "axes": list(ax), "count": len(bs), "bytes": sum(bs)} for (k, ax), bs in sorted(groups.items())]
    order = list(plan.mesh)
    pred_axis: dict[tuple[str, tuple[str, ...]], int] = defaultdict(int)
    for kind, per in by_axis.items():
        for axis, b in per.items():
            if b:
                axes = tuple(a for a in order if a in axis.split(","))
                pred_axis["all-reduce" if kind == "reduce-scatter" else kind, axes] += b
    meas_axis = {(k, tuple(a for a in order if a in ax)): sum(bs) for (k, ax), bs in groups.items()}
    per_axis = [{"kind": k, "axes": list(ax), "predicted": pred_axis.get((k, ax), 0),
                 "measured": meas_axis.get((k, ax), 0)} for k, ax in sorted(set(pred_axis) | set(meas_axis))]
    unexpected, known = [], []
    for r in rows:
        if r["bytes"] and not (set(r["axes"]) & axes_of.get(r["kind"], set())):
            if r["kind"] in KNOWN_CPU:
                known.append({**r, "cause": KNOWN_CPU[r["kind"]]})
            else:
                unexpected.append(r)
    notes = ["XLA's CPU pipeline emits no reduce-scatter: predicted reduce-scatters are counted as all-reduces "
             "(an all-reduce and a slice on the CPU; docs/cost-model.md item 1)"] if "reduce-scatter" in by_axis else []
    copies = getattr(step, "donated_copies", None)
    if copies is not None and copies.count:
        notes.append(f"XLA copies {copies.count} of the {copies.donated} buffers the step updates in place "
                     f"(parameters, optimizer states) and reads the copies: {format_bytes(copies.peak_bytes)} of "
                     f"its peak memory, which the cost model counts once (torch_xla donates the buffers unpaired; "
                     f"XLA pairs them with the step's outputs by size, most with another tensor's update; "
                     f"docs/cost-model.md item 5)")
    return VerifyReport(
        dict(plan.mesh),
        {"comm_bytes": dict(predicted), "peak_memory_bytes": plan.cost.get("peak_memory_bytes", 0)},
        {"comm_bytes": dict(measured), "peak_memory_bytes": step.memory_total, "collectives": rows,
         "memory_breakdown": step.memory_breakdown,
         "donated_copies": asdict(copies) if copies is not None else None},
        unexpected, known, step.compile_s, step.losses or [step.loss], step.reference_losses, step.max_abs_diff,
        step.max_rel_diff, notes, per_axis)


def verify(plan: ShardingPlan, model, example_inputs, *, loss_fn=None, optimizer=None, steps: int = 1,
           numerics: bool = False, seed: int = 0, timeout: float = 1800) -> VerifyReport:
    """Compile `steps` training steps of `model` (a user's module, sharded by `auto_shard` or not) under `plan`
    in a fresh torch_xla process and compare with the prediction. A model sharded by `auto_shard` brings its
    loss and optimizer; otherwise pass `loss_fn` and `optimizer` (a torch.optim instance or its kind)."""
    import torch

    from partir_torch.backends import xla_worker

    xs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    snapshot = _unsharded_copy(model)
    rec_loss, rec_opt = _recorded(model)
    loss_fn = loss_fn or rec_loss
    optimizer = optimizer or rec_opt
    if loss_fn is None:
        raise PartirError("verify needs the step's loss: pass loss_fn=..., or verify a model sharded by auto_shard")
    if optimizer is None or isinstance(optimizer, str):
        optimizer = xla_worker._optimizer(optimizer or plan.optimizer or "adamw", snapshot)
    elif any(id(p) not in {id(q) for q in snapshot.parameters()} for g in optimizer.param_groups for p in g["params"]):
        optimizer = _retarget(optimizer, model, snapshot)
    plan.check(snapshot, xs)
    import cloudpickle

    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        cloudpickle.dump({"model": snapshot, "inputs": [x.detach().cpu() for x in xs], "loss_fn": loss_fn,
                          "optimizer": optimizer}, f)
    try:
        step = xla_worker.run(plan, {"pickle": f.name}, steps=steps, numerics=numerics, seed=seed, timeout=timeout)
    finally:
        os.unlink(f.name)
    return compare(plan, step)


def verify_workload(plan: ShardingPlan, spec: str, overrides: dict[str, str] | None = None, *, steps: int = 1,
                    numerics: bool = False, seed: int = 0) -> VerifyReport:
    """`verify` for a zoo model or `file.py:factory` (the CLI's MODEL), built in the worker."""
    from partir_torch.backends import xla_worker

    step = xla_worker.run(plan, {"workload": spec, "overrides": overrides or {}}, optimizer=plan.optimizer or "adamw",
                          steps=steps, numerics=numerics, seed=seed)
    return compare(plan, step)


def _record(model):
    """What `auto_shard` did to `model` (None when it is not sharded, or torch_xla was never loaded)."""
    if "torch_xla" not in sys.modules:
        return None
    from partir_torch.backends import xla

    return xla.sharded(model)


def _recorded(model):
    rec = _record(model)
    return (rec.loss_fn, rec.optimizer) if rec else (None, None)


def _unsharded_copy(model):
    """`model` as the user built it, without what `auto_shard` added: a deep copy whose parameters and buffers
    are the caller's original tensors (meta or host) and whose module hooks are the user's own."""
    import copy

    rec = _record(model)
    if rec is None:
        return model
    memo: dict[int, Any] = {id(getattr(m, a)): t for m, a, t in rec.originals}
    memo[id(rec.plan)] = None
    ours = {h.id for h in rec.handles}
    clone = copy.deepcopy(model, memo)
    for m in clone.modules():
        for d in (m._forward_hooks, m._forward_pre_hooks, m._forward_hooks_with_kwargs,
                  m._forward_pre_hooks_with_kwargs, m._forward_hooks_always_called):
            for k in [k for k in d if k in ours]:
                del d[k]
    clone.__dict__.pop("partir_plan", None)
    return clone


def _retarget(optimizer, model, snapshot):
    """The user's optimizer (on `model`'s original parameters) rebuilt on the snapshot's, by name."""
    from partir_torch.backends.common import rebuild_optimizer

    rec = _record(model)
    names = dict(rec.names) if rec else {id(p): n for n, p in model.named_parameters()}
    return rebuild_optimizer(optimizer, names, dict(snapshot.named_parameters()))
