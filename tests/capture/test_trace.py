"""Capture of the whole step: roles, names, phases, attribution, inference mode, meta models, buffers."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.ir import Phase, Role


def test_every_value_has_shape_dtype_and_role(tiny):
    model, inputs, loss_fn = tiny
    p = capture(model, inputs, loss_fn, "adamw")
    assert p.mode == "train"
    assert {v.role for v in p.values} >= {
        Role.PARAMETER, Role.INPUT, Role.OPT_STATE, Role.GRADIENT, Role.ACTIVATION, Role.OUTPUT
    }
    for name, param in model.named_parameters():
        v = p.value(name)
        assert v.role is Role.PARAMETER and v.shape == tuple(param.shape) and v.dtype == param.dtype
        g = p.values[p.grads[name]]
        assert g.role is Role.GRADIENT and g.name == f"grad[{name}]" and g.shape == v.shape
        assert p.value(f"opt.exp_avg[{name}]").role is Role.OPT_STATE
        assert p.updates[p.value(f"updated[{name}]").id] == v.id
    assert [p.values[i].name for i in p.inputs] == ["inputs[0]", "inputs[1]"]
    assert p.values[p.loss].shape == () and p.values[p.loss].role is Role.OUTPUT
    # ops reference only existing values, producers are consistent, and the order is topological
    for op in p.ops:
        assert all(p.values[i].producer < op.id for i in op.inputs)
        assert all(p.values[o].producer == op.id for o in op.outputs if o >= 0)


def test_phases_follow_data_flow(tiny):
    model, inputs, loss_fn = tiny
    p = capture(model, inputs, loss_fn, "sgd")
    phases = [op.phase for op in p.ops]
    assert phases.count(Phase.FORWARD) and phases.count(Phase.BACKWARD) and phases.count(Phase.OPTIMIZER)
    # the optimizer phase writes the updated parameters; the loss is forward
    assert p.ops[p.values[p.loss].producer].phase is Phase.FORWARD
    for n in p.params:
        assert p.ops[p.value(f"updated[{n}]").producer].phase is Phase.OPTIMIZER
    mms = [op for op in p.ops if op.target in ("aten.mm.default", "aten.addmm.default")]
    assert {op.phase for op in mms} == {Phase.FORWARD, Phase.BACKWARD}


def test_ops_link_back_to_modules_forward_and_backward(tiny):
    model, inputs, loss_fn = tiny
    p = capture(model, inputs, loss_fn, "adamw")
    fwd = {op.module for op in p.ops if op.target == "aten.addmm.default"}
    assert fwd == {"blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "head"}
    bwd = {op.module for op in p.ops if op.phase is Phase.BACKWARD and op.target == "aten.mm.default"}
    assert {"blocks.0.up", "blocks.1.down", "head"} <= bwd
    assert any(op.module == "blocks.0.norm" for op in p.ops if op.target == "aten.native_layer_norm_backward.default")


def test_calls_inside_a_module_s_own_forward_are_numbered_as_a_backend_meets_them():
    """Each torch-function call that makes a tensor inside a module's forward gets the next number of that
    module (a backend counts the same calls to put the plan's constraints on them); reads of shapes make
    none and are not counted, nor is an assignment (its ops belong to no call: with the next call's number
    they would make that call's result look like the assigned tensor), submodules count their own, and
    backward ops carry their forward call's."""

    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            n = x.shape[0]  # not a tensor: not counted
            y = torch.cat([self.lin(x), x], -1)
            return (y * 2).reshape(n, -1)

    model = Skip()
    p = capture(model, (torch.randn(4, 6),), lambda m, x: m(x).sum(), "sgd")
    fwd = [(op.target, op.call) for op in p.ops if op.phase is Phase.FORWARD and op.module == ""]
    assert fwd == [("aten.cat.default", 0), ("aten.mul.Tensor", 1), ("aten.view.default", 2)]
    assert {op.call for op in p.ops if op.module == "lin" and op.phase is Phase.FORWARD} == {0}
    back = [(op.module, op.call) for op in p.ops if op.phase is Phase.BACKWARD and op.target == "aten.slice.Tensor"]
    assert back and set(back) == {("", 0)}  # the cat's backward

    class Masked(nn.Module):
        def forward(self, x):
            y = x.new_zeros(x.shape)
            y[:, 0] = 1.0  # in place, returns None: no call of its own
            return (x * y).sum(-1)

    p = capture(Masked(), (torch.randn(4, 6, requires_grad=True),), lambda m, x: m(x).sum(), "sgd")
    fwd = [(op.target, op.call) for op in p.ops if op.phase is Phase.FORWARD and op.module == ""]
    assert [f for f in fwd if f[1] is not None] == [("aten.new_zeros.default", 0), ("aten.mul.Tensor", 1),
                                                   ("aten.sum.dim_IntList", 2)]
    assert len(fwd) > 3  # the assignment's ops, numbered as no call


def test_calls_on_constants_only_are_not_numbered():
    """A factory call and the calls on its results only (a causal mask, a position index) make constants:
    the model may cache them and skip those calls on later forwards, so they get no number; the first call
    that mixes a constant with the model's own tensors does (`capture.attribution.Constants`)."""

    class Causal(nn.Module):
        def forward(self, x):
            n = x.shape[1]
            mask = torch.ones(n, n).tril() == 0  # constants: no number
            return (x @ x.transpose(1, 2)).masked_fill(mask, 0.0).sum(-1)

    p = capture(Causal(), (torch.randn(2, 5, 3, requires_grad=True),), lambda m, x: m(x).sum(), "sgd")
    fwd = [(op.target, op.call) for op in p.ops if op.phase is Phase.FORWARD and op.module == ""]
    assert {t for t, k in fwd if k is None} >= {"aten.tril.default", "aten.eq.Scalar"}
    assert next((t, k) for t, k in fwd if k is not None) == ("aten.transpose.int", 0)  # (the first on the input)


def test_constants_are_forgotten_when_they_are_gone():
    """The engine tracks constants over every step: a mask made each step must not leave an entry behind."""
    import gc

    from partir_torch.capture.attribution import Constants

    consts, kept = Constants(), []
    for i in range(50):
        t = torch.ones(3, 3).tril()
        consts.add(t)
        if i % 10 == 0:
            kept.append(t)
    del t
    gc.collect()
    assert len(consts.refs) == len(kept) and all(consts.constant((k,), None) for k in kept)
    assert not consts.constant((torch.ones(3),), None)  # (a tensor it never made)


def test_program_is_flat_and_json_summary(tiny):
    model, inputs, loss_fn = tiny
    p = capture(model, inputs, loss_fn, "adamw")
    s = p.summary()
    assert s["ops"] == len(p.ops) and s["params"] == sum(x.numel() for x in model.parameters())
    assert s["param_bytes"] == 4 * s["params"]
    assert isinstance(s["capture_time_s"], float) and s["capture_time_s"] > 0
    assert sum(s["ops_by_target"].values()) == s["ops"]
    assert all(isinstance(op.target, str) and isinstance(op.inputs, tuple) for op in p.ops)


def test_inference_mode_is_forward_only(tiny):
    model, inputs, _ = tiny
    p = capture(model, inputs[:1], mode="inference")
    assert p.mode == "inference" and p.optimizer is None and not p.grads
    assert {op.phase for op in p.ops} == {Phase.FORWARD}
    out = p.run(dict(model.named_parameters()), {}, inputs[:1])
    torch.testing.assert_close(next(iter(out.values())), model(inputs[0]))


def test_meta_model_captures_without_allocating():
    # A Llama-7B-shaped model (two of its 32 layers) on meta: the shapes of a real 7B layer, no weights.
    model, inputs, loss_fn = models.build("llama-7b", {"layers": "2", "seq": "256", "batch": "1"}, device="meta")
    assert all(p.is_meta for p in model.parameters())
    p = capture(model, inputs, loss_fn, "adamw")
    assert p.value("layers.1.mlp.gate_proj.weight").shape == (11008, 4096)
    assert p.param_count() == sum(x.numel() for x in model.parameters())
    assert all(x.is_meta for x in model.parameters())  # untouched


class _BN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def _mse(model, x, y):
    return F.mse_loss(model(x), y)


def test_buffer_mutations_become_outputs_with_eager_values():
    torch.manual_seed(0)
    model, x, y = _BN(), torch.randn(4, 3, 8, 8), torch.randn(4, 2)
    p = capture(model, (x, y), _mse, "sgd")
    new_mean = p.value("updated[bn.running_mean]")
    assert new_mean.role is Role.OUTPUT and p.updates[new_mean.id] == p.value("bn.running_mean").id
    before = {k: v.clone() for k, v in model.named_buffers()}
    out = p.run(dict(model.named_parameters()), dict(model.named_buffers()), (x, y),
                {n: {"momentum_buffer": torch.zeros_like(q)} for n, q in model.named_parameters()})
    for k, v in model.named_buffers():
        assert torch.equal(v, before[k])  # run() never writes the caller's buffers
    _mse(model, x, y)  # eager forward in train mode updates the running statistics
    torch.testing.assert_close(out[new_mean.id], model.bn.running_mean)
    torch.testing.assert_close(out[p.value("updated[bn.running_var]").id], model.bn.running_var)


class _Gelu(torch.autograd.Function):
    """An old-style autograd.Function (forward takes ctx, no setup_context), as BLOOM's GeLU is: torch.func
    refuses it, so capture differentiates the step with autograd, which runs this backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return g * 2.0 * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class _OldStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.down(_Gelu.apply(self.up(x)))


class _Square(torch.autograd.Function):
    """A Function with a vmap rule, called under `torch.vmap` in a forward (HF's mask functions run so):
    torch.func's functionalization has no rule for it, so capture takes the autograd path."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3.0 * x * g  # (not the true derivative: the capture must run this backward, not its own)


class _Vmapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.down(torch.vmap(_Square.apply)(self.up(x)))


@pytest.mark.parametrize("make", [_OldStyle, _Vmapped], ids=["without_setup_context", "under_vmap"])
def test_an_autograd_function_torch_func_refuses_is_differentiated_by_its_own_backward(make):
    """An old-style Function (BLOOM's GeLU) or one under `vmap` (HF's mask functions): the capture
    differentiates the step with autograd, which runs the Function's own backward (its factor 2.0 or 3.0)."""
    torch.manual_seed(0)
    model, x, y = make(), torch.randn(6, 4), torch.randn(6, 2)
    p = capture(model, (x, y), _mse, None)
    out = p.run(dict(model.named_parameters()), {}, (x, y))
    _mse(model, x, y).backward()
    for n, q in model.named_parameters():
        torch.testing.assert_close(out[p.grads[n]], q.grad)
    assert {op.module for op in p.ops if op.phase is Phase.BACKWARD and op.module} >= {"up", "down"}
