"""One rank's side of a reshard: the steps of `layout.walk` run on its local tensor with
torch's functional collectives (`_compat`: their names move between releases) over each mesh axis's
process group.

A step's data stays inside its axis's group. Where the blocks line up with one dim (the common case: an
axis minor-most on its dim), a step is the collective along that dim (all-gather along d,
reduce-scatter along d, chunks swapped by `all_to_all_single`); otherwise (chunked layouts,
interleaved blocks) it is the same collective on the flattened local tensor with the elements each device
sends and receives picked by index, computed here from the layouts. Either way each step moves exactly the
bytes `lower` counts for it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import torch

from partir_torch import _compat
from partir_torch.errors import PartirError
from partir_torch.ir.mesh import Mesh
from partir_torch.lower.layout import Layout, Step, along


class ReshardError(PartirError):
    """A reshard the rank program cannot run (a layout whose data is not where the walk expects it)."""


class Exchange:
    """Runs walk steps for the device at `coord` of `mesh`; `groups[axis]` is what functional collectives take
    for the axis's group (a ProcessGroup, or its name)."""

    def __init__(self, mesh: Mesh, coord: dict[str, int], groups: dict[str, object]) -> None:
        self.mesh, self.coord, self.groups = mesh, coord, groups

    def member(self, axis: str, j: int) -> dict[str, int]:
        return {**self.coord, axis: j}

    def run(self, x: torch.Tensor, step: Step, shape: tuple[int, ...]) -> torch.Tensor:
        kind, axis = step.kind, step.axis
        if kind == "all-reduce":
            out = _compat.all_reduce(x, "sum", self.groups[axis])
        elif kind == "reduce-scatter":
            out = self._reduce_scatter(x, step, shape)
        elif kind == "all-gather":
            out = self._gather(x, step, shape)
        elif kind == "all-to-all":
            out = self._all_to_all(x, step, shape)
        elif kind == "zero":
            out = x
        else:  # slice, relayout: a part of what the device holds
            out = self._local(x, step.src, step.dst, shape)
        if axis and axis in step.dst.partial and axis not in step.src.partial and self.coord[axis] != 0:
            out = torch.zeros_like(out)  # a summand kept by the axis's first device only
        return out

    # -- index arithmetic ----------------------------------------------------------------------------------
    def _index(self, lay: Layout, shape: tuple[int, ...], axis: str | None = None, j: int | None = None
               ) -> list[np.ndarray]:
        return lay.index(self.mesh, shape, self.coord if axis is None else self.member(axis, j))

    def _local(self, x: torch.Tensor, src: Layout, dst: Layout, shape: tuple[int, ...]) -> torch.Tensor:
        have, want = self._index(src, shape), self._index(dst, shape)
        for d, (h, w) in enumerate(zip(have, want)):
            if len(h) == len(w) and (h == w).all():
                continue
            pos = _positions(w, h, f"{src} -> {dst} dim {d}")
            if not len(pos):  # this device holds none of the dim (a dim smaller than its axes' devices)
                x = x.narrow(d, 0, 0)
            elif (np.diff(pos) == 1).all():
                x = x.narrow(d, int(pos[0]), len(pos))
            else:
                x = x.index_select(d, torch.as_tensor(pos, device=x.device))
        return x

    def _gather(self, x: torch.Tensor, step: Step, shape: tuple[int, ...]) -> torch.Tensor:
        axis, n = step.axis, self.mesh.size(step.axis)
        want = self._index(step.dst, shape)
        parts = [self._index(step.src, shape, axis, j) for j in range(n)]
        d = along(parts, want)
        if d is not None:
            return _compat.all_gather(x.contiguous(), d, self.groups[axis])
        flat = _compat.all_gather(_padded(x.contiguous().reshape(-1), _largest(parts)), 0, self.groups[axis])
        return _assemble(flat, parts, want, x.device, f"gather {step.src} -> {step.dst}", padded=True)

    def _reduce_scatter(self, x: torch.Tensor, step: Step, shape: tuple[int, ...]) -> torch.Tensor:
        axis, n = step.axis, self.mesh.size(step.axis)
        have = self._index(step.src, shape)
        dests = [self._index(step.dst, shape, axis, k) for k in range(n)]
        d = along(dests, have)
        if d is not None:
            return _compat.reduce_scatter(x.contiguous(), "sum", d, self.groups[axis])
        most = _largest(dests)  # (members' blocks padded to the largest: a layout's blocks may be uneven)
        send = torch.cat([_padded(_pick(x, have, dk), most) for dk in dests])
        mine = _compat.reduce_scatter(send, "sum", 0, self.groups[axis])
        local = [len(i) for i in dests[self.coord[axis]]]
        return mine[:math.prod(local)].reshape(local)

    def _all_to_all(self, x: torch.Tensor, step: Step, shape: tuple[int, ...]) -> torch.Tensor:
        axis, n = step.axis, self.mesh.size(step.axis)
        have, want = self._index(step.src, shape), self._index(step.dst, shape)
        dests = [self._index(step.dst, shape, axis, k) for k in range(n)]
        srcs = [self._index(step.src, shape, axis, j) for j in range(n)]
        sent = [[np.intersect1d(h, dk) for h, dk in zip(have, dest)] for dest in dests]
        got = [[np.intersect1d(s, w) for s, w in zip(src, want)] for src in srcs]
        t, s = along(sent, have), along(got, want)
        if t is not None and s is not None:  # split along t, the pieces received joined along s
            pieces = torch.stack(x.chunk(n, t)).contiguous()
            recv = _compat.all_to_all_single(pieces.reshape(-1), None, None, self.groups[axis])
            return torch.cat(recv.reshape(pieces.shape).unbind(0), s)
        send = torch.cat([_pick(x, have, part) for part in sent])
        sizes = [int(np.prod([len(i) for i in part])) for part in sent]
        recv_sizes = [int(np.prod([len(i) for i in part])) for part in got]
        flat = _compat.all_to_all_single(send, recv_sizes, sizes, self.groups[axis])
        return _assemble(flat, got, want, x.device, f"all-to-all {step.src} -> {step.dst}")


