"""Start ranks as PyTorch users do, from Python: `spawn(fn, world_size, *args)` runs `fn(rank, world_size,
*args)` in `world_size` processes with the process group started (gloo on the CPU, NCCL on GPUs); `Workers`
keeps them for several calls. Under `torchrun --nproc-per-node N script.py` there is nothing to start:
`auto_shard(..., backend="torch")` joins the job's process group.

    def train(rank, world_size):
        model, opt = partir_torch.auto_shard(model, batch, {"batch": 2, "model": 2}, loss_fn=..., optimizer=...)
        for _ in range(3):
            loss = partir_torch.step(model, opt, *batch)

    partir_torch.launch.spawn(train, 4)
"""

from partir_torch.backends.distributed.launch import RankError, Workers, spawn

__all__ = ["RankError", "Workers", "spawn"]
