"""A training loop on the torch backend (`backends/distributed/steps.py`, `variants.py`): the model's own
forward for evaluation, steps with clipping and accumulation, a batch of another shape, equal to the unsharded
loop doing the same; and every way a DDP habit or a torch API would go wrong said, never silent.

On 4 gloo ranks, HF GPT-2 and Llama from configs under a searched, memory-limited plan on {batch:2, model:2}.
One sharded model per architecture runs the whole loop (`loop_case`); each test reads its part."""

from __future__ import annotations

import copy

import pytest
import torch

from tests import needs

pytestmark = pytest.mark.engine
CLIP = 0.05  # small enough to clip every step of these models (their gradient norms are 0.5-2)


def hf(name: str):
    transformers = needs.need("transformers")
    torch.manual_seed(0)
    if name == "hf-gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=64)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                       max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(3, 128, (8, 16))
    return model, ids


def _lm_loss(model, ids):
    return model(ids, labels=ids).loss


def loop_case(rank, world, name):
    """Shard under a searched plan (0.6 x the replicated peak, clipping in the step), then evaluate, train 3
    steps (one plain, two of 2 microbatches), train on a batch of 6, try a batch of 5; beside the unsharded
    eager loop doing the same (`clip_grad_norm_`, two backward calls)."""
    import partir_torch
    from tests.backends.test_distributed import replicated_peak

    model, ids = hf(name)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    limit = 0.6 * replicated_peak(model, (ids,), _lm_loss, "batch=2,model=2")
    model, opt = partir_torch.auto_shard(model, (ids,), "batch=2,model=2", loss_fn=_lm_loss, optimizer=opt,
                                         memory=limit, budget=30, max_grad_norm=CLIP, cache=False, progress=False)
    plan = model.partir_plan
    out = {"sharded": sorted(n for n, s in plan.params.items() if any(s)) + sorted(
        f"{n}.{k}" for n, st in plan.optimizer_state.items() for k, s in st.items() if any(s))}
    model.eval(), ref.eval()
    with torch.no_grad():
        got, want = model(ids), ref(ids)
    out["eval"] = (got.logits - want.logits).abs().max().item() / want.logits.abs().max().item()
    out["eval_type"] = type(got).__name__
    model.train(), ref.train()

    def ref_step(batch, k):
        rng = torch.get_rng_state()
        total = 0.0
        for part in batch.chunk(k):
            loss = _lm_loss(ref, part) / k
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()
        torch.set_rng_state(rng)  # the sharded step draws the same dropout masks
        return total

    out["losses"] = []
    for batch, k in ((ids, 1), (ids, 2), (ids, 2), (ids[:6], 1)):
        want = ref_step(batch, k)
        got = partir_torch.step(model, opt, batch, accumulate=k).item()
        out["losses"].append((got, want))
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    out["params"] = max(((full[n] - p).abs().max() / p.abs().max().clamp(min=1)).item()
                        for n, p in ref.named_parameters())
    try:
        partir_torch.step(model, opt, ids[:5])
    except partir_torch.PartirError as e:
        out["five"] = str(e)
        out["five_axes"] = plan.inputs[0][0]  # the axes the plan splits the batch's dim 0 over
    out["clip"] = {}
    for clip in (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_):  # a DDP loop's habit
        try:
            out["clip"][clip.__name__] = f"returned {clip(model.parameters(), 1.0)!r}"
        except Exception as e:  # (the test reads what was raised)
            out["clip"][clip.__name__] = f"raised {type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module", params=["hf-gpt2", "hf-llama"])
def loop(request, four):
    return four.run(loop_case, request.param)


def test_the_plan_shards_the_weights(loop):
    assert all(r["sharded"] for r in loop), "the memory limit asks for sharded weights or optimizer states"


def test_eval_logits_equal_unsharded(loop):
    for r in loop:
        assert r["eval"] <= 1e-5 and r["eval_type"].startswith("CausalLMOutput"), r["eval"]


def test_clipped_and_accumulated_steps_and_another_batch_train_as_unsharded(loop):
    for r in loop:
        assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in r["losses"]), r["losses"]
        assert r["params"] <= 1e-5, r["params"]


def test_a_batch_the_plan_does_not_divide_names_the_dim_the_axis_and_drop_last(loop):
    for r in loop:
        axes = r["five_axes"] if isinstance(r["five_axes"], list) else [r["five_axes"]]
        assert "batch tensor 0 has 5 at dim 0" in r["five"] and "drop_last=True" in r["five"], r["five"]
        assert axes and all(f"'{a}'" in r["five"] for a in axes), (axes, r["five"])


def test_clipping_a_sharded_model_s_gradients_by_hand_raises_with_the_option(loop):
    """The gradients live inside the step: torch's clipping on the model's parameters never returns 0 or clips
    nothing silently, it raises naming the option that clips over every shard."""
    for r in loop:
        for name, said in r["clip"].items():
            assert said.startswith("raised ") and "max_grad_norm" in said, (name, said)
