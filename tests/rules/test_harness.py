"""The harness can fail: a wrong rule is caught, a vacuous draw is refused; BatchNorm's statistics over a
sharded batch are an all-reduce; fallback and coverage name the op, its module and source line."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn

from partir_torch.capture import capture
from partir_torch.ir import Mesh, Tile
from partir_torch.lower import lower
from partir_torch.rules import base
from partir_torch.rules.base import MissingRuleError
from partir_torch.rules.decompose import coverage, prepare
from partir_torch.tactics import apply_schedule
from tests.rules.harness import run_plan


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def test_a_mutated_rule_makes_the_simulator_check_fail(monkeypatch):
    """mm's contracted factor made a pass-through instead of a sum: the partial products go unreduced."""
    x, mesh = torch.randn(4, 8), Mesh.parse("x=2")
    actions = [Tile("0.weight", 1, "x")]  # tiles the contraction dim of the first linear
    _, ok = run_plan(_mlp(), (x,), mesh, actions)
    assert ok.max_rel_diff <= 1e-5
    name, fn = base._RULES["aten.addmm.default"]

    def wrong(op, program):
        rule = fn(op, program)
        return dataclasses.replace(rule, reduced=tuple(frozenset() for _ in rule.reduced), partialize=frozenset())

    monkeypatch.setitem(base._RULES, "aten.addmm.default", (name, wrong))
    _, bad = run_plan(_mlp(), (x,), mesh, actions)
    assert bad.max_rel_diff > 1e-3


def test_batchnorm_statistics_over_a_sharded_batch_are_all_reduced():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    x = torch.randn(4, 3, 2, 2)
    state, res = run_plan(m, (x,), Mesh.parse("batch=2"), [Tile("inputs[0]", 0, "batch")])
    assert res.max_rel_diff <= 1e-5
    p = state.program
    # the per-channel sums of the batch statistics (forward) come out partial and are all-reduced
    stats = [c for c in lower(state) if c.kind == "all-reduce" and p.values[c.value].shape == (4,)
             and p.ops[p.values[c.value].producer].target == "aten.sum.dim_IntList"
             and p.ops[p.values[c.value].producer].phase.name == "FORWARD"]
    assert len(stats) >= 2, [c.to_json(state) for c in lower(state)]
    # and the captured statistics are eager BatchNorm's (output, gradients, running statistics)
    out = p.run(dict(m.named_parameters()), {k: v.clone() for k, v in m.named_buffers()}, (x,),
                {n: {"momentum_buffer": torch.zeros_like(q)} for n, q in m.named_parameters()})
    ref = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    ref.load_state_dict(m.state_dict())
    w = torch.linspace(-1.0, 1.0, 4 * 4 * 2 * 2).reshape(4, 4, 2, 2)
    loss = (ref(x) * w).sum()
    loss.backward()
    assert out[p.loss].item() == pytest.approx(loss.item(), abs=1e-5)
    for n, q in ref.named_parameters():
        torch.testing.assert_close(out[p.value(f"grad[{n}]").id], q.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[p.value("updated[1.running_var]").id], ref[1].running_var, atol=1e-6, rtol=1e-5)


class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return torch.cdist(h, h)  # no rule and no decomposition (checked below)


def test_missing_rule_names_op_module_and_line_and_fallback_warns_with_cost():
    torch.manual_seed(0)
    program = capture(_Odd(), (torch.randn(4, 8),), lambda m, x: m(x).sum(), "sgd")
    with pytest.raises(MissingRuleError,
                       match=r"(?s)aten\._cdist_forward\.default.*module <root> \(test_harness\.py:\d+\).*fallback"):
        prepare(program)
    cov = coverage(program)
    assert [u.target for u in cov.missing] == ["aten._cdist_backward.default", "aten._cdist_forward.default"]
    assert not cov.ok
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        apply_schedule(program, Mesh.parse("batch=2"), "fallback;batch:BatchParallel")
    msgs = [str(x.message) for x in w if "aten._cdist_forward" in str(x.message)]
    assert len(msgs) == 1, msgs
    assert "module <root> (test_harness.py:" in msgs[0] and "all-gather on 'batch'" in msgs[0]


def test_batchnorm_eval_capture_matches_eager():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).eval()
    m[1].running_mean.normal_()
    m[1].running_var.uniform_(0.5, 2.0)
    x = torch.randn(4, 3, 2, 2)
    p = capture(m, (x,), lambda mod, t: mod(t).square().mean(), "sgd")
    out = p.run(dict(m.named_parameters()), dict(m.named_buffers()), (x,),
                {n: {"momentum_buffer": torch.zeros_like(q)} for n, q in m.named_parameters()})
    loss = m(x).square().mean()
    loss.backward()
    assert out[p.loss].item() == pytest.approx(loss.item(), abs=1e-6)
    for n, q in m.named_parameters():
        torch.testing.assert_close(out[p.value(f"grad[{n}]").id], q.grad, atol=1e-6, rtol=1e-5)
