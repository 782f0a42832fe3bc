"""Repeated-layer groups, found from the module tree and shapes alone.

Two modules are *repeats* when they are elements of the same container (`nn.ModuleList`, `nn.Sequential`,
`nn.ModuleDict`: the way PyTorch models write "N of this layer") and have the same structural signature:
the same class, the same parameter names, shapes and dtypes, and recursively the same children. Two
attributes of one block that merely share a type (`bn1`, `bn2`) are different layers, not repeats. A
parameter's group key is its path with the name of the outermost repeated module on the way replaced by
`*` (`h.3.attn.c_attn.weight` becomes `h.*.attn.c_attn.weight`; `h.3.ln_1` and `h.3.ln_2` keep their
names, as the relative path inside a repeat must match exactly); parameters with the same key and shape
form a group. No names are interpreted, so a model whose modules are called `p1`, `u`, `v` groups the
same way.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch.nn as nn


def _signatures(model: nn.Module) -> dict[str, int]:
    """Structural hash of every module, keyed by path."""
    sigs: dict[str, int] = {}

    def visit(path: str, mod: nn.Module) -> int:
        children = []
        for name, child in mod.named_children():
            children.append((name, visit(f"{path}.{name}" if path else name, child)))
        own = tuple(
            (n, tuple(t.shape), str(t.dtype))
            for n, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
            if t is not None
        )
        sig = hash((type(mod).__qualname__, own, tuple(children)))
        sigs[path] = sig
        return sig

    visit("", model)
    return sigs


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def repeated_modules(model: nn.Module) -> set[str]:
    """Paths of container elements that have at least one structurally identical sibling."""
    sigs = _signatures(model)
    containers = {p for p, m in model.named_modules(remove_duplicate=False) if isinstance(m, _CONTAINERS)}
    by_parent: dict[str, Counter[int]] = defaultdict(Counter)
    for path, sig in sigs.items():
        if path and path.rpartition(".")[0] in containers:
            by_parent[path.rpartition(".")[0]][sig] += 1
    return {p for p, s in sigs.items() if p and by_parent[p.rpartition(".")[0]][s] > 1}


def group_key(param_path: str, repeated: set[str]) -> str:
    """Star the outermost repeated module on the path; inside it the relative path must match exactly."""
    parts = param_path.split(".")
    for i in range(len(parts) - 1):
        if ".".join(parts[: i + 1]) in repeated:
            return ".".join([*parts[:i], "*", *parts[i + 1 :]])
    return param_path


def parameter_groups(
    model: nn.Module, names: list[str], shapes: dict[str, tuple[int, ...]]
) -> list[tuple[str, list[str]]]:
    """[(key, [param names])] for every key shared by two or more parameters, in first-appearance order.
    Keys are unique: where one key holds parameters of different shapes (a `Sequential` of convolutions and
    their BatchNorms: `*.weight` both), each group's key names its shape (`*.weight@24`,
    `*.weight@24x24x1x1`), so that no group's values are taken for another's peers."""
    repeated = repeated_modules(model)
    buckets: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for n in names:
        buckets.setdefault((group_key(n, repeated), shapes[n]), []).append(n)
    groups = [(key, shape, members) for (key, shape), members in buckets.items() if len(members) > 1]
    seen = Counter(key for key, _, _ in groups)
    return [(f"{key}@{'x'.join(map(str, shape)) or 'scalar'}" if seen[key] > 1 else key, members)
            for key, shape, members in groups]
