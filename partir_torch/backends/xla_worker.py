"""Compile and run training steps under a plan in a fresh torch_xla process, with XLA's HLO dump on.

XLA reads `XLA_FLAGS` (the dump) and `CPU_NUM_DEVICES` once, when its runtime starts, so each job gets a
fresh process and its own dump directory; the caller's own `XLA_FLAGS` come first (the dump's last), and
the runtime starts through `xla.start_runtime`, as in users' processes (the scheduler it chooses on the
CPU). The job applies the plan with the same functions `auto_shard` uses (`backends.xla.shard_module`,
`shard_optimizer`, `shard_batch`): what is measured is what users run.

A job's model comes from a zoo name / `file.py:factory` (`workload.load`, on the CPU) or from a file that
`cloudpickle` wrote (a user's model, inputs, loss and optimizer: `verify` on any model). A model built on
meta is materialized on the XLA device by `shard_module` (each module's `reset_parameters`); the unsharded
reference of `numerics` then starts from the same values, copied back to the CPU.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from partir_torch.backends.hlo import (
    DonatedCopies,
    HloCollective,
    find_step_module,
    read_collectives,
    read_donated_copies,
    read_memory_breakdown,
    read_memory_total,
)
from partir_torch.backends.xla import XlaError
from partir_torch.ir.mesh import Mesh
from partir_torch.plan import PlanSpecs, ShardingPlan

# the optimizers of jobs named by kind (the calibration's and the CLI's)
OPTIMIZERS = {"sgd": ("SGD", {"lr": 1e-2, "momentum": 0.9}), "adam": ("Adam", {"lr": 1e-3}),
              "adamw": ("AdamW", {"lr": 1e-3})}


@dataclass
class XlaStep:
    loss: float
    collectives: list[HloCollective]
    memory_total: int | None
    hlo_path: str | None  # the step's HLO text, when its dump was kept (`dump_dir` given)
    compile_s: float
    params_after: dict[str, list] | None = None
    memory_breakdown: dict[str, int] | None = None
    losses: list[float] | None = None
    reference_losses: list[float] | None = None
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    state_shardings: dict[str, str] | None = None
    donated_copies: DonatedCopies | None = None


def run(plan: ShardingPlan, source: dict[str, Any], *, optimizer: str | None = None, steps: int = 1,
        numerics: bool = False, seed: int = 0, lowerings: dict[str, bool] | None = None,
        return_params: bool = False, timeout: float = 900, dump_dir: str | None = None,
        auto: bool = False) -> XlaStep:
    """Run `steps` training steps of the model of `source` ({"workload": spec, "overrides": {...}} or
    {"pickle": path}) under `plan` in a fresh torch_xla process; read the step's partitioned HLO. The dump
    (tens of MiB a step) is deleted once read, unless it goes under the caller's `dump_dir`. `auto`: the plain
    step under torch_xla's own auto-sharding (`xr.use_spmd(auto=True)`) instead of the plan (its mesh only
    names the devices and the axes the collectives are read over)."""
    mesh = Mesh.of(plan.mesh)
    dump = tempfile.mkdtemp(prefix="partir-xla-", dir=dump_dir)  # fresh: the largest module is the step
    try:
        return _run(plan, source, dump, mesh, optimizer=optimizer, steps=steps, numerics=numerics, seed=seed,
                    lowerings=lowerings, return_params=return_params, timeout=timeout, kept=dump_dir is not None,
                    auto=auto)
    finally:
        if dump_dir is None:
            shutil.rmtree(dump, ignore_errors=True)


def _run(plan: ShardingPlan, source: dict[str, Any], dump: str, mesh: Mesh, *, optimizer: str | None, steps: int,
         numerics: bool, seed: int, lowerings: dict[str, bool] | None, return_params: bool, timeout: float,
         kept: bool, auto: bool = False) -> XlaStep:
    job = {"source": source, "plan": plan.to_json(), "optimizer": optimizer, "steps": steps, "numerics": numerics,
           "seed": seed, "lowerings": lowerings or {}, "return_params": return_params, "auto": auto}
    path = os.pathsep.join(p for p in sys.path if p)  # the caller's modules (a pickled model's classes) import there
    env = {**os.environ, "PYTHONPATH": path, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(mesh.devices),
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text "
                        "--xla_dump_hlo_pass_re=^$".strip(),
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        res = subprocess.run([sys.executable, "-m", "partir_torch.backends.xla_worker", f.name], env=env,
                             capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(f.name)
    if res.returncode != 0:
        raise XlaError(f"the torch_xla worker failed for {source} on {mesh}:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    hlo, mem = find_step_module(dump)
    return XlaStep(out["loss"], read_collectives(hlo.read_text(), list(mesh.axes)),
                   read_memory_total(mem.read_text()) if mem else None, str(hlo) if kept else None, out["compile_s"],
                   out.get("params_after"), read_memory_breakdown(mem.read_text()) if mem else None,
                   out["losses"], out.get("reference_losses"), out.get("max_abs_diff"), out.get("max_rel_diff"),
                   out.get("state_shardings"), read_donated_copies(hlo.read_text(), _read(_assignment(hlo))))


def _assignment(hlo: Path) -> Path:
    """The buffer assignment XLA dumps beside a module's text."""
    return hlo.with_name(hlo.name.replace("after_optimizations.txt", "after_optimizations-buffer-assignment.txt"))


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def run_step(model: str, mesh: Mesh, specs: PlanSpecs, *, overrides: dict[str, str] | None = None,
             optimizer: str = "adamw", seed: int = 0, return_params: bool = False, plain_layer_norm: bool = True,
             timeout: float = 900) -> XlaStep:
    """One step of a zoo model under `specs` (the calibration's form; `run` takes a whole plan)."""
    given = {f.name: getattr(specs, f.name) for f in fields(specs)}  # (every spec a plan carries, by name)
    plan = ShardingPlan(dict(mesh.axes), cost={}, **{**given, "inputs": list(specs.inputs)})
    return run(plan, {"workload": model, "overrides": overrides or {}}, optimizer=optimizer, seed=seed,
               lowerings={"layer_norm": plain_layer_norm}, return_params=return_params, timeout=timeout)


