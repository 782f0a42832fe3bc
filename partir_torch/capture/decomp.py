"""Decompositions applied while capturing: fused ops rewritten into ops every rule family covers.

BatchNorm is the one that matters. Its fused kernels compute the batch statistics inside the op, so a rule
for the fused op could only replicate the batch dim (or silently compute per-shard statistics). Written
out, the statistics are `sum` over the batch and spatial dims divided by the global count: with the batch
tiled, propagation makes the sums partial and lowering costs their all-reduce, as SyncBatchNorm does. The
backward (`native_batch_norm_backward`) is written out the same way. Both follow the formulas of torch's
kernels (biased variance normalizes, the unbiased one updates `running_var`); tests compare them with eager.

The running-statistics update is a `copy_` into the buffer, which functionalization turns into a buffer
output (`updated[bn.running_mean]`).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _dims(x: torch.Tensor) -> tuple[list[int], list[int], int]:
    """Reduced dims (all but channels), the per-channel broadcast shape, and the element count per channel."""
    dims = [0, *range(2, x.dim())]
    n = x.numel() // x.shape[1]
    return dims, [1, x.shape[1]] + [1] * (x.dim() - 2), n


def _bn_train(x, weight, bias, eps):
    dims, shape, n = _dims(x)
    mean = aten.div.Scalar(aten.sum.dim_IntList(x, dims), n)
    xc = aten.sub.Tensor(x, aten.view.default(mean, shape))
    var = aten.div.Scalar(aten.sum.dim_IntList(aten.mul.Tensor(xc, xc), dims), n)
    rstd = aten.rsqrt.default(aten.add.Scalar(var, eps))
    out = aten.mul.Tensor(xc, aten.view.default(rstd, shape))
    if weight is not None:
        out = aten.mul.Tensor(out, aten.view.default(weight, shape))
    if bias is not None:
        out = aten.add.Tensor(out, aten.view.default(bias, shape))
    return out, mean, rstd, var, n


def bn_legit(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        return bn_no_training(x, weight, bias, running_mean, running_var, momentum, eps)
    out, mean, rstd, var, n = _bn_train(x, weight, bias, eps)
    unbiased = aten.mul.Scalar(var, n / max(n - 1, 1))
    running_mean.copy_(aten.add.Tensor(aten.mul.Scalar(running_mean, 1 - momentum), aten.mul.Scalar(mean, momentum)))
    running_var.copy_(aten.add.Tensor(aten.mul.Scalar(running_var, 1 - momentum), aten.mul.Scalar(unbiased, momentum)))
    return out, mean, rstd


def bn_legit_no_stats(x, weight, bias, training, momentum, eps):
    out, mean, rstd, _, _ = _bn_train(x, weight, bias, eps)
    return out, mean, rstd


def bn_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    _, shape, _ = _dims(x)
    rstd = aten.rsqrt.default(aten.add.Scalar(running_var, eps))
    out = aten.mul.Tensor(aten.sub.Tensor(x, aten.view.default(running_mean, shape)), aten.view.default(rstd, shape))
    if weight is not None:
        out = aten.mul.Tensor(out, aten.view.default(weight, shape))
    if bias is not None:
        out = aten.add.Tensor(out, aten.view.default(bias, shape))
    empty = aten.new_zeros.default(x, [0])
    return out, empty, empty


def bn_backward(grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask):
    dims, shape, n = _dims(x)
    if train:
        mean, invstd = save_mean, save_invstd
    else:
        mean, invstd = running_mean, aten.rsqrt.default(aten.add.Scalar(running_var, eps))
    xhat = aten.mul.Tensor(aten.sub.Tensor(x, aten.view.default(mean, shape)), aten.view.default(invstd, shape))
    gb = aten.sum.dim_IntList(grad, dims)
    gw = aten.sum.dim_IntList(aten.mul.Tensor(grad, xhat), dims)
    scale = invstd if weight is None else aten.mul.Tensor(invstd, weight)
    if train:  # d/dx of (x - mean) * invstd through the batch statistics
        inner = aten.sub.Tensor(aten.sub.Tensor(aten.mul.Scalar(grad, n), aten.view.default(gb, shape)),
                                aten.mul.Tensor(xhat, aten.view.default(gw, shape)))
        gx = aten.mul.Tensor(inner, aten.view.default(aten.div.Scalar(scale, n), shape))
    else:
        gx = aten.mul.Tensor(grad, aten.view.default(scale, shape))
    return (gx if output_mask[0] else None, gw if output_mask[1] else None, gb if output_mask[2] else None)


def bn_native(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """`native_batch_norm`, which `batch_norm` reaches directly on newer torch (2.9 went through `_legit`)."""
    if not training:
        return bn_no_training(x, weight, bias, running_mean, running_var, momentum, eps)
    if running_mean is None:
        return bn_legit_no_stats(x, weight, bias, training, momentum, eps)
    return bn_legit(x, weight, bias, running_mean, running_var, training, momentum, eps)


FUNCTIONAL_DECOMPS = {
    aten.native_batch_norm.default: bn_native,
    aten._native_batch_norm_legit.default: bn_legit,
    aten._native_batch_norm_legit.no_stats: bn_legit_no_stats,
    aten._native_batch_norm_legit_no_training.default: bn_no_training,
    aten.native_batch_norm_backward.default: bn_backward,
}
