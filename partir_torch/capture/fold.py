"""Folding repeated layers: capture two of N identical blocks and weight the second by N - 1.

Why: a 48- or 80-layer model is the same block N times, and every action on a group does the same thing in
each block. The search propagates and costs thousands of candidate plans, so it works on a *folded*
program: every container (`nn.ModuleList` / `nn.Sequential`) whose N >= 3 elements are structurally
identical keeps its first two. Element 0 keeps the boundary with what comes before (embeddings); element 1
is an interior block (its input comes from a block of the same kind), so it stands for elements 1..N-1.

Costs of the full model from the folded program (`weights`):
    an op inside element 1 of a folded container counts N - 1 times (nested folds multiply);
    so do its collectives, and the persistent values (parameters, buffers, optimizer states) it owns;
    an activation or gradient counts N - 1 times in memory when it outlives its phase (saved for the
    backward, or a gradient held for the optimizer): N - 1 copies of it are live together in the full
    step; a temporary used within its own phase is live once.
Optimizer ops and gradient accumulations carry no module; they belong to the element of their newest
input (the branch just computed; for the optimizer, the gradient or state of the parameter it updates).
`tests/capture/test_fold.py` compares folded against full costs.

When the model's forward cannot run with some container cut (it indexes a block by number, or pops a
stack once per block, as the U-Net's decoder pops its skip connections), capture leaves that container
whole and folds the others (`folded(..., only=...)`, `capture.trace._capture_folded`).

The folded module shares the user's parameters (a shallow copy of the module tree); the user's model is
never modified.
"""

from __future__ import annotations

import copy
import re

import torch.nn as nn

from partir_torch.capture.groups import _signatures
from partir_torch.ir.program import Phase, Program, Role

KEEP = 2


def folded(model: nn.Module, *, min_repeats: int = 3, only: set[str] | frozenset[str] | None = None
           ) -> tuple[nn.Module, dict[str, int]]:
    """(a view of `model` with each run of identical container elements cut to two, {container: N}).

    `only`: fold just these containers (paths), leave every other one whole (`capture` uses it when the
    model's forward cannot run with some container cut, see `capture.trace`).
    """
    sigs = _signatures(model)
    repeats: dict[str, int] = {}

    def visit(mod: nn.Module, path: str) -> nn.Module:
        children = {}
        changed = False
        for name, child in mod._modules.items():
            if child is None:
                children[name] = child
                continue
            new = visit(child, f"{path}.{name}" if path else name)
            children[name] = new
            changed |= new is not child
        if (isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= min_repeats
                and (only is None or path in only)):
            paths = [f"{path}.{k}" if path else k for k in mod._modules]
            if len({sigs.get(p) for p in paths}) == 1:
                children = dict(list(children.items())[:KEEP])
                repeats[path] = len(mod)
                changed = True
        if not changed:
            return mod
        clone = copy.copy(mod)
        clone._modules = children
        clone._parameters = dict(mod._parameters)
        clone._buffers = dict(mod._buffers)
        return clone

    view = visit(model, "")
    kept = {p for p, _ in view.named_modules(remove_duplicate=False)}
    return view, {p: n for p, n in repeats.items() if p in kept}


def _element_weight(name: str | None, fold: dict[str, int]) -> int:
    """Weight of a module path or parameter-derived name: product of N - 1 over folded containers it sits
    in as element 1."""
    if not name or not fold:
        return 1
    w = 1
    for container, n in fold.items():
        prefix = f"{container}.1." if container else "1."
        if name.startswith(prefix) or name == prefix[:-1]:
            w *= n - 1
    return w


_PARAM_IN_NAME = re.compile(r"\[([^\]]+)\]$")


def weights(program: Program) -> tuple[list[int], list[int]]:
    """(per-op weight, per-value weight of the element it belongs to) that turn folded costs into full-model
    costs; all ones for a program captured without folding. Which values count with their weight in
    memory (those that outlive their phase) depends on aliasing, so the cost model decides that. Computed
    anew on each call: the cost model keeps its result in its tables (`cost.tables.Static`)."""
    fold: dict[str, int] = getattr(program, "fold", None) or {}
    n_ops, n_vals = len(program.ops), len(program.values)
    if not fold:
        return [1] * n_ops, [1] * n_vals
    vals, ops = program.values, program.ops
    own = [1] * n_vals  # the weight of the element a value belongs to
    for v in vals:
        if v.producer < 0 or v.role in (Role.GRADIENT, Role.OPT_STATE, Role.PARAMETER):
            m = _PARAM_IN_NAME.search(v.name)
            own[v.id] = _element_weight(m.group(1) if m else v.name, fold)
    # the optimizer's scalars shared by every parameter (the step, each group's lr, what is computed from them
    # alone) belong to no element: they never decide an op's
    shared = [v.producer < 0 and v.role is Role.OPT_STATE and not v.shape for v in vals]
    op_w = [1] * n_ops
    for op in program.ops:
        if op.module is None and op.inputs and all(shared[i] for i in op.inputs):
            for o in op.outputs:
                if o >= 0:
                    shared[o] = True
        if op.module is not None:
            w = _element_weight(op.module, fold)
        else:  # optimizer or unattributed (gradient accumulation) op: the element of its newest input
            mine = [i for i in op.inputs if not shared[i]]
            made = [i for i in mine if vals[i].producer >= 0]
            newest = max(made, key=lambda i: vals[i].producer) if made else None
            w = own[newest] if made else max((own[i] for i in mine), default=1)
            if newest is not None and ops[vals[newest].producer].module is None and op.phase is Phase.BACKWARD:
                # the newest input is itself a finished accumulation that reached this one through an identity
                # backward (a residual add): it is the gradient of a block's input passed on to the value
                # before it, which is accumulated once when that value also feeds something outside the
                # block (a skip connection): the element of the partial sum it joins, not of the block
                w = min(own[i] for i in made)
        op_w[op.id] = w
        for o in op.outputs:
            if o >= 0:
                own[o] = max(own[o], w) if vals[o].role is Role.GRADIENT else w
    return op_w, own


def full_names(name: str, fold: dict[str, int]) -> list[str]:
    """The names in the full model that folded `name` stands for (element 1 stands for 1..N-1)."""
    out = [name]
    for container, n in sorted(fold.items(), key=lambda kv: -len(kv[0])):  # inner containers first
        prefix = f"{container}.1." if container else "1."
        nxt = []
        for nm in out:
            nxt.append(nm)
            if nm.startswith(prefix):
                nxt += [f"{container}.{i}.{nm[len(prefix):]}" if container else f"{i}.{nm[len(prefix):]}"
                        for i in range(2, n)]
        out = nxt
    return out