def _optimizer(kind: str, model):
    import torch

    cls, hp = OPTIMIZERS[kind]
    return getattr(torch.optim, cls)(model.parameters(), **hp, foreach=False)


def reference_step(model: str, *, overrides: dict[str, str] | None = None, optimizer: str = "adamw", seed: int = 0
                   ) -> tuple[float, dict[str, list]]:
    """The same first step as a job of `run_step`, unsharded on the CPU in eager torch: (loss, first 64 values
    of every updated parameter)."""
    import torch

    from partir_torch import workload

    torch.manual_seed(seed)
    net, inputs, loss_fn = workload.load(model, overrides, device="cpu")
    opt = _optimizer(optimizer, net)
    loss = loss_fn(net, *inputs)
    loss.backward()
    opt.step()
    return float(loss.detach()), {n: p.detach().flatten()[:64].tolist() for n, p in net.named_parameters()}


def _load(job: dict[str, Any]):
    src = job["source"]
    if "pickle" in src:
        import cloudpickle

        with open(src["pickle"], "rb") as f:
            d = cloudpickle.load(f)
        return d["model"], tuple(d["inputs"]), d["loss_fn"], d["optimizer"]
    from partir_torch import workload

    model, inputs, loss_fn = workload.load(src["workload"], src.get("overrides"), device="cpu")
    return model, inputs, loss_fn, _optimizer(job["optimizer"] or "adamw", model)


def _reference(model, optimizer, values: dict[str, Any]):
    """An unsharded copy of (model, optimizer) holding `values` (the sharded model's start, on the CPU)."""
    import torch.nn as nn

    from partir_torch.backends.common import rebuild_optimizer
    from partir_torch.backends.common import slots as _slots

    names = {id(p): n for n, p in model.named_parameters()}
    ids = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    made: dict[int, Any] = {}
    for mod, attr, t, is_param in _slots(model):
        if id(t) not in made:
            v = values[ids[id(t)]].clone()
            made[id(t)] = nn.Parameter(v, t.requires_grad) if is_param else v
        setattr(mod, attr, made[id(t)])
    return model, rebuild_optimizer(optimizer, names, dict(model.named_parameters()), foreach=False)


