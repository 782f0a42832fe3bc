"""The examples run at tiny size and print the shardings they chose (each in its own process, as users run them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


def _run(*args: str, stderr: list[str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_USE_SPMD",
                                                            "TF_CPP_MIN_LOG_LEVEL")}
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    if stderr is not None:
        stderr.append(res.stderr)
    return res.stdout


@pytest.mark.xla
def test_quickstart_shards_the_weights_and_trains():
    """... and says once that XLA's GSPMD is deprecated, instead of XLA's line at every compile."""
    err: list[str] = []
    out = _run(str(EXAMPLES / "quickstart.py"), "--tiny", stderr=err)
    assert err[0].count("GSPMD partitioner") == 1 and "sharding_propagation.cc" not in err[0], err[0][-2000:]
    table = out.split("step 0")[0]
    assert "parameters sharded:" in table and "'model'" in table  # weights tiled over the model axis
    losses = [float(line.split("loss ")[1]) for line in out.splitlines() if line.startswith("step ") and "loss" in line]
    assert len(losses) == 3 and losses[-1] < losses[0]


@pytest.mark.xla
def test_saved_plan_is_searched_in_one_process_and_applied_in_another(tmp_path):
    path = str(tmp_path / "plan.json")
    searched = _run(str(EXAMPLES / "saved_plan.py"), "search", path, "--tiny")
    assert "saved to" in searched
    trained = _run(str(EXAMPLES / "saved_plan.py"), "train", path, "--tiny")
    def specs(out: str) -> list[str]:  # the table's rows of sharded parameters
        return [line for line in out.splitlines() if line.startswith("  ") and "[" in line]

    assert specs(searched) and specs(trained.split("applied")[1]) == specs(searched)
    assert "step 2: loss" in trained


@pytest.fixture(scope="module")
def one_device_loss() -> float:
    """The Lightning example's final loss trained unsharded: a plain `Trainer` on one CPU device (in a process
    of its own, as the examples run)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import pytorch_lightning as pl; import lightning_gpt as g\n"
            "model, loader = g.build(True)\n"
            "t = pl.Trainer(max_steps=3, logger=False, enable_model_summary=False, enable_progress_bar=False, "
            "enable_checkpointing=False, accelerator='cpu', devices=1)\n"
            "t.fit(model, loader); print('final loss', float(t.callback_metrics['loss']))")
    return _final_loss(_run("-c", code, str(EXAMPLES)))


def _final_loss(out: str) -> float:
    return float(next(x for x in out.splitlines() if x.startswith("final loss")).split()[-1])


@pytest.mark.xla
def test_lightning_example_trains_with_the_strategy(one_device_loss):
    """... to the loss the module reaches unsharded on one device."""
    out = _run(str(EXAMPLES / "lightning_gpt.py"), "--tiny", "--backend", "xla")
    assert "the applied plan's sharded parameters:" in out
    assert any(line.startswith("  net.") for line in out.split("sharded parameters:")[1].splitlines())
    assert _final_loss(out) == pytest.approx(one_device_loss, rel=1e-5)


@pytest.mark.engine
def test_torchrun_example_plans_trains_and_restores_a_dcp_checkpoint(tmp_path):
    """`torchrun --nproc-per-node 4` on CPU (gloo): rank 0 plans, every rank trains, a DCP checkpoint saved and
    loaded into a model sharded again gives the same next loss; its temporary directory is gone at the end."""
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_USE_SPMD")}
    (tmp_path / "tmp").mkdir()
    res = subprocess.run([str(torchrun), "--nproc-per-node", "4", str(EXAMPLES / "torchrun_gpt.py")],
                         capture_output=True, text=True, timeout=600, env={**env, "TMPDIR": str(tmp_path / "tmp")})
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "parameters sharded:" in out and out.count("step ") >= 3
    line = next(x for x in out.splitlines() if x.startswith("checkpoint"))
    trained, restored = (float(x.split()[0]) for x in line.split("next loss ")[1].split(", "))
    assert restored == trained, line
    assert not list((tmp_path / "tmp").glob("partir-*")), "the example left its checkpoint behind"


@pytest.mark.engine
def test_lightning_example_on_the_torch_backend_launches_ranks_and_checkpoints_whole_tensors(tmp_path,
                                                                                           one_device_loss):
    """`AutoShardStrategy(..., backend="torch")`: Lightning starts 4 CPU processes, rank 0 plans, each step is the
    plan's rank program, reaching the loss of one device on the same batches; a checkpoint taken mid-fit holds the
    whole (gathered) parameters."""
    import torch

    out = _run(str(EXAMPLES / "lightning_gpt.py"), "--tiny", "--backend", "torch", "--checkpoint", str(tmp_path))
    assert "on torch.distributed" in out
    assert _final_loss(out) == pytest.approx(one_device_loss, rel=1e-5)
    assert any(line.startswith("  net.") for line in out.split("sharded parameters:")[1].splitlines())
    (ckpt,) = tmp_path.glob("*.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    assert list(state["net.blocks.0.up.weight"].shape) == [128, 32]  # whole, though the plan splits it
