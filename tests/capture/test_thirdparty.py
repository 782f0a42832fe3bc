"""Real third-party models: HF transformers GPT-2, Llama, BERT (built from configs) and torchvision ResNet-18."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import partir_torch
from partir_torch.capture import capture
from tests import needs

transformers = needs.need("transformers")
torchvision = needs.need("torchvision")


def _causal_lm_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def _mlm_loss(model, ids, mask, labels):
    # BERT warns on padding by reading token values unless an attention mask is given
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def _ce(model, x, y):
    return F.cross_entropy(model(x), y)


def _hf(name):
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg), 12
    if name == "llama":
        cfg = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
        )
        return transformers.LlamaForCausalLM(cfg), 9
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        vocab_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager",  # the sdpa path checks `torch.all(mask == 1)`: a data-dependent branch
    )
    return transformers.BertForMaskedLM(cfg), 16  # per layer: q, k, v, out dense, 2 LayerNorms, 2 FFN dense; w+b


@pytest.mark.thirdparty
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hf_models_capture_and_match_eager(name):
    model, n_groups = _hf(name)
    ids = torch.randint(0, 128, (2, 16))
    if name == "bert":
        inputs, loss_fn = (ids, torch.ones_like(ids), ids), _mlm_loss
    else:
        inputs, loss_fn = (ids, ids), _causal_lm_loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    p = capture(model, inputs, loss_fn, opt)
    assert len(p.groups) == n_groups, [g.key for g in p.groups]

    # the captured step computes what eager HF + torch.optim compute (first step: zero states, step 0)
    params = {n: q.detach().clone() for n, q in model.named_parameters()}
    states = {n: {"exp_avg": torch.zeros_like(q), "exp_avg_sq": torch.zeros_like(q), "step": torch.tensor(0.0)}
              for n, q in model.named_parameters()}
    out = p.run(params, dict(model.named_buffers()), inputs, states)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    loss = loss_fn(ref, *inputs)
    loss.backward()
    ref_opt.step()
    assert out[p.loss].item() == pytest.approx(loss.item(), abs=1e-5)
    for n, q in ref.named_parameters():
        torch.testing.assert_close(out[p.value(f"updated[{n}]").id], q.detach(), atol=1e-5, rtol=1e-4)


@pytest.mark.thirdparty
def test_torchvision_resnet18():
    model = torchvision.models.resnet18(num_classes=10)
    p = capture(model, (torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))), _ce, "sgd")
    # layer1's two BasicBlocks are identical (conv1, bn1 w/b, conv2, bn2 w/b); later stages start with a
    # strided, downsampling block, so their two blocks differ
    assert [g.key for g in p.groups] == [
        "layer1.*.conv1.weight", "layer1.*.bn1.weight", "layer1.*.bn1.bias",
        "layer1.*.conv2.weight", "layer1.*.bn2.weight", "layer1.*.bn2.bias",
    ]
    assert "updated[layer4.1.bn2.running_mean]" in {v.name for v in p.values}
    assert p.op_counts()["aten.convolution_backward.default"] == 20


@pytest.mark.thirdparty
def test_library_checks_on_tensor_values_are_passed_on_the_library_s_compiled_path():
    """HF's SDPA mask check (`torch.all(mask == 1)`) and padding check stop a shape-only trace; the library skips
    them when compiled, so the capture takes that path by itself (one warning; `program.compiling`, which the
    backends follow), no flag needed: a user's HF model plans with no extra argument."""
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 8))
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=128))
    with pytest.warns(UserWarning, match=r"compiled path .*torch\.all\(mask == 1\)"):
        p = capture(bert, (ids, mask, ids), _mlm_loss, "adamw")
    assert p.compiling and "aten._safe_softmax.default" in p.op_counts()  # SDPA with the mask, in its math form
    same = capture(bert, (ids, mask, ids), _mlm_loss, "adamw", assume_compiling=True)
    assert same.content_hash() == p.content_hash()
    with pytest.warns(UserWarning, match="compiled path"):
        plan = partir_torch.find_plan(bert, (ids, mask, ids), "batch=2", loss_fn=_mlm_loss, budget=2)
    assert plan.inputs and plan.compiling  # (auto_shard and Lightning apply it on the same path)
    no_mask = transformers.BertForMaskedLM(bert.config)  # the padding check on input ids alone (no mask given)
    with pytest.warns(UserWarning, match=r"compiled path .*pad_token_id in input_ids"):
        capture(no_mask, (ids, ids), lambda m, i, y: m(input_ids=i, labels=y).loss, "adamw")

    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        encoder_layers=1, decoder_layers=1, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=128, max_position_embeddings=64))
    loss = lambda m, x, y: m(input_ids=x, labels=y).loss  # noqa: E731
    train = capture(bart.train(), (ids, ids), loss, "adamw", assume_compiling=True)  # LayerDrop's draw: every
    evals = capture(bart.eval(), (ids, ids), loss, "adamw", assume_compiling=True)  # layer kept (capture/draws)
    mms = ("aten.addmm.default", "aten.mm.default", "aten.bmm.default")
    assert [train.op_counts()[m] for m in mms] == [evals.op_counts()[m] for m in mms]
    assert train.op_counts()["aten.bernoulli.p"] > 0 == evals.op_counts().get("aten.bernoulli.p", 0)  # (dropout)
