"""What a rank really runs: its collectives counted by kind and mesh axis as they are issued, its peak memory,
and the step's numerics against the unsharded step; `verify` holds them against the plan's prediction.

Collectives are counted by a dispatch mode on the functional collective ops the rank graph issues (bytes
per device in `lower`'s form: all-gather its output, the others their input); `CommDebugMode` cross-checks
the counts in the tests. Memory: `torch.cuda.max_memory_allocated` on a GPU; elsewhere the live bytes of
the rank's tensors (`torch.distributed._tools.mem_tracker.MemTracker`: every tensor storage, freed when
its last reference goes), the inputs it holds (parameters, states, the batch's part) included.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from partir_torch import _compat
from partir_torch.backends.distributed.engine import Sharded, check_batch, rank_inputs
from partir_torch.lower import lower, summarize

COLLECTIVE_OPS = {"all_gather_into_tensor": "all-gather", "reduce_scatter_tensor": "reduce-scatter",
                  "all_reduce": "all-reduce", "all_reduce_": "all-reduce", "all_to_all_single": "all-to-all"}


class CountCollectives(_compat.TorchDispatchMode):
    """Counts the functional collectives run under it: [(kind, axis, bytes per device)]."""

    def __init__(self, axis_of: dict[str, str]) -> None:
        super().__init__()
        self.axis_of, self.seen = axis_of, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, _, name = func._schema.name.partition("::")
        if ns == "_c10d_functional" and name in COLLECTIVE_OPS:
            x = args[0]
            nbytes = x.numel() * x.element_size()
            if name == "all_gather_into_tensor":
                nbytes *= args[1]
            self.seen.append((COLLECTIVE_OPS[name], self.axis_of.get(args[-1], args[-1]), nbytes))
        return func(*args, **kwargs)

    def summary(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for kind, axis, nbytes in self.seen:
            out[kind][axis] += nbytes
        return {k: dict(v) for k, v in out.items()}


@dataclass
class RankRun:
    """One rank's measured step."""

    comm_bytes: dict[str, dict[str, int]]  # kind -> axis -> bytes per device
    count: dict[str, int]  # kind -> collectives issued
    peak_memory_bytes: int
    loss: float | None
    outputs: list[torch.Tensor] = field(default_factory=list, repr=False)
    collectives: list[tuple[str, str, int]] = field(default_factory=list)  # (kind, axis, bytes) as run, in order


def axis_of_groups(rec: Sharded) -> dict[str, str]:
    return {g.group_name: a for a, g in rec.rank_mesh.groups.items()}


def run_once(rec: Sharded, model, optimizer, batch, *, local: bool = False) -> RankRun:
    """One step of the rank graph, eagerly, on copies of the rank's parameters and states (the model is not
    changed): its collectives and its peak memory."""
    MemTracker = _compat.MemTracker
    check_batch(rec.state.program, rec.state, rec.rank_mesh, batch, local)
    graph = rec.graph if not rec.compiled else rec.graph._orig_mod
    flat = [t.clone() for t in rank_inputs(rec, model, optimizer, batch, local=local)]
    counter = CountCollectives(axis_of_groups(rec))
    dev = rec.rank_mesh.device
    with torch.no_grad():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            with counter:
                outs = graph(*flat)
            peak = torch.cuda.max_memory_allocated(dev) - base + sum(t.nbytes for t in flat)
        else:
            tracker = MemTracker()
            tracker.track_external(*flat)
            with tracker, counter:
                outs = graph(*flat)
            snap = tracker.get_tracker_snapshot("peak")
            peak = int(sum(d.get("Total", 0) for d in snap.values()))
    count: dict[str, int] = defaultdict(int)
    for kind, _, _ in counter.seen:
        count[kind] += 1
    loss = float(outs[0]) if rec.state.program.loss is not None else None
    return RankRun(counter.summary(), dict(count), peak, loss, list(outs), list(counter.seen))


def predicted(rec: Sharded) -> dict[str, dict[str, int]]:
    """The plan's collectives on this program (`lower`), kind -> axis -> bytes per device."""
    return {k: dict(v) for k, v in summarize(lower(rec.state)).items()}


def predicted_calls(rec: Sharded) -> dict[tuple[str, str], int]:
    """The calls the rank program makes per (kind, axis): `lower`'s collectives, a planned bucket's members
    (`lower/buckets.py`) one call a bucket."""
    calls = Counter((c.kind, c.axis) for c in lower(rec.state))
    for b in rec.program.buckets_plan:
        calls[(b.kind, b.axis)] += 1 - len(b.members)
    return dict(calls)


def compare(rec: Sharded, run: RankRun, hardware: str | None = None) -> dict[str, Any]:
    """Predicted against measured: bytes and calls per kind and axis, the collectives the plan does not list,
    memory."""
    from partir_torch.cost.hardware import hardware as preset
    from partir_torch.cost.model import evaluate

    pred = predicted(rec)
    cap = rec.program.bucket_cap
    report = evaluate(rec.state, preset(hardware or rec.hardware or rec.plan.hardware or "cpu-virtual",
                                        **({"bucket_cap": cap} if cap else {})))
    calls, ran = predicted_calls(rec), Counter((kind, axis) for kind, axis, _ in run.collectives)
    rows = []
    for kind in sorted(set(pred) | set(run.comm_bytes)):
        for axis in sorted(set(pred.get(kind, {})) | set(run.comm_bytes.get(kind, {}))):
            p, m = pred.get(kind, {}).get(axis, 0), run.comm_bytes.get(kind, {}).get(axis, 0)
            rows.append({"kind": kind, "axes": [axis], "predicted": p, "measured": m,
                         "predicted_calls": calls.get((kind, axis), 0), "measured_calls": ran[(kind, axis)]})
    unexpected = [{"kind": r["kind"], "axes": r["axes"], "count": 0, "bytes": r["measured"]}
                  for r in rows if r["measured"] and not r["predicted"]]
    return {"by_axis": rows, "unexpected": unexpected, "predicted_peak": int(report.peak_memory_bytes),
            "memory_by_role": report.memory_by_role, "measured_peak": run.peak_memory_bytes}
