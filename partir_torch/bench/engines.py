"""The zoo through both engines: every expert and the found plan run for real, priced from what they moved.

Per zoo model (tiny sizes, a global batch of 16 so every batch-parallel axis divides it) and 8-device mesh
(`MESHES`), the model is captured once and planned under a memory limit of `MEMORY` x the peak of the
replicated step (at these sizes replication is otherwise the best plan on any hardware: the launch floor of
every op outweighs any saving, so the limit is what makes the comparison one of shardings, as a large model's
HBM does). The plans: every expert schedule of `scenarios.experts` (the model axis `model`, the others batch
axes) and the search's plan for each target hardware (`HARDWARE`), each with that limit; plans with the same
actions are run once.

Each distinct plan runs one training step through
- the torch backend on gloo ranks (one process per device): the rank program's collectives as they run, by
  kind and axis, and each rank's peak live bytes (`backends/distributed/measure.py`);
- torch_xla SPMD in a fresh process (`backends/verify.py`): the compiled HLO's collectives by kind and mesh
  axes, and XLA's buffer assignment's peak;
and torch_xla's own auto-sharding (`xr.use_spmd(auto=True)`) runs the plain step once per model and mesh.

A row's *measured step* for a hardware is the cost model's compute for the plan on it plus the time of every
collective the engine ran, at that hardware's bandwidth and latency on the collective's axes
(`cost.report.transfer_time`, the cost model's own formula): what the engine moved, not what was predicted.
"""

from __future__ import annotations

import math
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

MODELS = ("tiny-mlp", "tiny-gpt2", "tiny-llama", "tiny-gns", "tiny-moe", "tiny-vit", "tiny-unet")
MESHES = ("batch=8", "batch=2,model=4", "batch=2,model=2,x=2")
QUICK_MODELS, QUICK_MESHES = ("tiny-mlp", "tiny-gpt2"), ("batch=8",)
HARDWARE = ("h100-sxm", "tpu-v5p")
MEMORY = 0.5  # each plan's per-device memory limit, as a fraction of the replicated step's peak
BATCH = {"tiny-gns": {}}  # the GNS's 16 nodes and 48 edges divide 8 as they are
BYTES_BAR = {"torch": 0.01, "torch_xla": 0.10}  # measured over predicted bytes, the bar per engine


def overrides(name: str) -> dict[str, str]:
    return BATCH.get(name, {"batch": "16"})


@dataclass
class Candidate:
    """One distinct plan of a model on a mesh: the names it goes by, its plan, and per hardware its prediction."""

    names: list[str]
    schedule: str
    plan: Any  # ShardingPlan
    state: Any = field(repr=False)  # ShardingState
    predicted: dict[str, dict[str, Any]] = field(default_factory=dict)  # hardware -> cost-model figures
    measured: dict[str, dict[str, Any]] = field(default_factory=dict)  # engine -> collectives, peak, error


def _figures(report) -> dict[str, Any]:
    return {"step_s": report.step_time_s, "compute_s": report.compute_time_s,
            "comm_s": dict(report.comm_time_by_axis), "peak": int(report.peak_memory_bytes),
            "feasible": bool(report.feasible)}


