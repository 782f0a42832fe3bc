"""`auto_shard` in the test process, as users call it: shardings on the device tensors, training equal to
unsharded, meta models materialized sharded, nothing changed when it fails, `unshard` restores."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import partir_torch
from partir_torch import models
from partir_torch.errors import PartirError
from partir_torch.plan import PlanMismatchError
from partir_torch.search.api import search
from tests import needs

pytestmark = pytest.mark.xla
MESH = {"batch": 2, "model": 4}


class Tagger(nn.Module):
    """Not a zoo model: embedding, a GRU-free MLP mixer, a tied output head, a buffer."""

    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.scale * self.mix(h))


def tagger_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def _tagger():
    torch.manual_seed(0)
    model = Tagger()
    batch = (torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16)))
    return model, batch


def _train(model, opt, loss_fn, batch, steps, shard: bool):
    import torch_xla

    losses = []
    for _ in range(steps):
        xs = partir_torch.shard_batch(model, *batch) if shard else batch
        loss = loss_fn(model, *xs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if shard:
            torch_xla.sync()
        losses.append(float(loss.detach().cpu()))
    return losses


def test_auto_shard_trains_like_unsharded_and_unshard_gives_the_trained_weights_back():
    from partir_torch.backends.xla import sharding_of

    model, batch = _tagger()
    ref = copy.deepcopy(model)
    own = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    plan = search(model, batch, MESH, loss_fn=tagger_loss, optimizer="sgd",
                  schedule="batch:BatchParallel;model:Megatron")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, sopt = partir_torch.auto_shard(model, batch, MESH, backend="xla",
                                          loss_fn=tagger_loss, optimizer=opt, plan=plan)
    assert model.partir_plan is plan
    assert next(model.parameters()).device.type == "xla"
    assert model.head.weight is model.embed.weight  # still tied
    assert sharding_of(model.mix[1].weight).startswith("{devices=[4,1,2]")  # rows over model, batch replicated
    assert list(model.state_dict()) == keys
    losses = _train(model, sopt, tagger_loss, batch, 3, shard=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_losses = _train(ref, ref_opt, tagger_loss, batch, 3, shard=False)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert losses[-1] < losses[0]
    partir_torch.unshard(model)
    assert not hasattr(model, "partir_plan")
    assert list(model.state_dict()) == keys
    for n, p in model.named_parameters():
        assert p is own[n] and p.device.type == "cpu"  # the caller's own Parameter objects, trained
        torch.testing.assert_close(p, dict(ref.named_parameters())[n], rtol=1e-5, atol=1e-6)


def test_a_tied_weight_the_plan_gathers_is_handed_gathered_to_both_its_modules_and_given_back():
    """FSDP gathers the tied embedding / head weight once for the forward: the model around both modules
    hands them one constrained copy and puts the Parameter back after its forward."""
    model, batch = _tagger()
    ref = copy.deepcopy(model)
    plan = search(model, batch, MESH, loss_fn=tagger_loss, optimizer="sgd", schedule="batch:BatchParallel;model:FSDP")
    assert "embed.weight" in plan.param_reads and any(plan.params["embed.weight"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, sopt = partir_torch.auto_shard(model, batch, MESH, backend="xla",
                                          loss_fn=tagger_loss, optimizer=opt, plan=plan)
    tied = model.embed.weight
    losses = _train(model, sopt, tagger_loss, batch, 3, shard=True)
    assert model.embed._parameters["weight"] is tied and model.head._parameters["weight"] is tied
    ref_losses = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), tagger_loss, batch, 3,
                        shard=False)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_a_zero_plan_holds_sharded_optimizer_states_on_the_device():
    """The states' shardings are read from the tensors XLA holds, not from the plan."""
    from partir_torch.backends.xla import sharding_of

    model, batch = _tagger()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, sopt = partir_torch.auto_shard(model, batch, MESH, backend="xla", loss_fn=tagger_loss, optimizer=opt,
                                          schedule="batch:BatchParallel;model:ZeRO(1)")
    w = model.mix[1].weight
    assert sharding_of(w) in ("", "{replicated}")  # ZeRO-1: parameters replicated,
    assert "devices=" in sharding_of(sopt.state[w]["exp_avg"])  # ... their Adam states sharded
    assert "devices=" in sharding_of(sopt.state[w]["exp_avg_sq"])
    assert type(sopt) is torch.optim.AdamW and sopt.param_groups[0]["lr"] == 1e-3
    assert sopt.param_groups[0]["weight_decay"] == opt.param_groups[0]["weight_decay"]
    assert not opt.state  # the caller's optimizer is not touched
    partir_torch.unshard(model)


def test_a_weight_tiled_on_every_dim_with_an_axis_left_over_is_placed_whole_and_right():
    """torch_xla cannot send such a tensor by shards (tests/backends/test_xla_known_bugs.py): it is moved whole,
    then split; its values and sharding on the device are the plan's."""
    from partir_torch.backends.xla import sharding_of
    from partir_torch.tactics import Manual

    model, batch = _tagger()
    want = model.mix[1].weight.detach().clone()
    model, _ = partir_torch.auto_shard(model, batch, {"batch": 2, "model": 2, "x": 2}, backend="xla",
                                       loss_fn=tagger_loss,
                                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                       schedule=[Manual({"mix.1.weight": ["x", "batch"]})])
    w = model.mix[1].weight
    assert model.partir_plan.params["mix.1.weight"] == ["x", "batch"]
    assert "last_tile_dim_replicate" in sharding_of(w) and torch.equal(w.detach().cpu(), want)
    partir_torch.unshard(model)


