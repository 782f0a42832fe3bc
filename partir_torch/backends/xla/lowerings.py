"""The backend's own lowerings (`Lowerings`, a `TorchFunctionMode` active during the root's forward): norms as
reductions over the normalized dims, attention as einsums over [B, H, T, d], grouped convolutions as plain or
depthwise ones, so that GSPMD partitions them as the plan does (the package docstring says why)."""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from partir_torch.backends.xla.constraints import CallConstraints
from partir_torch.capture.attention import multi_head_attention_forward

log = logging.getLogger(__name__)

def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):  # (F.layer_norm's names)
    x = input
    dims = tuple(range(-len(normalized_shape), 0))
    mu = x.mean(dims, keepdim=True)
    xc = x - mu
    y = xc * torch.rsqrt((xc * xc).mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def _affine(y: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
            per_channel: tuple[int, ...]) -> torch.Tensor:
    """A norm's per-channel scale and shift (either may be absent)."""
    y = y if weight is None else y * weight.reshape(per_channel)
    return y if bias is None else y + bias.reshape(per_channel)


def _group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):  # (F.group_norm's names)
    x = input
    n, c = x.shape[:2]
    xg = x.reshape(n, num_groups, -1)
    mu = xg.mean(-1, keepdim=True)
    xc = xg - mu
    y = (xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)).reshape(x.shape)
    per_channel = (1, c) + (1,) * (x.dim() - 2)
    return _affine(y, weight, bias, per_channel)


