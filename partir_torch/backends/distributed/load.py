"""Pretrained weights into a sharded model, each rank reading only its own slices.

`load(model, path)` fills the parameters and buffers of a model sharded on torch.distributed from what
`save_pretrained` writes (one `.safetensors` file, or a directory of them with its `*.index.json`) or from a
DCP checkpoint directory. Safetensors' `get_slice` reads a rank's block of a tensor from the memory-mapped
file without reading the rest, so no rank ever holds a whole sharded tensor; DCP's planner does the same for
its own format. Names are the model's `state_dict()` names; a tied parameter is found under any of its names
(HF drops the tied head's copy). Everything is checked before anything is written, so a checkpoint that does
not fit leaves the model as it was: a missing or unexpected key lists them, a shape that differs names both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from partir_torch.backends.distributed.engine import require
from partir_torch.backends.distributed.runtime import DistributedError
from partir_torch.ir.sharding import Sharding
from partir_torch.lower.local import region


class CheckpointMismatch(DistributedError):
    """The checkpoint's keys or shapes are not the model's."""


@dataclass(frozen=True)
class Loaded:
    """What this rank read: tensors filled, and bytes read against the bytes of the whole tensors."""

    tensors: int
    read_bytes: int
    whole_bytes: int

    def __str__(self) -> str:
        return (f"loaded {self.tensors} tensors: this rank read {self.read_bytes / 2**20:.2f} MiB of "
                f"{self.whole_bytes / 2**20:.2f} MiB")


def _files(path: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it."""
    from safetensors import safe_open

    if path.is_file():
        files = [path]
    else:
        index = sorted(path.glob("*.safetensors.index.json"))
        if index:
            weight_map = json.loads(index[0].read_text())["weight_map"]
            return {k: path / f for k, f in weight_map.items()}
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DistributedError(f"{path}: no .safetensors file and no DCP checkpoint (.metadata) there; pass what "
                               "save_pretrained(..., safe_serialization=True) or torch.distributed.checkpoint wrote")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update(dict.fromkeys(h.keys(), f))
    return out


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """The name the engine holds each tensor under -> every name `state_dict()` gives it (tied weights)."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    saved = set(model.state_dict(keep_vars=True))  # (not a non-persistent buffer: no checkpoint holds it)
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for n, t in named:
        if n not in saved:
            continue
        key = first.setdefault(id(t), n)
        out.setdefault(key, []).append(n)
    return out


def load(model: nn.Module, path: str | Path, *, strict: bool = True) -> Loaded:
    """Fill the sharded `model` from the checkpoint at `path` (module docstring). `strict=False` allows keys
    the model does not have (they are listed in a warning) and keeps the model's own values where the
    checkpoint has none (listed too)."""
    import warnings

    rec, path = require(model), Path(path)
    if not path.exists():
        raise DistributedError(f"{path}: no such file or directory")
    if path.is_dir() and (path / ".metadata").exists():
        return _load_dcp(model, rec, path)
    files = _files(path)
    aliases = _aliases(model)
    found: dict[str, str] = {}
    for name, names in aliases.items():
        key = next((n for n in names if n in files), None)
        if key is not None:
            found[name] = key
    missing = sorted(n for n in aliases if n not in found and n in rec.tensors)
    known = {n for names in aliases.values() for n in names}
    unexpected = sorted(k for k in files if k not in known)
    if strict and (missing or unexpected):
        raise CheckpointMismatch(
            f"{path} does not hold this model's tensors: missing {missing or 'none'}; unexpected "
            f"{unexpected or 'none'} (names are the model's state_dict() names; strict=False loads what matches)")
    if missing or unexpected:
        warnings.warn(f"partir_torch.load: kept the model's own values for {missing or 'none'}; ignored "
                      f"{unexpected or 'none'} in {path}", stacklevel=2)
    from safetensors import safe_open

    handles = {f: safe_open(str(f), framework="pt") for f in set(files.values())}
    plan_, wrong = [], []
    for name, key in found.items():
        t = rec.tensors.get(name)
        if t is None:
            continue
        sl = handles[files[key]].get_slice(key)
        shape = tuple(sl.get_shape())
        if shape != tuple(t.shape):
            wrong.append(f"{key}: checkpoint {list(shape)}, model {list(t.shape)}")
        plan_.append((name, key, t, sl))
    if wrong:
        raise CheckpointMismatch(f"{path}: shapes differ from the model's: " + "; ".join(wrong))
    state, rm = rec.state, rec.rank_mesh
    prog = state.program
    read = whole = 0
    with torch.no_grad():
        for name, _key, t, sl in plan_:
            vid = prog.params.get(name, prog.buffers.get(name))
            sh = state.shard[vid] if vid is not None else Sharding.replicated(t.dim())
            local = t.to_local() if hasattr(t, "to_local") else t
            part = _read(sl, region(rm.mesh, sh, tuple(t.shape), rm.coord) if t.dim() else ())
            local.copy_(part.to(local.dtype))
            read += part.numel() * part.element_size()
            whole += t.numel() * local.element_size()
    return Loaded(len(plan_), read, whole)


def _read(sl, reg: tuple) -> torch.Tensor:
    """The block `reg` of a safetensors slice: slices read as they are; a dim read in chunks (an index
    tensor) reads the span that holds them, then picks them."""
    if not reg:
        return sl[...] if sl.get_shape() == [] else sl[:]
    spans, picks = [], []
    for d, r in enumerate(reg):
        if isinstance(r, slice):
            spans.append(r)
            continue
        lo, hi = int(r.min()), int(r.max()) + 1
        spans.append(slice(lo, hi))
        picks.append((d, r - lo))
    out = sl[tuple(spans)]
    for d, idx in picks:
        out = out.index_select(d, idx)
    return out


def _load_dcp(model: nn.Module, rec, path: Path) -> Loaded:
    """A DCP checkpoint of the model's `state_dict()`: DCP's planner reads each rank's DTensor shards (a whole
    tensor where it is whole)."""
    import torch.distributed.checkpoint as dcp

    want = model.state_dict()  # (its DTensors share the parameters' shards: DCP fills them in place)
    try:
        dcp.load(want, checkpoint_id=str(path))
    except Exception as e:  # DCP names the key; say which model
        raise CheckpointMismatch(f"{path}: the DCP checkpoint does not load into {type(model).__name__}: {e}") from e
    n = sum(t.numel() * t.element_size() for t in want.values())
    got = sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in want.values())
    return Loaded(len(want), got, n)