def plans(name: str, mesh_text: str, episodes: int, memory: float = MEMORY
          ) -> tuple[list[Candidate], dict[str, float], Any, dict[str, str]]:
    """The distinct plans of `name` on `mesh_text`, the memory limit per hardware, the replicated state, and
    the experts that could not apply (with why)."""
    from partir_torch.bench.scenarios import experts
    from partir_torch.capture import capture
    from partir_torch.cost import evaluate, hardware
    from partir_torch.errors import PartirError
    from partir_torch.ir.mesh import parse_mesh
    from partir_torch.options import Options
    from partir_torch.search.api import Auto, SearchConfig, plan_program
    from partir_torch.tactics import apply_schedule, parse_schedule
    from partir_torch.workload import load

    mesh, dcn = parse_mesh(mesh_text)
    model, inputs, loss_fn = load(name, overrides(name), device="meta")
    program = capture(model, inputs, loss_fn, "adamw", fold=True)
    replicated = apply_schedule(program, mesh, [])
    limits = {hw: memory * evaluate(replicated, hardware(hw)).peak_memory_bytes for hw in HARDWARE}
    found: dict[tuple[str, ...], Candidate] = {}
    failed: dict[str, str] = {}

    def add(label: str, schedule: str, tactics: list, hw: str, budget: int) -> None:
        config = SearchConfig.of(Options(hardware=hw, budget=budget, progress=False, memory=limits[hw]), dcn)
        plan, state = plan_program(program, mesh, tactics, config, schedule=schedule, fallback=False, cache=False,
                                   need_state=True)
        key = tuple(plan.decisions)
        if key in found:
            found[key].names.append(label)
        else:
            found[key] = Candidate([label], schedule, plan, state)

    model_axis = "model" if "model" in mesh.names else mesh.names[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (an expert a model cannot take changes nothing: a duplicate plan)
        for label, schedule in experts(list(mesh.names), dcn, model=model_axis).items():
            try:
                add(label, schedule, parse_schedule(schedule, mesh), HARDWARE[0], 1)
            except PartirError as e:  # a schedule this program cannot take: said in the log, no row
                failed[label] = f"{type(e).__name__}: {e}"[:300]
        for hw in HARDWARE:
            add(f"found {hw}", "*:Auto", [Auto()], hw, episodes)
    out = list(found.values())
    for c in out:
        c.predicted = {hw: _figures(evaluate(c.state, hardware(hw), dcn_axes=dcn, memory_limit=limits[hw]))
                       for hw in HARDWARE}
    return out, limits, replicated, failed


# ---------------------------------------------------------------- the engines

def _torch_rank(rank: int, world: int, mesh_text: str, jobs: list[tuple[str, dict]]) -> list[dict[str, Any]]:
    """Every job's one step on this rank: [{collectives: [[kind, axes, count, bytes]], peak, error}]."""
    import torch

    import partir_torch
    from partir_torch.backends.distributed import engine, measure
    from partir_torch.plan import ShardingPlan
    from partir_torch.workload import load

    out = []
    for name, plan_json in jobs:
        try:
            torch.manual_seed(0)
            model, inputs, loss_fn = load(name, overrides(name), device="cpu")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, opt = partir_torch.auto_shard(model, inputs, mesh_text, loss_fn=loss_fn, optimizer=opt,
                                                     backend="torch", plan=ShardingPlan.from_json(plan_json),
                                                     progress=False, hardware="cpu-virtual")
            run = measure.run_once(engine.sharded(model), model, opt, inputs)
            partir_torch.unshard(model)
            groups: dict[tuple[str, str], list[int]] = {}
            for kind, axis, nbytes in run.collectives:
                groups.setdefault((kind, axis), []).append(nbytes)
            out.append({"collectives": [[k, [a], len(b), sum(b)] for (k, a), b in sorted(groups.items())],
                        "peak": run.peak_memory_bytes})
        except Exception as e:  # the row says so; every rank fails alike (the same plan, the same checks)
            out.append({"error": f"{type(e).__name__}: {e}"[:300], "trace": traceback.format_exc()[-800:]})
    return out


def run_torch(mesh_text: str, jobs: list[tuple[str, dict]], ranks=None) -> list[dict[str, Any]]:
    """`jobs` ((model, plan JSON)) through the torch backend on gloo ranks; the peak is the largest rank's."""
    from partir_torch.ir.mesh import parse_mesh
    from partir_torch.launch import Workers

    def run(w) -> list[dict[str, Any]]:
        per_rank = w.run(_torch_rank, mesh_text, jobs)
        rows = per_rank[0]
        for i, r in enumerate(rows):
            if "peak" in r:
                r["peak"] = max(p[i].get("peak", 0) for p in per_rank)
        return rows

    if ranks is not None:
        return run(ranks)
    with Workers(parse_mesh(mesh_text)[0].devices, timeout=7200) as w:
        return run(w)


def run_xla(name: str, plan) -> dict[str, Any]:
    """One step of `plan` compiled by torch_xla: the HLO's collectives [kind, axes, count, bytes] and peak."""
    from partir_torch.backends.verify import verify_workload

    try:
        rep = verify_workload(plan, name, overrides(name))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[-300:]}
    return {"collectives": [[r["kind"], list(r["axes"]), r["count"], r["bytes"]] for r in rep.measured["collectives"]],
            "peak": rep.measured["peak_memory_bytes"], "by_axis": rep.by_axis,
            # the plan's bytes in XLA's form: one collective over several axes where the plan sums over them
            "predicted_total": sum(rep.predicted["comm_bytes"].values())}


def run_xla_auto(name: str, plan) -> dict[str, Any]:
    """The plain step under torch_xla's own auto-sharding, on `plan`'s devices."""
    from partir_torch.backends import xla_worker

    try:
        step = xla_worker.run(plan, {"workload": name, "overrides": overrides(name)}, optimizer="adamw", auto=True)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[-300:]}
    groups: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for c in step.collectives:
        groups.setdefault((c.kind, tuple(c.axes)), []).append(c.bytes)
    return {"collectives": [[k, list(a), len(b), sum(b)] for (k, a), b in sorted(groups.items())],
            "peak": step.memory_total}


