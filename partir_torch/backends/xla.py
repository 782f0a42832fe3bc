"""Apply a `ShardingPlan` with torch_xla SPMD, in the caller's process: the one apply path of the project.

`auto_shard`, `verify` (through `xla_worker`, a fresh process with the HLO dump on) and the calibration all
call `shard_module` / `shard_optimizer` / `shard_batch` here, so the program XLA compiles is the plan that
was searched, applied one way.

What `shard_module` does to the user's model, all of it undone by `unshard(model)`:
1. every parameter and buffer is replaced by a copy on the XLA device (tied weights stay one tensor; a
   model built on meta is materialized there with `torch.empty` and each module's `reset_parameters`, so no
   full host copy is made) and `xs.mark_sharding`ed with the plan's spec; `state_dict()` keeps its keys;
2. each module whose output the plan shards gets a forward hook that applies `mark_sharding_with_gradients`
   with that spec, and each parameter a tensor hook that constrains its gradient: without them GSPMD
   resolves conflicts its own way and runs another program than the one costed (docs/cost-model.md);
3. a forward pre-hook on the root shards the batch tensors that reach `forward` (moving host tensors to
   the device), and checks their shapes against the plan's;
4. while the root's forward runs, a `TorchFunctionMode` (`Lowerings`) runs `F.layer_norm`, `F.group_norm`,
   `F.batch_norm` and `F.instance_norm` as reductions over the normalized dims and
   `F.scaled_dot_product_attention` as einsums over [B, H, T, d]: torch_xla lowers the norms to XLA's
   batch-norm ops (over a [1, B*T, D], [1, N*G, ...] or [1, N*C, ...] reshape for all but batch norm) and
   attention to matmuls over a [B*H, T, d] reshape: GSPMD gathers the batch around the norms and loses the
   head sharding in attention (the same math, so the same numerics); and grouped convolutions
   (and transposed ones) as plain or depthwise ones, a depthwise one's weight gradient computed per kernel
   offset (`_GroupedConv`): given the autodiff's `batch_group_count` convolution with its batch split,
   GSPMD all-reduces the partial sums over every device, not the batch axis alone;
5. each module whose input the plan reshards on entry (`plan.module_inputs`: LayerNorm's input gathered,
   say) gets a forward pre-hook that constrains that input (and its gradient) the same way, so that
   GSPMD reshards there and not after the module.
6. inside modules' own forwards, where no module boundary is (a U-Net's skip `torch.cat` in the model's
   `forward`, an MoE's dispatch einsums), the same `TorchFunctionMode` numbers the calls that make tensors
   per module as the capture numbered them (`capture.attribution.CallTracker`) and applies `plan.calls`: an
   operand the plan reshards before a call is constrained (with its gradient) as the call reads it, and the
   call's result as the plan has it (`CallConstraints`; a dot's sum the plan reduce-scatters first reduced
   in place when a mesh axis is idle on it, so that GSPMD does not split the dot over that axis:
   `reduce_in_place`). Views and in-place results are left
   as they are (a constrained copy would not alias), and a module whose calls stop matching the capture's
   (another function, or a result of another shape: its forward took another path on the device) is left
   to GSPMD, with one warning.
7. the model's output, when the loss function reshards it (a vocab-tiled head's logits gathered for the
   softmax; `plan.output`), is constrained to the sharding the loss reads it in, with the gradient the
   loss's backward sends back: the loss runs outside the model, where no hook reaches.
8. a plan whose program was captured with `assume_compiling=True` (`plan.compiling`) has the model's forward
   run with `torch.compiler.is_compiling()` true too, so the library takes the path that was captured (HF's
   mask helpers keep an all-ones mask that their eager path drops) and the calls match the capture's.
The caller's original tensors are kept (not modified) for `unshard`, which copies the trained values back
into them. The optimizer is rebuilt on the moved parameters (`shard_optimizer`): same class, param groups
and hyperparameters, with `foreach=False` and `capturable=True` (implementation options: one graph per
step, the same arithmetic), its states created up front and sharded as the plan says.

torch_xla is imported only here (and in `xla_worker`); a missing install is an error that says how to get
the pinned pair.
"""

from __future__ import annotations

import functools
import glob
import itertools
import logging
import math
import os
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from partir_torch.backends.common import initial_states, rebuild_optimizer
from partir_torch.backends.common import slots as tensor_slots
from partir_torch.capture.attribution import Constants, call_name, counted
from partir_torch.errors import PartirError
from partir_torch.ir.mesh import Mesh
from partir_torch.plan import ShardingPlan, divisibility
from partir_torch.rules.conv import depthwise

log = logging.getLogger(__name__)

INSTALL = "pip install 'torch==2.9.0' 'torch-xla==2.9.0' (the pair must match; ./dev setup installs it)"


class XlaError(PartirError):
    """torch_xla is missing, its runtime does not fit the mesh, or a plan cannot be applied with it."""


def _xla():
    try:
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
    except ImportError as e:
        raise XlaError(f"torch_xla is not installed ({e}); install the pinned pair: {INSTALL}") from e
    return torch_xla, xs, xr


