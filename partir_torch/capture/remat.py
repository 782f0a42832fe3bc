"""Activation checkpointing written into the captured step: a repeated block's forward run again in backward.

Why a rewrite of the step and not `torch.utils.checkpoint`: the step is one functional graph of forward,
backward and update, and what decides memory is which forward results the backward reads. Recomputing a
block means its backward reads copies made just before they are needed, so the originals die after their
last forward use. The cost model then prices the change with no special case (the copies' FLOPs in the
backward, the shorter lifetimes in the memory peak), the plan shards the copies like any op, and every engine
runs what was priced.

For each element of a repeated container (`capture/groups.py`: the blocks torchtitan wraps one by one), on
the traced FX graph:
    saved   = the block's forward nodes that a non-forward node reads;
    redo    = the block's forward nodes those depend on, inside the block (`selective`: a matmul's or an
              attention kernel's output is kept and read where it is, as torchtitan's selective policy keeps
              them, so the recompute stops there);
    the copies of `redo`, in graph order, go right before the first backward node that reads a saved one,
    and the backward reads the copies.
The block's input (from the block before) stays saved: the checkpoint boundary. A block that draws random
numbers is refused, naming the op (a recompute would draw again, unlike the forward).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from partir_torch.capture.groups import repeated_modules
from partir_torch.errors import CaptureError

MODES = ("full", "selective")
# kept under `selective`: the results worth the most FLOPs per byte (torchtitan's `_save_list`: matmuls, SDPA)
_KEEP = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten._scaled_dot_product_cudnn_attention.default",
})


def blocks(model: nn.Module) -> list[str]:
    """The outermost repeated container elements, in module order: what a remat policy recomputes."""
    rep = repeated_modules(model)
    return [p for p, _ in model.named_modules() if p in rep and not any(p.startswith(q + ".") for q in rep)]


def rematerialize(gm: fx.GraphModule, paths: list[str], mode: str) -> int:
    """Rewrite `gm` (a captured training step, its first output the loss) so each block of `paths` is
    recomputed in backward (module docstring); the number of nodes copied."""
    if mode not in MODES:
        raise CaptureError(f"remat={mode!r}: one of {', '.join(MODES)} (or None: keep every activation)")
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    (out,) = graph.find_nodes(op="output")
    # the forward: every node up to the loss, in graph order (autograd traces the backward after it); not the
    # loss's ancestors alone, which leave out what a forward op makes for the backward (a norm's saved rstd)
    forward = set(nodes[:order[out.args[0][0]] + 1])
    copied = 0
    for path in paths:
        mine = [n for n in nodes if n in forward and n.op == "call_function" and _inside(n, path)]
        inside = set(mine)
        saved = [n for n in mine if any(u not in forward for u in n.users)]
        keep = {n for n in mine if mode == "selective" and str(n.target) in _KEEP}
        redo = _needed([n for n in saved if n not in keep], inside - keep)
        if not redo:
            continue
        for n in redo:
            if _draws(n):
                raise CaptureError(f"remat: block {path!r} draws random numbers ({n.target}); recomputing it would "
                                   "draw again, unlike its forward. Set its dropout to 0, or plan without remat")
        first = min((u for n in saved if n in redo for u in n.users if u not in forward), key=order.__getitem__)
        made: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(first):
            for n in sorted(redo, key=order.__getitem__):
                made[n] = graph.node_copy(n, lambda a, made=made: made.get(a, a))
                made[n].meta = dict(n.meta)
        for n, c in made.items():
            for u in list(n.users):
                if u not in forward and u not in made.values():
                    u.replace_input_with(n, c)
        copied += len(made)
    graph.lint()
    gm.recompile()
    return copied


def _inside(n: fx.Node, path: str) -> bool:
    module = (n.meta.get("custom") or {}).get("module") or ""
    return module == path or module.startswith(path + ".")


def _needed(saved: list[fx.Node], inside: set[fx.Node]) -> set[fx.Node]:
    """`saved` and what they are computed from inside the block (stopping at its boundary and kept nodes)."""
    out: set[fx.Node] = set()
    todo = list(saved)
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        todo += [a for a in n.all_input_nodes if a in inside]
    return out


def _draws(n: fx.Node) -> bool:
    target = n.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    schema = target._schema.arguments
    names = [a.name for a in schema]
    for name in ("dropout_p", "p"):  # (a dropout of probability 0 draws nothing that matters)
        if name in names:
            i = names.index(name)
            default = schema[i].default_value if schema[i].has_default_value() else None
            if n.kwargs.get(name, n.args[i] if i < len(n.args) else default) == 0:
                return False
    return True
