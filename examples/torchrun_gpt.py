"""Plan, train, checkpoint and restore a GPT on torch.distributed: one process a device, as torchrun starts them.

    torchrun --nproc-per-node 4 examples/torchrun_gpt.py                 # 4 CPU ranks (gloo), mesh batch=2,model=2
    torchrun --nproc-per-node 8 examples/torchrun_gpt.py --mesh batch=2,model=4 --size small   # 8 GPUs (NCCL)
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/torchrun_gpt.py --mesh batch=2:dcn,model=8

Every rank builds the same model from the same seed and passes the global batch. Rank 0 searches the plan
and every rank checks it holds the same one; parameters and optimizer states are DTensors, saved and loaded
with torch.distributed.checkpoint (DCP) as FSDP2 users do. The learning rate warms up under an LR scheduler
built on the optimizer `auto_shard` returns.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import partir_torch
from partir_torch import models

SIZES = {"tiny": {"layers": "2", "width": "32", "heads": "4", "vocab": "128", "seq": "16", "batch": "8"},
         "small": {"layers": "4", "width": "256", "heads": "8", "vocab": "8192", "seq": "128", "batch": "16"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default="batch=2,model=2")
    ap.add_argument("--size", choices=SIZES, default="tiny")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--memory", default=None, help="per-device memory limit for the search, e.g. 200KiB")
    ap.add_argument("--checkpoint", default=None, help="a directory every rank can reach (default: a temporary one)")
    args = ap.parse_args()

    torch.manual_seed(0)
    model, (tokens, targets), loss_fn = models.build("gpt2-small", SIZES[args.size], device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = partir_torch.auto_shard(model, (tokens, targets), args.mesh, loss_fn=loss_fn, optimizer=opt,
                                         memory=args.memory, budget=60, backend="torch")
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))
    rank = dist.get_rank()
    if rank == 0:
        print(model.partir_plan.table())
    for i in range(args.steps):
        loss = partir_torch.step(model, opt, tokens, targets)
        warmup.step()
        if rank == 0:
            print(f"step {i}: loss {loss.item():.4f} (lr {opt.param_groups[0]['lr']:.2e} next)")

    path = args.checkpoint or _shared_tempdir()  # (a temporary one is removed at the end)
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    expected = partir_torch.step(model, opt, tokens, targets).item()

    torch.manual_seed(1)  # another start: everything comes back from the checkpoint
    again, _, _ = models.build("gpt2-small", SIZES[args.size], device="cpu")
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-3)
    again, opt2 = partir_torch.auto_shard(again, (tokens, targets), args.mesh, loss_fn=loss_fn, optimizer=opt2,
                                          plan=model.partir_plan, backend="torch")
    state = {"model": again.state_dict(), "optim": get_optimizer_state_dict(again, opt2)}
    dcp.load(state, checkpoint_id=path)
    again.load_state_dict(state["model"])
    set_optimizer_state_dict(again, opt2, state["optim"])
    restored = partir_torch.step(again, opt2, tokens, targets).item()
    if rank == 0:
        print(f"checkpoint {path}: next loss {expected:.6f} trained on, {restored:.6f} restored")
    dist.barrier()  # every rank has read it
    if rank == 0 and args.checkpoint is None:
        shutil.rmtree(path, ignore_errors=True)
    dist.destroy_process_group()


def _shared_tempdir() -> str:
    box = [tempfile.mkdtemp(prefix="partir-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main()