def _has_tpu() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def hardware_preset() -> str:
    """The preset of the TPU this process runs on (its accelerator type: `v5p-8`, `v5litepod-16`, `v6e-8`);
    `cpu-virtual`, said in one line, when there is none (or none a preset knows)."""
    from partir_torch.cost.hardware import preset_for

    kind = os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("ACCELERATOR_TYPE") or ""
    if _has_tpu() and not kind:
        try:
            from torch_xla._internal import tpu

            kind = f"v{tpu.version()}"
        except Exception:  # an unknown torch_xla layout: fall through to the note
            kind = ""
    preset = preset_for(kind) if kind else None
    if preset is None:
        what = f"TPU {kind!r} has no preset" if kind else "no TPU found"
        print(f"partir_torch: {what}; planning for cpu-virtual (give hardware=)", file=sys.stderr)
        return "cpu-virtual"
    return preset


# XLA CPU schedules a step for concurrency by default, "trading off extra memory pressure" (its flag's own
# words): all its copies of donated parameters and states, say, made at the start of the step. The cost model
# assumes a memory-aware scheduler, as accelerators' compilers have; XLA CPU's is this one.
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
_SCHEDULER_FLAG = MEMORY_SCHEDULER.split("=")[0]


def start_runtime(devices: int) -> str | None:
    """Make torch_xla's SPMD runtime ready for a mesh of `devices` devices; returns the one line to tell the
    user when it chose something for them (the CPU device, XLA CPU's memory-aware scheduler).

    The runtime reads `PJRT_DEVICE`, `CPU_NUM_DEVICES` and `XLA_FLAGS` once, when it starts: with neither
    device variable set and no accelerator, the CPU runtime is given `devices` virtual devices; on the CPU,
    XLA compiles with its memory-aware scheduler (`MEMORY_SCHEDULER`) unless `XLA_FLAGS` chooses one; once
    started, the device count must be the mesh's, and a CPU runtime started without that flag is warned of."""
    notes = []
    if "torch_xla" not in sys.modules:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's C++ info and deprecation lines
        if "PJRT_DEVICE" not in os.environ and not _has_tpu():
            os.environ["PJRT_DEVICE"] = "CPU"
    torch_xla, _, xr = _xla()
    started = torch_xla._XLAC._xla_runtime_is_initialized()
    cpu = xr.device_type() == "CPU"
    if not started and cpu and "CPU_NUM_DEVICES" not in os.environ:
        os.environ["CPU_NUM_DEVICES"] = str(devices)
        notes.append(f"no accelerator; using torch_xla's CPU runtime with {devices} virtual devices "
                     f"(PJRT_DEVICE=CPU CPU_NUM_DEVICES={devices})")
    flags = os.environ.get("XLA_FLAGS", "")
    if cpu and _SCHEDULER_FLAG not in flags:
        if started:
            _warn_scheduler()
        else:
            os.environ["XLA_FLAGS"] = f"{flags} {MEMORY_SCHEDULER}".strip()
            notes.append(f"XLA CPU compiles with its memory-aware scheduler, as the plan's memory assumes "
                         f"({MEMORY_SCHEDULER})")
    if not started and os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") >= "2":
        notes.append("XLA's GSPMD partitioner, which torch_xla SPMD compiles with, is deprecated upstream (Shardy "
                     "replaces it); XLA's warning of it on every compile is silenced (TF_CPP_MIN_LOG_LEVEL=2). The "
                     "torch backend (backend='torch') does not use it")
    note = "partir_torch: " + "; ".join(notes) if notes else None
    if not xr.is_spmd():
        xr.use_spmd()
    have = xr.global_runtime_device_count()
    if have != devices:
        how = (f"set PJRT_DEVICE=CPU CPU_NUM_DEVICES={devices} in the environment before torch_xla starts "
               "(before the first XLA tensor of the process)" if xr.device_type() == "CPU" else
               f"use a mesh whose sizes multiply to {have}")
        raise XlaError(f"the mesh needs {devices} devices, but torch_xla's runtime has {have} "
                       f"({xr.device_type()}{', already started' if started else ''}): {how}")
    _probe_autograd(torch_xla)
    return note


@functools.cache
def _warn_scheduler() -> None:
    log.warning("torch_xla's CPU runtime started without XLA CPU's memory-aware scheduler: its default schedules "
                "for concurrency and holds more memory per device than the plan predicts; set XLA_FLAGS=%s "
                "before torch_xla starts (or call partir_torch.start_runtime first)", MEMORY_SCHEDULER)


def _probe_autograd(torch_xla) -> None:
    """PyTorch sizes autograd's per-device queues once, at the first backward of the process: after a backward
    that ran before torch_xla's runtime started, every XLA backward fails with an internal assert. Say so
    now, before the model is touched, instead of in the user's first `loss.backward()`."""
    w = torch.zeros(1, device=torch_xla.device(), requires_grad=True)
    try:
        (w * 2).sum().backward()
    except RuntimeError as e:
        if "device_ready_queues_" not in str(e):
            raise
        raise XlaError("autograd ran before torch_xla's runtime started in this process, and PyTorch sizes its "
                       "per-device queues once, so no XLA backward can run in it. Start the runtime first: "
                       "call partir_torch.start_runtime(mesh) (or auto_shard) before any backward of the process: "
                       "before partir_torch.search() or capture(), and before training on the CPU") from None


def device_mesh(mesh: Mesh, dcn_axes: Sequence[str] = ()):
    """torch_xla's mesh for the abstract one: device ids from the runtime, row-major (the layout
    `backends.hlo` reads replica groups with); a `HybridMesh` when axes cross slices (DCN) and the runtime
    has slices. On a single slice (the CPU mesh) DCN axes only matter to the cost model."""
    _, xs, xr = _xla()
    names, shape = mesh.names, tuple(s for _, s in mesh.axes)
    attrs = xr.global_runtime_device_attributes()
    if dcn_axes and attrs and "slice_index" in attrs[0]:
        dcn = tuple(s if n in dcn_axes else 1 for n, s in mesh.axes)
        ici = tuple(s // d for s, d in zip(shape, dcn))
        return xs.HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn, axis_names=names)
    import numpy as np

    return xs.Mesh(np.arange(mesh.devices), shape, names)


