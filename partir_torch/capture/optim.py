"""Functional optimizer updates, with torch.optim's own arithmetic, for capture.

torch.optim mutates state and reads the step count with `.item()` (its non-capturable path), which a
fake-tensor trace cannot do. Here each update is written out of place with the step as a tensor, op for op
as torch's *capturable* single-tensor path (`torch/optim/adam.py::_single_tensor_adam`,
`torch/optim/sgd.py::_single_tensor_sgd`). `tests/capture/test_optim.py` runs both on real tensors and
compares them, so a torch change that drifts from this is caught.

The captured step is the steady state: every state tensor exists (SGD's momentum buffer too), as after the
first `optimizer.step()`. torch keeps one step counter per parameter, all equal; here Adam's counter is one
shared scalar state (`opt.step`) and the bias corrections are computed once per distinct hyperparameter set,
which keeps the optimizer phase at ~8 ops per parameter instead of ~20 (same values, fewer scalar ops).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from partir_torch.errors import UnsupportedOptimizerError

# Options each optimizer's param_group may carry; those only selecting an implementation are accepted.
_IMPL_ONLY = {"foreach", "fused", "capturable", "params", "initial_lr", "name"}
_OPTIONS = {
    "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "differentiable"},
    "adam": {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "differentiable", "decoupled_weight_decay"},
}
_OPTIONS["adamw"] = _OPTIONS["adam"]
_DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 1e-2, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False},
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "maximize": False},
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False,
              "maximize": False},
}
_CLASSES = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}


@dataclass(frozen=True)
class OptimizerSpec:
    """Which update to trace and with which hyperparameters, per parameter name."""

    kind: str
    hparams: Mapping[str, Mapping[str, Any]]

    def state_names(self, param: str) -> tuple[str, ...]:
        """Per-parameter state tensors (same shape and dtype as the parameter)."""
        hp = self.hparams[param]
        if self.kind == "sgd":
            return ("momentum_buffer",) if hp["momentum"] != 0 else ()
        return ("exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if hp["amsgrad"] else ()))

    @property
    def shared_states(self) -> tuple[str, ...]:
        """Scalar float32 states shared by all parameters (Adam's step count)."""
        return () if self.kind == "sgd" else ("step",)

    def advance(self, shared: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The shared states after this step."""
        return {"step": shared["step"] + 1} if "step" in shared else {}

    def update(
        self,
        param_name: str,
        p: torch.Tensor,
        g: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        shared: Mapping[str, torch.Tensor],
        cache: dict[Any, Any],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One out-of-place update: (new param, new per-parameter state). `shared` holds the advanced step."""
        hp = self.hparams[param_name]
        if self.kind == "sgd":
            return _sgd(p, g, state, **hp)
        decoupled = self.kind == "adamw" or hp.get("decoupled_weight_decay", False)
        return _adam(p, g, state, shared["step"], cache, decoupled=decoupled, **hp)


def _sgd(p, g, state, *, lr, momentum, dampening, weight_decay, nesterov, maximize, **_):
    g = -g if maximize else g
    if weight_decay != 0:
        g = g.add(p, alpha=weight_decay)
    new_state = {}
    if momentum != 0:
        buf = state["momentum_buffer"].mul(momentum).add(g, alpha=1 - dampening)
        new_state["momentum_buffer"] = buf
        g = g.add(buf, alpha=momentum) if nesterov else buf
    return p.add(g, alpha=-lr), new_state


def _adam(p, g, state, step, cache, *, lr, betas, eps, weight_decay, amsgrad, maximize, decoupled, **_):
    beta1, beta2 = betas
    g = -g if maximize else g
    if weight_decay != 0:
        if decoupled:
            p = p.mul(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    exp_avg = state["exp_avg"].lerp(g, 1 - beta1)
    exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(g, g, value=1 - beta2)
    key = (lr, beta1, beta2, eps, p.dtype)
    if key not in cache:  # scalar bias-correction terms, as torch's capturable path computes them (in float64
        # for a float64 parameter: torch's default path computes them in Python floats)
        t = step.to(torch.float64) if p.dtype == torch.float64 else step
        bias_correction1 = 1 - torch.pow(beta1, t)
        bias_correction2 = 1 - torch.pow(beta2, t)
        step_size_neg = (lr / bias_correction1).neg()
        cache[key] = (bias_correction2.sqrt() * step_size_neg, eps / step_size_neg)
    scale, eps_term = cache[key]
    new_state = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second = exp_avg_sq
    if amsgrad:
        second = torch.maximum(state["max_exp_avg_sq"], exp_avg_sq)
        new_state["max_exp_avg_sq"] = second
    denom = (second.sqrt() / scale).add(eps_term)
    return p.addcdiv(exp_avg, denom), new_state


def _check_options(kind: str, cls: str, group: Mapping[str, Any], index: int) -> dict[str, Any]:
    hp: dict[str, Any] = {}
    for key, val in group.items():
        if key in _IMPL_ONLY:
            continue
        if key not in _OPTIONS[kind]:
            raise UnsupportedOptimizerError(
                f"{cls} option {key!r} (param group {index}) is not supported by capture; supported options: "
                f"{sorted(_OPTIONS[kind])}. Remove it or capture with optimizer={kind!r}."
            )
        if key == "differentiable" and val:
            raise UnsupportedOptimizerError(
                f"{cls} option 'differentiable=True' (param group {index}) is not supported: the captured "
                "step does not differentiate through the update. Construct the optimizer with differentiable=False."
            )
        if isinstance(val, torch.Tensor):
            if val.numel() != 1:
                raise UnsupportedOptimizerError(
                    f"{cls} option {key!r} is a tensor of shape {list(val.shape)}; use a float"
                )
            val = float(val)
        if key == "betas":
            val = tuple(float(b) for b in val)
        hp[key] = val
    if kind == "sgd" and hp.get("nesterov") and (hp.get("momentum", 0) == 0 or hp.get("dampening", 0) != 0):
        raise UnsupportedOptimizerError("SGD option 'nesterov' needs momentum > 0 and dampening = 0")
    return {**_DEFAULTS[kind], **hp}


def optimizer_spec(
    optimizer: torch.optim.Optimizer | str | None, named_params: Mapping[str, torch.Tensor], *, strict: bool = True
) -> OptimizerSpec | None:
    """Read the update rule and hyperparameters from a `torch.optim` instance, or take defaults by name.

    `named_params` maps the model's (deduplicated) parameter names to the parameter objects, so the
    optimizer's parameters are matched by identity.
    """
    if optimizer is None:
        return None
    if isinstance(optimizer, str):
        kind = optimizer.lower()
        if kind not in _DEFAULTS:
            raise UnsupportedOptimizerError(
                f"unknown optimizer {optimizer!r}; capture knows {sorted(_DEFAULTS)} by name, or pass a torch.optim "
                "SGD / Adam / AdamW instance"
            )
        return OptimizerSpec(kind, {n: dict(_DEFAULTS[kind]) for n, p in named_params.items() if p.requires_grad})
    kind = _CLASSES.get(type(optimizer))
    cls = type(optimizer).__name__
    if kind is None:
        raise UnsupportedOptimizerError(
            f"optimizer {cls} is not supported; capture traces torch.optim.SGD, Adam and AdamW "
            "(or pass optimizer='sgd' | 'adam' | 'adamw')"
        )
    by_id = {id(p): n for n, p in named_params.items()}
    hparams: dict[str, dict[str, Any]] = {}
    for i, group in enumerate(optimizer.param_groups):
        hp = _check_options(kind, cls, group, i)
        for p in group["params"]:
            name = by_id.get(id(p))
            if name is None and not strict:  # a folded model holds only some of the optimizer's parameters
                continue
            if name is None:
                raise UnsupportedOptimizerError(
                    f"{cls} param group {i} holds a tensor of shape {list(p.shape)} that is not a parameter of the "
                    "model; build the optimizer from model.parameters()"
                )
            hparams[name] = hp
    return OptimizerSpec(kind, hparams)
