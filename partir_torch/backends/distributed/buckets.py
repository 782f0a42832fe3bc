"""The rank program's buckets at run time: each reduction's summand held where its value is made, the bucket's
one collective issued on their concatenation when its last member is made, each member cut from the result
where it is first read. (The summands are concatenated at the issue, not copied into a buffer made at the first
member: until the issue they live as the cost model counts them, and after it the buffer replaces them.)

The buckets themselves are planned from the state (`lower/buckets.py`: which reductions, in which order, when
each is made and first read), so the cost model prices the same calls. The collectives are the functional
ones' own ops (`_c10d_functional.all_reduce_` in place on the buffer, `reduce_scatter_tensor`), called
directly so that the traced rank graph holds the wait where the result is read, not right after the issue (the
functional API waits at once while tracing). A reduce-scatter's buffer is rank-major (every member's block for
rank 0, then rank 1's, ...), so each rank gets its own block of every member, as FSDP2's `foreach_reduce`
lays its buffer out.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from partir_torch import _compat
from partir_torch.lower.buckets import Bucket, Reduction
from partir_torch.propagate import ShardingState


class Buckets:
    """One run of the planned buckets (module docstring); `group_name(axis)` names the axis's process group."""

    def __init__(self, plan: list[Bucket], group_name: Callable[[str], str], state: ShardingState, *,
                 inplace: bool = True) -> None:
        self.plan, self.group_name = plan, group_name
        self.inplace = inplace  # all-reduce in place on the buffer (torch.compile's functionalization refuses it)
        self.mesh, self.values = state.mesh, state.program.values
        size = self.size = state.mesh.size
        self.of: dict[Hashable, tuple[int, Reduction, int]] = {}  # slot -> (bucket, member, offset per rank)
        for b, bucket in enumerate(plan):
            n = size(bucket.axis) if bucket.kind == "reduce-scatter" else 1
            offset = 0
            for m in bucket.members:
                self.of[m.slot] = (b, m, offset)
                offset += _numel(m) // n
        self.index = {m.slot: i for bucket in plan for i, m in enumerate(bucket.members)}
        self.held: dict[int, dict[int, torch.Tensor]] = {}  # bucket -> the summands put so far, by member
        self.issued: dict[int, torch.Tensor] = {}  # bucket -> its collective's result, waited at the first read
        self.waited: set[int] = set()

    def holds(self, slot: Hashable) -> bool:
        return slot in self.of

    def put(self, slot: Hashable, x: torch.Tensor) -> None:
        """A member's summand, as made; the bucket issued once its last member is made."""
        b, _, _ = self.of[slot]
        held = self.held.setdefault(b, {})
        held[self.index[slot]] = x  # (members of one op may be made in another order than the plan lists them)
        if len(held) == len(self.plan[b].members):
            self._issue(b)

    def take(self, slot: Hashable) -> torch.Tensor:
        """A member's reduced local tensor, cut from its bucket's result (waited here, at the first read)."""
        b, m, offset = self.of[slot]
        if b not in self.issued:
            raise RuntimeError(f"bucket {b} was read before its last member was made (the plan says otherwise)")
        ops = _compat.c10d_functional
        if b not in self.waited:
            self.issued[b] = ops.wait_tensor.default(self.issued[b])
            self.waited.add(b)
        out = self.issued[b]
        shape = self.values[m.value].shape
        if self.plan[b].kind == "all-reduce":
            return out[offset:offset + _numel(m)].view(m.dst.local_shape(shape, self.mesh))
        n = self.size(m.step.axis)
        block = list(m.dst.local_shape(shape, self.mesh))
        moved = [block[m.dim], *block[:m.dim], *block[m.dim + 1:]]  # (sent dim-major)
        return out[offset:offset + _numel(m) // n].view(moved).movedim(0, m.dim)

    def _issue(self, b: int) -> None:
        bucket, by_member = self.plan[b], self.held.pop(b)
        held = [by_member[i] for i in range(len(bucket.members))]
        ops, name = _compat.c10d_functional, self.group_name(bucket.axis)
        if bucket.kind == "all-reduce":
            buf = torch.cat([x.reshape(-1) for x in held]) if len(held) > 1 else held[0].reshape(-1).clone()
            self.issued[b] = (ops.all_reduce_ if self.inplace else ops.all_reduce).default(buf, "sum", name)
        else:  # rank-major: rank r's block of every member, in member order, then rank r + 1's
            n = self.size(bucket.axis)
            rows = [x.movedim(m.dim, 0).reshape(n, -1) for x, m in zip(held, bucket.members)]
            buf = torch.cat(rows, dim=1).reshape(-1) if len(rows) > 1 else rows[0].reshape(-1).contiguous()
            self.issued[b] = ops.reduce_scatter_tensor.default(buf, "sum", n, name)


def _numel(m: Reduction) -> int:
    return m.nbytes // m.dtype.itemsize
