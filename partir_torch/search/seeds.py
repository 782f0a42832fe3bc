"""Expert composites as starting plans: the tactics' own actions (`tactics/experts.py`), combined per axis.

The refinement of `Auto` "both" climbs from the plans of its two tree searches; a short budget on a large mesh
can leave both in a basin worse than what an engineer would write by hand (Megatron on one axis, data
parallelism, FSDP or ZeRO-1 on the others). So the refinement also starts from those composites, each one a
plan of the search space (its actions are `Tile`s of parameter groups and inputs and the `ShardOptimizer("*")`
move), found from the program's structure as the tactics find them (`tactics.megatron_pairs`: no name is
read). Every composite is judged by the same cost model, and the local search moves on from the best ones:
the answer is at most the refinement's simplicity margin above the best composite that fits (once the budget
has let them be replayed), and usually better (docs/scale.md).

Roles per axis: `dp` (tile every input's batch dim), `fsdp` (dp, then ZeRO-3 of every parameter), `zero1` (dp,
then ZeRO-1), `megatron` (column/row pairs of linears), `megatron_sp` (megatron, and the sequence dim of the
inputs over the same axis: Megatron's sequence parallelism, norms and dropout split between the pairs), `none`
(the axis left unused: at most one, beside another role; pure tensor parallelism on a small model, where the
gradients' reduction costs more than the batch split saves, and the climb cannot drop a batch split tile by
tile); at most one axis is `megatron` or `megatron_sp`, and an axis over DCN takes only `dp` or `zero1` (what
the hierarchical plans engineers write put there: the gradients' reduction, no per-layer gather or activation
all-reduce; the search may still move away from it) unless `over_dcn` (`Auto` asks for those when none of the
others fits in memory: FSDP across nodes, as an engineer does when nothing else fits, Llama-3-8B on 8 H100
nodes). Actions are returned in the plan's canonical order (`space.rank`), so a Megatron tile is the major
axis of a dim that a ZeRO move also tiles.
"""

from __future__ import annotations

import itertools

from partir_torch.ir.actions import Tile
from partir_torch.propagate import ShardingState
from partir_torch.search.space import Action, rank, state_slots
from partir_torch.tactics import FSDP, SequenceParallel, ZeRO, batch_tiles, group_of, megatron_tiles

ROLES = ("dp", "fsdp", "zero1", "megatron", "megatron_sp", "none")
_HEAVY = ("fsdp", "megatron", "megatron_sp")  # per-layer collectives: not over DCN by default


def _megatron(state: ShardingState, axis: str) -> list[Action]:
    """The Megatron tactic's tiles (`tactics.megatron_tiles`) whose target is a parameter group's key or a slot
    of the search space (an ungrouped parameter large enough to be one). A group too small for a slot is still
    tiled as the tactic tiles it: grouped-query attention's k/v projections (L405's, 1/128 of the largest
    weight), left whole, cost every layer the k/v compute on every device and an all-reduce of their gradient."""
    p = state.program
    targets = {s.target for s in state_slots(state) if s.kind == "param"} | {g.key for g in p.groups}
    tiles = [Tile(group_of(p, p.values[w].name), d, axis) for w, d in megatron_tiles(state, axis)]
    dims: dict[str, set[int]] = {}
    for t in tiles:
        dims.setdefault(t.target, set()).add(t.dim)
    # a group whose members the pairs split on different dims (a Sequential's chained linears, grouped as
    # repeats: column, then row) has no one tile: it stays whole (the search may still tile it)
    out = [t for t in tiles if t.target in targets and len(dims[t.target]) == 1]
    return list(dict.fromkeys(out))


def composites(state: ShardingState, axes: tuple[str, ...], dcn_axes: frozenset[str] = frozenset(), *,
               over_dcn: bool = False) -> list[tuple[str, list[Action]]]:
    """(name like `data:dp,model:megatron`, actions in canonical order) for every assignment of roles to
    `axes` (see the module docstring); assignments a program cannot take (no batch dim divides, no column/row
    pair) are left out."""
    p = state.program
    per_role: dict[tuple[str, str], list[Action] | None] = {}
    for a in axes:
        dp = batch_tiles(state, a)
        mega = _megatron(state, a)
        per_role[a, "dp"] = dp or None
        per_role[a, "fsdp"] = FSDP(a).actions(state) if dp and p.opt_states else None
        per_role[a, "zero1"] = [*dp, *ZeRO(a, 1).actions(state)] if dp and p.opt_states else None
        per_role[a, "megatron"] = mega or None
        seq = SequenceParallel(a).actions(state) if mega else []
        per_role[a, "megatron_sp"] = [*mega, *seq] if seq else None
        per_role[a, "none"] = []
    out = []
    for roles in itertools.product(ROLES, repeat=len(axes)):
        heavy = any(a in dcn_axes and r in _HEAVY for a, r in zip(axes, roles))
        # over_dcn: only the ones the default leaves out
        if roles.count("megatron") + roles.count("megatron_sp") > 1 or heavy != over_dcn:
            continue
        if roles.count("none") > (len(axes) > 1):
            continue
        parts = [per_role[a, r] for a, r in zip(axes, roles)]
        if any(x is None for x in parts):
            continue
        acts = sorted((x for part in parts for x in part), key=lambda x: rank(p, x))  # stable: axes in order
        out.append((",".join(f"{a}:{r}" for a, r in zip(axes, roles)), acts))
    return out
