"""`lower/buckets.py`: the cost model's count of calls under buckets (`coalesced`, vectorized for the search)
equals the rule it states, walked one collective at a time (`_walked`, below), on the zoo's plans at bucket
caps from DDP's to a few bytes, folded and not. The engine's measured calls are held against the same count
in `tests/backends/test_distributed.py` (`check`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.cost import evaluate, hardware
from partir_torch.cost import model as cost_model
from partir_torch.cost.report import COLLECTIVES
from partir_torch.ir import Mesh
from partir_torch.tactics import apply_schedule
from tests.test_simulate import random_plan


def _walked(value, op, move, kind, axis, nbytes, weight, st, cap):
    """The docstring's rule, one collective at a time in the order the values are made."""
    pairs: dict[tuple, int] = {}
    for v, m in zip(value.tolist(), move.tolist()):
        pairs[(v, m)] = pairs.get((v, m), 0) + 1
    calls: dict[tuple[int, int], int] = {}
    cands = []
    for v, o, m, k, a, b, w in zip(*(x.tolist() for x in (value, op, move, kind, axis, nbytes, weight))):
        made = int(st.v_producer[v])
        read = o if o != made else int(st.v_first_read[v])
        if COLLECTIVES[k] in ("all-reduce", "reduce-scatter") and made >= 0 and pairs[(v, m)] == 1 and read > made:
            cands.append((made, read, k, a, int(st.v_dtype[v]), b, w, w > 1 and read <= st.block_end[made]))
        else:
            calls[(k, a)] = calls.get((k, a), 0) + w
    runs: dict[tuple, list] = {}

    def close(key, run):
        b = run[3] if run[2] > 1 else run[0]
        calls[key[:2]] = calls.get(key[:2], 0) + run[2] * max(1, -(-b // cap))

    for made, read, k, a, dt, b, w, repeats in sorted(cands, key=lambda c: c[0]):
        key = (k, a, dt)
        run = runs.get(key)
        if run is not None and run[1] <= made:
            close(key, run)
            run = None
        if run is None:
            run = runs[key] = [0, read, 1, 0]  # [weighted bytes, first read, copies, bytes once]
        run[0], run[1], run[3] = run[0] + w * b, min(run[1], read), run[3] + b
        run[2] = max(run[2], w if repeats else 1)
    for key, run in runs.items():
        close(key, run)
    return calls


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-moe", "tiny-gns"])
def test_the_vectorized_count_is_the_rule_walked(monkeypatch, name, fold):
    seen = []
    fast = cost_model.coalesced

    def both(*args):
        got = fast(*args)
        seen.append((got[0], _walked(*args)))
        return got

    monkeypatch.setattr(cost_model, "coalesced", both)
    model, inputs, loss_fn = models.build(name, {"layers": "4"} if name != "tiny-gns" else None)
    program = capture(model, inputs, loss_fn, "adamw", fold=fold)
    mesh = Mesh.parse("batch=2,model=4")
    states = [apply_schedule(program, mesh, s) for s in ("batch:DP;model:Megatron;batch:ZeRO(1)",
                                                         "batch:FSDP;model:FSDP")]
    states += [random_plan(program, mesh, seed) for seed in range(3)]
    for state in states:
        for cap in (25 * 2**20, 4096, 64):
            evaluate(state, dataclasses.replace(hardware("tpu-v5e"), bucket_cap=cap))
    assert len(seen) == 15
    for got, want in seen:
        assert got == want
    # buckets do coalesce here: DDP's cap makes fewer calls than a 64-byte one (the check is not vacuous)
    counts = [sum(g.values()) for g, _ in seen]
    assert np.any(np.array(counts[0::3]) < np.array(counts[2::3]))
