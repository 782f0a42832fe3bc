"""Functional optimizer updates, with torch.optim's own arithmetic, for capture.

torch.optim mutates state and reads the step count with `.item()` (its non-capturable path), which a
fake-tensor trace cannot do. Here each update is written out of place with the step as a tensor, op for op
as torch's *capturable* single-tensor path (`torch/optim/adam.py::_single_tensor_adam`, and likewise for
SGD, RMSprop, Adagrad, Adamax, NAdam, RAdam; Adafactor's `.item()` scalars become 0-dim tensors).
`tests/capture/test_optim.py` runs both on real tensors and compares them, so a torch change that drifts
from this is caught.

The captured step is the steady state: every state tensor exists (SGD's momentum buffer too), as after the
first `optimizer.step()`. torch keeps one step counter per parameter, all equal; here the counter is one
shared scalar state (`opt.step`; NAdam's momentum product too, `opt.mu_product`) and the bias corrections
are computed once per param group, which keeps the optimizer phase at ~8 ops per parameter instead of ~20
(same values, fewer scalar ops).

Each param group's learning rate is an input of the step (`opt.lr[g]`, a 0-dim float32; float64 in a step
that updates a float64 parameter, torch.optim's Python float exactly), not a constant:
an LR scheduler changes it between steps and the same program runs (torch's tensor-lr forms: `addcmul` by
the lr where torch.optim would `add(alpha=-lr)`). The other hyperparameters are constants of the program.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from partir_torch.errors import UnsupportedOptimizerError

# Every optimizer capture traces, by the name `optimizer=` also takes; the options each accepts are its
# constructor's (those only selecting an implementation are accepted and ignored), the defaults torch's.
CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad, "adafactor": torch.optim.Adafactor, "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam, "adamax": torch.optim.Adamax,
}
# what LR schedulers add to a group beside the lr (which is an input of the step)
SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum"})
_IMPL_ONLY = {"foreach", "fused", "capturable", "params", "name", *SCHEDULER_KEYS}
# by name, SGD gets momentum (a plan for plain SGD has no state to shard) and the lr capture always used
_NAME_DEFAULTS = {"sgd": {"lr": 1e-2, "momentum": 0.9}}


def _torch_defaults(kind: str) -> dict[str, Any]:
    """What a param group of this class holds when nothing is given (more than its signature: AdamW's
    `decoupled_weight_decay`)."""
    defaults = CLASSES[kind]([torch.zeros(1, requires_grad=True)]).defaults
    return {k: v for k, v in defaults.items() if k not in _IMPL_ONLY}


_DEFAULTS: dict[str, dict[str, Any]] = {k: {**_torch_defaults(k), **_NAME_DEFAULTS.get(k, {})} for k in CLASSES}
_BY_CLASS = {cls: kind for kind, cls in CLASSES.items()}


@dataclass(frozen=True)
class OptimizerSpec:
    """Which update to trace and with which hyperparameters, per parameter name."""

    kind: str
    hparams: Mapping[str, Mapping[str, Any]]

    def state_names(self, param: str) -> tuple[str, ...]:
        """Per-parameter state tensors, named as torch.optim names them."""
        hp = self.hparams[param]
        if self.kind == "sgd":
            return ("momentum_buffer",) if hp["momentum"] != 0 else ()
        if self.kind == "rmsprop":
            return ("square_avg", *(("momentum_buffer",) if hp["momentum"] > 0 else ()),
                    *(("grad_avg",) if hp["centered"] else ()))
        if self.kind == "adagrad":
            return ("sum",)
        if self.kind == "adamax":
            return ("exp_avg", "exp_inf")
        if self.kind == "adafactor":
            return ("row_var", "col_var", "variance")  # (`state_shapes` keeps the ones a shape has)
        return ("exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if hp.get("amsgrad") else ()))

    def state_shapes(self, param: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Each per-parameter state's shape: the parameter's, but Adafactor's factored second moments (a
        matrix keeps a row and a column: the last dim, or the one before it, of size 1)."""
        names = self.state_names(param)
        if self.kind != "adafactor":
            return {s: tuple(shape) for s in names}
        if len(shape) > 1:
            return {"row_var": (*shape[:-1], 1), "col_var": (*shape[:-2], 1, shape[-1])}
        return {"variance": tuple(shape)}

    def hypers(self, params: Iterable[str]) -> dict[str, float]:
        """The hyperparameter inputs of a step updating `params`, by name, with their values now: the lr of
        each param group they belong to, in group order."""
        groups = {self.hparams[n]["group"]: float(self.hparams[n]["lr"]) for n in params}
        return {f"lr[{g}]": groups[g] for g in sorted(groups)}

    @staticmethod
    def hyper_group(name: str) -> int:
        """The param group a hyperparameter input (`hypers`' name, `lr[g]`) belongs to."""
        return int(name.removeprefix("lr[").removesuffix("]"))

    @property
    def shared_states(self) -> tuple[str, ...]:
        """Scalar float32 states shared by all parameters (the step count; NAdam's momentum product)."""
        if self.kind == "sgd":
            return ()
        return ("step", "mu_product") if self.kind == "nadam" else ("step",)

    def advance(self, shared: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The shared states after this step."""
        if "step" not in shared:
            return {}
        step = shared["step"] + 1
        if self.kind != "nadam":
            return {"step": step}
        (beta1, _), md = _one(self, "NAdam", ("betas", "momentum_decay"))
        return {"step": step, "mu_product": shared["mu_product"] * _mu(beta1, md, step)}

    def update(
        self,
        param_name: str,
        p: torch.Tensor,
        g: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        shared: Mapping[str, torch.Tensor],
        cache: dict[Any, Any],
        hypers: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One out-of-place update: (new param, new per-parameter state). `shared` holds the advanced states,
        `hypers` the step's hyperparameter inputs (`hypers`' names)."""
        hp = dict(self.hparams[param_name])
        hp["lr"] = hypers[f"lr[{hp['group']}]"]  # (float64 where any parameter is: never cast down)
        if self.kind == "sgd":
            return _sgd(p, g, state, **hp)
        step = shared["step"].to(torch.float64) if p.dtype == torch.float64 else shared["step"]
        g = -g if hp["maximize"] else g
        if self.kind in ("adam", "adamw"):
            decoupled = self.kind == "adamw" or hp.get("decoupled_weight_decay", False)
            return _adam(p, g, state, step, cache, decoupled=decoupled, **hp)
        return _UPDATES[self.kind](p, g, state, step, shared, cache, **hp)

    def example_states(self, param: str, p: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """Plausible steady-state values (a few steps in) for simulating a plan: small moments, positive
        second moments, the shared states' values at step 3."""
        out = {}
        for s, shape in self.state_shapes(param, tuple(p.shape)).items():
            positive = s in ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "exp_inf", "row_var", "col_var",
                             "variance")
            x = torch.rand(shape, generator=gen) if positive else torch.randn(shape, generator=gen)
            out[s] = (x * 0.01 + (1e-3 if positive else 0.0)).to(p.dtype)
        if "step" in self.shared_states:
            out["step"] = torch.tensor(3.0)
        if "mu_product" in self.shared_states:
            out["mu_product"] = torch.tensor(0.5)
        return out


def _one(spec: OptimizerSpec, cls: str, keys: tuple[str, ...]) -> tuple[Any, ...]:
    """Hyperparameters a shared state depends on: one value across the param groups."""
    seen = {tuple(hp[k] for k in keys) for hp in spec.hparams.values()}
    if len(seen) > 1:
        raise UnsupportedOptimizerError(
            f"{cls}'s param groups differ in {', '.join(keys)} ({sorted(seen)}): capture keeps one momentum product "
            "for all parameters; use the same values in every group")
    return next(iter(seen))


def _mu(beta1: float, momentum_decay: float, step: torch.Tensor) -> torch.Tensor:
    return beta1 * (1.0 - 0.5 * torch.pow(0.96, step * momentum_decay))


def _decay(p, g, lr, weight_decay, decoupled, cache, group):
    if weight_decay == 0:
        return p, g
    return (p.mul(_shrink(lr, weight_decay, cache, group, p.dtype)), g) if decoupled else \
        (p, g.add(p, alpha=weight_decay))


def _shrink(lr, weight_decay, cache, group, dtype):
    """Decoupled weight decay's factor `1 - lr * weight_decay`, once per param group (a scalar op per
    parameter would cost a launch each)."""
    key = ("decay", group, weight_decay, dtype)
    if key not in cache:
        cache[key] = 1 - lr * weight_decay
    return cache[key]


def _sgd(p, g, state, *, lr, momentum, dampening, weight_decay, nesterov, maximize, **_):
    g = -g if maximize else g
    if weight_decay != 0:
        g = g.add(p, alpha=weight_decay)
    new_state = {}
    if momentum != 0:
        buf = state["momentum_buffer"].mul(momentum).add(g, alpha=1 - dampening)
        new_state["momentum_buffer"] = buf
        g = g.add(buf, alpha=momentum) if nesterov else buf
    return p.addcmul(g, lr, value=-1), new_state


def _adam(p, g, state, step, cache, *, lr, betas, eps, weight_decay, amsgrad, decoupled, group, **_):
    beta1, beta2 = betas
    p, g = _decay(p, g, lr, weight_decay, decoupled, cache, group)
    exp_avg = state["exp_avg"].lerp(g, 1 - beta1)
    exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(g, g, value=1 - beta2)
    key = ("adam", group, beta1, beta2, eps, p.dtype)
    if key not in cache:  # scalar bias-correction terms, as torch's capturable path computes them (in float64
        # for a float64 parameter: torch's default path computes them in Python floats)
        bias_correction1 = 1 - torch.pow(beta1, step)
        bias_correction2 = 1 - torch.pow(beta2, step)
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


def _rmsprop(p, g, state, step, shared, cache, *, lr, alpha, eps, weight_decay, momentum, centered, **_):
    if weight_decay != 0:
        g = g.add(p, alpha=weight_decay)
    square_avg = state["square_avg"].mul(alpha).addcmul(g, g, value=1 - alpha)
    new_state = {"square_avg": square_avg}
    if centered:
        grad_avg = state["grad_avg"].lerp(g, 1 - alpha)
        new_state["grad_avg"] = grad_avg
        avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt()
    else:
        avg = square_avg.sqrt()
    avg = avg.add(eps)
    if momentum > 0:
        buf = state["momentum_buffer"].mul(momentum).addcdiv(g, avg)
        new_state["momentum_buffer"] = buf
        return p.addcmul(buf, lr, value=-1), new_state
    return p.addcmul(g.div(avg), lr, value=-1), new_state


def _adagrad(p, g, state, step, shared, cache, *, lr, lr_decay, weight_decay, eps, group, **_):
    if weight_decay != 0:
        g = g.add(p, alpha=weight_decay)
    total = state["sum"].addcmul(g, g, value=1)
    std = total.sqrt().add(eps)
    if lr_decay == 0:
        return p.addcmul(g.div(std), lr, value=-1), {"sum": total}
    key = ("adagrad", group, lr_decay, p.dtype)
    if key not in cache:
        cache[key] = -lr / (1 + (step - 1) * lr_decay)
    return p.add(g.div(std).mul(cache[key])), {"sum": total}


def _adamax(p, g, state, step, shared, cache, *, lr, betas, eps, weight_decay, group, **_):
    beta1, beta2 = betas
    if weight_decay != 0:
        g = g.add(p, alpha=weight_decay)
    exp_avg = state["exp_avg"].lerp(g, 1 - beta1)
    exp_inf = torch.maximum(state["exp_inf"].mul(beta2), g.abs().add(eps))
    key = ("adamax", group, beta1, p.dtype)
    if key not in cache:  # torch's capturable form: (beta1^t - 1) / lr
        cache[key] = (torch.pow(beta1, step) - 1) / lr
    return p.addcdiv(exp_avg, exp_inf * cache[key]), {"exp_avg": exp_avg, "exp_inf": exp_inf}


def _nadam(p, g, state, step, shared, cache, *, lr, betas, eps, weight_decay, momentum_decay,
           decoupled_weight_decay, group, **_):
    beta1, beta2 = betas
    p, g = _decay(p, g, lr, weight_decay, decoupled_weight_decay, cache, group)
    exp_avg = state["exp_avg"].lerp(g, 1 - beta1)
    exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(g, g, value=1 - beta2)
    key = ("nadam", group, beta1, beta2, momentum_decay, p.dtype)
    if key not in cache:
        mu, mu_next = _mu(beta1, momentum_decay, step), _mu(beta1, momentum_decay, step + 1)
        mu_product = shared["mu_product"].to(step.dtype)
        cache[key] = (1 - torch.pow(beta2, step), -lr * (1.0 - mu) / (1.0 - mu_product),
                      -lr * mu_next / (1.0 - mu_product * mu_next))
    bias_correction2, grad_scale, avg_scale = cache[key]
    denom = exp_avg_sq.div(bias_correction2).sqrt().add(eps)
    p = p.addcdiv(g * grad_scale, denom).addcdiv(exp_avg * avg_scale, denom)
    return p, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _radam(p, g, state, step, shared, cache, *, lr, betas, eps, weight_decay, decoupled_weight_decay, group, **_):
    beta1, beta2 = betas
    p, g = _decay(p, g, lr, weight_decay, decoupled_weight_decay, cache, group)
    exp_avg = state["exp_avg"].lerp(g, 1 - beta1)
    exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(g, g, value=1 - beta2)
    key = ("radam", beta1, beta2, p.dtype)
    if key not in cache:  # torch's capturable form: the rectified step where rho_t > 5, else plain momentum
        bias_correction1, bias_correction2 = 1 - torch.pow(beta1, step), 1 - torch.pow(beta2, step)
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * torch.pow(beta2, step) / bias_correction2
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)).sqrt()
        cache[key] = (bias_correction1, bias_correction2.sqrt(), rho_t > 5.0, rect)
    bias_correction1, bc2_sqrt, rectify, rect = cache[key]
    adaptive = bc2_sqrt / exp_avg_sq.sqrt().add(eps)
    update = torch.where(rectify, rect * adaptive, 1.0)
    p = p.add((exp_avg / bias_correction1) * lr * update, alpha=-1.0)
    return p, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _adafactor(p, g, state, step, shared, cache, *, lr, beta2_decay, eps, d, weight_decay, group, **_):
    eps1, eps2 = eps
    eps1 = torch.finfo(p.dtype).eps if eps1 is None else eps1
    one_minus_beta2 = torch.pow(step, beta2_decay)
    rho = torch.clamp(step.rsqrt(), max=lr)
    alpha = torch.clamp(torch.linalg.vector_norm(p) / math.sqrt(p.numel()), min=eps2) * rho
    if weight_decay != 0:
        p = p.mul(_shrink(lr, weight_decay, cache, group, p.dtype))
    if g.dim() > 1:
        row_mean = torch.linalg.vector_norm(g, dim=-1, keepdim=True).square().div(g.size(-1))
        col_mean = torch.linalg.vector_norm(g, dim=-2, keepdim=True).square().div(g.size(-2))
        row_var = state["row_var"].lerp(row_mean, one_minus_beta2.to(p.dtype))
        col_var = state["col_var"].lerp(col_mean, one_minus_beta2.to(p.dtype))
        new_state = {"row_var": row_var, "col_var": col_var}
        var_estimate = (row_var @ col_var).div(row_var.mean(dim=-2, keepdim=True).clamp(min=eps1))
    else:
        var_estimate = state["variance"].lerp(g * g, one_minus_beta2.to(p.dtype))
        new_state = {"variance": var_estimate}
    update = var_estimate.clamp(min=eps1 * eps1).rsqrt().mul(g)
    denom = torch.clamp(torch.linalg.vector_norm(update) / (math.sqrt(update.numel()) * d), min=1.0)
    return p.add(update * (-alpha / denom).to(p.dtype)), new_state


