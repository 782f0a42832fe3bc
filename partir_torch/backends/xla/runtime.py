"""torch_xla's runtime for the backend: the import with its install hint, the SPMD runtime and its device count,
the mesh, sharding annotations and moving tensors onto the device."""

from __future__ import annotations

import functools
import glob
import logging
import os
import sys
from collections.abc import Sequence

import torch

from partir_torch.errors import PartirError
from partir_torch.ir.mesh import Mesh

log = logging.getLogger(__name__)


# torch_xla 2.9 is its last release and needs exactly its torch twin (`api.require_xla` says it before a call)
INSTALL = ("torch_xla 2.9 (its last release) needs torch 2.9.0 on Python 3.11: from a checkout, `./dev setup xla` "
           "makes that environment (.venv-xla); elsewhere, in a Python 3.11 environment, "
           "`pip install 'partir_torch[xla]'` (torch==2.9.0, torch-xla==2.9.0)")


class XlaError(PartirError):
    """torch_xla is missing, its runtime does not fit the mesh, or a plan cannot be applied with it."""


def _xla():
    try:
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
    except ImportError as e:
        raise XlaError(f"torch_xla is not installed ({e}). {INSTALL}") from e
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
                       "before partir_torch.find_plan() or capture(), and before training on the CPU") from None


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
