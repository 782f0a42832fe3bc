"""Op coverage: every aten op of every zoo training step (forward, backward, optimizer) has a real rule."""

from __future__ import annotations

import pytest

from partir_torch import capture, models
from partir_torch.rules import registered, rule_for

CONFIGS = [(n, a) for n in ["tiny-mlp", "tiny-unet", "tiny-gns"] for a in [None]] + [
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
