"""A submodule with data-dependent shapes is captured, with fallback=True, as one opaque op that runs replicated,
is differentiated exactly, simulated for real and costed with its measured FLOPs (`capture/opaque.py`)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partir_torch.capture import capture
from partir_torch.errors import CaptureError
from partir_torch.ir import Mesh
from partir_torch.simulate import simulate
from partir_torch.tactics import apply_schedule

D, T = 8, 24  # features, tokens (4 x 6)


class Route(nn.Module):
    """Selects tokens with `nonzero` (a data-dependent shape) and updates them with `up`; every token is selected
    here (|x|.sum() >= 0), so its FLOPs are known exactly: 2·T·D·D forward."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, D, bias=False)

    def forward(self, x):
        flat = x.reshape(-1, D)
        idx = torch.nonzero(flat.abs().sum(-1) >= 0).squeeze(1)
        return flat.index_add(0, idx, self.up(flat[idx])).reshape(x.shape)


class Net(nn.Module):
    def __init__(self, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.route = inner if inner is not None else Route()
        self.out = nn.Linear(D, 4)

    def forward(self, x):
        return self.out(self.route(torch.relu(self.inp(x))))


def _loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, 4), y.reshape(-1))


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 6, D, generator=g), torch.randint(0, 4, (4, 6), generator=g)


def _capture(net, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = capture(net, _data(), _loss, None, fallback=True, **kw)
    return program, [str(w.message) for w in caught if "capture (fallback)" in str(w.message)]


def test_without_fallback_the_error_names_the_module_and_suggests_fallback():
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match=r"fallback=True .*module 'route' \(Route\) then becomes one opaque op"):
        capture(Net(), _data(), _loss, "sgd")


def test_fallback_captures_one_opaque_op_with_one_warning_naming_module_and_flops():
    torch.manual_seed(0)
    program, warned = _capture(Net())
    assert len(warned) == 1
    assert "module 'route' (Route)" in warned[0] and f"{2 * T * D * D:,} FLOPs forward" in warned[0]
    opaque = [op for op in program.ops if op.target.startswith("partir_opaque.")]
    assert [op.target.endswith("_backward.default") for op in opaque] == [False, True]
    assert {op.module for op in opaque} == {"route"}
    # measured: forward 2TD²; backward = the recomputed forward + grad of input + grad of weight
    assert opaque[0].flops == 2 * T * D * D
    assert opaque[1].flops == 3 * 2 * T * D * D
    assert all(op.flops is None for op in program.ops if op not in opaque)


def test_opaque_step_equals_eager_torch_and_the_sharded_simulation():
    torch.manual_seed(0)
    net = Net()
    program, _ = _capture(net)
    x, y = _data()
    params = {n: p.detach() for n, p in net.named_parameters()}
    out = program.run(params, {}, (x, y))
    loss = _loss(net, x, y)
    loss.backward()
    assert torch.allclose(out[program.loss], loss.detach())
    for n, p in net.named_parameters():  # the opaque op's own parameter too: its backward op is exact
        assert torch.allclose(out[program.grads[n]], p.grad, atol=1e-6), n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback warnings of the replicated opaque ops
        state = apply_schedule(program, Mesh.parse("batch=2,model=2"), "batch:BatchParallel", fallback=True)
    sim = simulate(program, state, params, {}, (x, y))
    assert sim.max_rel_diff < 1e-6
    assert sim.executed.get("all-gather", 0) >= 1  # the batch-sharded activation is gathered for the opaque op


def test_cost_model_charges_the_measured_flops_to_every_device():
    from partir_torch.cost import evaluate, hardware

    torch.manual_seed(0)
    program, _ = _capture(Net())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = apply_schedule(program, Mesh.parse("batch=2"), "batch:BatchParallel", fallback=True)
    flops = evaluate(rep, hardware("cpu-virtual")).flops_per_device
    opaque = 4 * 2 * T * D * D  # forward + backward, replicated: each device runs all of it
    others = flops - opaque
    # the rest: the batch-sharded linears, halved by the batch axis — inp forward and weight gradient (its
    # input needs none), out forward and both gradients
    linears = 2 * 2 * T * D * D + 3 * 2 * T * D * 4
    assert others == pytest.approx(linears / 2)


class Select(nn.Module):
    """Returns the tokens whose first feature is positive: its output shape itself depends on the data."""

    def forward(self, x):
        return x.reshape(-1, D)[x.reshape(-1, D)[:, 0] > 0]


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sel = Select()
        self.up = nn.Linear(D, D)

    def forward(self, x):
        return x + self.up(self.sel(x)).sum(0)


def test_a_module_whose_output_shape_varies_makes_its_parent_opaque():
    torch.manual_seed(0)
    program, warned = _capture(Net(Pool()))
    assert len(warned) == 1 and "module 'route' (Pool)" in warned[0]
    assert {op.module for op in program.ops if op.target.startswith("partir_opaque.")} == {"route"}


class RootBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 4)

    def forward(self, x):
        return self.fc(x[x[..., 0] > 0])


def test_data_dependence_in_the_models_own_forward_stays_an_error():
    with pytest.raises(CaptureError, match="data-dependent"):
        capture(RootBranch(), _data(), lambda m, x, y: m(x).sum(), "sgd", fallback=True)


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, D)
        self.register_buffer("hits", torch.zeros(()))

    def forward(self, x):
        flat = x.reshape(-1, D)
        idx = torch.nonzero(flat[:, 0] > 0).squeeze(1)
        self.hits.add_(idx.numel())
        return flat.index_add(0, idx, self.up(flat[idx])).reshape(x.shape)


def test_an_opaque_module_that_writes_its_buffers_is_refused():
    with pytest.raises(CaptureError, match=r"module 'route' \(Counting\) writes its 'hits' in forward"):
        capture(Net(Counting()), _data(), _loss, "sgd", fallback=True)


class RouteWithNones(Route):
    """Called with a None argument, returns a tuple with a None in it (as HF blocks do)."""

    def forward(self, x, mask=None, scale=2.0):
        assert mask is None
        return super().forward(x) * scale, None


class NetWithNones(Net):
    def __init__(self) -> None:
        super().__init__(RouteWithNones())

    def forward(self, x):
        h, nothing = self.route(torch.relu(self.inp(x)), mask=None)
        assert nothing is None
        return self.out(h)


def test_none_arguments_and_outputs_pass_through_the_opaque_op():
    torch.manual_seed(0)
    net = NetWithNones()
    program, warned = _capture(net)
    assert len(warned) == 1 and "module 'route' (RouteWithNones)" in warned[0]
    x, y = _data()
    out = program.run({n: p.detach() for n, p in net.named_parameters()}, {}, (x, y))
    assert torch.allclose(out[program.loss], _loss(net, x, y))
