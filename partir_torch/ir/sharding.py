"""Per-value shardings: for each dim the ordered mesh axes that tile it (major to minor), plus partial axes.

Written like the paper and like JAX: `P('batch', None)`, `P(('batch', 'model'), None)`, and a pending
reduction as `P(None, None) + sum{model}`. An axis appears at most once per value.

Values are always tiled in blocks. An op can read or write a tensor in a *chunked* layout: a dim made of
n equal chunks (a split into n equal parts, a concat of n equal parts) where each chunk is tiled on its
own, so that device i holds the i-th tile of every chunk (`P(None, 'model') chunks{1: 3}`). Blocks and
chunks over the same axes hold the same number of elements; turning one into the other is an all-to-all
(GPT-2's fused QKV projection under Megatron: `lower.transitions`).

>>> s = Sharding.replicated(2).tile(0, "batch")
>>> str(s), s.to_spec()
("P('batch', None)", ['batch', None])
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from partir_torch.errors import IllegalActionError
from partir_torch.ir.mesh import Mesh


def tile_count(mesh: Mesh, axes: Iterable[str]) -> int:
    """How many tiles `axes` cut a dim into: the product of their sizes."""
    return mesh.tile_count(axes if isinstance(axes, tuple) else tuple(axes))


def divides(size: int, mesh: Mesh, axes: Iterable[str]) -> bool:
    """The rule of §1, its one definition: a dim of `size` tiled by `axes` needs `size % tile_count == 0`."""
    return size % tile_count(mesh, axes) == 0


def local_dim(size: int, mesh: Mesh, axes: Iterable[str]) -> int:
    """The size of a dim's tile on one device."""
    return size // tile_count(mesh, axes)


_REPLICATED: dict[int, Sharding] = {}
_TILED: dict[tuple, Sharding] = {}  # (sharding, dim, axis) -> the tiled sharding (see `Sharding.tile`)


@dataclass(frozen=True)
class Sharding:
    dims: tuple[tuple[str, ...], ...]
    partial: frozenset[str] = field(default_factory=frozenset)
    chunks: tuple[tuple[int, int], ...] = ()  # ((dim, n), ...): tiled dims read as n chunks (see above)
    _axes: frozenset[str] = field(init=False, repr=False, compare=False, hash=False)
    _dim_of: dict = field(init=False, repr=False, compare=False, hash=False)
    _hash: int = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:  # read in the propagation loop: computed once
        object.__setattr__(self, "_axes", frozenset(a for d in self.dims for a in d) | self.partial)
        object.__setattr__(self, "_dim_of", {a: i for i, d in enumerate(self.dims) for a in d})
        object.__setattr__(self, "_hash", hash((self.dims, self.partial, self.chunks)))

    def __hash__(self) -> int:  # shardings key the tiling memo and the cost tables: hashed once
        return self._hash

    def __reduce__(self) -> tuple:  # rebuilt, not copied: string hashes differ between processes
        return (Sharding, (self.dims, self.partial, self.chunks))

    def dim_of(self, axis: str) -> int | None:
        """The dim `axis` tiles, or None."""
        return self._dim_of.get(axis)

    @classmethod
    def replicated(cls, rank: int) -> Sharding:
        """Shared per rank: shardings are immutable, and a program has thousands of replicated values."""
        s = _REPLICATED.get(rank)
        if s is None:
            s = _REPLICATED[rank] = cls(((),) * rank)
        return s

    @classmethod
    def from_spec(cls, spec: list) -> Sharding:
        """The JSON / torch_xla partition-spec form: one entry per dim, None, an axis, or a list of axes."""
        dims = tuple(() if d is None else (d,) if isinstance(d, str) else tuple(d) for d in spec)
        return cls(dims)

    @property
    def axes(self) -> frozenset[str]:
        return self._axes

    def tile(self, dim: int, axis: str, *, value: str = "value", shape: tuple[int, ...] | None = None,
             mesh: Mesh | None = None) -> Sharding:
        """This sharding with `dim` further tiled (minor-most) by `axis`; checks the rule of §1. The result
        depends only on (self, dim, axis), so it is shared (`_TILED`): propagation tiles thousands of values."""
        got = _TILED.get((self, dim, axis))
        if got is None:
            if not -len(self.dims) <= dim < len(self.dims):
                raise IllegalActionError(f"{value} has rank {len(self.dims)}; dim {dim} does not exist")
            if axis in self.axes:
                raise IllegalActionError(
                    f"axis {axis!r} is already used on {value} (sharding {self}); an axis tiles a value at most once"
                )
            dims = list(self.dims)
            dims[dim % len(dims)] = (*dims[dim % len(dims)], axis)
            got = _TILED[(self, dim, axis)] = Sharding(tuple(dims), self.partial)
        dim %= len(self.dims)
        if shape is not None and mesh is not None and not divides(shape[dim], mesh, (*self.dims[dim], axis)):
            k = tile_count(mesh, (*self.dims[dim], axis))
            raise IllegalActionError(
                f"cannot tile {value} {list(shape)} dim {dim} (size {shape[dim]}) over {axis!r}: "
                f"the dim must divide by the product of its axes' sizes {k} "
                f"({', '.join(f'{a}={mesh.size(a)}' for a in (*self.dims[dim], axis))})"
            )
        return got

    def try_tile(self, dim: int, axis: str, size: int, mesh: Mesh) -> Sharding | None:
        """`tile` for propagation's inner loop: None where an axis would be used twice or the rule of §1
        forbids it (no error built). `dim` is non-negative, `size` the dim's size."""
        if axis in self._axes or size % mesh.tile_count((*self.dims[dim], axis)):
            return None
        got = _TILED.get((self, dim, axis))
        return got if got is not None else self.tile(dim, axis)

    def local_shape(self, shape: tuple[int, ...], mesh: Mesh) -> tuple[int, ...]:
        return tuple(local_dim(size, mesh, axes) for size, axes in zip(shape, self.dims))

    def to_spec(self) -> list:
        return [None if not d else d[0] if len(d) == 1 else list(d) for d in self.dims]

    def __str__(self) -> str:
        parts = ["None" if not d else repr(d[0]) if len(d) == 1 else repr(d) for d in self.dims]
        text = f"P({', '.join(parts)})"
        if self.chunks:
            text += " chunks{" + ", ".join(f"{d}: {n}" for d, n in self.chunks) + "}"
        return text + (" + sum{" + ", ".join(sorted(self.partial)) + "}" if self.partial else "")
