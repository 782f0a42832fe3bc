"""The captured optimizer update equals torch.optim's, on real tensors (the oracle for capture/optim.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from partir_torch.capture import capture

CASES = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd-nesterov-wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01),
    "sgd-dampening-maximize": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, dampening=0.3, maximize=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam-amsgrad-wd": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, weight_decay=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    "rmsprop-centered-momentum-wd": lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.9, momentum=0.5,
                                                                   centered=True, weight_decay=0.01, maximize=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "adagrad-decay-wd": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.05, weight_decay=0.01,
                                                       initial_accumulator_value=0.1),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01, weight_decay=0.01),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01),
    "nadam-decoupled": lambda ps: torch.optim.NAdam(ps, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True,
                                                    momentum_decay=0.01),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01),  # rho_t <= 5 at step 3: the unrectified branch
    "radam-rectified": lambda ps: torch.optim.RAdam(ps, lr=0.01, betas=(0.9, 0.5), weight_decay=0.01),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
    "adafactor-wd-maximize": lambda ps: torch.optim.Adafactor(ps, lr=0.05, weight_decay=0.01, d=1.5,
                                                              beta2_decay=-0.5, eps=(1e-20, 1e-3), maximize=True),
}
# steps before the captured one (RAdam rectifies once rho_t > 5: with beta2 = 0.5, from step 6)
WARMUP = {"radam-rectified": 6}


def _two_groups(model):
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks")]
    return torch.optim.AdamW([{"params": blocks, "lr": 0.02}, {"params": rest, "weight_decay": 0.0}], lr=0.01)


def _make(case, model):
    return _two_groups(model) if case == "adamw-two-groups" else CASES[case](model.parameters())


@pytest.mark.parametrize("case", [*CASES, "adamw-two-groups"])
def test_captured_step_matches_torch_optim(tiny, case):
    """Also after the learning rates changed, as an LR scheduler changes them (per group): the lr is an input
    of the captured step, the program is not captured again."""
    model, inputs, loss_fn = tiny
    opt = _make(case, model)
    for _ in range(WARMUP.get(case, 2)):  # steady state: every state tensor exists and the step count is past 1
        loss_fn(model, *inputs).backward()
        opt.step()
        opt.zero_grad()
    program = capture(model, inputs, loss_fn, opt)

    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    scale = {f"lr[{g}]": 0.3 * (g + 1) for g in range(len(opt.param_groups))}
    assert program.hyper_values == {h: opt.param_groups[g]["lr"] for g, h in enumerate(scale)}
    out = program.run(params, {}, inputs, states, {h: program.hyper_values[h] * s for h, s in scale.items()})

    ref = copy.deepcopy(model)
    ref_opt = _make(case, ref)
    ref_opt.load_state_dict(opt.state_dict())
    for group, s in zip(ref_opt.param_groups, scale.values()):
        group["lr"] *= s
    loss = loss_fn(ref, *inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref_opt.step()

    assert out[program.loss].item() == pytest.approx(loss.item(), abs=1e-6)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(out[program.grads[n]], grads[n], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out[program.value(f"updated[{n}]").id], p.detach(), atol=1e-6, rtol=0)
        for s, v in ref_opt.state[p].items():
            if s in program.shared_states:
                torch.testing.assert_close(out[program.value(f"updated.opt.{s}").id], v)
            else:
                torch.testing.assert_close(out[program.value(f"updated.opt.{s}[{n}]").id], v, atol=1e-6, rtol=0)


def test_optimizer_by_name_uses_torch_defaults(tiny):
    model, inputs, loss_fn = tiny
    program = capture(model, inputs, loss_fn, "adamw")
    assert program.optimizer == "adamw"
    names = {v.name for v in program.values}
    assert "opt.exp_avg[blocks.0.up.weight]" in names and "opt.exp_avg_sq[head.bias]" in names
    assert "opt.step" in names
    program = capture(model, inputs, loss_fn, "sgd")
    assert "opt.momentum_buffer[emb.weight]" in {v.name for v in program.values}


def test_frozen_parameters_get_no_gradient_or_update(tiny):
    model, inputs, loss_fn = tiny
    model.emb.weight.requires_grad_(False)
    program = capture(model, inputs, loss_fn, torch.optim.Adam([p for p in model.parameters() if p.requires_grad]))
    assert "emb.weight" not in program.grads and "emb.weight" not in program.opt_states
    assert "head.weight" in program.grads
