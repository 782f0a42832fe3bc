"""Search once, save the plan, and train with it in a fresh process (no search there).

    .venv-xla/bin/python examples/saved_plan.py search plan.json [--tiny]   # process 1: search and save
    .venv-xla/bin/python examples/saved_plan.py train plan.json [--tiny]    # process 2: load, check, apply, train

(trained with torch_xla, in the XLA environment; on torch.distributed `auto_shard(..., plan="plan.json")` in
every rank does the same: `examples/torchrun_gpt.py`)

The plan file is JSON (`ShardingPlan.save`): the mesh, hardware, schedule, every spec needed to apply it and
the content hash of the captured step; loading it against a model checks names, shapes and divisibility.
"""

from __future__ import annotations

import argparse

import torch

import partir_torch
from partir_torch import models


def workload(tiny: bool):
    overrides = {"batch": "8"} if tiny else {"layers": "4", "width": "256", "heads": "8", "vocab": "4096",
                                             "seq": "128", "batch": "16"}
    return models.build("tiny-llama" if tiny else "llama-7b", overrides, device="cpu")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["search", "train"])
    ap.add_argument("path")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    mesh = {"batch": 2, "model": 4}
    if args.what == "search":
        model, inputs, loss_fn = workload(args.tiny)
        plan = partir_torch.find_plan(model, inputs, mesh, loss_fn=loss_fn, optimizer="adamw", budget=80,
                                   memory="320KiB" if args.tiny else "48MiB")
        plan.save(args.path)
        print(plan.table())
        print(f"saved to {args.path} (program hash {plan.program_hash})")
        return
    partir_torch.start_runtime(mesh)  # torch_xla's runtime before any backward of this process
    torch.manual_seed(0)
    model, inputs, loss_fn = workload(args.tiny)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = partir_torch.auto_shard(model, inputs, mesh, backend="xla", loss_fn=loss_fn, optimizer=optimizer,
                                               plan=args.path)
    print(f"applied {args.path}:")
    print(model.partir_plan.table())
    import torch_xla

    for step in range(3):
        loss = loss_fn(model, *partir_torch.shard_batch(model, *inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch_xla.sync()
        print(f"step {step}: loss {float(loss.detach()):.4f}")


if __name__ == "__main__":
    main()
