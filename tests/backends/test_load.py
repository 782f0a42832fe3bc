"""`backends/distributed/load.py`: pretrained weights into a sharded model, each rank reading its own slices:
a `save_pretrained` directory and a DCP checkpoint give exactly the weights the whole model holds, a rank reads
its part only, and a checkpoint that does not fit is an error naming the keys and shapes, the model untouched.

On 2 gloo ranks, HF GPT-2 from a config (a tied head, a fused qkv weight read in chunks) under Megatron."""

from __future__ import annotations

import pytest
import torch

from tests import needs

pytestmark = pytest.mark.engine


def gpt2(seed: int):
    transformers = needs.need("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)  # (no dropout: the loss is the weights')
    return transformers.GPT2LMHeadModel(cfg)


def _loss(model, ids):
    return model(ids, labels=ids).loss


def _sharded(seed: int):
    import partir_torch

    model = gpt2(seed)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = partir_torch.auto_shard(model, (ids,), "model=2", loss_fn=_loss, optimizer=opt,
                                         schedule="model:Megatron", backend="torch", cache=False, progress=False)
    return model, opt, ids


def _max_diff(model, want) -> float:
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return max((full[n] - p).abs().max().item() for n, p in want.named_parameters())


def load_case(rank, world, where):
    import torch.distributed.checkpoint as dcp

    import partir_torch

    out = {}
    pretrained = gpt2(0)  # what save_pretrained wrote (the test wrote it before starting the job)
    model, opt, ids = _sharded(1)
    out["before"] = _max_diff(model, pretrained)
    got = partir_torch.load(model, where / "hf")
    out["hf"] = _max_diff(model, pretrained)
    out["read"] = (got.read_bytes, got.whole_bytes, got.tensors)
    out["split"] = sorted(n for n, s in model.partir_plan.params.items() if any(s))
    loss = float(partir_torch.step(model, opt, ids))
    out["loss"] = (loss, float(_loss(pretrained, ids).detach()))  # the first step's loss is the loaded weights'
    # a DCP checkpoint of the sharded model, loaded into another sharded one
    dcp.save(model.state_dict(), checkpoint_id=str(where / "dcp"))
    other, _, _ = _sharded(2)
    partir_torch.load(other, where / "dcp")
    out["dcp"] = max((a.full_tensor() - b.full_tensor()).abs().max().item()
                     for a, b in zip(other.parameters(), model.parameters()))
    # checkpoints that do not fit: the model untouched
    third, _, _ = _sharded(3)
    kept = {n: p.full_tensor().clone() for n, p in third.named_parameters()}
    for bad in ("missing", "shape"):
        try:
            partir_torch.load(third, where / bad)
            out[bad] = "loaded"
        except partir_torch.PartirError as e:
            out[bad] = str(e)
    out["untouched"] = max((p.full_tensor() - kept[n]).abs().max().item() for n, p in third.named_parameters())
    return out


@pytest.fixture(scope="module")
def loaded(two, tmp_path_factory):
    from safetensors.torch import save_file

    where = tmp_path_factory.mktemp("load")
    model = gpt2(0)
    model.save_pretrained(where / "hf")
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # (tied: as HF saves)
    (where / "missing").mkdir()
    gone = "transformer.h.1.mlp.c_fc.bias"
    save_file({k: v for k, v in sd.items() if k != gone}, where / "missing" / "m.safetensors")
    (where / "shape").mkdir()
    save_file({**sd, "transformer.wpe.weight": torch.zeros(16, 32)}, where / "shape" / "m.safetensors")
    return two.run(load_case, where)


def test_a_save_pretrained_directory_loads_into_the_sharded_model_exactly(loaded):
    for r in loaded:
        assert r["split"], "Megatron splits the blocks' weights: the check would read whole tensors only"
        assert r["before"] > 1e-3  # other weights before the load: the check is not vacuous
        assert r["hf"] == 0.0, r["hf"]
        a, b = r["loss"]
        assert abs(a - b) <= 1e-5 * abs(b), r["loss"]


def test_each_rank_reads_its_slices_not_the_whole_tensors(loaded):
    for r in loaded:
        read, whole, n = r["read"]
        assert n > 10 and read < 0.75 * whole, r["read"]  # split tensors read in halves, replicated ones whole


def test_a_dcp_checkpoint_of_a_sharded_model_loads_into_another(loaded):
    assert all(r["dcp"] == 0.0 for r in loaded), [r["dcp"] for r in loaded]


def test_a_checkpoint_that_does_not_fit_names_the_keys_and_shapes_and_changes_nothing(loaded):
    for r in loaded:
        assert "missing ['transformer.h.1.mlp.c_fc.bias']" in r["missing"], r["missing"]
        assert "transformer.wpe.weight: checkpoint [16, 32], model [32, 32]" in r["shape"], r["shape"]
        assert r["untouched"] == 0.0
