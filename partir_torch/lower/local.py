"""An op on one device's local tensors: the arguments and kernels that differ from the whole op's.

Both the simulator (`simulate.py`, the oracle: every device emulated in one process) and the torch backend's
rank program (`backends/distributed/rank.py`: one real device) run each op of a sharded program on local
shards; what changes from the unsharded op lives here, once: shape arguments made local (view and creation
sizes from the result's local shape), sizes that depend on a tiled dim (split sizes, group norm's counts, a
depthwise convolution's groups), and the kernels whose local computation is another (an embedding whose
table is split by rows: masked). `region` is a device's block of a tensor in a layout.
"""

from __future__ import annotations

from typing import Any

import torch

from partir_torch.ir.mesh import Mesh
from partir_torch.ir.program import Ref
from partir_torch.ir.sharding import Sharding
from partir_torch.lower.collectives import required_operand
from partir_torch.propagate import ShardingState

SPLITS = ("aten.split.Tensor", "aten.split_with_sizes.default", "aten.unsafe_split.Tensor",
          "aten.unsafe_split_with_sizes.default")
# (aten target, argument index) whose value is the local shape of result 0
SHAPE_ARG = {
    "aten.view.default": 1, "aten._unsafe_view.default": 1, "aten.reshape.default": 1, "aten.expand.default": 1,
    "aten.zeros.default": 0, "aten.ones.default": 0, "aten.full.default": 0, "aten.empty.memory_format": 0,
    "aten.select_backward.default": 1, "aten.upsample_nearest2d_backward.default": 2,
    "aten.upsample_bilinear2d_backward.default": 2, "aten.upsample_nearest1d_backward.default": 2,
    "aten.upsample_linear1d_backward.default": 2, "aten.upsample_nearest3d_backward.default": 2,
    "aten.upsample_bicubic2d_backward.default": 2,
    "aten.slice_backward.default": 1, "aten.new_zeros.default": 1, "aten.new_ones.default": 1,
    "aten.new_empty.default": 1, "aten.new_full.default": 1, "aten.new_empty_strided.default": 1,
    "aten.rand.default": 0, "aten.randn.default": 0,
    "aten.view_copy.default": 1, "aten.expand_copy.default": 1,
}


def region(mesh: Mesh, sh: Sharding, shape: tuple[int, ...], c: dict[str, int]) -> tuple[slice | torch.Tensor, ...]:
    """Device `c`'s part of a tensor of `shape` laid out by `sh`: a block per dim, or its tile of each chunk
    (`Sharding.chunks`)."""
    chunks = dict(sh.chunks)
    out: list[slice | torch.Tensor] = []
    for d, (size, axes) in enumerate(zip(shape, sh.dims)):
        idx, n = 0, 1
        for a in axes:
            idx = idx * mesh.size(a) + c[a]
            n *= mesh.size(a)
        k = chunks.get(d, 1)
        tile = size // k // n
        if k > 1 and n > 1:
            out.append(torch.cat([torch.arange(j * (size // k) + idx * tile, j * (size // k) + (idx + 1) * tile)
                                  for j in range(k)]))
        else:
            out.append(slice(idx * (size // n), (idx + 1) * (size // n)))
    return tuple(out)


def local_args(op, args: tuple, kwargs: dict, state: ShardingState) -> tuple[tuple, dict]:
    """An op's arguments on one device, its tensors already its local operands: shape arguments (view sizes,
    creation sizes) and sizes that depend on a tiled dim made local."""
    results = [o for o in op.outputs if o >= 0]
    if op.target in SHAPE_ARG and results:
        k = SHAPE_ARG[op.target]
        local = state.op_output(op.id, 0).local_shape(state.program.values[results[0]].shape, state.mesh)
        args = (*args[:k], list(local), *args[k + 1:])
    return _localize(op.target, args, state, op.id, results), kwargs


def run_local(op, args: tuple, kwargs: dict, state: ShardingState, c: dict[str, int]) -> Any:
    """The op on device `c`'s tiles: the aten op itself, except where a rule tiles a factor whose local kernel
    is another computation (an embedding table's rows: `rules.indexing`)."""
    prog = state.program
    if op.target == "aten.embedding.default":
        table = required_operand(state, op.id, 0)
        if table.dims[0]:
            first = region(state.mesh, table, prog.values[op.args[0].id].shape, c)[0].start
            return masked_embedding(args[0], args[1], first)
    elif op.target == "aten.embedding_dense_backward.default":
        out = state.op_output(op.id, 0)
        if out.dims[0]:  # the device's rows of the whole scatter-add: the rows a masked scatter-add gives
            return op.overload(*args, **kwargs)[region(state.mesh, out, prog.values[op.outputs[0]].shape, c)[0]]
    return op.overload(*args, **kwargs)


def masked_embedding(rows: torch.Tensor, idx: torch.Tensor, first: int) -> torch.Tensor:
    """One device's part of an embedding whose table is tiled on its rows (`rules.indexing.embedding`): the
    rows it holds (`first` is the global index of its first), zeros for indices outside them."""
    local = idx - first
    inside = (local >= 0) & (local < rows.shape[0])
    return torch.embedding(rows, local.clamp(0, rows.shape[0] - 1)) * inside.unsqueeze(-1).to(rows.dtype)


def subst(a: Any, it) -> Any:
    if isinstance(a, Ref):
        return next(it)
    if isinstance(a, list):
        return [subst(x, it) for x in a]
    if isinstance(a, tuple):
        return tuple(subst(x, it) for x in a)
    return a


def _localize(target: str, args: tuple, state: ShardingState, o: int, results: list[int]) -> tuple:
    """Non-shape size arguments that depend on a tiled dim."""
    prog, mesh = state.program, state.mesh
    if target in SPLITS:  # equal parts of the local chunks
        x = state.rules[o].operands[0]
        if x.chunks:
            d, n = x.chunks[0]
            local = required_operand(state, o, 0).local_shape(prog.values[x.value].shape, mesh)[d] // n
            return (args[0], local if target.endswith(".Tensor") else [local] * n, *args[2:])
    if target == "aten.native_group_norm.default":  # the device's batch rows, channels and whole groups
        n, c = state.op_output(o, 0).local_shape(prog.values[results[0]].shape, mesh)[:2]
        g = state.op_output(o, 1).local_shape(prog.values[results[1]].shape, mesh)[1]
        return (*args[:3], n, c, args[5], g, *args[7:])
    if target == "aten.convolution.default" and args[8] > 1:  # a depthwise one's groups: its local channels
        return (*args[:8], _local_groups(state, o, 1, args[8]), *args[9:])
    if target == "aten.convolution_backward.default":
        if args[9] > 1:
            args = (*args[:9], _local_groups(state, o, 2, args[9]), *args[10:])
        outs = prog.ops[o].outputs
        if args[3] is not None and outs[2] >= 0:
            r = [x for x in outs if x >= 0].index(outs[2])
            size = state.op_output(o, r).local_shape(prog.values[outs[2]].shape, mesh)
            return (*args[:3], list(size), *args[4:])
    return args


def _local_groups(state: ShardingState, o: int, w: int, groups: int) -> int:
    """A grouped convolution's groups on one device: fewer where its weight's output channels are tiled (a
    depthwise one's, `rules/conv`)."""
    full = state.program.values[state.rules[o].operands[w].value].shape
    return groups * required_operand(state, o, w).local_shape(full, state.mesh)[0] // full[0]
