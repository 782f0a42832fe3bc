"""A LightningModule trained sharded by changing one argument of `Trainer`.

    .venv/bin/python examples/lightning_gpt.py           # a 4-layer GPT, 8 steps
    .venv/bin/python examples/lightning_gpt.py --tiny    # seconds (what the test runs)
    .venv/bin/python examples/lightning_gpt.py --tiny --backend torch   # 4 CPU processes launched by Lightning

`AutoShardStrategy` captures this module's own `training_step` on the first batch, searches a plan for the
mesh, applies it (torch_xla SPMD in this process; or, with `--backend torch`, on torch.distributed: Lightning
starts one process per device) and trains; `strategy.plan` is the plan it applied.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from quickstart import TinyGPT

from partir_torch.lightning import AutoShardStrategy


class LitGPT(pl.LightningModule):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.net = TinyGPT(vocab, d, heads, layers, seq)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = F.cross_entropy(self.net(tokens).flatten(0, 1), targets.flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))  # per step
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def build(tiny: bool) -> tuple[LitGPT, torch.utils.data.DataLoader]:
    """The module and its data loader, seeded: the same on every rank, and on one device."""
    torch.manual_seed(0)
    vocab, d, heads, layers, seq, batch = (128, 32, 4, 2, 16, 8) if tiny else (4096, 256, 8, 4, 128, 16)
    data = torch.randint(0, vocab, (4 * batch, seq + 1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch)
    return LitGPT(vocab, d, heads, layers, seq), loader


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--backend", choices=["torch", "xla"], default="torch")
    ap.add_argument("--checkpoint", default=None, help="a directory: Lightning checkpoints the sharded module there")
    args = ap.parse_args()
    model, loader = build(args.tiny)
    mesh = {"batch": 2, "model": 4} if args.backend == "xla" else {"batch": 2, "model": 2}
    strategy = AutoShardStrategy(mesh, memory="400KiB" if args.tiny else "40MiB", budget=80, backend=args.backend)
    # torch: Lightning starts 4 processes, each reading this loader whole, in its order (as one device would;
    # its default distributed sampler would shuffle it, as under DDP)
    devices = {"accelerator": "cpu", "devices": 4, "use_distributed_sampler": False} if args.backend == "torch" else {}
    saving = {"callbacks": [pl.callbacks.ModelCheckpoint(dirpath=args.checkpoint, every_n_train_steps=2)]} \
        if args.checkpoint else {"enable_checkpointing": False}
    trainer = pl.Trainer(strategy=strategy, max_steps=3 if args.tiny else 8, logger=False, enable_model_summary=False,
                         enable_progress_bar=not args.tiny, **devices, **saving)
    trainer.fit(model, loader)
    if trainer.global_rank:
        return
    print("the applied plan's sharded parameters:")
    for name, spec in strategy.plan.params.items():
        if any(spec):
            print(f"  {name}: {spec}")
    print(f"final loss {float(trainer.callback_metrics['loss']):.6f}")


if __name__ == "__main__":
    main()