def _auto(job: dict[str, Any], torch_xla, model, inputs, loss_fn) -> dict[str, Any]:
    """The plain step under torch_xla's auto-sharding: XLA chooses every tensor's sharding."""
    dev = torch_xla.device()
    model.to(dev)
    inputs = [x.to(dev) for x in inputs]
    opt = _optimizer(job["optimizer"] or "adamw", model)
    losses, t0, compile_s = [], time.perf_counter(), 0.0
    for i in range(job["steps"]):
        loss = loss_fn(model, *inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch_xla.sync()
        losses.append(float(loss.detach().cpu()))
        if i == 0:
            compile_s = time.perf_counter() - t0
    return {"loss": losses[0], "losses": losses, "compile_s": compile_s}


def _worker(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from partir_torch.backends import xla

    xla.start_runtime(int(os.environ["CPU_NUM_DEVICES"]))
    torch_xla, _, xr = xla.runtime._xla()
    if job.get("auto"):
        xr.use_spmd(auto=True)
    torch.manual_seed(job["seed"])
    model, inputs, loss_fn, optimizer = _load(job)
    if job.get("auto"):
        return _auto(job, torch_xla, model, inputs, loss_fn)
    plan = ShardingPlan.from_json(job["plan"])
    ref = copy.deepcopy((model, optimizer)) if job["numerics"] else None
    torch_xla.manual_seed(job["seed"])
    opt = xla.apply(model, optimizer, plan, lowerings=xla.Lowerings(**job["lowerings"]), loss_fn=loss_fn)
    start = {n: t.detach().cpu() for n, t in [*model.named_parameters(), *model.named_buffers()]} if ref else None
    losses, t0, compile_s = [], time.perf_counter(), 0.0
    for i in range(job["steps"]):
        losses.append(float(xla.train_step(model, opt, loss_fn, inputs).cpu()))
        if i == 0:
            compile_s = time.perf_counter() - t0
    params = dict(model.named_parameters())
    out: dict[str, Any] = {"loss": losses[0], "losses": losses, "compile_s": compile_s,
                           "state_shardings": {f"{n}.{s}": xla.sharding_of(t) for n, p in params.items()
                                               for s, t in opt.state[p].items() if getattr(t, "dim", lambda: 0)()}}
    if job.get("return_params"):
        out["params_after"] = {n: p.detach().cpu().flatten()[:64].tolist() for n, p in params.items()}
    if ref is not None:
        ref_model, ref_opt = _reference(*ref, start)
        ref_losses = []
        for _ in range(job["steps"]):
            loss = loss_fn(ref_model, *inputs)
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref_losses.append(float(loss.detach()))
        diffs = [(float((p.detach().cpu() - q.detach()).abs().max()), float(q.detach().abs().max()))
                 for (_, p), (_, q) in zip(params.items(), ref_model.named_parameters())]
        diffs += [(abs(a - b), abs(b)) for a, b in zip(losses, ref_losses)]
        out["reference_losses"] = ref_losses
        out["max_abs_diff"] = max(d for d, _ in diffs)
        out["max_rel_diff"] = max_relative(diffs)
    return out



REL_FLOOR = 1e-6  # an fp32 absolute tolerance: the scale below which a tensor counts as zero


def max_relative(diffs: list[tuple[float, float]]) -> float:
    """The largest of (max |sharded - unsharded|, max |unsharded|) pairs as a relative difference, each
    tensor's against its own largest magnitude, or `REL_FLOOR` for a tensor that stays about zero: a key
    projection's bias has a zero gradient in exact arithmetic, so both runs leave it at fp32 noise (6e-12)
    that differs by as much again, which is no difference in training (as `torch.testing.assert_close`'s atol)."""
    return max((d / max(m, REL_FLOOR) for d, m in diffs), default=0.0)

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(json.dumps(_worker(json.load(f))))
