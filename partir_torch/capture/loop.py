"""The training loop's asks, written into the captured step: microbatches accumulated, gradients clipped.

Both are part of the step's program, so the plan shards them like every other op and the engine runs them
exactly: a clip by the global norm sums each gradient's squares over its own shards and all-reduces the
partial sums where the plan splits a gradient (as FSDP2's `clip_grad_norm_` over DTensors does), and the
microbatches run one after another inside the step, each freeing its activations before the next starts.

Microbatches: the step's inputs arrive stacked, `[k, b, ...]` for a global batch of `k * b` rows (the rows
in order: microbatch i is rows `i*b .. (i+1)*b - 1`, as `torch.chunk` splits them); the plan splits dim 1,
the rows of one microbatch, so a device holds its part of every microbatch and no row moves.

Mixed precision (FSDP2's `MixedPrecisionPolicy`): inside the differentiated function each floating parameter
is cast to `param_dtype` (through `reduce_dtype` where that differs from both), and the model's floating
inputs too, at its root forward. The casts' backward is the gradient's way back: computed in `param_dtype`,
cast to `reduce_dtype`, then to the master's dtype. A pending sum passes through that one widening cast
(`rules/pointwise.py`), so the plan reduces the gradients in `reduce_dtype`, as FSDP2's reduce-scatter does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from partir_torch.errors import CaptureError
from partir_torch.ir.program import Loop

Grads = list[torch.Tensor]


def loop_of(options) -> Loop:
    """The `Loop` an `Options` asks for (its `accumulate`, `max_grad_norm`, `max_grad_value`, `param_dtype`,
    `reduce_dtype`, `remat`)."""
    return Loop(options.accumulate, options.max_grad_norm, options.max_grad_value,
                param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype, remat=options.remat)


def stacked_shape(shape: Sequence[int], loop: Loop, i: int) -> tuple[int, ...]:
    """Input `i`'s shape as the step takes it: `[k, b, ...]` for `accumulate=k`."""
    k = loop.accumulate
    if k == 1:
        return tuple(shape)
    if not shape or shape[0] % k:
        raise CaptureError(f"accumulate={k}: input {i} has shape {list(shape)}, whose dim 0 (the batch) does not "
                           f"split in {k} microbatches; pass a batch of a multiple of {k} rows")
    return (k, shape[0] // k, *shape[1:])


def stack(x: torch.Tensor, loop: Loop) -> torch.Tensor:
    """A global batch tensor as the step takes it (a view)."""
    return x if loop.accumulate == 1 else x.reshape(stacked_shape(tuple(x.shape), loop, 0))


Aux = dict[str, torch.Tensor]


def with_aux(out) -> tuple[torch.Tensor, Aux]:
    """A loss function's result as (loss, the scalars it returns beside it): `loss`, or `(loss, {name: value})`
    (the metrics a Lightning `training_step` logs: the step returns them, so the engine can log them)."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        loss, aux = out
        bad = [k for k, v in aux.items() if not (isinstance(v, torch.Tensor) and v.numel() == 1)]
        if bad:
            raise CaptureError(f"the values returned beside the loss must be one-element tensors; {bad} are not")
        return loss, {k: v.reshape(()) for k, v in aux.items()}
    return out, {}


def accumulated(one: Callable[[Sequence[torch.Tensor]], tuple[Grads, torch.Tensor, Aux]],
                xs: Sequence[torch.Tensor], loop: Loop) -> tuple[Grads, torch.Tensor, Aux]:
    """`one(inputs) -> (grads, loss, aux)` over each microbatch in turn: the gradients' sum divided by
    `loop.divide_by` (k; more for the last, short window of a Lightning epoch, which divides by its full
    window), the losses averaged, the aux values stacked, one per microbatch."""
    k = loop.accumulate
    if k == 1 and loop.divide_by == 1:
        return one(xs)
    grads: Grads | None = None
    total = None
    auxes: list[Aux] = []
    for i in range(k):
        g, loss, aux = one([x[i] for x in xs] if k > 1 else xs)
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        total = loss if total is None else total + loss
        auxes.append(aux)
    assert grads is not None and total is not None
    return [g / loop.divide_by for g in grads], total / k, {name: torch.stack([a[name] for a in auxes])
                                                            for name in auxes[0]}


def clipped(grads: Grads, loop: Loop) -> Grads:
    """The gradients as `clip_grad_norm_(params, max_grad_norm)` then `clip_grad_value_(params, max_grad_value)`
    leave them (torch's formula: coefficient `max_norm / (norm + 1e-6)`, at most 1)."""
    if loop.max_grad_norm is not None and grads:
        sq = None
        for g in grads:
            s = (g * g).sum()
            sq = s if sq is None else sq + s
        coef = (loop.max_grad_norm / (torch.sqrt(sq) + 1e-6)).clamp(max=1.0)
        grads = [g * coef for g in grads]
    if loop.max_grad_value is not None:
        grads = [g.clamp(-loop.max_grad_value, loop.max_grad_value) for g in grads]
    return grads


def cast_params(values: Mapping[str, torch.Tensor], names: Sequence[str], loop: Loop) -> dict[str, torch.Tensor]:
    """`values` with the floating parameters among `names` cast as the policy says (module docstring)."""
    pdt, rdt = loop.dtype("param_dtype"), loop.dtype("reduce_dtype")
    if pdt is None:
        return dict(values)
    out = dict(values)
    for n in names:
        p = values[n]
        if p.is_floating_point() and p.dtype != pdt:
            if rdt is not None and rdt not in (pdt, p.dtype):
                p = p.to(rdt)
            out[n] = p.to(pdt)
    return out


@contextlib.contextmanager
def cast_inputs(model: torch.nn.Module, loop: Loop) -> Iterator[None]:
    """While on: the model's root forward gets its floating tensor arguments in `param_dtype` (FSDP2's
    `cast_forward_inputs`); the loss function's own tensors (targets) are left as they are."""
    pdt = loop.dtype("param_dtype")
    if pdt is None:
        yield
        return

    def cast(a: Any) -> Any:
        return a.to(pdt) if isinstance(a, torch.Tensor) and a.is_floating_point() else a

    def pre(mod: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(cast(a) for a in args), {k: cast(a) for k, a in kwargs.items()}

    handle = model.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
