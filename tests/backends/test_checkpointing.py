"""Activation checkpointing on the torch backend (`Options(remat=...)`, `capture/remat.py`): the rank program
recomputes each block in backward, trains as the kept step, holds less, and lets a memory-limited search fit
where keeping every activation cannot. On 2 gloo ranks, the zoo GPT with 6 blocks and a batch whose
activations dominate the step."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.engine

BIG = {"layers": 6, "batch": 16, "seq": 64}
LIMIT = 6_000_000  # bytes a rank: under what keeping the activations needs, over what recomputing them needs


def remat_case(rank, world, remat, memory=None):
    import partir_torch
    from partir_torch import models

    torch.manual_seed(0)
    model, inputs, loss_fn = models.build("tiny-gpt2", BIG, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    how = {"memory": memory} if memory else {"schedule": "batch:BatchParallel"}
    try:
        model, opt = partir_torch.auto_shard(model, inputs, "batch=2", loss_fn=loss_fn, optimizer=opt, remat=remat,
                                             cache=False, progress=False, **how)
    except partir_torch.PartirError as e:
        return {"error": str(e)}
    report = partir_torch.verify(model, inputs)
    return {"predicted": report.predicted["peak_memory_bytes"], "measured": report.measured["peak_memory_bytes"],
            "losses": [float(partir_torch.step(model, opt, *inputs)) for _ in range(3)],
            "params": [p.full_tensor().detach() for p in model.parameters()],
            "remat": model.partir_plan.loop.get("remat")}


def test_recomputed_blocks_train_as_kept_ones_in_less_memory(two):
    kept = two.run(remat_case, None)[0]
    full = two.run(remat_case, "full")[0]
    assert full["losses"] == pytest.approx(kept["losses"], rel=1e-6, abs=0)
    assert max((a - b).abs().max().item() for a, b in zip(full["params"], kept["params"])) <= 1e-6
    assert full["measured"] < 0.5 * kept["measured"], (full["measured"], kept["measured"])
    assert 0.75 <= full["measured"] / full["predicted"] <= 1.15, (full["measured"], full["predicted"])


def test_a_memory_limit_only_remat_meets_is_met(two):
    """`remat="auto"`: the search recomputes because nothing kept fits; the rank keeps under the limit."""
    kept = two.run(remat_case, None, LIMIT)[0]
    assert "no plan found fits in memory" in kept["error"]
    auto = two.run(remat_case, "auto", LIMIT)[0]
    assert auto["remat"] in ("selective", "full")
    assert auto["predicted"] <= LIMIT and auto["measured"] <= LIMIT, auto
