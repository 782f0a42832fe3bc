"""The torch backend's step beside PyTorch's own data-parallel engines, on the same model, ranks and batch.

    .venv/bin/python benchmarks/engine_torch.py [--ranks 4] [--mesh batch=2,model=2] [--models tiny-gpt2 ...]
        [--steps 6] [--out benchmarks/results/engine_torch.json]

Per model, on `--ranks` gloo CPU ranks (or NCCL GPUs where there are enough): the searched plan's rank
program eagerly and through `torch.compile`, then DDP and FSDP2 (`fully_shard`) on the whole batch split
over every rank, each trained `--steps` AdamW steps; the median step time after the first (compilation)
steps, and the first step's time. The searched plan is also checked: its collectives as predicted (bytes by
kind and axis), its loss beside DDP's. Prints a table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

CONFIGS = {"tiny-gpt2": {"batch": "8"}, "gpt2-small": {"layers": "2", "width": "256", "heads": "8", "vocab": "4096",
                                                       "seq": "64", "batch": "8"},
           "tiny-llama": {"batch": "8"}, "tiny-mlp": {}}


def _timed(fn, steps: int) -> tuple[list[float], float]:
    import torch.distributed as dist

    times, loss = [], 0.0
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        loss = float(fn())
        times.append(time.perf_counter() - t)
    return times, loss


def _record(out: dict, what: str, times: list[float], loss: float) -> None:
    out[f"{what}_first_s"], out[f"{what}_step_s"], out[f"{what}_loss"] = times[0], statistics.median(times[2:]), loss


def one(rank: int, world: int, name: str, mesh: str, steps: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import partir_torch
    from partir_torch import models
    from partir_torch.backends.distributed import engine, measure

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def build():
        torch.manual_seed(0)
        return models.build(name, CONFIGS.get(name), device=dev)

    out: dict = {"model": name, "mesh": mesh, "ranks": world}
    for mode in ("eager", "compiled"):
        model, inputs, loss_fn = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        t = time.perf_counter()
        model, opt = partir_torch.auto_shard(model, inputs, mesh, loss_fn=loss_fn, optimizer=opt, backend="torch",
                                             compile=mode == "compiled", budget=60)
        out[f"{mode}_apply_s"] = time.perf_counter() - t
        if mode == "eager":
            rec = engine.sharded(model)
            cmp = measure.compare(rec, measure.run_once(rec, model, opt, inputs))
            out["plan"] = model.partir_plan.decisions
            out["predicted_step_ms"] = model.partir_plan.cost["step_time_s"] * 1e3
            out["bytes_as_predicted"] = all(r["predicted"] == r["measured"] for r in cmp["by_axis"])
            out["memory_measured_over_predicted"] = cmp["measured_peak"] / cmp["predicted_peak"]
        times, loss = _timed(lambda: partir_torch.step(model, opt, *inputs), steps)  # noqa: B023
        _record(out, mode, times, loss)
    for kind in ("ddp", "fsdp2"):
        model, inputs, loss_fn = build()
        if kind == "ddp":
            model = DistributedDataParallel(model)
        else:
            for m in model.modules():
                if isinstance(m, torch.nn.ModuleList):
                    for block in m:
                        fully_shard(block)
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        n = inputs[0].shape[0] // world
        mine = [x[rank * n:(rank + 1) * n] for x in inputs]

        def step(model=model, opt=opt, mine=mine, loss_fn=loss_fn):
            loss = loss_fn(model, *mine)
            loss.backward()
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            return t / world

        times, loss = _timed(step, steps)
        _record(out, kind, times, loss)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mesh", default="batch=2,model=2")
    ap.add_argument("--models", nargs="+", default=["tiny-gpt2", "gpt2-small"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_torch.json"))
    args = ap.parse_args()
    from partir_torch.launch import Workers

    rows = []
    with Workers(args.ranks, timeout=3600) as w:
        for name in args.models:
            rows.append(w.run(one, name, args.mesh, args.steps)[0])
    print(f"{'model':<12} {'plan eager':>11} {'compiled':>10} {'DDP':>9} {'FSDP2':>9}  first compiled  bytes  memory")
    for r in rows:
        print(f"{r['model']:<12} {r['eager_step_s'] * 1e3:>9.1f}ms {r['compiled_step_s'] * 1e3:>8.1f}ms "
              f"{r['ddp_step_s'] * 1e3:>7.1f}ms {r['fsdp2_step_s'] * 1e3:>7.1f}ms  {r['compiled_first_s']:>12.1f}s  "
              f"{'exact' if r['bytes_as_predicted'] else 'DIFFER'}  {r['memory_measured_over_predicted']:.2f}")
    Path(args.out).write_text(json.dumps({"machine": platform.platform(), "cpus": __import__("os").cpu_count(),
                                          "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
