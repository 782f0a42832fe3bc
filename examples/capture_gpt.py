"""Capture GPT-2 small's AdamW training step on fake tensors and look around the program.

    .venv/bin/python examples/capture_gpt.py
"""

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.ir import Phase, Role

model, inputs, loss_fn = models.build("gpt2-small", device="meta")
program = capture(model, inputs, loss_fn, optimizer="adamw")
print(f"{len(program.ops)} ops captured in {program.capture_time_s:.2f} s")
print(program.value("h.0.attn.c_attn.weight"))
print(program.value("opt.exp_avg[h.0.attn.c_attn.weight]"))
for group in program.groups[:3]:
    print(group)
first_bwd = next(op for op in program.ops if op.phase is Phase.BACKWARD and op.target == "aten.mm.default")
print("a backward matmul:", first_bwd)
print("gradients:", len(program.values_by_role(Role.GRADIENT)))
