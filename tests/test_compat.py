"""`partir_torch/_compat.py` on the installed torch, and what capture makes of the ops that moved between
releases. Marked `both`: `./dev test` runs these in the default environment (the newest torch) and in the XLA
one (torch 2.9.0), so each release's names and captured ops are pinned."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from partir_torch import _compat
from partir_torch.capture import capture
from partir_torch.errors import PartirError

pytestmark = pytest.mark.both


@pytest.mark.parametrize("name", sorted(_compat.NAMES))
def test_every_private_name_resolves_on_the_installed_torch(name):
    assert _compat.get(name) is not None


def test_the_functional_collectives_are_their_newest_names():
    new = _compat.torch_version() >= (2, 10)  # `*_single` since 2.10; 2.9 has only `*_tensor`
    assert _compat.get("all_gather").__name__ == ("all_gather_single" if new else "all_gather_tensor")
    assert _compat.get("reduce_scatter").__name__ == ("reduce_scatter_single" if new else "reduce_scatter_tensor")


def test_a_missing_name_names_itself_the_release_and_the_feature(monkeypatch):
    monkeypatch.setitem(_compat.NAMES, "gone", _compat.Name((("torch._nowhere", "gone"), ("torch", "_gone_too")),
                                                           "the frobnicator"))
    with pytest.raises(_compat.PrivateNameMissing) as e:
        _ = _compat.gone
    text = str(e.value)
    assert "the frobnicator" in text and "torch._nowhere.gone" in text and "torch._gone_too" in text
    assert torch.__version__ in text and isinstance(e.value, PartirError)


def test_a_torch_older_than_the_minimum_is_one_line_naming_it(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.8.1+cpu")
    with pytest.raises(PartirError, match=r"needs torch >= 2\.9, but torch 2\.8\.1\+cpu is installed"):
        _compat.check_torch()


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x)).mean()


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_batch_norm_is_captured_written_out_on_every_release(mode):
    """`batch_norm` reaches `_native_batch_norm_legit*` on torch 2.9 and `native_batch_norm` on newer ones:
    either way the capture holds its sums (the statistics a sharded batch all-reduces), no fused kernel, and
    the running statistics as buffer outputs named for the buffer."""
    torch.manual_seed(0)
    model = _Norm().train(mode == "train")
    x = torch.randn(4, 3, 6, 6)
    program = capture(model, (x,), lambda m, x: m(x), "sgd")
    targets = set(program.op_counts())
    assert not {t for t in targets if "batch_norm" in t and "backward" not in t}, targets
    assert not {t for t in targets if "batch_norm" in t}, targets  # the backward too
    assert "aten.sum.dim_IntList" in targets
    updated = {program.values[v].name for v in program.outputs
               if program.values[v].name.removeprefix("updated[").removesuffix("]") in program.buffers}
    assert updated == ({"updated[bn.running_mean]", "updated[bn.running_var]", "updated[bn.num_batches_tracked]"}
                       if mode == "train" else set())


def test_batch_norm_s_captured_step_is_eager_s():
    torch.manual_seed(0)
    model = _Norm()
    x = torch.randn(4, 3, 6, 6)
    program = capture(model, (x,), lambda m, x: m(x), "sgd")
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    out = program.run(params, buffers, (x,), {n: {"momentum_buffer": torch.zeros_like(p)} for n, p in params.items()})
    loss = model(x)
    loss.backward()
    assert torch.allclose(out[program.loss], loss.detach(), atol=1e-6)
    assert torch.allclose(out[program.grads["bn.weight"]], model.bn.weight.grad, atol=1e-5)
    got = {program.values[v].name: out[v] for v in program.outputs}
    assert torch.allclose(got["updated[bn.running_var]"], model.bn.running_var, atol=1e-6)