class _BatchNormTraining(torch.autograd.Function):
    """Batch norm over the batch's statistics, with torch's backward: two reductions over the batch (the
    gradient's sum and its sum against the normalized input), as `native_batch_norm_backward` and the plan
    have them (autograd through the decomposed forward would make four)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        dims = [0, *range(2, x.dim())]
        per_channel = (1, -1) + (1,) * (x.dim() - 2)
        mean = x.mean(dims)
        xc = x - mean.reshape(per_channel)
        var = (xc * xc).mean(dims)
        rstd = torch.rsqrt(var + eps)
        xhat = xc * rstd.reshape(per_channel)
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.has_bias = bias is not None
        y = _affine(xhat, weight, bias, per_channel)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx, gy, _mean, _var):
        xhat, rstd, weight = ctx.saved_tensors
        dims = [0, *range(2, gy.dim())]
        per_channel = (1, -1) + (1,) * (gy.dim() - 2)
        n = gy.numel() // gy.shape[1]
        sum_g, sum_gx = gy.sum(dims), (gy * xhat).sum(dims)
        scale = rstd if weight is None else rstd * weight
        mean_g, mean_gx = (sum_g / n).reshape(per_channel), (sum_gx / n).reshape(per_channel)
        gx = scale.reshape(per_channel) * (gy - mean_g - xhat * mean_gx)
        return (gx, sum_gx if weight is not None and ctx.needs_input_grad[1] else None,
                sum_g if ctx.has_bias and ctx.needs_input_grad[2] else None, None)


def _batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                eps=1e-5):  # (F.batch_norm's names)
    x = input
    per_channel = (1, -1) + (1,) * (x.dim() - 2)
    if not training:
        y = (x - running_mean.reshape(per_channel)) * torch.rsqrt(running_var + eps).reshape(per_channel)
        return _affine(y, weight, bias, per_channel)
    y, mean, var = _BatchNormTraining.apply(x, weight, bias, eps)
    if running_mean is not None:  # torch updates the running variance with the unbiased one
        n = x.numel() // x.shape[1]
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(momentum * mean)
            running_var.mul_(1 - momentum).add_(momentum * n / max(n - 1, 1) * var)
    return y


def _instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                   momentum=0.1, eps=1e-5):  # (F.instance_norm's names)
    x = input
    n, c = x.shape[:2]
    per_channel = (1, c) + (1,) * (x.dim() - 2)
    if use_input_stats:
        dims = tuple(range(2, x.dim()))
        mean = x.mean(dims, keepdim=True)
        xc = x - mean
        var = (xc * xc).mean(dims, keepdim=True)
        y = xc * torch.rsqrt(var + eps)
        if running_mean is not None:  # the batch's mean of each instance's statistics (unbiased variance)
            m = x[0, 0].numel()
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(momentum * mean.reshape(n, c).mean(0))
                running_var.mul_(1 - momentum).add_(momentum * m / max(m - 1, 1) * var.reshape(n, c).mean(0))
    else:
        y = (x - running_mean.reshape(per_channel)) * torch.rsqrt(running_var + eps).reshape(per_channel)
    return _affine(y, weight, bias, per_channel)


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):  # F.scaled_dot_product_attention's names: callers pass them by keyword
    q, k, v = query, key, value
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = torch.einsum("...qd,...kd->...qk", q, k) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if is_causal:
        rows = torch.arange(q.shape[-2], device=q.device).unsqueeze(1)
        cols = torch.arange(k.shape[-2], device=q.device).unsqueeze(0)
        scores = scores.masked_fill(cols > rows, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return torch.einsum("...qk,...kd->...qd", probs, v)


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _weight_grad(x: torch.Tensor, gy: torch.Tensor, shape: torch.Size, stride, pads, dilation,
                 groups: int) -> torch.Tensor:
    """The weight gradient of a grouped convolution of `x` (padded by `pads`) giving `gy`, per kernel offset: the
    product of the strided slice of `x` that offset reads with the outputs that read it inside `x`, summed (a
    product and a sum for a depthwise one, which XLA fuses, nothing materialized; a dot otherwise), then
    summed over the batch at once (one all-reduce of the whole gradient, as the plan has it). GSPMD
    partitions these with the batch split correctly, where its convolution handler, given the autodiff's
    `batch_group_count` convolution, all-reduces the partial sums over every device and not over the batch
    axis alone (tests/backends/test_xla_known_bugs.py). No padded copy of `x` is made: GSPMD gathered the
    batch of one."""
    n, d = x.shape[0], x.dim() - 2
    o, cg, k = shape[0], shape[1], shape[2:]
    og = o // groups
    parts = []
    for off in itertools.product(*[range(kk) for kk in k]):
        xs, ys = [slice(None)] * 2, [slice(None)] * 2
        for i in range(d):
            first = off[i] * dilation[i] - pads[i][0]  # the input index output 0 reads at this offset
            lo = (-first + stride[i] - 1) // stride[i] if first < 0 else 0  # the first output inside `x`
            hi = min(gy.shape[2 + i], (x.shape[2 + i] - 1 - first) // stride[i] + 1)
            xs.append(slice(first + lo * stride[i], first + (hi - 1) * stride[i] + 1, stride[i]) if hi > lo
                      else slice(0, 0))
            ys.append(slice(lo, max(lo, hi)))
        xo = x[tuple(xs)].reshape(n, groups, cg, -1)
        yo = gy[tuple(ys)].reshape(n, groups, og, -1)
        if cg == 1:  # depthwise: a product and a sum, which XLA fuses with the slices
            parts.append((xo * yo).sum(3).reshape(n, groups, og, 1))
        else:
            parts.append(torch.einsum("ngcl,ngol->ngoc", xo, yo))
    return torch.stack(parts, -1).sum(0).reshape(shape)  # summed over the batch once: one all-reduce


def _pad(x: torch.Tensor, pads: list[tuple[int, int]]) -> torch.Tensor:
    flat = [p for pair in reversed(pads) for p in pair]
    return F.pad(x, flat) if any(flat) else x


class _GroupedConv(torch.autograd.Function):
    """A depthwise convolution (or transposed convolution) whose weight gradient is `_weight_grad`'s; the
    forward and the input gradient are torch's own convolutions, a depthwise multiplier's channels one at a
    time in the input gradient (a convolution with several channels a group is one GSPMD gathers the batch
    of). Padding is the convolutions' own where it is the same on both sides: GSPMD gathered the batch of an
    explicitly padded input."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, pads, dilation, groups, transposed, output_padding):
        d = x.dim() - 2
        ctx.save_for_backward(x, weight)
        ctx.conf = (stride, pads, dilation, groups, transposed, bias is not None)
        if transposed:
            return _CONV_T[d](x, weight, bias, stride, [p for p, _ in pads], output_padding, groups, dilation)
        if all(a == b for a, b in pads):
            return _CONV[d](x, weight, bias, stride, [a for a, _ in pads], dilation, groups)
        return _CONV[d](_pad(x, pads), weight, bias, stride, 0, dilation, groups)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        stride, pads, dilation, groups, transposed, has_bias = ctx.conf
        d = x.dim() - 2
        gx = gw = gb = None
        m = gy.shape[1] // groups if not transposed else weight.shape[1]
        if transposed:  # the adjoint of the convolution of `gy` by `weight`: its input's and weight's roles swap
            if ctx.needs_input_grad[0]:
                padding = [a for a, _ in pads]
                gx = sum(_CONV[d](gy[:, j::m], weight[:, j:j + 1], None, stride, padding, dilation, groups)
                         for j in range(m))
            if ctx.needs_input_grad[1]:
                gw = _weight_grad(gy, x, weight.shape, stride, pads, dilation, groups)
        else:
            if ctx.needs_input_grad[0]:
                grad_input = getattr(torch.nn.grad, f"conv{d}d_input")
                same = all(a == b for a, b in pads)  # the convolution's own padding, else a padded input's
                shape = x.shape if same else [*x.shape[:2], *(s + a + b for s, (a, b) in zip(x.shape[2:], pads))]
                padding = [a for a, _ in pads] if same else 0
                gx = sum(grad_input(shape, weight[j::m], gy[:, j::m], stride, padding, dilation, groups)
                         for j in range(m))
                if not same:
                    gx = gx[(slice(None), slice(None), *(slice(a, a + s) for s, (a, _) in zip(x.shape[2:], pads)))]
            if ctx.needs_input_grad[1]:
                gw = _weight_grad(x, gy, weight.shape, stride, pads, dilation, groups)
        if has_bias and ctx.needs_input_grad[2]:
            gb = gy.sum([0, *range(2, gy.dim())])
        return gx, gw, gb, None, None, None, None, None, None


