"""`capture/remat.py`: activation checkpointing written into the captured step. A recomputed block gives the
same loss and gradients as a kept one (the same ops on the same values), its activations die after the forward
(the cost model's peak falls, with no special case), and a block that draws random numbers is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.cost import evaluate, hardware
from partir_torch.errors import CaptureError, PartirError
from partir_torch.ir import Mesh
from partir_torch.ir.program import Loop
from partir_torch.tactics import apply_schedule

BIG = {"layers": 6, "batch": 16, "seq": 64}  # activations dominate the step's memory


def _run(p, model):
    params = {n: q.detach() for n, q in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    states = {n: {k: torch.zeros(p.values[v].shape, dtype=p.values[v].dtype) for k, v in st.items()}
              for n, st in p.opt_states.items()}
    return params, buffers, states


def _same_step(model, inputs, loss_fn, remat, **kw):
    """(loss and gradient differences from the kept step, ops added, the two programs)."""
    kept = capture(model, inputs, loss_fn, "adamw", **kw)
    redo = capture(model, inputs, loss_fn, "adamw", loop=Loop(remat=remat), **kw)
    params, buffers, states = _run(kept, model)
    a = kept.run(params, buffers, inputs, states)
    b = redo.run(params, buffers, inputs, states)
    diff = max([(a[kept.loss] - b[redo.loss]).abs().item()]
               + [(a[kept.grads[n]] - b[redo.grads[n]]).abs().max().item() for n in kept.grads])
    return diff, len(redo.ops) - len(kept.ops), kept, redo


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
@pytest.mark.parametrize("remat", ["full", "selective"])
def test_recomputed_blocks_give_the_kept_step(name, remat):
    torch.manual_seed(0)
    model, inputs, loss_fn = models.build(name, device="cpu")
    diff, added, kept, redo = _same_step(model, inputs, loss_fn, remat)
    assert diff <= 1e-6, diff
    assert added > 0  # the blocks' forward ops, again ...

    def matmuls(p, phase):
        return sum(op.phase.name == phase and op.target in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")
                   for op in p.ops)

    # ... run in the backward (read there, not left dead): full remat recomputes the blocks' matmuls, selective
    # keeps them (its copies are the cheap ops between)
    more = matmuls(redo, "BACKWARD") - matmuls(kept, "BACKWARD")
    assert more > 0 if remat == "full" else more == 0, more
    assert matmuls(redo, "OPTIMIZER") == 0 and len([o for o in redo.ops if o.phase.name == "OPTIMIZER"]) == len(
        [o for o in kept.ops if o.phase.name == "OPTIMIZER"])


def test_stock_transformer_encoder_recomputes_its_layers():
    """`nn.TransformerEncoder` (its blocks are `layers.0`, `layers.1`, ...: no name this project knows)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    x = torch.randn(4, 8, 32)

    def loss_fn(m, x):
        return m(x).pow(2).mean()

    diff, added, _kept, redo = _same_step(model, (x,), loss_fn, "full")
    assert diff <= 1e-6 and added > 0
    assert {op.module.split(".")[1] for op in redo.ops
            if op.phase.name == "BACKWARD" and op.module and op.module.startswith("layers.")} == {"0", "1", "2"}


def _peak(p, mesh="batch=2", schedule="batch:BatchParallel"):
    state = apply_schedule(p, Mesh.parse(mesh), schedule)
    return evaluate(state, hardware("cpu-virtual"))


def test_remat_lowers_the_predicted_peak_and_costs_compute():
    torch.manual_seed(0)
    model, inputs, loss_fn = models.build("tiny-gpt2", BIG, device="cpu")
    reports = {r: _peak(capture(model, inputs, loss_fn, "adamw", loop=Loop(remat=r))) for r in
               (None, "selective", "full")}
    peaks = {r: rep.peak_memory_bytes for r, rep in reports.items()}
    assert peaks["full"] < 0.5 * peaks[None], peaks  # the blocks' activations: only their inputs live on
    assert peaks["full"] < peaks["selective"] < peaks[None], peaks
    flops = {r: rep.compute_time_s for r, rep in reports.items()}
    assert flops["full"] > flops["selective"] > flops[None], flops  # the recompute is priced


def test_folded_capture_prices_remat_as_the_full_one():
    torch.manual_seed(0)
    model, inputs, loss_fn = models.build("tiny-gpt2", BIG, device="cpu")
    loop = Loop(remat="full")
    full = _peak(capture(model, inputs, loss_fn, "adamw", loop=loop))
    folded = _peak(capture(model, inputs, loss_fn, "adamw", loop=loop, fold=True))
    assert abs(folded.peak_memory_bytes / full.peak_memory_bytes - 1) < 0.05
    assert abs(folded.compute_time_s / full.compute_time_s - 1) < 0.05


class _Drops(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(p), nn.ReLU()) for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def test_a_block_that_draws_is_refused_naming_the_op():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    with pytest.raises(CaptureError, match=r"remat: block 'blocks.0' draws random numbers \(aten\..*\)"):
        capture(_Drops(0.1), (x,), lambda m, x: m(x).sum(), "sgd", loop=Loop(remat="full"))
    diff, added, _, _ = _same_step(_Drops(0.0), (x,), lambda m, x: m(x).sum(), "full")  # p=0: nothing drawn
    assert diff <= 1e-6 and added > 0


def test_remat_options_say_what_they_take():
    from partir_torch.options import Options

    assert Options(remat="full").remat == "full"
    with pytest.raises(PartirError, match=r"remat must be .full., .selective., .auto. or None"):
        Options(remat="everything")
    assert "remat=selective" in str(Loop(remat="selective"))


@pytest.mark.thirdparty
def test_hf_gpt2_blocks_recompute_and_its_dropout_is_named():
    from tests import needs

    transformers = needs.need("transformers")
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 16))

    def loss_fn(m, ids):
        return m(ids, labels=ids).loss

    def gpt2(p):
        cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=128, n_positions=32,
                                      resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)
        return transformers.GPT2LMHeadModel(cfg)

    diff, added, _, _redo = _same_step(gpt2(0.0), (ids,), loss_fn, "full")
    assert diff <= 1e-6 and added > 0
    with pytest.raises(CaptureError, match=r"block 'transformer.h.0' draws random numbers"):
        capture(gpt2(0.1), (ids,), loss_fn, "adamw", loop=Loop(remat="full"))


def test_auto_keeps_activations_unless_only_recomputing_them_fits():
    """`remat="auto"`: the search plans the step kept, selective and full, and keeps the fastest that fits:
    kept without a limit (recomputing costs FLOPs), a recomputing one under a limit the kept step cannot meet."""
    from partir_torch.search.api import search

    torch.manual_seed(0)
    model, inputs, loss_fn = models.build("tiny-gpt2", BIG, device="cpu")
    kw = {"loss_fn": loss_fn, "budget": 20, "cache": False, "progress": False, "hardware": "cpu-virtual"}
    free = search(model, inputs, "batch=2", remat="auto", **kw)
    assert "remat" not in free.loop
    tight = search(model, inputs, "batch=2", remat="auto", memory=6_000_000, **kw)
    assert tight.loop.get("remat") in ("selective", "full") and tight.cost["feasible"]
    with pytest.raises(PartirError, match="no plan found fits"):
        search(model, inputs, "batch=2", memory=6_000_000, **kw)