# ---------------------------------------------------------------- pricing and verdicts

def priced(collectives: list, mesh: dict[str, int], hw, dcn: frozenset[str] = frozenset()) -> dict[str, float]:
    """Seconds per mesh-axes label of the collectives an engine ran, at `hw`'s bandwidth on their axes."""
    from partir_torch.cost.report import transfer_time

    out: dict[str, float] = {}
    for kind, axes, count, nbytes in collectives:
        n = math.prod(mesh[a] for a in axes)
        slow = any(a in dcn for a in axes)
        t = transfer_time(kind, nbytes, n, hw.dcn_bandwidth if slow else hw.link_bandwidth,
                          hw.dcn_latency if slow else hw.link_latency, count)
        out[",".join(axes)] = out.get(",".join(axes), 0.0) + t
    return out


def predicted_bytes(c: Candidate) -> dict[str, dict[str, int]]:
    from partir_torch.lower import lower, summarize

    return {k: dict(v) for k, v in summarize(lower(c.state)).items()}


def bytes_ratio(c: Candidate, engine: str) -> float | None:
    """Measured over predicted bytes, all collectives together (1.0 when neither moves any)."""
    m = c.measured.get(engine, {})
    if "collectives" not in m:
        return None
    measured = sum(r[3] for r in m["collectives"])
    predicted = m.get("predicted_total", sum(b for per in predicted_bytes(c).values() for b in per.values()))
    return 1.0 if measured == predicted == 0 else measured / max(predicted, 1)


def run_one(name: str, mesh_text: str, episodes: int, engines: tuple[str, ...], ranks=None,
            log=print, memory: float = MEMORY) -> dict[str, Any]:
    """Plan, run and price one model on one mesh: the JSON row of `engines.json`."""
    from partir_torch.cost import evaluate, hardware
    from partir_torch.ir.mesh import parse_mesh

    t = time.perf_counter()
    cands, limits, replicated, failed = plans(name, mesh_text, episodes, memory)
    log(f"{name} on {mesh_text}: {len(cands)} distinct plans in {time.perf_counter() - t:.1f} s")
    mesh, dcn = parse_mesh(mesh_text)
    if "torch" in engines:
        t = time.perf_counter()
        for c, got in zip(cands, run_torch(mesh_text, [(name, c.plan.to_json()) for c in cands], ranks)):
            c.measured["torch"] = got
        log(f"  torch: {time.perf_counter() - t:.0f} s")
    auto: dict[str, Any] | None = None
    if "torch_xla" in engines:
        t = time.perf_counter()
        for c in cands:
            c.measured["torch_xla"] = run_xla(name, c.plan)
        auto = run_xla_auto(name, cands[0].plan)
        log(f"  torch_xla: {time.perf_counter() - t:.0f} s")
    row: dict[str, Any] = {"model": name, "overrides": overrides(name), "mesh": mesh_text, "memory": memory,
                           "limits": limits,
                           "plans": [], "engines": list(engines), "failed": failed}
    axes = dict(mesh.axes)
    for c in cands:
        entry = {"names": c.names, "schedule": c.schedule, "actions": c.plan.decisions, "predicted": c.predicted,
                 "predicted_bytes": predicted_bytes(c), "measured": {}}
        for engine, m in c.measured.items():
            got = {k: v for k, v in m.items() if k != "by_axis"}
            if "collectives" in m:
                got["bytes_ratio"] = bytes_ratio(c, engine)
                got["comm_s"] = {hw: priced(m["collectives"], axes, hardware(hw), dcn) for hw in HARDWARE}
                got["step_s"] = {hw: c.predicted[hw]["compute_s"] + sum(got["comm_s"][hw].values())
                                 for hw in HARDWARE}
            entry["measured"][engine] = got
        row["plans"].append(entry)
    if auto is not None:
        rep = {hw: evaluate(replicated, hardware(hw)) for hw in HARDWARE}
        if "collectives" in auto:
            auto["step_s"] = {hw: rep[hw].compute_time_s + sum(priced(auto["collectives"], axes, hardware(hw),
                                                                      dcn).values()) for hw in HARDWARE}
        auto["replicated_peak"] = {hw: int(rep[hw].peak_memory_bytes) for hw in HARDWARE}
        row["xla_auto"] = auto
    row["verdicts"] = verdicts(row)
    return row


