"""Lightning's whole `fit` on the torch backend (`partir_torch/lightning/distributed.py`), on a LightningModule
written here (`tests/lightning_fit.py`): a validation loader, `self.log` / `self.log_dict`, a step LR schedule,
`gradient_clip_val`, `accumulate_grad_batches=2` and a last batch of 6, on 4 and 2 gloo CPU processes
Lightning launches, against plain Lightning on one device with the same settings; then a resume from the
sharded run's checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import needs

pytestmark = pytest.mark.engine
SCRIPT = Path(__file__).with_name("lightning_fit.py")
ROOT = SCRIPT.parent.parent


def fit(out: Path, *args: str) -> dict:
    needs.need("pytorch_lightning")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(SCRIPT), str(out), *args], capture_output=True, text=True,
                         timeout=900, env=env, cwd=out.parent)
    assert res.returncode == 0, res.stderr[-4000:]
    return {**json.loads(out.read_text()), "stderr": res.stderr}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fit")
    return {
        "one": fit(d / "one.json"),
        "four": fit(d / "four.json", "--devices", "4", "--mesh", "batch=2,model=2",
                    "--schedule", "batch:BatchParallel;model:Megatron", "--ckpt", str(d / "ckpt")),
        "two": fit(d / "two.json", "--devices", "2", "--mesh", "batch=2", "--schedule", "batch:FSDP"),
        "resumed": fit(d / "resumed.json", "--devices", "4", "--mesh", "batch=2,model=2",
                       "--schedule", "batch:BatchParallel;model:Megatron",
                       "--resume", str(next((d / "ckpt").glob("epoch=0*.ckpt")))),
    }


def _diff(a: dict, b: dict) -> float:
    import torch

    return max((torch.tensor(a[n]) - torch.tensor(b[n])).abs().max().item() for n in a)


@pytest.mark.parametrize("run", ["four", "two"])
def test_fit_trains_as_plain_lightning_does(runs, run):
    """Clipped by the global norm, two batches a step, the last one short, scheduled: the same parameters."""
    assert _diff(runs[run]["params"], runs["one"]["params"]) <= 1e-4


@pytest.mark.parametrize("run", ["four", "two"])
def test_every_logged_metric_is_there_with_plain_lightning_s_value(runs, run):
    want, got = runs["one"]["metrics"], runs[run]["metrics"]
    assert set(got) >= set(want) >= {"train_acc_step", "train_acc_epoch", "train_loss", "val_loss", "val_acc"}
    assert all(abs(got[k] - want[k]) <= 1e-4 for k in want), (got, want)
    assert runs[run]["test"][0]["test_loss"] == pytest.approx(runs["one"]["test"][0]["test_loss"], abs=1e-4)
    assert runs[run]["predicted"] == runs["one"]["predicted"]


def test_resuming_from_the_sharded_run_s_checkpoint_continues_identically(runs):
    assert _diff(runs["resumed"]["params"], runs["four"]["params"]) <= 1e-5
