"""Where each device's elements of a tensor are, and the walk from one sharding to another, step by step.

`lower.transitions` (the collectives the cost model counts) is this walk's collectives, and a backend's
rank program runs the same walk on its local tensors (`backends/distributed/reshard.py`), so what is costed is
what runs. A step moves one mesh axis, and its data stays inside that axis's group of devices:

    pending sums first, while the data is largest: reduce-scatters (mesh order, the axes of one dim in
        the destination's order), then the sum over the other axes: one all-reduce, or over several axes
        hierarchically (the flattened sum reduce-scattered over each axis but the last, minor first, the part
        all-reduced over the last, gathered back: each axis moves 1/n of the bytes of the one before, so k
        axes cost one ring over their product);
    axes held in another place of their dim's order than the destination's (`misplaced`) gathered, and of
        two axes swapping dims, one;
    then axis by axis (mesh order, the axes gathered off one dim minor first): gathered, moved to another
        dim (all-to-all), or sliced; an axis lands minor-most on its dim, so the axes of a dim land in the
        destination's order (earlier ones pulled forward); a chunked dim (`Sharding.chunks`) split by one
        axis turns into blocks (or back) by an all-to-all, one split by several is gathered and sliced.

The walk runs on a richer layout than `Sharding`: gathering an axis that is not the minor-most of its dim
leaves the dim's blocks interleaved, which a `Sharding` cannot say. A `Layout` dim is a chunk count and its
axes major to minor, each held at the device's coordinate or held whole (gathered); a device's elements of
the dim are the blocks those coordinates select, in every chunk, in ascending order. A partial axis:
devices hold summands.

>>> from partir_torch.ir.mesh import Mesh
>>> m = Mesh.parse("batch=2,model=2")
>>> src = Sharding(((), ()), frozenset({"model"}))
>>> [(s.kind, s.axis, s.nbytes) for s in walk(src, Sharding(((), ("model",))), (8, 8), 4, m)]
[('reduce-scatter', 'model', 256)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from partir_torch.ir.mesh import Mesh
from partir_torch.ir.sharding import Sharding

Dim = tuple[tuple[str, bool], ...]  # (axis, held whole) major to minor


@dataclass(frozen=True)
class Layout:
    dims: tuple[Dim, ...]
    chunks: tuple[int, ...]
    partial: frozenset[str] = frozenset()

    @classmethod
    def of(cls, sh: Sharding) -> Layout:
        chunks = dict(sh.chunks)
        return cls(tuple(tuple((a, False) for a in d) for d in sh.dims),
                   tuple(chunks.get(i, 1) if d else 1 for i, d in enumerate(sh.dims)), sh.partial)

    def tiled(self, d: int) -> tuple[str, ...]:
        """The axes that split dim `d` (held at the device's coordinate)."""
        return tuple(a for a, whole in self.dims[d] if not whole)

    def dim_of(self, axis: str) -> int | None:
        return next((d for d, dim in enumerate(self.dims) for a, whole in dim if a == axis and not whole), None)

    def normal(self) -> Layout:
        """Axes held whole at the minor end of a dim dropped (the blocks they select are contiguous); a dim
        no axis splits has one chunk."""
        dims, chunks = [], []
        for dim, k in zip(self.dims, self.chunks):
            dim = list(dim)
            while dim and dim[-1][1]:
                dim.pop()
            dims.append(tuple(dim))
            chunks.append(k if any(not w for _, w in dim) else 1)
        return Layout(tuple(dims), tuple(chunks), self.partial)

    def moved(self, axis: str, dim: int | None, partial: bool, *, chunks: int | None = None) -> Layout:
        """`axis` gathered off its dim (held whole where it was) and, when `dim` is given, splitting `dim`
        minor-most (in `chunks` chunks when given); partial on it or not."""
        dims = [tuple((a, True) if a == axis else (a, w) for a, w in d) for d in self.dims]
        ks = list(self.chunks)
        if dim is not None:
            d = [x for x in dims[dim] if x[0] != axis]
            d.append((axis, False))
            dims[dim] = tuple(d)
            if chunks is not None:
                ks[dim] = chunks
        part = (self.partial - {axis}) | ({axis} if partial else frozenset())
        return Layout(tuple(dims), tuple(ks), frozenset(part)).normal()

    def local_shape(self, shape: tuple[int, ...], mesh: Mesh) -> tuple[int, ...]:
        out = []
        for size, dim in zip(shape, self.dims):
            n = 1
            for a, whole in dim:
                n *= 1 if whole else mesh.size(a)
            out.append(size // n)
        return tuple(out)

    def index(self, mesh: Mesh, shape: tuple[int, ...], coord: dict[str, int]) -> list[np.ndarray]:
        """Per dim, the global indices device `coord` holds, ascending (its local order)."""
        out = []
        for size, dim, k in zip(shape, self.dims, self.chunks):
            n = 1
            for a, _ in dim:
                n *= mesh.size(a)
            blocks = np.zeros(1, dtype=np.int64)
            for a, whole in dim:  # mixed radix, major first
                m = mesh.size(a)
                digits = np.arange(m) if whole else np.array([coord[a]])
                blocks = (blocks[:, None] * m + digits[None, :]).reshape(-1)
            tile = size // k // n
            starts = (np.arange(k)[:, None] * (size // k) + np.sort(blocks)[None, :] * tile).reshape(-1)
            out.append((starts[:, None] + np.arange(tile)[None, :]).reshape(-1))
        return out

    def same_place(self, other: Layout) -> bool:
        """Whether the two hold the same elements on every device in the same order (a change of notation)."""
        return self.normal() == other.normal()

    def __str__(self) -> str:
        parts = []
        for dim, k in zip(self.dims, self.chunks):
            axes = [f"{a}*" if w else a for a, w in dim]
            text = "None" if not axes else repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))
            parts.append(text + (f"/{k}" if k > 1 else ""))
        return f"L({', '.join(parts)})" + (" + sum{" + ", ".join(sorted(self.partial)) + "}" if self.partial else "")


@dataclass(frozen=True)
class Step:
    """One move of the walk: `kind` is a collective over `axis` (bytes per device as `lower` counts them), or a
    local one (`slice`: keep a part; `zero`: a device off the axis's first coordinate drops its summand).
    `flat`: a step of a hierarchical all-reduce, on the flattened tensor (its layouts are the sum's)."""

    kind: str
    axis: str
    src: Layout
    dst: Layout
    nbytes: int = 0
    flat: bool = False

    @property
    def collective(self) -> bool:
        return self.kind in ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")


def walk(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, mesh: Mesh) -> list[Step]:
    """The steps from `src` to `dst` (module docstring), ending in `dst`'s layout."""
    out: list[Step] = []
    cur, end = Layout.of(src), Layout.of(dst)

    def nbytes(lay: Layout) -> int:
        n = itemsize
        for size in lay.local_shape(shape, mesh):
            n *= size
        return n

    def step(kind: str, axis: str, nxt: Layout, size: int = 0) -> None:
        nonlocal cur
        out.append(Step(kind, axis, cur, nxt, size))
        cur = nxt

    if src.partial - dst.partial:
        reduced = [a for a in mesh.names if a in src.partial and a not in dst.partial]
        for axis in _dim_order([a for a in reduced if dst.dim_of(a) is not None], dst):
            d = dst.dim_of(axis)  # reduce-scatter: the sum lands tiled
            step("reduce-scatter", axis, cur.moved(axis, d, False, chunks=_k(cur, end, d)), nbytes(cur))
        summed = [a for a in reversed(reduced) if dst.dim_of(a) is None]
        outer = math.prod(mesh.size(a) for a in summed[:-1])
        if len(summed) > 1 and (nbytes(cur) // itemsize) % outer == 0:
            # hierarchical: reduce-scatter the flattened sum over each axis but the last (minor first), all-reduce
            # the part over the last, gather back: each axis's ring moves 1/n of the bytes of the one before
            # (one ring over the axes' product; a slow axis listed first moves the least)
            size, done = nbytes(cur), cur.moved(summed[0], None, False)
            for a in summed[1:]:
                done = done.moved(a, None, False)
            for a in summed[:-1]:
                out.append(Step("reduce-scatter", a, cur, cur, size, flat=True))
                size //= mesh.size(a)
            out.append(Step("all-reduce", summed[-1], cur, cur, size, flat=True))
            for a in reversed(summed[:-1]):
                size *= mesh.size(a)
                out.append(Step("all-gather", a, cur, done if a == summed[0] else cur, size, flat=True))
            cur = done
        else:
            for axis in summed:
                step("all-reduce", axis, cur.moved(axis, None, False), nbytes(cur))
    moved = misplaced(_sharding(cur), dst)
    for axis in mesh.names:  # gathered first, then sliced again in their place
        if axis in moved:
            nxt = cur.moved(axis, None, axis in cur.partial)
            step("all-gather", axis, nxt, nbytes(nxt))
    while True:
        now = _sharding(cur)
        order, cycle = _land_order(_gather_order(now, dst, mesh.names), now, dst)
        if not cycle:
            break
        for axis in mesh.names:  # (axes swapping dims)
            if axis in cycle:
                nxt = cur.moved(axis, None, axis in cur.partial)
                step("all-gather", axis, nxt, nbytes(nxt))
    for axis in order:
        s_dim, d_dim = cur.dim_of(axis), dst.dim_of(axis)
        s_part, d_part = axis in cur.partial, axis in dst.partial
        k_dst = end.chunks[d_dim] if d_dim is not None else 1
        if s_part == d_part and s_dim == d_dim and (s_dim is None or cur.chunks[s_dim] == k_dst):
            continue
        if s_dim is not None and s_dim == d_dim:  # the same tiles, as blocks vs chunks
            if len(cur.tiled(s_dim)) == 1:
                step("all-to-all", axis, cur.moved(axis, d_dim, d_part, chunks=k_dst), nbytes(cur))
                continue
            for a in reversed(cur.tiled(s_dim)):  # split by several axes: gathered, then sliced below
                nxt = cur.moved(a, None, a in cur.partial)
                step("all-gather", a, nxt, nbytes(nxt))
            s_dim = None
        if s_dim is not None and d_dim is not None:
            step("all-to-all", axis, cur.moved(axis, d_dim, d_part, chunks=_k(cur, end, d_dim)), nbytes(cur))
        elif s_dim is not None:  # (gathered to a summand: the devices off the axis's first coordinate drop it)
            nxt = cur.moved(axis, None, d_part)
            step("all-gather", axis, nxt, nbytes(nxt))
        elif d_dim is not None:
            step("slice", axis, cur.moved(axis, d_dim, False, chunks=_k(cur, end, d_dim)))
        else:  # replicated -> a summand: free; partial -> replicated was reduced above
            step("zero", axis, cur.moved(axis, None, d_part))
    if not cur.same_place(end):
        out.append(Step("relayout", "", cur, end))
    return out


def _dim_order(axes: list[str], dst: Sharding) -> list[str]:
    """`axes` (mesh order), the ones landing on one dim of `dst` reordered among their places into `dst`'s
    order of that dim: each lands minor-most, so they must come major first."""
    out = list(axes)
    for dim in dst.dims:
        slots = [i for i, a in enumerate(out) if a in dim]
        for i, a in zip(slots, sorted((out[i] for i in slots), key=dim.index)):
            out[i] = a
    return out


def _land_order(order: list[str], src: Sharding, dst: Sharding) -> tuple[list[str], set[str]]:
    """`order`, with each axis that lands on a dim of `dst` preceded by what must happen on that dim first (an
    axis lands minor-most): the axes of `src` leaving the dim (minor first), and the axes before it in the
    dim's order of `dst`; and the axes in a cycle of such needs (two axes swapping dims), to gather first."""
    out: list[str] = []
    stack: list[str] = []
    cycle: set[str] = set()

    def emit(a: str) -> None:
        if a in out:
            return
        if a in stack:  # each waits for the other to leave: gathered first, sliced in its place later
            cycle.add(a)
            return
        stack.append(a)
        d = dst.dim_of(a)
        if d is not None:
            for gone in reversed(src.dims[d]):
                if gone != a and gone not in dst.dims[d]:
                    emit(gone)
            for prior in dst.dims[d][:dst.dims[d].index(a)]:
                emit(prior)
        stack.pop()
        out.append(a)

    for a in order:
        emit(a)
    return out, cycle


def _k(cur: Layout, end: Layout, d: int) -> int:
    """The chunk count of dim `d` once an axis lands on it: the destination's when nothing split it yet (the
    elements may as well land where they end), else its own."""
    return end.chunks[d] if not cur.tiled(d) else cur.chunks[d]


def _sharding(lay: Layout) -> Sharding:
    """The axes that split each dim of `lay` as a `Sharding` (axes held whole dropped, no chunks)."""
    return Sharding(tuple(lay.tiled(d) for d in range(len(lay.dims))), lay.partial)


def _gather_order(src: Sharding, dst: Sharding, names: tuple[str, ...]) -> list[str]:
    """Mesh order, except that the axes gathered off one dim go minor first (each a gather over contiguous
    blocks, as an SPMD partitioner does them)."""
    order: list[str] = []
    for axis in names:
        if axis in order:
            continue
        d = src.dim_of(axis)
        if d is not None and dst.dim_of(axis) is None:
            tail = src.dims[d][src.dims[d].index(axis):]
            order += [a for a in reversed(tail) if dst.dim_of(a) is None and a not in order]
        else:
            order.append(axis)
    return order


def misplaced(src: Sharding, dst: Sharding) -> set[str]:
    """Axes that tile the same dim in `src` and `dst` but not at the same place in its order of axes (after
    where the two orders part): a device's tile is then another block of the dim, so the axis must be
    gathered and sliced again. A dim tiled (a, b) holds block i_a·n_b + i_b; dropping a keeps b only when
    b is the whole rest of the order, and adding a in front of b moves every block."""
    out: set[str] = set()
    for s, d in zip(src.dims, dst.dims):
        k = 0
        while k < len(s) and k < len(d) and s[k] == d[k]:
            k += 1
        out.update(a for a in s[k:] if a in d[k:])
    return out


def count(steps: list[Step]) -> list[tuple[str, str, int]]:
    """The collectives of a walk in `lower.transitions`' form."""
    return [(s.kind, s.axis, s.nbytes) for s in steps if s.collective]


def along(parts: list[list[np.ndarray]], whole: list[np.ndarray]) -> int | None:
    """The dim along which `parts` (per member, per dim indices), joined in member order in blocks of one size,
    make `whole` while every other dim is `whole`'s; None when they do not."""
    found = None
    for d, w in enumerate(whole):
        cols = [p[d] for p in parts]
        if all(len(c) == len(w) and (c == w).all() for c in cols):
            continue
        if found is not None:
            return None
        joined = np.concatenate(cols)
        if len(joined) != len(w) or (joined != w).any() or len({len(c) for c in cols}) > 1:
            return None
        found = d
    return found if found is not None else (0 if len(parts) == 1 else None)


def scatter_dim(step: Step, shape: tuple[int, ...], mesh: Mesh) -> int | None:
    """The dim a reduce-scatter step's destination blocks lie along, in member order (None: not along one);
    the same on every device, read at the first."""
    coord = dict.fromkeys(mesh.names, 0)
    n = mesh.size(step.axis)
    return along([step.dst.index(mesh, shape, {**coord, step.axis: k}) for k in range(n)],
                 step.src.index(mesh, shape, coord))