def test_a_meta_model_is_materialized_sharded_without_a_full_host_copy():
    from torch.utils._python_dispatch import TorchDispatchMode

    from partir_torch.backends.xla import sharding_of

    biggest = 0

    class HostAllocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal biggest
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else [out]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and type(t) is torch.Tensor:
                    biggest = max(biggest, t.numel())
            return out

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))
    x = torch.randn(8, 64, device="meta")

    def loss_fn(m, x):
        return m(x).square().mean()

    plan = search(model, (x,), MESH, loss_fn=loss_fn, optimizer="sgd", schedule="model:Megatron")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HostAllocations():
        model, _ = partir_torch.auto_shard(model, (x,), MESH, backend="xla", loss_fn=loss_fn, optimizer=opt, plan=plan)
    assert biggest < 512 * 64  # no weight was made whole on the host
    assert "devices=[4,1,2]" in sharding_of(model[0].weight)
    assert "devices=[1,4,2]" in sharding_of(model[2].weight)
    w = model[0].weight.detach().cpu()
    assert w.abs().max() > 0 and w.std() > 0.01  # initialized by reset_parameters, not left empty
    partir_torch.unshard(model)


def test_a_failing_auto_shard_leaves_the_model_and_optimizer_as_they_were():
    model, batch = _tagger()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tagger_loss(model, *batch).backward()
    opt.step()
    opt.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(opt.state_dict())
    other = search(model, batch, {"batch": 8}, loss_fn=tagger_loss, optimizer="adamw", schedule="batch:BatchParallel")
    with pytest.raises(PlanMismatchError, match=r"the plan is for mesh \{'batch': 8\}, not \{'batch': 2, 'model': 4\}"):
        partir_torch.auto_shard(model, batch, MESH, backend="xla", loss_fn=tagger_loss, optimizer=opt, plan=other)
    stranger = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(3))], lr=0.1)
    plan = search(model, batch, MESH, loss_fn=tagger_loss, optimizer="sgd", schedule="batch:BatchParallel")
    with pytest.raises(PartirError, match=r"holds a tensor of shape \[3\] that is not a parameter of the model"):
        partir_torch.auto_shard(model, batch, MESH, backend="xla", loss_fn=tagger_loss, optimizer=stranger, plan=plan)
    # failures after the model was moved: in the optimizer's rebuild, and in the model's hooks
    damped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    with pytest.raises(PartirError, match=r"SGD with dampening != 0 .* use dampening=0"):
        partir_torch.auto_shard(model, batch, MESH, backend="xla", loss_fn=tagger_loss, optimizer=damped, plan=plan)
    plan.activations = {**plan.activations, "mix.9": [None, None, None]}
    with pytest.raises(PartirError, match=r"constrains the output of module 'mix.9', which this model does not have"):
        partir_torch.auto_shard(model, batch, MESH, backend="xla", loss_fn=tagger_loss, optimizer=opt, plan=plan)
    assert partir_torch.backends.xla.sharded(model) is None and not hasattr(model, "partir_plan")
    for k, v in model.state_dict().items():
        assert v.device.type == "cpu"
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert all(p.device.type == "cpu" for p in model.parameters())
    after = opt.state_dict()
    for i, st in state["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(after["state"][i][k], v, rtol=0, atol=0)


def test_bad_requests_are_named():
    model, batch = _tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = search(model, batch, MESH, loss_fn=tagger_loss, optimizer="sgd", schedule="batch:BatchParallel")
    with pytest.raises(PartirError,
                       match=r"the mesh needs 16 devices, but torch_xla's runtime has 8 .*CPU_NUM_DEVICES=16"):
        partir_torch.auto_shard(model, batch, {"batch": 4, "model": 4}, backend="xla",
                                loss_fn=tagger_loss, optimizer=opt)
    with pytest.raises(PartirError, match=r"optimizer must be your torch.optim optimizer"):
        partir_torch.auto_shard(model, batch, MESH, backend="xla", loss_fn=tagger_loss, optimizer="adamw")
    model, _ = partir_torch.auto_shard(model, batch, MESH, backend="xla", loss_fn=tagger_loss, optimizer=opt, plan=plan)
    with pytest.raises(PartirError, match=r"already sharded by partir_torch; call partir_torch.unshard\(model\) first"):
        partir_torch.auto_shard(model, batch, MESH, backend="xla", loss_fn=tagger_loss, optimizer=opt, plan=plan)
    with pytest.raises(PartirError, match=r"input 0 has shape \[3, 16\], the plan was made for \[8, 16\]: "
                                          r"input 0 dim 0 \(size 3\) does not divide over \['batch'\].*drop_last=True"):
        model(batch[0][:3])
    from partir_torch.backends.xla import sharded

    model(batch[0])  # the next, good batch runs with the plan's constraints again (the failed call left none)
    assert sharded(model).lowerings.depth == 0 and sharded(model).lowerings.calls.counts
    partir_torch.unshard(model)


def test_a_smaller_batch_that_still_divides_is_sharded_as_planned_with_a_warning(caplog):
    import torch_xla

    model, batch = _tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = search(model, batch, MESH, loss_fn=tagger_loss, optimizer="sgd", schedule="batch:BatchParallel")
    small = (batch[0][:4], batch[1][:4])
    ref = copy.deepcopy(model)
    model, _ = partir_torch.auto_shard(model, batch, MESH, backend="xla", loss_fn=tagger_loss, optimizer=opt, plan=plan)
    with caplog.at_level(logging.WARNING):
        loss = tagger_loss(model, *partir_torch.shard_batch(model, *small))
        torch_xla.sync()
    assert "input 0 has shape [4, 16], the plan was made for [8, 16]: sharded as planned" in caplog.text
    assert float(loss.detach()) == pytest.approx(float(tagger_loss(ref, *small).detach()), rel=1e-5)
    spec = partir_torch.api.input_sharding(plan, 0)
    assert spec.partition_spec == ("batch", None) and spec.can_apply(batch[0])
    partir_torch.unshard(model)


def test_a_saved_plan_applies_in_another_call_and_a_plan_for_another_model_is_refused(tmp_path):
    model, batch = _tagger()
    plan = search(model, batch, "batch=2:dcn,model=4", loss_fn=tagger_loss, optimizer="sgd",
                  schedule="batch:BatchParallel;model:Megatron")
    assert plan.dcn_axes == ["batch"]
    plan.save(tmp_path / "plan.json")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = partir_torch.auto_shard(model, batch, "batch=2:dcn,model=4", backend="xla",
                                       loss_fn=tagger_loss, optimizer=opt,
                                       plan=tmp_path / "plan.json")
    assert model.partir_plan.params == plan.params
    partir_torch.unshard(model)
    gpt, inputs, loss_fn = models.build("tiny-gpt2", device="meta")
    with pytest.raises(PlanMismatchError, match=r"parameters in the plan but not in the model: embed.weight"):
        partir_torch.auto_shard(gpt, inputs, MESH, backend="xla",
                                loss_fn=loss_fn, optimizer=torch.optim.SGD(gpt.parameters()),
                                plan=tmp_path / "plan.json")


def test_without_torch_xla_the_error_says_how_to_install_the_pinned_pair(monkeypatch):
    import sys

    for name in ("torch_xla", "torch_xla.distributed.spmd", "torch_xla.runtime"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError, as when it is not installed
    model, batch = _tagger()
    with pytest.raises(PartirError, match=r"needs torch_xla, which is not installed .*dev setup xla.*torch-xla==2.9"):
        partir_torch.auto_shard(model, batch, MESH, loss_fn=tagger_loss, optimizer=torch.optim.SGD(model.parameters()),
                                backend="xla")
    assert next(model.parameters()).device.type == "cpu"
    # the default backend is torch.distributed, which says how to start its ranks
    with pytest.raises(PartirError, match=r"no torch.distributed process group: start one with torchrun"):
        partir_torch.auto_shard(model, batch, MESH, loss_fn=tagger_loss, optimizer=torch.optim.SGD(model.parameters()))
    assert next(model.parameters()).device.type == "cpu"


_START = """
import logging, os, sys
import torch
if sys.argv[1] == "started":
    import torch_xla, torch_xla.runtime as xr
    xr.use_spmd()
    (torch.ones(2, device=torch_xla.device()) + 1).cpu()  # the user's own first XLA step starts the runtime
from partir_torch.backends import xla
logging.basicConfig(level=logging.WARNING, format="%(message)s")
print("note:", xla.start_runtime(8))
import torch_xla
(torch.ones(4, device=torch_xla.device()) * 2).cpu()  # one compile, dumped where XLA_FLAGS says
"""


@pytest.mark.parametrize("case", ["fresh", "user-chose", "started"])
def test_on_the_cpu_xla_compiles_with_its_memory_aware_scheduler_or_says_why_not(case, tmp_path):
    """XLA CPU's default scheduler trades memory for concurrency (on the searched tiny GNS plan: 1.44 of the
    predicted per-device memory, 1.22 with this one); `start_runtime` picks the memory-aware one before the
    runtime starts, keeps a scheduler the user chose, and warns when the runtime started before it could."""
    import os
    import subprocess
    import sys

    from partir_torch.backends.xla import MEMORY_SCHEDULER

    dump = tmp_path / "dump"
    flags = f"--xla_dump_to={dump} --xla_dump_hlo_pass_re=^$"
    if case == "user-chose":
        flags += " --xla_cpu_enable_concurrency_optimized_scheduler=true"
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_USE_SPMD")}
    env.update(XLA_FLAGS=flags, **({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8"} if case == "started" else {}))
    res = subprocess.run([sys.executable, "-c", _START, case], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    options = "".join(f.read_text() for f in dump.glob("*.debug_options"))  # what XLA compiled with
    assert "xla_dump_to" in options  # the user's own flags are kept
    chose = "xla_cpu_enable_concurrency_optimized_scheduler: false" in options
    assert chose == (case == "fresh"), options
    assert (MEMORY_SCHEDULER in res.stdout) == (case == "fresh"), res.stdout
    warned = "started without XLA CPU's memory-aware scheduler" in res.stderr
    assert warned == (case == "started") and (not warned or MEMORY_SCHEDULER in res.stderr), res.stderr[-2000:]


@pytest.mark.parametrize("shape,groups", [((4, 8, 5, 5), 4), ((2, 6, 7), 3), ((3, 4), 2)])
def test_the_norm_lowerings_compute_what_torch_does(shape, groups):
    """The lowerings `shard_module` runs instead of torch_xla's batch-norm forms are the same math."""
    from partir_torch.backends.xla.lowerings import _batch_norm, _group_norm, _instance_norm, _layer_norm

    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64)
    w, b = torch.randn(shape[1], dtype=torch.float64), torch.randn(shape[1], dtype=torch.float64)
    torch.testing.assert_close(_group_norm(x, groups, w, b, 1e-5), F.group_norm(x, groups, w, b, 1e-5))
    torch.testing.assert_close(_group_norm(x, groups), F.group_norm(x, groups))
    lw, lb = torch.randn(shape[-1], dtype=torch.float64), torch.randn(shape[-1], dtype=torch.float64)
    torch.testing.assert_close(_layer_norm(x, (shape[-1],), lw, lb), F.layer_norm(x, (shape[-1],), lw, lb))
    for training in (True, False):  # batch norm, with the running statistics it updates
        ours = [torch.randn(shape[1], dtype=torch.float64), torch.rand(shape[1], dtype=torch.float64) + 0.5]
        theirs = [t.clone() for t in ours]
        torch.testing.assert_close(_batch_norm(x, *ours, w, b, training, 0.3, 1e-5),
                                   F.batch_norm(x, *theirs, w, b, training, 0.3, 1e-5))
        torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(_batch_norm(x, None, None, training=True), F.batch_norm(x, None, None, training=True))
    if len(shape) > 2:  # instance norm, with and without running statistics
        for use_input_stats in (True, False):
            ours = [torch.randn(shape[1], dtype=torch.float64), torch.rand(shape[1], dtype=torch.float64) + 0.5]
            theirs = [t.clone() for t in ours]
            torch.testing.assert_close(_instance_norm(x, *ours, w, b, use_input_stats, 0.3, 1e-5),
                                       F.instance_norm(x, *theirs, w, b, use_input_stats, 0.3, 1e-5))
            torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(_instance_norm(x), F.instance_norm(x))
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    gy = torch.randn_like(x)
    grads = [torch.autograd.grad(bn(xs, None, None, ws, bs, True), (xs, ws, bs), gy)
             for bn in (_batch_norm, F.batch_norm)]
    torch.testing.assert_close(*grads)  # (the backward's own: `_BatchNormTraining`)


@pytest.mark.parametrize(("transposed", "d", "cin", "cout", "k", "stride", "padding", "dilation", "groups"), [
    (False, 2, 16, 16, 3, 1, 1, 1, 4),  # a plain convolution per group
    (False, 2, 16, 32, 3, 2, 0, 1, 8),  # a depthwise convolution per channel of a group
    (False, 2, 8, 16, 4, 1, "same", 2, 8),  # depthwise with a multiplier, an even kernel padded 'same'
    (False, 1, 6, 6, 5, 2, 2, 1, 6),
    (False, 3, 4, 8, 3, 1, 1, 1, 2),
    (False, 2, 8, 8, 5, 3, 4, 3, 8),  # offsets whose window reads only padding
    (True, 2, 16, 8, 2, 2, 0, 1, 2),
    (True, 2, 8, 8, 3, 2, 1, 1, 4),
    (True, 2, 8, 16, 3, 2, 1, 2, 8),
    (True, 1, 6, 6, 5, 3, 2, 2, 6),
])
def test_the_grouped_convolution_lowerings_compute_what_torch_does(transposed, d, cin, cout, k, stride, padding,
                                                                   dilation, groups):
    """The backend's grouped convolutions (`xla._grouped_conv`, `_grouped_conv_transpose`, `_GroupedConv`)
    give torch's outputs and input, weight and bias gradients."""
    from partir_torch.backends.xla.lowerings import _CONV, _CONV_T, _grouped_conv, _grouped_conv_transpose

    torch.manual_seed(0)
    x = torch.randn(3, cin, *[9] * d, dtype=torch.float64, requires_grad=True)
    shape = (cin, cout // groups) if transposed else (cout, cin // groups)
    w = torch.randn(*shape, *[k] * d, dtype=torch.float64, requires_grad=True)
    b = torch.randn(cout, dtype=torch.float64, requires_grad=True)
    if transposed:
        args = (stride, padding, 1 if stride > 1 else 0, groups, dilation)
        ours, theirs = _grouped_conv_transpose(d), _CONV_T[d]
    else:
        args = (stride, padding, dilation, groups)
        ours, theirs = _grouped_conv(d), _CONV[d]
    got, want = ours(x, w, b, *args), theirs(x, w, b, *args)
    torch.testing.assert_close(got, want)
    gy = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, (x, w, b), gy), torch.autograd.grad(want, (x, w, b), gy))


@pytest.mark.parametrize("name", ["layer_norm", "group_norm", "batch_norm", "instance_norm",
                                  "scaled_dot_product_attention"])
def test_the_lowerings_take_the_torch_functions_arguments_by_position_and_by_keyword(name):
    """A lowering is called in place of the torch function with the caller's own arguments: HF ALBERT calls
    `F.scaled_dot_product_attention(query=..., key=..., value=...)`, which failed with another parameter name."""
    import inspect

    from partir_torch.backends.xla import Lowerings

    torch.manual_seed(0)
    func = getattr(F, name)
    low = Lowerings().table[func]
    ours = list(inspect.signature(low).parameters)
    try:
        theirs = list(inspect.signature(func).parameters)
    except ValueError:  # a builtin: its documented signature
        theirs = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    assert ours == theirs[:len(ours)], (ours, theirs)
    x = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    w, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    cases = {
        "layer_norm": [dict(input=x, normalized_shape=(8,), weight=w, bias=b, eps=1e-5)],
        "group_norm": [dict(input=x, num_groups=2, weight=w[:4], bias=b[:4])],
        "batch_norm": [dict(input=x, running_mean=None, running_var=None, weight=w[:4], bias=b[:4], training=True,
                            momentum=0.2, eps=1e-3)],
        "instance_norm": [dict(input=x, running_mean=None, running_var=None, weight=w[:4], bias=b[:4],
                               use_input_stats=True, momentum=0.2, eps=1e-3)],
        "scaled_dot_product_attention": [
            dict(query=x, key=x.flip(-2), value=x * 2, is_causal=True, scale=0.3),
            dict(query=x, key=x, value=x, attn_mask=torch.rand(6, 6) > 0.3),
            dict(query=x, key=x[:, :2], value=x[:, :2], attn_mask=torch.randn(6, 6, dtype=torch.float64),
                 enable_gqa=True)],
    }
    for kw in cases[name]:
        torch.testing.assert_close(low(**kw), func(**kw))
        first = next(iter(kw))
        torch.testing.assert_close(low(kw[first], **{k: v for k, v in kw.items() if k != first}), func(**kw))


class Dropper(nn.Module):
    """Not a zoo model: a linear layer whose output goes through dropout, so the output shows the mask."""

    def __init__(self, d: int = 64, p: float = 0.5) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(x))


def test_dropout_on_the_engine_draws_per_shard_masks_with_dropouts_statistics():
    """docs/apply.md: XLA draws a sharded random tensor per shard from its own generator. What must hold is
    dropout's law: each element dropped with probability p, the kept ones scaled by 1/(1-p), and the shards'
    masks drawn apart (not one mask repeated on every shard)."""
    import torch_xla

    torch.manual_seed(0)
    p, model = 0.5, Dropper()
    x = torch.randn(16, 32, 64)
    plan = search(model, (x,), MESH, loss_fn=lambda m, x: m(x).square().mean(), optimizer="sgd",
                  schedule="batch:BatchParallel;model:BatchParallel")
    assert list(plan.inputs[0][0]) == ["batch", "model"]  # the batch dim split 8 ways
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = partir_torch.auto_shard(model, (x,), MESH, backend="xla",
                                       loss_fn=lambda m, x: m(x).square().mean(), optimizer=opt,
                                       plan=plan)
    (xs,) = partir_torch.shard_batch(model, x)
    model.train()
    y = model(xs)
    model.eval()
    z = model(xs)
    torch_xla.sync()
    y, z = y.cpu(), z.cpu()
    dropped = y == 0
    n = dropped.numel()
    assert abs(dropped.float().mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5
    torch.testing.assert_close(y[~dropped], z[~dropped] / (1 - p))
    shards = dropped.reshape(8, -1)  # the batch is split 8 ways (batch x model): two rows a shard
    assert all(not torch.equal(shards[0], s) for s in shards[1:])


class Detour(nn.Module):
    """Not a zoo model: its forward takes another path on the XLA device than at capture (an extra op, before
    the `cat` or after it: there it makes the shape the capture's next call made)."""

    def __init__(self, d: int = 16, late: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.late = late

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "xla" and not self.late:
            x = x * 1.0
        y = torch.cat([self.a(x), self.b(x)], -1)
        if x.device.type == "xla" and self.late:
            y = y * 1.0
        return y.relu()


def test_calls_counted_on_the_device_match_the_capture_and_a_forward_that_strays_is_left_alone(caplog):
    """The engine numbers a module's calls as the capture did, so each of the plan's call constraints lands on
    its op (every constrained module's calls are met, none lost); a forward that takes another path on the
    device (Detour's extra op shifts its calls) gets no constraint from the stray call on, says so once, and
    still trains like unsharded."""
    import torch_xla

    from partir_torch.backends.xla import sharded

    model, batch = _tagger()
    plan = search(model, batch, MESH, loss_fn=tagger_loss, optimizer="sgd", schedule="batch:BatchParallel;model:FSDP")
    assert plan.calls
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = partir_torch.auto_shard(model, batch, MESH, backend="xla", loss_fn=tagger_loss, optimizer=opt, plan=plan)
    with caplog.at_level(logging.WARNING):
        tagger_loss(model, *partir_torch.shard_batch(model, *batch)).backward()
        torch_xla.sync()
    calls = sharded(model).lowerings.calls
    assert not calls.lost and "makes" not in caplog.text
    for path, cs in plan.calls.items():  # each module made at least as many calls as the plan numbers
        assert calls.counts[path] > max(int(k) for k in cs), (path, calls.counts[path], sorted(cs))
    partir_torch.unshard(model)

    def loss(m, x):
        return m(x).square().mean()

    for late, says in ((False, "call 0 of its forward is mul() where the capture had cat()"),
                       (True, "call 1 of its forward is mul() where the capture had relu()")):  # (same shape)
        torch.manual_seed(0)
        net, x = Detour(late=late), torch.randn(8, 16)
        plan = search(net, (x,), MESH, loss_fn=loss, optimizer="sgd", schedule="batch:BatchParallel;model:Megatron")
        assert plan.calls[""]["1" if late else "0"]["out"] is not None
        ref = copy.deepcopy(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        net, opt = partir_torch.auto_shard(net, (x,), MESH, backend="xla", loss_fn=loss, optimizer=opt, plan=plan)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            losses = _train(net, opt, loss, (x,), 2, shard=True)
        assert sharded(net).lowerings.calls.lost == {""}
        assert f"module '': {says}" in caplog.text and caplog.text.count("takes another path") == 1
        ref_losses = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), loss, (x,), 2, shard=False)
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        partir_torch.unshard(net)


class Checked(nn.Module):
    """Not a zoo model: a value check its forward skips when compiled, as HF's all-ones mask helpers do."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and bool((x == x).all()):
            x = x * 1.0  # the eager path: one call more
        return torch.cat([self.a(x), self.b(x)], -1).relu()


def test_a_plan_captured_as_compiled_runs_its_forward_as_compiled(caplog):
    """`assume_compiling=True` captures the path a library takes when compiled; the plan says so
    (`plan.compiling`), and the engine runs the forward on that path too: every call met as numbered (on the
    eager path the calls shift and the root's constraints are lost), training equal to unsharded eager, and
    `torch.compiler.is_compiling()` false again after the forward."""
    import torch_xla

    from partir_torch.backends.xla import sharded
    from partir_torch.plan import ShardingPlan

    torch.manual_seed(0)
    net, x = Checked(), torch.randn(8, 16)

    def loss(m, x):
        return m(x).square().mean()

    plan = search(net, (x,), MESH, loss_fn=loss, optimizer="sgd", schedule="batch:BatchParallel;model:Megatron",
                  assume_compiling=True)
    assert plan.compiling and "" in plan.calls and ShardingPlan.from_json(plan.to_json()).compiling
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = partir_torch.auto_shard(net, (x,), MESH, backend="xla", loss_fn=loss, optimizer=opt, plan=plan)
    with caplog.at_level(logging.WARNING):
        losses = _train(net, opt, loss, (x,), 2, shard=True)
    assert sharded(net).lowerings.calls.lost == set() and "makes" not in caplog.text
    assert not torch.compiler.is_compiling()
    assert losses == pytest.approx(_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), loss, (x,), 2, shard=False),
                                   rel=1e-5)
    torch_xla.sync()
    partir_torch.unshard(net)


@pytest.mark.parametrize("name", ["tv-swin", "tv-convnext"])
def test_users_models_keep_every_call_constraint_on_the_device(name, caplog):
    """torchvision's Swin (a shifted-window mask built by item assignment inside its attention function) and
    ConvNeXt (a linear over [N, H, W, C], which the graph holds as [N*H*W, C]) meet each numbered call on the
    device as the capture did: no module loses its constraints, and training equals unsharded."""
    from benchmarks.workloads.thirdparty import BUILDERS
    from partir_torch.backends.xla import sharded

    needs.need("torchvision")
    torch.manual_seed(0)
    model, inputs, loss_fn = BUILDERS[name]()
    for m in model.modules():  # (torchvision draws stochastic depth and attention dropout from floats)
        for a in ("p", "dropout", "attention_dropout"):
            if isinstance(getattr(m, a, None), float):
                setattr(m, a, 0.0)
    ref = copy.deepcopy(model)
    plan = search(model, inputs, MESH, loss_fn=loss_fn, optimizer="sgd", schedule="batch:BatchParallel;model:FSDP")
    assert sum(len(c) for c in plan.calls.values()) > 10
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = partir_torch.auto_shard(model, inputs, MESH, backend="xla", loss_fn=loss_fn, optimizer=opt, plan=plan)
    with caplog.at_level(logging.WARNING):
        losses = _train(model, opt, loss_fn, inputs, 2, shard=True)
    assert not sharded(model).lowerings.calls.lost, caplog.text
    ref_losses = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.01), loss_fn, inputs, 2, shard=False)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    partir_torch.unshard(model)


class Scaled(nn.Module):
    """Not a zoo model: a host constant made in forward (transformers' Gemma scales its embeddings so)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.tensor(x.shape[-1] ** 0.5, dtype=x.dtype)


def test_a_host_constant_made_in_forward_is_left_on_the_host():
    """The capture holds `torch.tensor(...)` as an activation of the step; on the device it is a host tensor
    that the engine moves itself. A constant's call has no number (`capture.attribution.Constants`), so
    the plan cannot constrain it; the call that mixes it with the model's tensors is numbered, and training
    equals unsharded."""
    torch.manual_seed(0)
    net, x = Scaled(), torch.randn(8, 16)

    def loss(m, x):
        return m(x).square().mean()

    plan = search(net, (x,), MESH, loss_fn=loss, optimizer="sgd", schedule="batch:BatchParallel")
    assert plan.calls[""] and all(c.get("fn") != "tensor" for c in plan.calls[""].values())
    assert plan.calls[""]["0"]["fn"] == "mul"  # (the first call of the root's own forward that is not constant)
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = partir_torch.auto_shard(net, (x,), MESH, backend="xla", loss_fn=loss, optimizer=opt, plan=plan)
    losses = _train(net, opt, loss, (x,), 2, shard=True)
    assert losses == pytest.approx(_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), loss, (x,), 2, shard=False),
                                   rel=1e-5)
    partir_torch.unshard(net)


def test_a_grouped_convolution_s_weight_gradient_is_made_whole_before_it_is_tiled():
    """A grouped convolution runs with its channels whole (`rules/conv.py`): its weight gradient is made whole
    and then tiled. Constrained to the tiles directly, with the output channel-tiled (a RegNetY stage under a
    searched plan), GSPMD partitions the weight-gradient convolution over 2 channel tiles of 3 groups and
    XLA 2.9 aborts the process in its convolution handler; the backend's hook for such a weight
    (`grad_hook(..., first=replicated)`, chosen by `_grouped_conv_weights`) has XLA make it whole first."""
    import torch_xla

    from partir_torch.backends.xla import constrain, device_mesh, grad_hook
    from partir_torch.backends.xla.module import _grouped_conv_weights
    from partir_torch.ir import Mesh

    mesh = device_mesh(Mesh.parse("batch=2,model=4"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(24, 24, 1), nn.Conv2d(24, 24, 3, padding=1, groups=3, bias=False))
    assert _grouped_conv_weights(model) == {"1.weight"}
    assert _grouped_conv_weights(nn.Conv2d(8, 8, 3, groups=8)) == set()  # depthwise: the plan tiles its gradient
    x = torch.randn(4, 24, 8, 8)
    model(x).square().mean().backward()
    ref = model[1].weight.grad
    conv = copy.deepcopy(model[1]).to(torch_xla.device())
    conv.weight.grad = None
    partir_torch.backends.xla.runtime._mark(conv.weight, mesh, ("batch", None, None, None))
    conv.weight.register_hook(grad_hook(mesh, ("batch", None, None, None), first=(None,) * 4))
    y = constrain(conv(model[0](x).detach().to(torch_xla.device())), mesh, (None, "batch", None, None),
                  (None, "batch", None, None))
    y.square().mean().backward()
    torch_xla.sync()
    torch.testing.assert_close(conv.weight.grad.cpu(), ref, rtol=1e-4, atol=1e-6)


class _Packed(nn.Module):
    """Counts the runs of equal tokens as HF's packed-sequence check does (`(diff != 0).cumsum(-1)` on a bool
    mask, in the model's own forward) and gates an embedding with it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        starts = torch.diff(tokens, dim=-1, prepend=tokens[:, :1]) != 0
        runs = starts.cumsum(-1)
        return self.head(self.embed(tokens) * (runs > 0).unsqueeze(-1))


def test_a_boolean_mask_made_by_a_call_is_left_to_the_engine():
    """torch_xla 2.9 lowers `cumsum` of a bool as a `pred` reduce-window; a sharding annotation on the mask
    before it made XLA's verifier reject the step (HF Gemma-2). The plan's call constraints skip booleans."""
    torch.manual_seed(0)
    model = _Packed()
    batch = (torch.randint(0, 3, (8, 6)), torch.randint(0, 16, (8, 6)))
    ref = copy.deepcopy(model)
    plan = search(model, batch, MESH, loss_fn=tagger_loss, optimizer="sgd", schedule="batch:BatchParallel")
    assert any(c["fn"] == "ne" and c["out"] is not None for c in plan.calls.get("", {}).values()), plan.calls
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = partir_torch.auto_shard(model, batch, MESH, backend="xla",
                                         loss_fn=tagger_loss, optimizer=opt, plan=plan)
    got = _train(model, opt, tagger_loss, batch, 2, shard=True)
    want = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), tagger_loss, batch, 2, shard=False)
    assert got == pytest.approx(want, rel=1e-5)


class _Patches(nn.Module):
    """Cuts images into patches through a rank-6 view, as ViT-MAE's loss does (`einsum("nchpwq->nhwpqc")`)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * 4 * 4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[:2]
        p = torch.einsum("nchpwq->nhwpqc", x.reshape(n, c, 2, 4, 2, 4))
        return self.proj(p.reshape(n, 4, -1)).mean(1)


def test_a_tensor_of_rank_6_is_left_to_the_engine():
    """torch_xla 2.9 cannot annotate a tensor of more than 5 dims (test_xla_known_bugs.py): the plan's
    constraint on the patches is skipped, and the model trains like unsharded."""
    torch.manual_seed(0)
    model = _Patches()
    batch = (torch.randn(8, 3, 8, 8), torch.randn(8, 8))
    loss = lambda m, x, y: F.mse_loss(m(x), y)  # noqa: E731
    ref = copy.deepcopy(model)
    plan = search(model, batch, MESH, loss_fn=loss, optimizer="sgd", schedule="batch:BatchParallel")
    assert any(c["out"] is not None and len(c["out"][0]) == 6 for c in plan.calls.get("", {}).values()), plan.calls
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = partir_torch.auto_shard(model, batch, MESH, backend="xla", loss_fn=loss, optimizer=opt, plan=plan)
    got = _train(model, opt, loss, batch, 2, shard=True)
    want = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), loss, batch, 2, shard=False)
    assert got == pytest.approx(want, rel=1e-5)


def test_auto_shard_computes_only_its_own_tensors_next_to_a_step_that_failed(monkeypatch):
    """A step that failed to compile leaves its tensors holding a graph that cannot run; `auto_shard` of
    another model then computes only its own parameters and states (a global `torch_xla.sync()` failed on
    the others with "Check failed: tensor_data")."""
    import gc

    import torch_xla

    import partir_torch.backends.xla.runtime as backend

    torch.manual_seed(0)
    loss = lambda m, x, y: F.mse_loss(m(x), y)  # noqa: E731
    broken, batch = _Patches(), (torch.randn(8, 3, 8, 8), torch.randn(8, 8))
    opt = torch.optim.SGD(broken.parameters(), lr=0.1)
    broken, opt = partir_torch.auto_shard(broken, batch, MESH, backend="xla", loss_fn=loss, optimizer=opt,
                                          schedule="batch:BatchParallel")
    monkeypatch.setattr(backend, "MAX_RANK", 99)  # the rank-6 annotation XLA rejects (test_xla_known_bugs.py)
    with pytest.raises(ValueError, match="not unique in tile assignment"):
        loss(broken, *partir_torch.shard_batch(broken, *batch)).backward()
        opt.step()
        torch_xla.sync()
    monkeypatch.setattr(backend, "MAX_RANK", 5)
    try:
        model, mb = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), (torch.randn(8, 8), torch.randn(8, 4))
        model, _ = partir_torch.auto_shard(model, mb, MESH, backend="xla", loss_fn=loss, optimizer=torch.optim.SGD(
            model.parameters(), lr=0.1), schedule="batch:BatchParallel")
        assert all(p.device.type == "xla" for p in model.parameters())
    finally:  # the failed step's tensors go, so that later syncs of this process run
        del broken, opt
        gc.collect()
        torch_xla.sync()


def test_a_grouped_convolution_with_a_split_batch_trains_like_unsharded_and_moves_only_the_planned_bytes(caplog):
    """torch_xla 2.9 gets a grouped convolution's weight gradient wrong when its batch is split, and GSPMD
    gathers the batch of one with fewer groups than channels (test_xla_known_bugs.py). The backend runs the
    latter as plain or depthwise convolutions, and computes a depthwise one's weight gradient per kernel offset
    (`xla._GroupedConv`): a data-parallel plan trains like unsharded with the batch split at every
    convolution, transposed ones too, and XLA moves exactly the plan's bytes (no gather)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, groups=4), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1, groups=8), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, stride=2, padding="valid", dilation=1, groups=16), nn.ReLU(),
                          nn.ConvTranspose2d(16, 8, 2, stride=2, groups=2), nn.ReLU(),
                          nn.ConvTranspose2d(8, 8, 3, padding=1, groups=4), nn.ReLU(),
                          nn.ConvTranspose2d(8, 8, 3, padding=1, groups=8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    batch = (torch.randn(8, 3, 9, 9), torch.randint(0, 4, (8,)))
    loss = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    ref, fresh = copy.deepcopy(model), copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with caplog.at_level(logging.WARNING, logger="partir_torch.backends.xla"):
        model, opt = partir_torch.auto_shard(model, batch, MESH, backend="xla", loss_fn=loss, optimizer=opt,
                                             schedule="batch:BatchParallel")
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    got = _train(model, opt, loss, batch, 3, shard=True)
    want = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.5), loss, batch, 3, shard=False)
    assert got == pytest.approx(want, rel=1e-5)
    j = partir_torch.verify(fresh, batch, plan=model.partir_plan, loss_fn=loss,
                            optimizer=torch.optim.SGD(fresh.parameters(), lr=0.5)).to_json()
    assert j["unexpected_collectives"] == [] and set(j["measured"]["comm_bytes"]) == {"all-reduce"}, j["measured"]
    assert j["ratios"]["all-reduce"] == pytest.approx(1.0, abs=0.01), j["ratios"]


def test_batch_and_instance_norm_in_training_mode_keep_the_batch_split_and_their_running_statistics():
    """torch_xla lowers batch and instance norm to XLA's batch-norm op, around which GSPMD gathers the batch
    (two all-gathers of the activations per layer on tv-resnet18, which the plan does not have); the backend
    runs them as reductions (`xla._batch_norm`, `_instance_norm`): XLA then all-reduces the statistics as the
    plan does, the model trains like unsharded and its running statistics come back the same."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16, momentum=0.3), nn.ReLU(),
                          nn.Conv2d(16, 16, 1), nn.InstanceNorm2d(16, affine=True, track_running_stats=True),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4), nn.BatchNorm1d(4))
    batch = (torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,)))
    loss = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    ref, fresh = copy.deepcopy(model), copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = partir_torch.auto_shard(model, batch, MESH, backend="xla", loss_fn=loss, optimizer=opt,
                                         schedule="batch:BatchParallel")
    got = _train(model, opt, loss, batch, 3, shard=True)
    want = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), loss, batch, 3, shard=False)
    assert got == pytest.approx(want, rel=1e-5)
    plan = model.partir_plan
    stats = {k: v for k, v in partir_torch.unshard(model).state_dict().items() if "running" in k or "batches" in k}
    assert len(stats) == 12
    for k, v in stats.items():
        torch.testing.assert_close(v, ref.state_dict()[k], rtol=1e-5, atol=1e-5, msg=k)
    j = partir_torch.verify(fresh, batch, plan=plan, loss_fn=loss,
                            optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1)).to_json()
    assert j["unexpected_collectives"] == [] and set(j["measured"]["comm_bytes"]) == {"all-reduce"}, j["measured"]
    assert j["ratios"]["all-reduce"] == pytest.approx(1.0, abs=0.01), j["ratios"]


