"""`verify` on the torch backend: run the rank program on copies of the model's shards and hold what it ran
against the plan (`measure.py`), in `backends.verify.VerifyReport`'s form; with `steps`, also the losses
and parameters of `steps` steps against the unsharded step (`Program.run`) from the same start.

Every rank runs it (its collectives are real); each reports its own rank's figures.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from partir_torch.backends.distributed import engine, measure
from partir_torch.backends.verify import VerifyReport


def verify(model, example_inputs, *, steps: int = 0, local: bool = False) -> VerifyReport:
    rec = engine.require(model)
    opt = rec.optimizer
    batch = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    run = measure.run_once(rec, model, opt, batch, local=local)
    cmp = measure.compare(rec, run)
    pred: dict[str, int] = defaultdict(int)
    meas: dict[str, int] = defaultdict(int)
    for r in cmp["by_axis"]:
        pred[r["kind"]] += r["predicted"]
        meas[r["kind"]] += r["measured"]
    counts = [{"kind": k, "axes": [], "count": n, "bytes": meas[k]} for k, n in sorted(run.count.items())]
    report = VerifyReport(
        dict(rec.rank_mesh.mesh.axes),
        {"comm_bytes": dict(pred), "peak_memory_bytes": cmp["predicted_peak"]},
        {"comm_bytes": dict(meas), "peak_memory_bytes": cmp["measured_peak"], "collectives": counts,
         "memory_breakdown": cmp["memory_by_role"]},
        unexpected_collectives=cmp["unexpected"], by_axis=cmp["by_axis"], engine="torch",
        notes=[f"rank {rec.rank_mesh.rank} of {rec.rank_mesh.world} (torch backend, {rec.rank_mesh.device.type}): "
               "collectives counted as the rank program issued them, memory the live bytes of its tensors"])
    if steps:
        losses, ref, diff, rel = numerics(rec, model, opt, batch, steps, local=local)
        report.losses, report.reference_losses = losses, ref
        report.max_abs_diff, report.max_rel_diff = diff, rel
    return report


def numerics(rec: engine.Sharded, model, optimizer, batch, steps: int, *, local: bool = False
             ) -> tuple[list[float], list[float], float, float]:
    """(losses, unsharded losses, max |difference| of the updated values, relative) over `steps` steps run
    on copies, sharded (the rank graph) and unsharded (`Program.run` on the whole values)."""
    prog, rm = rec.state.program, rec.rank_mesh
    flat = [t.clone() for t in engine.rank_inputs(rec, model, optimizer, batch, local=local)]
    ids = prog._placeholder_ids()
    whole = {v: _whole(t, v, rec) for v, t in zip(ids, flat)}
    if local:
        whole.update({v: b.to(rm.device) for v, b in zip(prog.inputs, _global(batch, rec))})
    else:
        whole.update({v: b.to(rm.device) for v, b in zip(prog.inputs, batch)})
    losses, ref = [], []
    graph = rec.graph
    pos = {v: i for i, v in enumerate(ids)}
    with torch.no_grad():
        for _ in range(steps):
            outs = graph(*flat)
            if prog.loss is not None:
                losses.append(float(outs[0]))
            for (_new, old), t in zip(prog.updates.items(), outs[1 if prog.loss is not None else 0:]):
                flat[pos[old]] = t
            got = _run_unsharded(prog, whole)
            if prog.loss is not None:
                ref.append(float(got[prog.loss]))
            for new, old in prog.updates.items():
                whole[old] = got[new]
    diff = rel = 0.0
    for old in prog.updates.values():
        mine = _whole(flat[pos[old]], old, rec)
        d = (mine.double() - whole[old].double()).abs().max().item() if mine.numel() else 0.0
        diff = max(diff, d)
        rel = max(rel, d / max(1.0, whole[old].double().abs().max().item() if mine.numel() else 1.0))
    return losses, ref, diff, rel


def _whole(t: torch.Tensor, v: int, rec: engine.Sharded) -> torch.Tensor:
    """The whole value `v` from every rank's part `t` (an all-gather over the world: verify only)."""
    import torch.distributed as dist

    sh = rec.state.shard[v]
    if not any(sh.dims):  # (a copy: the sharded step writes its updates over its inputs)
        return t.clone()
    val = rec.state.program.values[v]
    parts = [torch.empty_like(t) for _ in range(rec.rank_mesh.world)]
    dist.all_gather(parts, t.contiguous())
    from partir_torch.backends.distributed.reshard import coords
    from partir_torch.lower.local import region

    out = torch.empty(val.shape, dtype=t.dtype, device=t.device)
    for c, part in zip(coords(rec.rank_mesh.mesh), parts):
        out[tuple(r.to(t.device) if isinstance(r, torch.Tensor) else r
                  for r in region(rec.rank_mesh.mesh, sh, val.shape, c))] = part
    return out


def _global(batch, rec: engine.Sharded) -> list[torch.Tensor]:
    prog = rec.state.program
    return [_whole(b.to(rec.rank_mesh.device), v, rec) for b, v in zip(batch, prog.inputs)]


def _run_unsharded(prog, whole: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    params = {n: whole[v] for n, v in prog.params.items()}
    buffers = {n: whole[v] for n, v in prog.buffers.items()}
    states = {p: {s: whole[v] for s, v in st.items()} for p, st in prog.opt_states.items()}
    inputs = [whole[v] for v in prog.inputs]
    return prog.run(params, buffers, inputs, states, {h: float(whole[v]) for h, v in prog.hypers.items()})
