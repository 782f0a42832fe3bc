"""`backends/distributed/materialize.py`: a model built on the meta device, initialized on each rank as its own
parts only, holds exactly the parameters of the same model initialized whole from the same seed, and trains as
it; a module it cannot initialize is named before the search.

On 2 gloo ranks: the zoo's GPT (every module has `reset_parameters`) and Llama (its RMSNorm and rotary tables
need the user's `init_fn`), under FSDP (every weight split), in fp64."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.engine


def llama_init():
    """The user's init for the zoo Llama's modules without `reset_parameters` (as torchtitan's `init_weights`
    recomputes its rotary tables)."""
    from partir_torch import models
    from partir_torch.models.llama import RMSNorm, RotaryEmbedding

    tables = dict(models.build("tiny-llama", device="cpu")[0].named_buffers())

    def init(m: torch.nn.Module) -> None:
        if isinstance(m, RMSNorm):
            torch.nn.init.ones_(m.weight)
        elif isinstance(m, RotaryEmbedding):
            m.cos.copy_(tables["rotary.cos"])
            m.sin.copy_(tables["rotary.sin"])
        else:
            m.reset_parameters()

    return init


def meta_case(rank, world, name):
    import copy

    import partir_torch
    from partir_torch import models
    from partir_torch.backends.distributed.engine import sharded
    from partir_torch.backends.distributed.materialize import init_whole

    _, inputs, loss_fn = models.build(name, device="cpu")  # (real batches)
    init = llama_init() if name == "tiny-llama" else None
    model = models.build(name, device="meta")[0].double()  # (fp64: AdamW's first steps amplify fp32 rounding)
    torch.manual_seed(0)
    ref = init_whole(copy.deepcopy(model), init)  # the same procedure on whole tensors, the same seed
    out = {"meta": all(p.is_meta for p in model.parameters())}
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = partir_torch.auto_shard(model, inputs, "batch=2", loss_fn=loss_fn, optimizer=opt, init_fn=init,
                                         schedule="batch:FSDP", cache=False, progress=False)
    out["split"] = sum(any(s) for s in model.partir_plan.params.values())
    out["init_bytes"] = sharded(model).init_bytes
    out["local"] = max(p.to_local().numel() / p.numel() for p in model.parameters() if p.dim())
    # each local part, parameter or optimizer state, owns its storage: not a view keeping a whole tensor alive
    locals_ = [p.to_local() for p in model.parameters()]
    locals_ += [t.to_local() for st in opt.state.values() for t in st.values() if hasattr(t, "to_local")]
    out["held"] = max(t.untyped_storage().nbytes() / max(1, t.numel() * t.element_size()) for t in locals_)
    out["init"] = max((p.full_tensor() - r).abs().max().item() for p, r in zip(model.parameters(), ref.parameters()))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out["losses"] = []
    for _ in range(3):
        got = float(partir_torch.step(model, opt, *inputs))
        loss = loss_fn(ref, *inputs)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["losses"].append((got, float(loss.detach())))
    back = partir_torch.unshard(model)
    out["unsharded"] = max((p - r).abs().max().item() for p, r in zip(back.parameters(), ref.parameters()))
    out["unsharded_meta"] = any(p.is_meta for p in back.parameters())
    return out


def refused_case(rank, world):
    import partir_torch
    from partir_torch import models

    _, inputs, loss_fn = models.build("tiny-llama", device="cpu")
    model = models.build("tiny-llama", device="meta")[0]
    opt = torch.optim.AdamW(model.parameters())
    try:
        partir_torch.auto_shard(model, inputs, "batch=2", loss_fn=loss_fn, optimizer=opt, cache=False,
                                progress=False)
    except partir_torch.PartirError as e:
        return {"error": str(e), "meta": all(p.is_meta for p in model.parameters())}
    return {"error": None}


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_a_meta_model_initialized_in_parts_equals_the_whole_init_and_trains_as_it(two, name):
    for r in two.run(meta_case, name):
        assert r["meta"] and r["split"] and r["local"] <= 0.5, r  # every split weight: half on each rank
        assert r["held"] == 1.0, r["held"]  # (a view of the whole tensor would hold 2.0: the model on every rank)
        assert r["init"] == 0.0, r["init"]
        largest, model_bytes = r["init_bytes"]  # a rank held one module whole at a time, never the model
        assert 0 < largest <= 0.5 * model_bytes, r["init_bytes"]
        assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in r["losses"]), r["losses"]
        assert r["unsharded"] <= 1e-5 and not r["unsharded_meta"], r


def test_a_meta_model_it_cannot_initialize_names_the_modules_and_the_fix(two):
    for r in two.run(refused_case):
        assert r["error"] and "RotaryEmbedding" in r["error"] and "RMSNorm" in r["error"], r
        assert "init_fn" in r["error"] and r["meta"]
