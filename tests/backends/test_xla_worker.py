"""The worker's numerics figure (`xla_worker.max_relative`)."""

from __future__ import annotations

import pytest

from partir_torch.backends.xla_worker import REL_FLOOR, max_relative


def test_a_tensor_that_stays_about_zero_is_compared_against_the_floor_not_its_own_noise():
    # a key bias: zero gradient in exact arithmetic, fp32 noise of 6e-12 in both runs, differing by as much
    assert max_relative([(6.2e-12, 6.5e-12), (1e-9, 1.0)]) == pytest.approx(6.2e-12 / REL_FLOOR)
    assert max_relative([(6.2e-12, 6.5e-12)]) < 1e-5
    # a tensor of real size keeps its own scale: 1e-4 off on values of 1e-3 is 10 % off
    assert max_relative([(1e-4, 1e-3), (0.0, 5.0)]) == pytest.approx(0.1)
    assert max_relative([]) == 0.0


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.xla
def test_the_hlo_dump_is_deleted_once_read_unless_the_caller_keeps_it(tmp_path, monkeypatch, keep):
    """A step's dump is tens of MiB (the disk of an earlier CI run filled up with leftovers)."""
    import tempfile

    from partir_torch import models
    from partir_torch.backends import xla_worker
    from partir_torch.search import search

    model, inputs, loss_fn = models.build("tiny-mlp", {"batch": "8"}, device="meta")
    plan = search(model, inputs, "batch=2", loss_fn=loss_fn, optimizer="sgd", schedule="batch:BatchParallel")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    kept = tmp_path / "kept"
    kept.mkdir()
    step = xla_worker.run(plan, {"workload": "tiny-mlp", "overrides": {"batch": "8"}}, optimizer="sgd",
                          dump_dir=str(kept) if keep else None)
    assert step.collectives and step.memory_total
    dumps = [p for p in scratch.iterdir() if p.name.startswith("partir-xla-")]
    assert dumps == [] and (step.hlo_path is not None) == keep
    assert (len(list(kept.iterdir())) == 1) == keep


@pytest.mark.parametrize("user_flags", ["", "--xla_cpu_enable_concurrency_optimized_scheduler=true"])
@pytest.mark.xla
def test_the_worker_compiles_as_the_user_s_process_does(tmp_path, monkeypatch, user_flags):
    """`verify` measures what users run: the worker starts its runtime as `auto_shard` does (XLA CPU's memory
    scheduler chosen) and keeps the caller's own `XLA_FLAGS` (a scheduler the user chose)."""
    from partir_torch import models
    from partir_torch.backends import xla_worker
    from partir_torch.search import search

    model, inputs, loss_fn = models.build("tiny-mlp", {"batch": "8"}, device="meta")
    plan = search(model, inputs, "batch=2", loss_fn=loss_fn, optimizer="sgd", schedule="batch:BatchParallel")
    monkeypatch.setenv("XLA_FLAGS", user_flags)
    step = xla_worker.run(plan, {"workload": "tiny-mlp", "overrides": {"batch": "8"}}, optimizer="sgd",
                          dump_dir=str(tmp_path))
    options = "".join(p.read_text() for p in tmp_path.glob("*/*.debug_options"))
    assert step.hlo_path and "xla_dump_to" in options
    assert ("xla_cpu_enable_concurrency_optimized_scheduler: false" in options) == (not user_flags), options
