"""A model built on the meta device, materialized on each rank as its own shards only.

A model too large for one rank is built with `torch.device("meta")`: shapes, no storage. The plan is searched
on it as on any model (capture runs on meta). At apply, each module that holds meta tensors of its own is
initialized in turn, in `model.modules()` order: its tensors are made real (empty) on the rank's device, the
module's own `reset_parameters()` (or the user's `init_fn(module)`) fills them, and each is cut to this rank's
part at once. A rank holds one module's tensors whole at a time, never the model; nothing is sent between
ranks (every rank draws alike: its generator is rank 0's before the first module).

The values are those of `init_whole(model, init_fn)` with the same seed, the same procedure on whole tensors:
the reference a test, or a user, compares with. CPU generators have no counter to skip ahead (DTensor's
offset-based RNG tracker is CUDA's Philox), so each rank draws a module's whole tensor and keeps its part:
compute, not memory, grows with the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from partir_torch.backends.distributed.runtime import DistributedError

InitFn = Callable[[nn.Module], None]


def owners(model: nn.Module) -> list[tuple[nn.Module, list[tuple[str, torch.Tensor, bool]]]]:
    """The modules (in `modules()` order) holding meta tensors of their own, first holder of a tied one."""
    seen: set[int] = set()
    out = []
    for mod in model.modules():
        own = [(n, t, True) for n, t in mod.named_parameters(recurse=False, remove_duplicate=False)]
        own += [(n, t, False) for n, t in mod.named_buffers(recurse=False, remove_duplicate=False) if t is not None]
        mine = [(n, t, p) for n, t, p in own if t.is_meta and id(t) not in seen]
        seen.update(id(t) for _, t, _ in mine)
        if mine:
            out.append((mod, mine))
    return out


def check(model: nn.Module, init_fn: InitFn | None) -> None:
    """Without `init_fn`, every module holding meta tensors must have `reset_parameters` (else: which lack it)."""
    if init_fn is not None:
        return
    names = {id(m): n or type(model).__name__ for n, m in model.named_modules()}
    lack = [f"{names[id(m)]} ({type(m).__name__})" for m, _ in owners(model) if not hasattr(m, "reset_parameters")]
    if lack:
        raise DistributedError(
            f"the model is on the meta device and {len(lack)} module(s) holding tensors have no reset_parameters "
            f"to initialize them: {', '.join(lack[:8])}{' ...' if len(lack) > 8 else ''}; pass "
            "auto_shard(..., init_fn=fn), fn(module) filling that module's own tensors, or build the model with "
            "weights")


def _fill(mod: nn.Module, own: list[tuple[str, torch.Tensor, bool]], device: torch.device,
          init_fn: InitFn | None) -> dict[str, torch.Tensor]:
    """The module's own meta tensors made real on `device` and initialized; {attribute: whole tensor}."""
    real = {}
    for n, t, is_param in own:
        empty = torch.empty(t.shape, dtype=t.dtype, device=device)
        real[n] = nn.Parameter(empty, requires_grad=t.requires_grad) if is_param else empty
        if is_param:
            mod._parameters[n] = real[n]
        else:
            mod._buffers[n] = real[n]
    with torch.no_grad():
        (init_fn or type(mod).reset_parameters)(mod)
    return real


def materialize(model: nn.Module, device: torch.device, init_fn: InitFn | None,
                cut: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]
                ) -> tuple[dict[int, torch.Tensor], tuple[int, int]]:
    """id of each meta tensor -> `cut(meta tensor, whole value, is_param)`, module by module (module
    docstring), and (the most bytes held whole at once: the largest module's, the model's bytes). The
    model's attributes hold the meta tensors again on return: the caller puts the cut ones in."""
    check(model, init_fn)
    out: dict[int, torch.Tensor] = {}
    largest = total = 0
    for mod, own in owners(model):
        nbytes = sum(t.numel() * t.element_size() for _, t, _ in own)
        largest, total = max(largest, nbytes), total + nbytes
        try:
            whole = _fill(mod, own, device, init_fn)
            for n, t, is_param in own:
                out[id(t)] = cut(t, whole[n].detach(), is_param)
            del whole
        finally:
            for n, t, is_param in own:  # the meta tensors back: the caller's `originals` stay the model's own
                (mod._parameters if is_param else mod._buffers)[n] = t
    return out, (largest, total)


def init_whole(model: nn.Module, init_fn: InitFn | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """The reference: `model` (on meta) made real on `device` whole and initialized by the same procedure,
    module by module in `modules()` order (`reset_parameters`, or `init_fn`); ties kept. In place."""
    check(model, init_fn)
    made: dict[int, torch.Tensor] = {}
    for mod, own in owners(model):
        whole = _fill(mod, own, torch.device(device), init_fn)
        made.update({id(t): whole[n] for n, t, _ in own})
    for mod in model.modules():  # a tied tensor's other holders
        for store in (mod._parameters, mod._buffers):
            for n, t in list(store.items()):
                if t is not None and id(t) in made:
                    store[n] = made[id(t)]
    return model
