"""Op coverage: every aten op of every zoo training step (forward, backward, optimizer) has a real rule."""

from __future__ import annotations

import pytest

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.rules import registered, rule_for

CONFIGS = [("tiny-mlp", None), pytest.param("tiny-unet", None, marks=pytest.mark.slow), ("tiny-gns", None)] + [
    (n, a) for n in ["tiny-gpt2", "tiny-llama", "tiny-moe", "tiny-vit"] for a in ["sdpa", "math"]]


@pytest.mark.parametrize(("name", "attn"), CONFIGS)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_every_zoo_op_has_a_rule(name, attn, optimizer):
    model, inputs, loss_fn = models.build(name, {"attn": attn} if attn else None, device="meta")
    program = capture(model, inputs, loss_fn, optimizer)
    table = registered()
    missing = sorted({op.target for op in program.ops} - set(table))
    assert not missing, f"{name}: no rule for {missing}"
    for op in program.ops:  # and every rule accepts the op it is registered for
        rule = rule_for(op, program)
        assert len(rule.operands) + len(rule.results) >= 1


def test_ops_without_rules_are_decomposed_into_ops_with_rules():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from partir_torch.ir import Mesh
    from partir_torch.rules.base import MissingRuleError
    from partir_torch.rules.decompose import missing_ops, prepare
    from partir_torch.simulate import simulate
    from partir_torch.tactics import apply_schedule

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return F.hardswish(self.fc(x))  # aten.hardswish has no rule of its own

    torch.manual_seed(0)
    m, x = M(), torch.randn(4, 8)
    program = capture(m, (x,), lambda mod, t: mod(t).square().mean(), "sgd")
    assert missing_ops(program) == {"aten.hardswish.default", "aten.hardswish_backward.default"}
    with pytest.raises(MissingRuleError, match=r"aten\.hardswish\.default"):
        rule_for(next(op for op in program.ops if op.target == "aten.hardswish.default"), program)
    ready = prepare(program)
    assert not missing_ops(ready)
    # the ops hardswish decomposed into keep the module and source line of the op they replace
    before = {(op.module, op.source) for op in program.ops if op.target.startswith("aten.hardswish")}
    new = [op for op in ready.ops if op.target not in {o.target for o in program.ops}]
    assert new and {(op.module, op.source) for op in new} <= before, [(op.target, op.module, op.source) for op in new]
    assert all(src and src.startswith("test_coverage.py:") for _, src in before)
    state = apply_schedule(program, Mesh.parse("batch=4"), "batch:BatchParallel")
    states = {n: {"momentum_buffer": torch.zeros_like(p)} for n, p in m.named_parameters()}
    res = simulate(state.program, state, {n: p.detach() for n, p in m.named_parameters()}, {}, (x,), states)
    assert res.max_abs_diff <= 1e-6