def _keeps_every_call(model: nn.Module, caplog, check=None) -> nn.Module:
    """`auto_shard` `model` on MESH (batch-parallel and Megatron) and train 3 SGD steps: no module's calls
    stray from the capture's or stop short of the plan's, and the losses are the unsharded ones. `check`
    looks at the sharded model before training."""
    batch = (torch.randn(8, 6, 16), torch.randint(0, 4, (8, 6)))
    loss = lambda m, x, y: F.cross_entropy(m(x).flatten(0, 1), y.flatten())  # noqa: E731
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with caplog.at_level(logging.WARNING, logger="partir_torch.backends.xla"):
        model, opt = partir_torch.auto_shard(model, batch, MESH, backend="xla", loss_fn=loss, optimizer=opt,
                                             schedule="batch:BatchParallel;model:Megatron")
        if check is not None:
            check(model)
        got = _train(model, opt, loss, batch, 3, shard=True)
    assert not [r for r in caplog.records if "another path" in r.getMessage()]
    want = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.5), loss, batch, 3, shard=False)
    assert got == pytest.approx(want, rel=1e-5)
    return model


class Residuals(nn.Module):
    """Residual blocks each skipped in training mode when a scalar draw falls below `skip` (LayerDrop's
    decision, as HF BART, Whisper and wav2vec2 make it in their own forward)."""

    def __init__(self, skip: float, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d)) for _ in range(2))
        self.head = nn.Linear(d, 4)
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.training and torch.rand([]) < self.skip:
                continue
            x = x + block(x)
        return self.head(x)