def _tuple(v, d: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * d


def _grouped_conv(d: int) -> Callable:
    def conv(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # (F.convNd's names)
        if groups == 1 or input.dim() != d + 2:
            return _CONV[d](input, weight, bias, stride, padding, dilation, groups)
        width = input.shape[1] // groups
        if width > 1:
            if groups <= width:  # one plain convolution per group
                return torch.cat([_CONV[d](x, w, b, stride, padding, dilation) for x, w, b in
                                  zip(input.chunk(groups, 1), weight.chunk(groups), _chunks(bias, groups))], 1)
            # one depthwise convolution per channel of a group (the i-th input channel of every group)
            y = sum(conv(input[:, i::width], weight[:, i:i + 1], None, stride, padding, dilation, groups)
                    for i in range(width))
            return y if bias is None else y + bias.reshape(-1, *(1,) * d)
        dil = _tuple(dilation, d)
        if isinstance(padding, str):  # 'same' pads an even kernel's extra element after, as torch does
            total = [0] * d if padding == "valid" else [dil[i] * (weight.shape[2 + i] - 1) for i in range(d)]
            pads = [(t // 2, t - t // 2) for t in total]
        else:
            pads = [(p, p) for p in _tuple(padding, d)]
        return _GroupedConv.apply(input, weight, bias, _tuple(stride, d), pads, dil, groups, False, None)

    return conv


def _grouped_conv_transpose(d: int) -> Callable:
    def conv_transpose(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
        if groups == 1 or input.dim() != d + 2:
            return _CONV_T[d](input, weight, bias, stride, padding, output_padding, groups, dilation)
        width = input.shape[1] // groups
        if width > 1:
            if groups <= width:
                return torch.cat([_CONV_T[d](x, w, b, stride, padding, output_padding, 1, dilation) for x, w, b in
                                  zip(input.chunk(groups, 1), weight.chunk(groups), _chunks(bias, groups))], 1)
            y = sum(conv_transpose(input[:, i::width], weight[i::width], None, stride, padding, output_padding,
                                   groups, dilation) for i in range(width))
            return y if bias is None else y + bias.reshape(-1, *(1,) * d)
        return _GroupedConv.apply(input, weight, bias, _tuple(stride, d), [(p, p) for p in _tuple(padding, d)],
                                  _tuple(dilation, d), groups, True, _tuple(output_padding, d))

    return conv_transpose


def _chunks(bias: torch.Tensor | None, groups: int) -> Sequence[torch.Tensor | None]:
    return [None] * groups if bias is None else bias.chunk(groups)


def _compiling_true() -> bool:
    return True


class Lowerings(TorchFunctionMode):
    """Active while the sharded model's forward runs (module docstring, items 4, 6 and 8)."""

    def __init__(self, layer_norm: bool = True, attention: bool = True, grouped_conv: bool = True) -> None:
        super().__init__()
        self.table: dict[Callable, Callable] = {}
        if layer_norm:
            self.table[F.layer_norm] = _layer_norm
            self.table[F.group_norm] = _group_norm
            self.table[F.batch_norm] = _batch_norm
            self.table[F.instance_norm] = _instance_norm
        if attention:
            self.table[F.scaled_dot_product_attention] = _attention
            # nn.MultiheadAttention batch-major with a heads dim, as captured (`capture/attention.py`)
            self.table[F.multi_head_attention_forward] = functools.partial(multi_head_attention_forward,
                                                                           attention=_attention)
        if grouped_conv:
            self.table.update({_CONV[d]: _grouped_conv(d) for d in _CONV})
            self.table.update({_CONV_T[d]: _grouped_conv_transpose(d) for d in _CONV_T})
        self.calls: CallConstraints | None = None
        self.compiling = False  # run the forward with torch.compiler.is_compiling() true (`plan.compiling`)
        self._is_compiling: Callable[[], bool] | None = None
        self.depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        impl = self.table.get(func, func)
        if self.calls is None:
            return impl(*args, **(kwargs or {}))
        return self.calls.run(func, impl, args, kwargs or {})

    @property
    def active(self) -> bool:
        return bool(self.table) or self.calls is not None or self.compiling

    def enter(self, *_: Any) -> None:
        if self.active and self.depth == 0:
            if self.calls is not None:
                self.calls.counts.clear()
            if self.compiling:  # (as `capture(assume_compiling=True)` traced it)
                self._is_compiling, torch.compiler.is_compiling = torch.compiler.is_compiling, _compiling_true
            self.__enter__()
        self.depth += 1

    def leave(self, *_: Any) -> None:
        if self.depth == 0:  # the forward failed before `enter` ran (a pre-hook raised: a bad batch)
            return
        self.depth -= 1
        if self.active and self.depth == 0:
            self.__exit__(None, None, None)
            if self.calls is not None:
                self.calls.finish()
            if self._is_compiling is not None:
                torch.compiler.is_compiling, self._is_compiling = self._is_compiling, None