def verdicts(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Per engine and hardware: the found plan's measured step against the best expert that fits (its
    prediction fits the limit and its measured peak does too), and why where the found plan is slower."""
    out = []
    for engine in row["engines"]:
        for hw in HARDWARE:
            def fits(p: dict[str, Any], engine=engine, hw=hw) -> bool:
                m = p["measured"].get(engine, {})
                return (p["predicted"][hw]["feasible"] and "step_s" in m and m["peak"] is not None
                        and m["peak"] <= row["limits"][hw])

            found = next(p for p in row["plans"] if f"found {hw}" in p["names"])
            experts = [p for p in row["plans"] if any(not n.startswith("found") for n in p["names"])]
            fitting = [p for p in experts if fits(p)]
            v: dict[str, Any] = {"engine": engine, "hardware": hw, "found_fits": fits(found),
                                 "experts_fitting": len(fitting), "experts": len(experts)}
            fm = found["measured"].get(engine, {})
            if "step_s" in fm and not v["found_fits"]:
                pred, peak = found["predicted"][hw], fm["peak"]
                v["memory"] = (f"the found plan measures {peak / 1024:.0f} KiB, over the limit "
                               f"{row['limits'][hw] / 1024:.0f} KiB (predicted {pred['peak'] / 1024:.0f} KiB)"
                               if pred["feasible"] else f"the search found no plan within the limit "
                               f"{row['limits'][hw] / 1024:.0f} KiB (its plan: {pred['peak'] / 1024:.0f} KiB)")
            if "step_s" not in fm:
                v["why"] = f"the found plan did not run: {fm.get('error', 'not measured')}"
            elif fitting:
                best = min(fitting, key=lambda p: p["measured"][engine]["step_s"][hw])
                bm = best["measured"][engine]["step_s"][hw]
                v |= {"found_s": fm["step_s"][hw], "best": next(n for n in best["names"] if not n.startswith("found")),
                      "best_s": bm, "ratio": fm["step_s"][hw] / bm}
                if best is found:
                    v["ratio"] = 1.0
                if v["ratio"] > 1.0:
                    v["why"] = _why(found, best, engine, hw)
            out.append(v)
    return out


def _kinds(collectives: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, _axes, _count, nbytes in collectives:
        out[kind] = out.get(kind, 0) + nbytes
    return out


def _why(found: dict, best: dict, engine: str, hw: str) -> str:
    """The reason a found plan measures slower than an expert: the cost model already ranked them so (the
    search's margin or budget), or the engine ran other collectives than predicted (which kinds, how much)."""
    fp, bp = found["predicted"][hw]["step_s"], best["predicted"][hw]["step_s"]
    if fp > bp:
        return (f"predicted too: {fp * 1e3:.3f} vs {bp * 1e3:.3f} ms (the search keeps an action only when it "
                f"buys 0.5 % of the step; within its budget it found no better)")
    parts = []
    for name, p in (("found", found), ("expert", best)):
        ran = _kinds(p["measured"][engine]["collectives"])
        pred = {k: sum(v.values()) for k, v in p["predicted_bytes"].items() if sum(v.values())}
        if ran != pred:
            parts.append(f"{name} ran " + (", ".join(f"{k} {b / 1024:.1f} KiB" for k, b in sorted(ran.items()))
                                           or "nothing") + " where the plan has "
                         + (", ".join(f"{k} {b / 1024:.1f} KiB" for k, b in sorted(pred.items())) or "nothing"))
    if engine == "torch_xla" and any("reduce-scatter" in p["predicted_bytes"] for p in (found, best)):
        parts.append("XLA's CPU pipeline runs a reduce-scatter as an all-reduce, twice its time "
                     "(docs/cost-model.md item 1)")
    return (f"predicted faster ({fp * 1e3:.3f} vs {bp * 1e3:.3f} ms), measured slower: "
            + ("; ".join(parts) or "the same collectives in another grouping"))


def run(models=MODELS, meshes=MESHES, episodes: int = 200, engines=("torch", "torch_xla"), log=print,
        on_row=None) -> list[dict[str, Any]]:
    """Every model on every mesh (the torch backend's ranks started once per mesh); `on_row(rows)` after each."""
    from contextlib import nullcontext

    from partir_torch.ir.mesh import parse_mesh
    from partir_torch.launch import Workers

    rows: list[dict[str, Any]] = []
    for mesh_text in meshes:
        ranks = (Workers(parse_mesh(mesh_text)[0].devices, timeout=7200) if "torch" in engines else nullcontext())
        with ranks as w:
            for name in models:
                rows.append(run_one(name, mesh_text, episodes, engines, w, log))
                if on_row is not None:
                    on_row(rows)
    return rows