def _spec(entry: list | None, n: int) -> tuple:
    if entry is None:
        return (None,) * n
    return tuple(tuple(e) if isinstance(e, list) else e for e in entry)


def _mark(t: torch.Tensor, mesh, spec: tuple) -> None:
    """`xs.mark_sharding(t, mesh, spec)` without its per-call probe for torchax and jax (a failed import on
    every call when they are absent: a sixth of placing GPT-2 small, and paid again in every traced step)."""
    torch_xla, _, _ = _xla()
    if t.dim() != len(spec):
        raise ValueError(f"spec {spec} has {len(spec)} entries for a tensor of rank {t.dim()}")
    if t.dim() > MAX_RANK:
        if any(e is not None for e in spec) and tuple(t.shape) not in _UNMARKED:
            _UNMARKED.add(tuple(t.shape))
            log.warning("a tensor of shape %s is kept replicated where the plan has %s: torch_xla 2.9 cannot "
                        "annotate a tensor of rank %d (more than %d dims: the XLA verifier rejects its sharding)",
                        list(t.shape), spec, t.dim(), MAX_RANK)
        return
    torch_xla._XLAC._xla_mark_sharding(t, mesh.get_op_sharding(spec))


MAX_RANK = 5  # torch_xla 2.9's `Mesh.get_op_sharding` builds a tile assignment with repeated devices above
# this rank (tests/backends/test_xla_known_bugs.py): such tensors are left to GSPMD
_UNMARKED: set[tuple[int, ...]] = set()  # shapes warned about once


def _to_device(t: torch.Tensor, mesh, spec: list | None) -> torch.Tensor:
    """A host tensor on the XLA device, transferred shard by shard with `spec` (a `.to(device)` would place
    it whole on every device first, and `mark_sharding` then move it back to re-split it)."""
    torch_xla, xs, _ = _xla()
    import torch_xla.core.xla_model as xm

    if t.dim() == 0:  # a scalar: replicated, nothing to split
        return t.detach().to(torch_xla.device())
    spec_t = _spec(spec, t.dim())
    used = {a for e in spec_t if e is not None for a in ((e,) if isinstance(e, str) else e)}
    if t.dim() > MAX_RANK:  # (kept whole: `_mark`)
        t = t.detach().to(torch_xla.device())
    if t.device.type != "xla" and all(e is not None for e in spec_t) and len(used) < len(mesh.axis_names):
        # torch_xla 2.9 cannot transfer by shards a tensor tiled on every dim and replicated over another axis
        # (an IndexError: tests/backends/test_xla_known_bugs.py): move it whole, then split it on the device
        t = t.detach().to(torch_xla.device())
    if t.device.type == "xla":
        _mark(t, mesh, spec_t)
        return t
    sharding = xs.ShardingSpec(mesh, spec_t)
    return xm.send_cpu_data_to_device([t.detach().cpu()], torch_xla.device(), sharding)[0]


def sharding_of(t: torch.Tensor) -> str:
    """torch_xla's sharding annotation of a device tensor ('' when replicated / none): what tests check."""
    torch_xla, _, _ = _xla()
    return torch_xla._XLAC._get_xla_sharding_spec(t)


# -- lowerings that keep shardings (named as the torch functions they stand for: called by keyword too) ----
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


_MUTATING = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ior__", "__iand__"}


def _mutates(func: Callable, kwargs: dict[str, Any]) -> bool:
    name = getattr(func, "__name__", "")
    return "out" in kwargs or name in _MUTATING or (name.endswith("_") and not name.endswith("__"))