def test_a_model_that_draws_to_skip_its_layers_trains_in_training_mode_like_unsharded(caplog):
    """The capture takes the draw as keeping every block (`capture/draws.py`); the engine meets the same
    calls (the draws and comparisons are constants, numbered by neither: no module loses its constraints)."""
    torch.manual_seed(0)
    model = _keeps_every_call(Residuals(skip=0.0).train(), caplog)
    assert model.training and model.partir_plan.calls


class HostTable(nn.Module):
    """Keeps a host table as a plain attribute and moves it to the input's device on its first forward
    there, as HF CodeGen does its sinusoid table: a call on the engine that the capture never made."""

    def __init__(self, d: int = 16, t: int = 6) -> None:
        super().__init__()
        self.table = torch.randn(t, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.table
        if table.device != x.device:
            table = table.to(x.device)
            self.table = table
        return self.head(torch.relu(self.mix(x * table)))


def test_a_move_to_the_device_the_capture_never_made_keeps_the_module_s_calls(caplog):
    torch.manual_seed(0)

    def lands_on(model):  # (the plan's call the engine's first-forward move meets)
        assert model.partir_plan.calls.get("", {}).get("0", {}).get("fn") == "mul"

    model = _keeps_every_call(HostTable(), caplog, lands_on)
    assert model.table.device.type == "xla"  # (the model moved it, on the engine's first forward)


@functools.lru_cache(maxsize=4)
def _relative_index(n: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(n, device=device)
    return pos[:, None] - pos[None, :] + n - 1


class RelativeBias(nn.Module):
    """Attention with a relative-position bias whose index is cached per size and device, as HF BEiT caches
    its own: made on the engine's first forward only (the capture empties the caches it fills)."""

    def __init__(self, n: int = 6, d: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.bias = nn.Parameter(torch.randn(2 * n - 1) * 0.1)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        bias = self.bias[_relative_index(x.shape[1], x.device)]
        att = torch.softmax(h @ h.transpose(1, 2) / 4 + bias, dim=-1)
        return self.head(att @ h)


def test_a_constant_the_model_caches_after_its_first_step_keeps_the_module_s_calls(caplog):
    """Calls on constants only are not numbered (`capture.attribution.Constants`), at capture and on the
    engine: the index made on the first step and read from the cache on the next leaves the calls after it
    where the plan has them."""
    torch.manual_seed(0)

    def calls_after_the_index(model):
        assert any(int(k) > 0 for k in model.partir_plan.calls.get("", {}))

    _keeps_every_call(RelativeBias(), caplog, calls_after_the_index)
    info = _relative_index.cache_info()  # (made once on the engine and once on the host, then read from the cache)
    assert info.misses == info.currsize == 2 and info.hits >= 4


@torch.jit.script
def _scale(x: torch.Tensor, factor: int) -> torch.Tensor:
    return torch.sqrt(torch.tensor(x.size(-1), dtype=torch.float) * factor)


class ScriptedScale(nn.Module):
    """Attention scaled by a TorchScript function, as HF DeBERTa-v2 scales its scores: tracing runs the
    function's ops through torch functions as operators, eagerly its interpreter runs them unseen."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        att = torch.softmax(h @ h.transpose(1, 2) / _scale(h, 2).to(dtype=h.dtype), dim=-1)
        return self.head(att @ h)


def test_a_torchscript_function_s_ops_are_none_of_the_module_s_calls(caplog):
    torch.manual_seed(0)

    def calls_after_the_scale(model):
        assert len(model.partir_plan.calls.get("", {})) >= 3

    _keeps_every_call(ScriptedScale(), caplog, calls_after_the_scale)
