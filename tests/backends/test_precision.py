"""Mixed precision on the torch backend (`Options(param_dtype=..., reduce_dtype=...)`, FSDP2's
`MixedPrecisionPolicy`): the rank program computes in `param_dtype` on casts of the fp32 shards, reduces the
gradients in `reduce_dtype`, updates the fp32 masters; equal to the policy run unsharded by hand.

On 2 gloo ranks. The oracle (`policy_reference`) is the policy written in plain torch on one process: a working
copy with its parameters in `param_dtype`, floating inputs cast at the root forward, gradients cast back onto
the masters, the optimizer on the masters. bf16 rounds sums taken in another order by ~4e-3, so a bf16 run is
held to the issue's 1e-3 on the losses and checked for what it computes in (the rank graph's dtypes) and sends
(bytes as predicted); the masters' exactness is held where rounding allows it: fp64 masters computing in fp32."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.engine


def make_opt(kind, params):
    return torch.optim.AdamW(params, lr=1e-3) if kind == "adamw" else torch.optim.SGD(params, lr=0.1, momentum=0.9)


def policy_reference(model, inputs, loss_fn, pdt, steps, kind):
    master = copy.deepcopy(model)
    opt = make_opt(kind, master.parameters())

    def cast(mod, args, kwargs):
        return tuple(x.to(pdt) if x.is_floating_point() else x for x in args), kwargs

    losses = []
    for _ in range(steps):
        work = copy.deepcopy(master)
        for p in work.parameters():
            p.data = p.data.to(pdt)
        handle = work.register_forward_pre_hook(cast, with_kwargs=True)
        loss = loss_fn(work, *inputs)
        loss.backward()
        handle.remove()
        for mp, wp in zip(master.parameters(), work.parameters()):
            mp.grad = wp.grad.to(mp.dtype)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, master


def policy_case(rank, world, name, schedule, mesh, masters, kind="adamw"):
    """3 steps of `name` under `schedule` with bf16 compute and fp32 reductions (`masters`="float32"), or fp32
    compute on fp64 masters ("float64"); the rank graph's dtypes and the bytes it sent."""
    import partir_torch
    from partir_torch import _compat, models
    from partir_torch.backends.distributed.engine import sharded

    torch.manual_seed(0)
    if name.startswith("hf-"):
        from tests.backends.test_steps import _lm_loss, hf

        model, ids = hf(name)
        inputs, loss_fn = (ids,), _lm_loss
    else:
        model, inputs, loss_fn = models.build(name, device="cpu")
    model = model.to(getattr(torch, masters))
    pdt, rdt = (torch.bfloat16, torch.float32) if masters == "float32" else (torch.float32, None)
    ref_losses, ref = policy_reference(model, inputs, loss_fn, pdt, 3, kind)
    opt = make_opt(kind, model.parameters())
    model, opt = partir_torch.auto_shard(model, inputs, mesh, loss_fn=loss_fn, optimizer=opt, schedule=schedule,
                                         param_dtype=pdt, reduce_dtype=rdt, cache=False, progress=False)
    report = partir_torch.verify(model, inputs)
    out = {"bytes": [(r["predicted"], r["measured"]) for r in report.by_axis]}
    graph = sharded(model).graph
    ops = _compat.c10d_functional
    reductions = {ops.all_reduce.default, ops.all_reduce_.default, ops.reduce_scatter_tensor.default}
    vals = {n: n.meta.get("val") for n in graph.graph.nodes if n.op == "call_function"}
    out["mm"] = sorted({str(v.dtype) for n, v in vals.items()
                        if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)})
    out["reduced"] = {}  # bytes reduced per dtype
    for n, v in vals.items():
        if n.target in reductions:
            out["reduced"][str(v.dtype)] = out["reduced"].get(str(v.dtype), 0) + v.numel() * v.element_size()
    out["losses"] = [float(partir_torch.step(model, opt, *inputs)) for _ in range(3)]
    out["ref_losses"] = ref_losses
    if name.startswith("hf-"):  # evaluation runs under the policy too: its logits in param_dtype
        model.eval()
        with torch.no_grad():
            logits = model(*inputs).logits
    back = partir_torch.unshard(model)
    out["masters"] = sorted({str(p.dtype) for p in back.parameters()})
    out["params"] = max((p - r).abs().max().item() for p, r in zip(back.parameters(), ref.parameters()))
    if name.startswith("hf-"):  # against the unsharded model's bf16 working copy, in eager
        work = copy.deepcopy(back).eval()
        for p in work.parameters():
            p.data = p.data.to(pdt)
        with torch.no_grad():
            want = work(*inputs).logits
        out["eval_dtype"] = str(logits.dtype)
        out["eval"] = ((logits.float() - want.float()).abs().max() / want.float().abs().max()).item()
    return out


CASES = [("tiny-gpt2", "batch:FSDP", "batch=2"), ("tiny-gpt2", "model:Megatron", "model=2"),
         ("tiny-llama", "batch:FSDP", "batch=2")]


@pytest.mark.parametrize(("name", "schedule", "mesh"), CASES)
def test_bf16_compute_fp32_reductions_and_masters(two, name, schedule, mesh):
    out = two.run(policy_case, name, schedule, mesh, "float32")[0]
    assert out["mm"] == ["torch.bfloat16"]  # every matmul of the step in bf16 (none left in fp32)
    red = out["reduced"]
    if schedule == "batch:FSDP":  # the weight gradients reduced in fp32, as reduce_dtype says (a tied
        # embedding's two summands and a position table's summed gradient are reduced before the cast: bf16)
        assert red.get("torch.float32", 0) > 2 * red.get("torch.bfloat16", 0), red
    else:  # Megatron reduces activations only: in the dtype they are computed in
        assert set(red) == {"torch.bfloat16"}, red
    assert all(p == m for p, m in out["bytes"]), out["bytes"]
    assert out["masters"] == ["torch.float32"]
    for got, want in zip(out["losses"], out["ref_losses"]):
        assert abs(got - want) <= 1e-3 * abs(want), (out["losses"], out["ref_losses"])


@pytest.mark.parametrize(("name", "schedule", "mesh"), CASES[::2])
def test_fp64_masters_computing_in_fp32_match_exactly(two, name, schedule, mesh):
    """SGD with momentum: AdamW turns the rounding noise of a gradient that is zero in exact arithmetic
    (attention's key bias) into steps of +-lr, whichever engine computes it."""
    out = two.run(policy_case, name, schedule, mesh, "float64", "sgd")[0]
    assert out["mm"] == ["torch.float32"] and out["masters"] == ["torch.float64"]
    assert out["params"] <= 1e-5, out["params"]
    for got, want in zip(out["losses"], out["ref_losses"]):
        assert abs(got - want) <= 1e-5 * abs(want), (out["losses"], out["ref_losses"])


@pytest.mark.thirdparty
def test_hf_gpt2_under_the_bf16_policy(two):
    out = two.run(policy_case, "hf-gpt2", "batch:FSDP", "batch=2", "float32")[0]
    assert out["mm"] == ["torch.bfloat16"] and out["masters"] == ["torch.float32"]
    assert out["eval_dtype"] == "torch.bfloat16" and out["eval"] <= 2e-2, out["eval"]
    assert all(p == m for p, m in out["bytes"]), out["bytes"]
    for got, want in zip(out["losses"], out["ref_losses"]):
        assert abs(got - want) <= 1e-3 * abs(want), (out["losses"], out["ref_losses"])