_UPDATES = {"rmsprop": _rmsprop, "adagrad": _adagrad, "adamax": _adamax, "nadam": _nadam, "radam": _radam,
            "adafactor": _adafactor}


def _check_options(kind: str, cls: str, group: Mapping[str, Any], index: int) -> dict[str, Any]:
    hp: dict[str, Any] = {}
    for key, val in group.items():
        if key in _IMPL_ONLY:
            continue
        if key not in _DEFAULTS[kind]:
            raise UnsupportedOptimizerError(
                f"{cls} option {key!r} (param group {index}) is not supported by capture; supported options: "
                f"{sorted(_DEFAULTS[kind])}. Remove it or capture with optimizer={kind!r}."
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
        if key in ("betas", "eps") and isinstance(val, (tuple, list)):
            val = tuple(None if b is None else float(b) for b in val)
        hp[key] = val
    if kind == "sgd" and hp.get("nesterov") and (hp.get("momentum", 0) == 0 or hp.get("dampening", 0) != 0):
        raise UnsupportedOptimizerError("SGD option 'nesterov' needs momentum > 0 and dampening = 0")
    return {**_DEFAULTS[kind], **hp, "group": index}


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
                f"unknown optimizer {optimizer!r}; capture knows {sorted(_DEFAULTS)} by name, or pass an instance "
                f"of one of {_supported()}"
            )
        return OptimizerSpec(kind, {n: {**_DEFAULTS[kind], "group": 0} for n, p in named_params.items()
                                   if p.requires_grad})
    # (a subclass is its torch.optim class: the torch backend's rebuilt `PlannedAdamW` is an AdamW)
    kind = next((_BY_CLASS[c] for c in type(optimizer).__mro__ if c in _BY_CLASS), None)
    cls = type(optimizer).__name__
    if kind is None:
        raise UnsupportedOptimizerError(
            f"optimizer {cls} is not supported; capture traces {_supported()} (or pass optimizer= one of "
            f"{sorted(_DEFAULTS)} by name)"
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
    spec = OptimizerSpec(kind, hparams)
    if kind == "nadam" and hparams:
        _one(spec, cls, ("betas", "momentum_decay"))
    return spec


def _supported() -> str:
    return ", ".join(f"torch.optim.{c.__name__}" for c in CLASSES.values())
