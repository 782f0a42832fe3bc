"""`AutoShardStrategy`: a LightningModule that is not in the zoo trains sharded through `Trainer` with the
unsharded losses and parameters, and gets its own parameters back at teardown."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.xla


def _module():
    import pytorch_lightning as pl

    class Denoiser(pl.LightningModule):
        """A conv encoder and an MLP head with a dict batch and a dict output."""

        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Sequential(nn.Conv1d(4, 32, 3, padding=1), nn.GELU(), nn.Conv1d(32, 32, 3, padding=1))
            self.head = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 4))
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            h = self.enc(batch["x"]).transpose(1, 2)
            loss = F.mse_loss(self.head(h), batch["y"])
            self.log("loss", loss)
            return {"loss": loss}

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"].detach().cpu()))

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # stepped per batch: it must
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}  # follow the new one

    return Denoiser


class _Dicts(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, 16, generator=g), torch.randn(n, 16, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def test_autoshardstrategy_trains_a_lightning_module_like_unsharded():
    import pytorch_lightning as pl

    from partir_torch.lightning import AutoShardStrategy

    torch.manual_seed(0)
    Denoiser = _module()
    model = Denoiser()
    ref = Denoiser()
    ref.load_state_dict(model.state_dict())
    own = dict(model.named_parameters())
    loader = torch.utils.data.DataLoader(_Dicts(32), batch_size=8)
    strategy = AutoShardStrategy({"batch": 2, "model": 4}, memory="64KiB", budget=60, backend="xla")
    trainer = pl.Trainer(strategy=strategy, max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    assert strategy.plan is not None and any(any(s) for s in strategy.plan.params.values())
    assert strategy.plan.cost["feasible"]
    # the same steps, unsharded, with the module's own optimizer and scheduler
    conf = ref.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    ref_losses = []
    for batch in loader:
        loss = F.mse_loss(ref.head(ref.enc(batch["x"]).transpose(1, 2)), batch["y"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ref_losses.append(float(loss))
    assert model.losses == pytest.approx(ref_losses, rel=1e-5)
    for n, p in model.named_parameters():
        assert p is own[n] and p.device.type == "cpu"  # unsharded at teardown: the module's own parameters
        torch.testing.assert_close(p.detach(), dict(ref.named_parameters())[n].detach(), rtol=1e-5, atol=1e-6)