def _positions(sub: np.ndarray, full: np.ndarray, what: str) -> np.ndarray:
    """Where each of `sub`'s global indices sits in `full` (both ascending); every one must be there."""
    pos = np.searchsorted(full, sub)
    if len(sub) and (pos.max(initial=0) >= len(full) or (full[np.minimum(pos, len(full) - 1)] != sub).any()):
        raise ReshardError(f"reshard {what}: the device does not hold the elements it needs")
    return pos


def _pick(x: torch.Tensor, have: list[np.ndarray], part: list[np.ndarray]) -> torch.Tensor:
    """The elements of `x` (holding `have`) at the global indices `part` (per dim), flattened row-major."""
    for d, (h, p) in enumerate(zip(have, part)):
        if len(h) != len(p) or (h != p).any():
            x = x.index_select(d, torch.as_tensor(_positions(p, h, f"send dim {d}"), device=x.device))
    return x.reshape(-1)


def _largest(parts: list[list[np.ndarray]]) -> int:
    """The largest member's block (elements): what every member sends when blocks differ."""
    return max(math.prod(len(i) for i in p) for p in parts)


def _padded(x: torch.Tensor, n: int) -> torch.Tensor:
    """Flat `x` with zeros up to `n` elements (a collective's members send blocks of one size)."""
    return x if x.numel() == n else torch.cat([x, x.new_zeros(n - x.numel())])


def _assemble(flat: torch.Tensor, parts: list[list[np.ndarray]], want: list[np.ndarray], device: torch.device,
              what: str, padded: bool = False) -> torch.Tensor:
    """The local tensor holding `want` (per dim) from `flat`, the members' blocks one after the other (member j
    sent the product of `parts[j]`, row-major; `padded`: each block padded to the largest's size)."""
    shape = tuple(len(w) for w in want)
    index = np.full(shape, -1, dtype=np.int64)
    offset, most = 0, _largest(parts) if padded else None
    for part in parts:
        inside = [np.isin(w, p) for w, p in zip(want, part)]
        sizes = [len(p) for p in part]
        if all(m.any() for m in inside) or not shape:
            pos = [np.searchsorted(p, w[m]) for w, p, m in zip(want, part, inside)]
            block = np.ravel_multi_index(np.ix_(*pos), sizes) if shape else np.zeros((), dtype=np.int64)
            index[np.ix_(*[np.nonzero(m)[0] for m in inside])] = block + offset
        offset += most or int(np.prod(sizes))
    if (index < 0).any():
        raise ReshardError(f"reshard {what}: no device of the group holds some of the elements needed")
    return flat[torch.as_tensor(index.reshape(-1), device=device)].reshape(shape)


def run_walk(exchange: Exchange, x: torch.Tensor, steps: list[Step], shape: tuple[int, ...],
             on_step: Callable[[Step], None] | None = None) -> torch.Tensor:
    """Every step of a walk on the local tensor `x` of a value of global `shape`; a hierarchical all-reduce's
    steps (`Step.flat`) on the flattened tensor, reshaped back after its last gather."""
    local: tuple[int, ...] | None = None
    for s in steps:
        if s.flat:
            if local is None:
                local, x = tuple(x.shape), x.contiguous().reshape(-1)
            group = exchange.groups[s.axis]
            if s.kind == "reduce-scatter":
                x = _compat.reduce_scatter(x, "sum", 0, group)
            elif s.kind == "all-reduce":
                x = _compat.all_reduce(x, "sum", group)
            else:
                x = _compat.all_gather(x, 0, group)
                if s.dst != s.src:  # the last gather: the sum whole again
                    x, local = x.reshape(local), None
        else:
            x = exchange.run(x, s, shape)
        if on_step is not None:
            on_step(s)
    return x


def coords(mesh: Mesh) -> list[dict[str, int]]:
    """Every device's coordinate, in rank order (the mesh's axes major to minor)."""
    return [dict(zip(mesh.names, c)) for c in itertools.product(*(range(s) for _, s in mesh.axes))]