class CallConstraints:
    """The plan's constraints at the torch-function calls inside modules' forwards (`plan.calls`,
    `plan/reads.call_constraints`): calls are numbered per module path as the capture numbered them
    (`capture.attribution.CallTracker`: calls that make tensors, from the model's call on), an operand the
    plan reshards is constrained (with its gradient) before the call, and the call's result after it.
    A result whose shape is not the captured one means the forward took another path than at capture: the
    module's remaining calls are left alone (one warning)."""

    def __init__(self, model: nn.Module, mesh, calls: dict[str, dict[str, dict]], axes: tuple[str, ...]) -> None:
        self.mesh, self.axes = mesh, axes
        self.paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
        self.table = {path: {int(k): c for k, c in cs.items()} for path, cs in calls.items()}
        self.last = {path: max(cs) for path, cs in self.table.items() if cs}  # each module's last constrained call
        self.stack: list[str] = []
        self.counts: dict[str, int] = {}
        self.lost: set[str] = set()  # modules whose calls stopped matching the capture's (warned once)
        self.short: set[str] = set()  # modules that ended a forward before their last constrained call (warned)
        self.constants = Constants()  # (tracked as the capture tracks them: their calls are not numbered)

    def push(self, mod: nn.Module, *_: Any) -> None:
        path = self.paths.get(id(mod))
        if path is not None:
            self.stack.append(path)

    def pop(self, mod: nn.Module, *_: Any) -> None:
        if self.paths.get(id(mod)) is not None and self.stack:
            self.stack.pop()

    def run(self, func: Callable, impl: Callable, args: tuple, kwargs: dict[str, Any]):
        if not self.stack:
            return impl(*args, **kwargs)
        path = self.stack[-1]
        if self.constants.constant(args, kwargs):
            out = impl(*args, **kwargs)
            self.constants.add(out)
            return out
        k = self.counts.get(path, 0)
        c = self.table.get(path, {}).get(k) if path not in self.lost else None
        other = c is not None and c.get("fn") and c["fn"] != call_name(func)  # (or a call that makes no tensor)
        if c is not None and not other and c["ins"] and not _mutates(func, kwargs):
            args, kwargs = self._inputs(c["ins"], args, kwargs)
        out = impl(*args, **kwargs)
        if not counted(func, out) or (other and _moved(args, kwargs, out)):
            return out  # (a move to the device the capture never made is none of its calls)
        self.counts[path] = k + 1
        if other:
            self._stray(path, k, f"is {call_name(func)}() where the capture had {c['fn']}()")
            return out
        if c is None or c["out"] is None or not isinstance(out, torch.Tensor):
            return out
        shape, spec, *rest = c["out"]
        if list(out.shape) != shape:
            self._stray(path, k, f"makes {list(out.shape)} where the capture had {shape}")
            return out
        if out._is_view() or _mutates(func, kwargs) or any(out is a for a in args):
            return out  # aliasing kept: a constrained copy would not see later in-place writes
        if out.device.type != "xla" or out.dim() == 0:
            return out  # a host constant the model makes (`torch.tensor(d ** 0.5)`), or a scalar
        if rest and reduce_in_place(rest[0], spec, self.axes):  # all-reduced in place, then sliced
            reduced, grad = rest[0]["reduced"], rest[0]["grad"]
            out = constrain(out, self.mesh, _spec(reduced, len(reduced)),
                            _spec(grad, len(grad)) if grad is not None else None)
        return constrain(out, self.mesh, _spec(spec, len(spec)), _spec(spec, len(spec)))

    def finish(self) -> None:
        """At the end of the model's forward: a module that made fewer calls than the plan constrains (the
        capture numbered calls this forward did not make) had its later constraints silently unmet; say so,
        once per module (a module skipped on this step, as LayerDrop skips layers, is one of them)."""
        for path, last in self.last.items():
            n = self.counts.get(path, 0)
            if n <= last and path not in self.lost and path not in self.short:
                self.short.add(path)
                log.warning("module %r made %d calls in this forward where the plan constrains its call %d: its "
                            "constraints from call %d on were not applied (the forward takes another path than at "
                            "capture, or skipped the module)", path, n, last, n)

    def _stray(self, path: str, k: int, what: str) -> None:
        self.lost.add(path)
        log.warning("module %r: call %d of its forward %s; its remaining calls are not constrained (the forward "
                    "takes another path than at capture)", path, k, what)

    def _inputs(self, ins: list, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        picks = [(shape, nth, _spec(spec, len(spec)), _spec(grad, len(grad)) if grad is not None else None)
                 for shape, nth, spec, grad in ins]
        return constrain_by_shape((args, kwargs), self.mesh, picks)


_DOTS = {"mm", "addmm", "bmm", "baddbmm"}  # rules of the ops GSPMD's dot partitioner takes


def _moved(args: tuple, kwargs: dict[str, Any], out: Any) -> bool:
    """Whether a call moved tensors to another device. The capture runs on one device: a model that moves a
    host tensor it keeps as a plain attribute only when the devices differ (HF CodeGen's sinusoid table,
    `if t.device != x.device: self.t = t.to(x.device)`) makes that call on the engine's first forward and
    never at capture, so where the plan's call of that number is another function, the move is not
    counted (a move the capture also made, a no-op there, is one of its calls: `.to(x.device)` of a host
    constant)."""
    given = {t.device for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    made = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return bool(given) and bool(made) and all(t.device not in given for t in made)


def reduce_in_place(summed: dict, spec: list, axes: tuple[str, ...]) -> bool:
    """Whether a call's result the plan makes as a sum and reduce-scatters into `spec` (`summed`:
    `reads.PendingSum` as JSON) is constrained reduced in place first: a dot's sum with a mesh axis idle on
    it (neither tiling nor summing it). Left to itself, GSPMD's dot partitioner splits such a dot over the
    idle axis (a QKV projection's rows), all-reduces a part and moves it to its devices with a
    collective-permute, and gathers its gradient the same way; reduced in place, it all-reduces and slices,
    an XLA reduce-scatter in the CPU's form. Other sums (a convolution's, a dot's with no idle axis) it
    reduce-scatters as the plan does, and reduced in place first it partitions them otherwise (measured:
    docs/apply.md), so they are left as they are."""
    used = {a for e in spec if e is not None for a in ([e] if isinstance(e, str) else e)}
    return summed["by"] in _DOTS and bool(set(axes) - used - set(summed["over"]))


def constrain_by_shape(tree: Any, mesh, picks: list[tuple], *, unique: bool = False) -> Any:
    """`tree` with, for each (shape, nth, spec, grad spec) of `picks`, its `nth` tensor leaf of that shape
    constrained (`unique`: only when it is the one tensor of that shape). A plan names a call's operands and a
    model's output so; a leaf off the XLA device (a host constant) is left alone."""
    leaves, spec_tree = pytree.tree_flatten(tree)
    for shape, nth, spec, grad in picks:
        hits = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and list(t.shape) == shape]
        if nth < len(hits) and not (unique and len(hits) > 1) and leaves[hits[nth]].device.type == "xla":
            leaves[hits[nth]] = constrain(leaves[hits[nth]], mesh, spec, grad)
    return pytree.tree_unflatten(leaves, spec_tree)


class _Constrain(torch.autograd.Function):
    """A sharding constraint on a new tensor (the caller's keeps its own), and on its gradient when `grad_spec`
    is given: `mark_sharding_with_gradients` with the gradient left to GSPMD when the plan does not say."""

    @staticmethod
    def forward(ctx, t, mesh, spec, grad_spec):
        _, xs, _ = _xla()
        ctx.mesh, ctx.grad_spec = mesh, grad_spec
        out = t.clone()
        if sharding_of(t):  # a sharded parameter's data keeps its sharding: annotate the use instead
            xs.annotate_custom_sharding(out, mesh, spec)
        else:
            _mark(out, mesh, spec)
        return out

    @staticmethod
    def backward(ctx, g):
        if ctx.grad_spec is not None:
            g = g.clone()
            _mark(g, ctx.mesh, ctx.grad_spec)
        return g, None, None, None


def constrain(t: torch.Tensor, mesh, spec: tuple, grad_spec: tuple | None) -> torch.Tensor:
    """`t` constrained to `spec` (and its gradient to `grad_spec`). A boolean tensor is left to GSPMD: torch_xla
    2.9 lowers `cumsum` of a bool as a `pred` reduce-window, and with a sharding annotation before it XLA's
    HLO verifier rejects the program after sharding propagation ("Expected instruction to have shape equal to
    u8[4,8], actual shape is pred[4,8]": HF Gemma-2's packed-sequence mask). A mask's resharding is cheap."""
    if t.dtype == torch.bool or t.dim() > MAX_RANK:  # (and a tensor torch_xla cannot annotate: `_mark`)
        return t
    return _Constrain.apply(t, mesh, spec, grad_spec)


class _ReadAs:
    """Hands the modules holding a parameter (`places`: (module, attribute), several when it is tied) the
    parameter constrained to the sharding the plan reads it in, for the duration of the forward of the
    module around them: the engine then reshards it once, and the backward reuses the resharded tensor
    autograd saved (the parameter object and `state_dict` are untouched). `grad`: the sharding the read's
    gradient is constrained to (`plan.read_grads`: a tied weight's readers' gradients, summed at the read)."""

    def __init__(self, places: list[tuple[nn.Module, str]], mesh, spec: tuple, grad: tuple | None = None) -> None:
        self.places, self.mesh, self.spec, self.grad = places, mesh, spec, grad
        self.saved: list[torch.Tensor] = []

    def enter(self, mod: nn.Module, args: Any) -> None:
        holder, attr = self.places[0]
        p = holder._parameters[attr]
        self.saved.append(p)
        with torch._C.DisableTorchFunction():  # not one of the model's calls (`CallConstraints` counts those)
            read = constrain(p, self.mesh, self.spec, self.grad)
        for m, a in self.places:
            m._parameters[a] = read

    def leave(self, mod: nn.Module, args: Any, out: Any) -> None:
        if self.saved:
            p = self.saved.pop()
            for m, a in self.places:
                m._parameters[a] = p


# -- applying a plan to a module ------------------------------------------------------------------------------
@dataclass(eq=False)
class Sharded:
    """What `shard_module` did to one model: enough to undo it, to shard its batches and to verify it."""

    plan: ShardingPlan
    mesh: Any  # torch_xla's Mesh
    originals: list[tuple[nn.Module, str, torch.Tensor]]  # (owner, attribute, the caller's tensor)
    names: dict[int, str]  # id of the caller's parameter -> its name (for the optimizer)
    handles: list[Any] = field(default_factory=list)
    lowerings: Lowerings | None = None
    loss_fn: Callable[..., torch.Tensor] | None = None
    optimizer: torch.optim.Optimizer | None = None  # the caller's, as it was given (a template for verify)
    warned_shapes: set[tuple] = field(default_factory=set)


_SHARDED: weakref.WeakKeyDictionary[nn.Module, Sharded] = weakref.WeakKeyDictionary()


def sharded(model: nn.Module) -> Sharded | None:
    """The record of `shard_module` on `model`, or None when it is not sharded."""
    return _SHARDED.get(model)


def shard_module(model: nn.Module, plan: ShardingPlan, mesh=None, *, lowerings: Lowerings | None = None,
                 loss_fn=None) -> Sharded:
    """Move `model` to the XLA device with the plan's shardings, constraints and batch hook (module docstring).
    On any failure the model is left as it was."""
    torch_xla, _, _ = _xla()
    if model in _SHARDED:
        raise XlaError(f"{type(model).__name__} is already sharded by partir_torch (plan for mesh "
                       f"{_SHARDED[model].plan.mesh}); call partir_torch.unshard(model) first to shard it again")
    if mesh is None:
        mesh = device_mesh(Mesh.of(plan.mesh), plan.dcn_axes)
    slots = tensor_slots(model)
    on_meta = sorted({id(t) for _, _, t, _ in slots if t.is_meta})
    if on_meta and len(on_meta) != len({id(t) for _, _, t, _ in slots}):
        meta_names = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        raise XlaError(f"some parameters or buffers are on the meta device and others are not "
                       f"({', '.join(meta_names[:5])}{' …' if len(meta_names) > 5 else ''}): "
                       "build the model wholly on meta, or wholly with weights")
    names = {id(p): n for n, p in model.named_parameters()}
    bnames = {id(b): n for n, b in model.named_buffers()}
    record = Sharded(plan, mesh, [(m, a, t) for m, a, t, _ in slots], names, lowerings=lowerings or Lowerings(),
                     loss_fn=loss_fn)
    dev = torch_xla.device()
    try:
        moved: dict[int, torch.Tensor] = {}
        for mod, attr, t, is_param in slots:
            new = moved.get(id(t))
            if new is None:
                name = names.get(id(t)) or bnames.get(id(t))
                # replicated ones too: an unannotated parameter's update may come out sharded like its states
                spec = plan.params.get(name) if id(t) in names else plan.buffers.get(name)
                data = torch.empty_like(t, device=dev) if t.is_meta else _to_device(t, mesh, spec)
                new = nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data
                moved[id(t)] = new
            setattr(mod, attr, new)
        if on_meta:
            _initialize(model, [bnames[i] for i in on_meta if i in bnames])
            for i, t in moved.items():  # marked after their initialization (lazy: computed sharded)
                name = names.get(i) or bnames.get(i)
                spec = plan.params.get(name) if i in names else plan.buffers.get(name)
                _mark(t, mesh, _spec(spec, t.dim()))
        _install_hooks(model, record)
        _materialize(moved.values())  # (and, from meta, initialize) the sharded parameters now
    except BaseException:
        _restore(model, record)
        raise
    _SHARDED[model] = record
    model.partir_plan = plan
    return record


def _initialize(model: nn.Module, meta_buffers: list[str]) -> None:
    """Parameters of a model built on meta, as `Module.to_empty` users initialize them."""
    covered: set[int] = set()
    for mod in model.modules():
        reset = getattr(mod, "reset_parameters", None)
        if callable(reset):
            with torch.no_grad():
                reset()
            covered.update(id(p) for p in mod.parameters(recurse=False))
    left = [n for n, p in model.named_parameters() if id(p) not in covered]
    if left:
        with torch.no_grad():
            for n in left:
                model.get_parameter(n).zero_()
        log.warning("built on meta, %d parameters have no module reset_parameters() and start at zero: %s",
                    len(left), ", ".join(left[:6]) + (" …" if len(left) > 6 else ""))
    if meta_buffers:
        log.warning("built on meta, buffers %s have no values (buffers are not reset); compute them after "
                    "auto_shard or build the model with weights", ", ".join(meta_buffers[:6]))


def _install_hooks(model: nn.Module, rec: Sharded) -> None:
    _, xs, _ = _xla()
    plan, mesh = rec.plan, rec.mesh

    def constrain_to(spec: tuple):
        def hook(mod, args, out):
            if isinstance(out, torch.Tensor) and out.dim() == len(spec):
                with torch._C.DisableTorchFunction():  # not one of the model's calls
                    return xs.mark_sharding_with_gradients(out, mesh, spec)
            return None

        return hook

    for path, spec in plan.activations.items():  # module outputs and their gradients as the plan has them
        try:
            mod = model.get_submodule(path)
        except AttributeError as e:
            raise XlaError(f"the plan constrains the output of module {path!r}, which this model does not have; "
                           "the plan was made for another model (search again)") from e
        rec.handles.append(mod.register_forward_hook(constrain_to(_spec(spec, len(spec)))))

    def as_the_loss_reads(shape: list[int], spec: tuple, grad: tuple | None):
        def hook(mod, args, out):
            with torch._C.DisableTorchFunction():  # not one of the model's calls
                return constrain_by_shape(out, mesh, [(shape, 0, spec, grad)], unique=True)

        return hook

    def read_as(spec: tuple, grad: tuple | None, shape: list[int] | None):
        def hook(mod, args, kwargs):
            slots = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            slots += [(k, a) for k, a in kwargs.items() if isinstance(a, torch.Tensor)]
            hits = [(k, a) for k, a in slots if (list(a.shape) == shape if shape else a.dim() == len(spec))]
            if len(hits) != 1:
                return None
            k, a = hits[0]
            with torch._C.DisableTorchFunction():  # not one of the model's calls
                a = constrain(a, mesh, spec, grad)
            if isinstance(k, int):
                return (*args[:k], a, *args[k + 1:]), kwargs
            return args, {**kwargs, k: a}

        return hook

    if plan.output is not None:  # the model's output as the loss reads it (`plan/reads.model_output`)
        shape, spec, grad = plan.output
        rec.handles.append(model.register_forward_hook(
            as_the_loss_reads(shape, _spec(spec, len(spec)), _spec(grad, len(grad)) if grad is not None else None)))

    in_shapes = plan.shapes.get("module_inputs", {})
    for path, (spec, grad) in plan.module_inputs.items():  # where the plan reshards a module's input on entry
        rec.handles.append(model.get_submodule(path).register_forward_pre_hook(
            read_as(_spec(spec, len(spec)), _spec(grad, len(grad)) if grad is not None else None,
                    in_shapes.get(path)), with_kwargs=True))

    held: dict[int, list[tuple[str, nn.Module, str]]] = {}  # id(parameter) -> where it is held (tied: several)
    for path, m in model.named_modules(remove_duplicate=False):
        for a, p in m._parameters.items():
            if isinstance(p, nn.Parameter):
                held.setdefault(id(p), []).append((path, m, a))
    for name, spec in plan.param_reads.items():  # parameters gathered once, as the plan reads them
        owner, _, attr = name.rpartition(".")
        p = model.get_submodule(owner)._parameters.get(attr)
        if not isinstance(p, nn.Parameter):
            continue
        places = list({(id(m), a): (m, a) for _, m, a in held[id(p)]}.values())
        paths = list(zip(*[path.split(".") if path else [] for path, _, _ in held[id(p)]]))
        n = next((i for i, names in enumerate(paths) if len(set(names)) > 1), len(paths))
        mod = model.get_submodule(".".join(names[0] for names in paths[:n]))  # the module around all of them
        grad = plan.read_grads.get(name)
        swap = _ReadAs(places, mesh, _spec(spec, len(spec)), _spec(grad, len(grad)) if grad is not None else None)
        rec.handles += [mod.register_forward_pre_hook(swap.enter),
                        mod.register_forward_hook(swap.leave, always_call=True)]

    grouped = _grouped_conv_weights(model)
    params = dict(model.named_parameters())
    for n, spec in plan.grads.items():  # parameter gradients reduced as planned
        p = params.get(n)
        if p is not None and p.requires_grad and spec is not None:  # replicated ones too (as parameters)
            made = plan.grads_made.get(n)
            first = (_spec(made, p.dim()) if made is not None else (None,) * p.dim() if n in grouped else None)
            rec.handles.append(p.register_hook(grad_hook(mesh, _spec(spec, p.dim()), first=first)))
    rec.handles.append(model.register_forward_pre_hook(_batch_hook(rec), with_kwargs=True))
    if rec.lowerings is not None:
        rec.lowerings.compiling = plan.compiling
    if rec.lowerings is not None and plan.calls:
        calls = rec.lowerings.calls = CallConstraints(model, mesh, plan.calls, tuple(plan.mesh))
        for m in {id(m): m for m in model.modules()}.values():  # first in, last out: around the user's hooks
            rec.handles += [m.register_forward_pre_hook(calls.push, prepend=True),
                            m.register_forward_hook(calls.pop, prepend=True, always_call=True)]
    if rec.lowerings is not None and rec.lowerings.active:
        rec.handles.append(model.register_forward_pre_hook(rec.lowerings.enter))
        rec.handles.append(model.register_forward_hook(rec.lowerings.leave, always_call=True))


def grad_hook(mesh, spec: tuple, *, first: tuple | None = None) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """A parameter's gradient hook: the gradient constrained to `spec`, as the plan keeps it; with `first`,
    constrained to `first` before, as the plan makes it (`plan.grads_made`; replicated for a grouped
    convolution's weight, `_grouped_conv_weights`)."""
    if first is None or first == spec:
        def mark(g: torch.Tensor) -> None:
            _mark(g, mesh, spec)

        return mark

    def made_first(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        _mark(g, mesh, first)
        g = g.clone()
        _mark(g, mesh, spec)
        return g

    return made_first


def _grouped_conv_weights(model: nn.Module) -> set[str]:
    """The weights of the model's grouped convolutions but depthwise ones. Their convolution runs with its
    channels whole (`rules/conv.py`), so the plan makes their gradient whole and then reduces it to its tiles;
    the engine is told so. (Left to GSPMD's convolution handler, the weight-gradient convolution partitioned
    over output channels that do not divide the groups, a RegNetY stage of 3 groups tiled by 2, aborted XLA
    2.9: "Check failed: new_input_batch_size % new_output_batch_size == 0"; docs/apply.md.) A depthwise
    convolution's channels are its groups: the plan tiles its gradient as it makes it, and made whole first
    it would be gathered."""
    return {f"{path}.weight" if path else "weight" for path, m in model.named_modules()
            if isinstance(m, nn.modules.conv._ConvNd) and m.groups > 1
            and not depthwise(m.in_channels, m.weight.shape, m.groups)}


def _batch_hook(rec: Sharded):
    slots = {k: i for i, k in enumerate(rec.plan.input_args) if k is not None}

    def hook(mod, args, kwargs):
        args = list(args)
        for k, i in slots.items():
            if isinstance(k, int) and k < len(args) and isinstance(args[k], torch.Tensor):
                args[k] = shard_input(rec, i, args[k])
            elif isinstance(k, str) and isinstance(kwargs.get(k), torch.Tensor):
                kwargs[k] = shard_input(rec, i, kwargs[k])
        return tuple(args), kwargs

    return hook


def shard_input(rec: Sharded, i: int, x: torch.Tensor) -> torch.Tensor:
    """Input `i` of the step on the device with the plan's sharding. A batch of another shape than the
    example's (the last, smaller batch of an epoch) is sharded the same way when its dims still divide,
    with one warning (XLA compiles a second program for it); otherwise it is an error."""
    plan = rec.plan
    spec = plan.inputs[i] if i < len(plan.inputs) else None
    shapes = plan.shapes.get("inputs") or []
    want = shapes[i] if i < len(shapes) else None
    if want is not None and list(x.shape) != list(want):
        bad = divisibility(f"input {i}", tuple(x.shape), spec or [], plan.mesh)
        if bad or x.dim() != len(want):
            raise XlaError(f"input {i} has shape {list(x.shape)}, the plan was made for {want}: " + "; ".join(bad)
                           + ". Drop the last partial batch (DataLoader(drop_last=True)) "
                           "or pad it to the planned shape")
        if (i, tuple(x.shape)) not in rec.warned_shapes:
            rec.warned_shapes.add((i, tuple(x.shape)))
            log.warning("input %d has shape %s, the plan was made for %s: sharded as planned; XLA compiles "
                        "another program for this shape", i, list(x.shape), want)
    return _to_device(x, rec.mesh, spec)


def shard_batch(model: nn.Module, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The step's inputs (all of them, targets included) on the device with the plan's shardings."""
    rec = _require(model)
    return tuple(shard_input(rec, i, x) for i, x in enumerate(batch))


def input_sharding(plan: ShardingPlan, i: int, mesh=None):
    """torch_xla's `ShardingSpec` of input `i`, for `MpDeviceLoader(loader, dev, input_sharding=...)`."""
    _, xs, _ = _xla()
    if not 0 <= i < len(plan.inputs):
        raise XlaError(f"the plan has {len(plan.inputs)} inputs; there is no input {i}")
    mesh = mesh or device_mesh(Mesh.of(plan.mesh), plan.dcn_axes)
    spec = plan.inputs[i]
    n = len(spec) if spec is not None else len(plan.shapes.get("inputs", [[]])[i])
    return xs.ShardingSpec(mesh, _spec(spec, n))


def _require(model: nn.Module) -> Sharded:
    rec = _SHARDED.get(model)
    if rec is None:
        raise XlaError(f"{type(model).__name__} is not sharded by partir_torch; call partir_torch.auto_shard first")
    return rec


def _restore(model: nn.Module, rec: Sharded) -> None:
    for h in rec.handles:
        h.remove()
    rec.handles.clear()
    for mod, attr, t in rec.originals:
        setattr(mod, attr, t)


def discard(model: nn.Module) -> None:
    """Undo `shard_module` without keeping its values (a failed `auto_shard`): the model as it was given."""
    rec = _require(model)
    _restore(model, rec)
    del _SHARDED[model]
    model.__dict__.pop("partir_plan", None)


def unshard(model: nn.Module) -> nn.Module:
    """Undo `shard_module`: hooks removed, the caller's own parameter and buffer objects put back, holding the
    trained values (on their original device; a model built on meta gets CPU tensors)."""
    rec = _require(model)
    current = {(id(mod), attr): getattr(mod, attr) for mod, attr, _ in rec.originals}
    copied: dict[int, torch.Tensor] = {}
    for mod, attr, orig in rec.originals:
        now = current[(id(mod), attr)]
        if id(orig) not in copied:
            with torch.no_grad():
                if orig.is_meta:
                    data = now.detach().cpu()
                    copied[id(orig)] = (
                        nn.Parameter(data, orig.requires_grad) if isinstance(orig, nn.Parameter) else data
                    )
                else:
                    orig.copy_(now.detach().to(orig.device))
                    copied[id(orig)] = orig
    _restore(model, rec)
    for mod, attr, orig in rec.originals:
        setattr(mod, attr, copied[id(orig)])
    del _SHARDED[model]
    model.__dict__.pop("partir_plan", None)
    return model


# -- the optimizer ---------------------------------------------------------------------------------------------
def shard_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    """`optimizer` (built on the caller's parameters of `model`) rebuilt on the sharded ones: same class, param
    groups and hyperparameters; its states (moved, or created as torch would) sharded as the plan says. The
    caller's optimizer is not modified."""
    torch_xla, _, _ = _xla()
    rec = _require(model)
    plan, dev = rec.plan, torch_xla.device()
    if isinstance(optimizer, torch.optim.SGD) and any(g.get("dampening", 0) for g in optimizer.param_groups):
        raise XlaError("SGD with dampening != 0 starts its momentum buffer from the first gradient undamped, which a "
                       "buffer created up front (to shard it) cannot reproduce; use dampening=0")
    new = rebuild_optimizer(optimizer, rec.names, dict(model.named_parameters()), foreach=False, capturable=True)
    for og, ng in zip(optimizer.param_groups, new.param_groups):
        for old_p, p in zip(og["params"], ng["params"]):
            name = rec.names[id(old_p)]
            had = optimizer.state.get(old_p)
            st = dict(had) if had else initial_states(new, ng, p, dev)
            for s, t in st.items():
                spec = plan.optimizer_state.get(name, {}).get(s, plan.params.get(name))
                if isinstance(t, torch.Tensor):
                    st[s] = _to_device(t, rec.mesh, spec if t.dim() else [])
            new.state[p] = st
    rec.optimizer = optimizer
    _materialize(t for st in new.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    return new


def apply(model: nn.Module, optimizer: torch.optim.Optimizer, plan: ShardingPlan, mesh=None, *,
          lowerings: Lowerings | None = None, loss_fn=None) -> torch.optim.Optimizer:
    """`shard_module` then `shard_optimizer`, all or nothing: returns the sharded optimizer; on a failure the
    model is as it was given."""
    shard_module(model, plan, mesh, lowerings=lowerings, loss_fn=loss_fn)
    try:
        return shard_optimizer(optimizer, model)
    except BaseException:
        discard(model)
        raise


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, batch: Sequence[torch.Tensor]
               ) -> torch.Tensor:
    """One step of the sharded model, ending the XLA graph: batch sharded as planned, backward, update,
    gradients dropped (temporaries of the step, not outputs of the graph), `torch_xla.sync()`."""
    torch_xla, _, _ = _xla()
    loss = loss_fn(model, *shard_batch(model, *batch))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch_xla.sync()
    return loss.detach()


def _materialize(tensors) -> None:
    """Compute these device tensors now, and nothing else the process has pending: after a user's step failed
    to compile (its tensors hold a graph that cannot run), a global `torch_xla.sync()` fails on those
    ("Check failed: tensor_data"), and a sharding applied next to them would fail with it."""
    torch_xla, _, _ = _xla()
    ts = [t for t in tensors if t.device.type == "xla"]
    if ts:
        torch_xla._XLAC._xla_sync_multi(ts, devices=[], wait=True)


def sync() -> None:
    """Run the pending XLA graph (`torch_xla.sync()`), for callers outside the backends."""
    import torch_xla

    torch_xla.sync()
