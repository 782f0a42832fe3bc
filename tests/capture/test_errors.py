"""Bad input gets an error that names the culprit, and the model and optimizer are left exactly as they were."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from partir_torch.capture import capture
from partir_torch.errors import CaptureError, InputShapeError, UnsupportedOptimizerError


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.fc(x)
        return -self.fc(x)


def _loss(model, x):
    return model(x).sum()


def _snapshot(model, opt):
    return (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
            [p.requires_grad for p in model.parameters()])


def _assert_untouched(model, opt, snap):
    sd, osd, rg = snap
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert [p.requires_grad for p in model.parameters()] == rg
    assert repr(opt.state_dict()) == repr(osd)
    assert all(p.grad is None for p in model.parameters())


def test_data_dependent_control_flow_names_the_source_line():
    model = _Branchy()
    opt = torch.optim.Adam(model.parameters())
    snap = _snapshot(model, opt)
    with pytest.raises(CaptureError, match=r"data-dependent.*test_errors\.py:\d+ \(`if x\.sum\(\) > 0:"):
        capture(model, (torch.randn(2, 4),), _loss, opt)
    _assert_untouched(model, opt, snap)


def test_wrong_input_shape_shows_expected_and_given(tiny):
    model, (tokens, targets), loss_fn = tiny
    opt = torch.optim.AdamW(model.parameters())
    loss_fn(model, tokens, targets).backward()
    opt.step()  # the optimizer has state that must survive the failed capture
    opt.zero_grad()
    snap = _snapshot(model, opt)

    def bad_loss(m, x, y):  # feeds float features where the model expects token ids through blocks
        return m.blocks[0](x).sum()

    with pytest.raises(InputShapeError, match=r"module 'blocks\.0\.norm'.*received input shapes \[\[2, 8, 5\]\]"
                                              r".*expects \[\.\.\., 16\].*inputs\[0\]: \[2, 8, 5\]"):
        capture(model, (torch.randn(2, 8, 5), targets), bad_loss, opt)
    _assert_untouched(model, opt, snap)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: torch.optim.Adam(ps, differentiable=True), r"'differentiable=True'"),
        (lambda ps: torch.optim.LBFGS(ps), r"LBFGS is not supported.*torch.optim.SGD.*Adafactor.*Adamax"),
        (lambda ps: torch.optim.NAdam([{"params": ps[:2], "momentum_decay": 0.01}, {"params": ps[2:]}]),
         r"NAdam's param groups differ in betas, momentum_decay"),
    ],
)
def test_unsupported_optimizer_names_the_option(tiny, make, match):
    model, inputs, loss_fn = tiny
    opt = make(list(model.parameters()))
    snap = _snapshot(model, opt)
    with pytest.raises(UnsupportedOptimizerError, match=match):
        capture(model, inputs, loss_fn, opt)
    _assert_untouched(model, opt, snap)


def test_unknown_param_group_option_is_named(tiny):
    model, inputs, loss_fn = tiny
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.param_groups[0]["my_schedule_hint"] = 3
    with pytest.raises(UnsupportedOptimizerError, match=r"SGD option 'my_schedule_hint'"):
        capture(model, inputs, loss_fn, opt)


def test_unknown_optimizer_name_lists_known(tiny):
    model, inputs, loss_fn = tiny
    with pytest.raises(UnsupportedOptimizerError, match=r"unknown optimizer 'lamb'.*adam.*adamw.*sgd"):
        capture(model, inputs, loss_fn, "lamb")


def test_non_scalar_loss_and_non_tensor_inputs(tiny):
    model, inputs, _ = tiny
    with pytest.raises(CaptureError, match=r"scalar tensor, got \[2, 8, 32\]"):
        capture(model, inputs[:1], lambda m, x: m(x), "sgd")
    with pytest.raises(CaptureError, match=r"example input 1 is a int"):
        capture(model, (inputs[0], 3), lambda m, x, k: m(x).sum(), "sgd")


@torch.library.custom_op("partir_test::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class _Opaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return _opaque(self.fc(x))


def test_untraceable_op_names_the_source_line_and_module():
    model = _Opaque()
    with pytest.raises(CaptureError, match=r"in module '<root>' \(_Opaque\) at .*test_errors\.py:\d+ "
                                           r"\(`return _opaque\(self\.fc\(x\)\)`\)"):
        capture(model, (torch.randn(2, 4),), _loss, "sgd")


@pytest.mark.xla
def test_torch_xlas_patched_gru_is_named_with_the_way_around():
    import torch.nn as nn

    from partir_torch.errors import CaptureError

    assert hasattr(nn.GRU, "_orig"), "torch_xla (imported by conftest) patches nn.GRU at import"
    model = nn.GRU(4, 4, batch_first=True)
    with pytest.raises(CaptureError, match=r"GRU here is torch_xla's replacement .* torch.nn.GRU._orig"):
        capture(model, (torch.randn(2, 3, 4),), lambda m, x: m(x)[0].sum(), "sgd")
