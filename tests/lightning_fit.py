"""A LightningModule and its whole fit, run as a script (Lightning re-runs the script for each rank it launches):

    python tests/lightning_fit.py OUT.json [--devices N --mesh M --schedule S] [--resume CKPT] [--ckpt DIR]

With `--devices 1` it is plain Lightning on one device (the reference); otherwise partir_torch's strategy on N
gloo CPU ranks. Rank 0 writes the final parameters, every metric Lightning holds, and the predictions."""

from __future__ import annotations

import argparse
import json

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F


class Classifier(pl.LightningModule):
    """Features to five classes: a small residual MLP with LayerNorm, a step LR schedule."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.block = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.out = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.block(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_acc", (logits.argmax(-1) == y).float().mean(), on_step=True, on_epoch=True)
        self.log_dict({"train_loss": loss}, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=2e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5),
                                                   "interval": "step"}}


def loaders():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(54, 12, generator=g), torch.randint(0, 5, (54,), generator=g)
    train = torch.utils.data.TensorDataset(x[:38], y[:38])  # batches of 8: 8, 8, 8, 8 and a last one of 6
    val = torch.utils.data.TensorDataset(x[38:], y[38:])
    return (torch.utils.data.DataLoader(train, batch_size=8), torch.utils.data.DataLoader(val, batch_size=8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--mesh", default=None)
    ap.add_argument("--schedule", default=None)
    ap.add_argument("--ckpt", default=None, help="save a checkpoint each epoch here")
    ap.add_argument("--resume", default=None, help="resume from this checkpoint")
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Classifier()
    train, val = loaders()
    kw = dict(max_epochs=args.epochs, gradient_clip_val=0.3, accumulate_grad_batches=2, accelerator="cpu",
              logger=False, enable_model_summary=False, enable_progress_bar=False, num_sanity_val_steps=0,
              deterministic=True)
    if args.devices > 1:
        from partir_torch.lightning import AutoShardStrategy

        kw.update(devices=args.devices, use_distributed_sampler=False, strategy=AutoShardStrategy(
            args.mesh, schedule=args.schedule, cache=False, progress=False))
    else:
        kw.update(devices=1)
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=args.ckpt, save_top_k=-1, every_n_epochs=1)] \
        if args.ckpt else []
    trainer = pl.Trainer(callbacks=callbacks, enable_checkpointing=bool(args.ckpt), **kw)
    trainer.fit(model, train, val, ckpt_path=args.resume)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    tested = trainer.test(model, val, verbose=False)
    predicted = trainer.predict(model, val)
    if trainer.global_rank == 0:
        params = {n: p.detach().tolist() for n, p in model.named_parameters()}
        with open(args.out, "w") as f:
            json.dump({"params": params, "metrics": metrics, "test": tested,
                       "predicted": [p.tolist() for p in predicted]}, f)


if __name__ == "__main__":
    main()
