"""Pictures of a plan (matplotlib, PNG): which device holds which block of one tensor, and the whole plan as
one chart, the way a practitioner checks a sharding by eye.

- `draw_tensor`: the tensor's first two dims cut into the blocks its spec makes (a dim tiled over axes
  `(a, b)` in `size(a) * size(b)` blocks, `a` major), each block labelled with the devices that hold it (a
  device is its row-major index in the mesh: `{batch: 2, model: 4}` numbers `batch=1, model=0` as 4); the
  same picture torch_xla's `visualize_tensor_sharding` draws for one array;
- `draw_plan`: every input, parameter group (repeated layers collapsed) and optimizer state the plan splits
  beyond its parameter, one row each, one column per dim, coloured by the mesh axes that split it; beside
  it the predicted step time (compute, communication per axis) and memory by role.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Any

from partir_torch.errors import PartirError


def _entries(e: Any) -> list[str]:
    return [] if e is None else [e] if isinstance(e, str) else list(e)


def tensor_spec(plan: Any, name: str) -> tuple[list[int], list]:
    """(shape, spec) of a parameter, an input (`inputs[0]`) or an optimizer state (`opt.exp_avg[w]`)."""
    shapes = plan.shapes
    if name in plan.params:
        return list(shapes["params"][name]), plan.params[name]
    if m := re.fullmatch(r"inputs\[(\d+)\]", name):
        i = int(m[1])
        if i < len(plan.inputs):
            return list(shapes["inputs"][i]), plan.inputs[i] or [None] * len(shapes["inputs"][i])
    if m := re.fullmatch(r"opt\.(\w+)\[(.+)\]", name):
        state, param = m[1], m[2]
        if state in plan.optimizer_state.get(param, {}):
            return list(shapes["params"][param]), plan.optimizer_state[param][state]
    known = [*list(plan.params)[:3], "inputs[0]", *[f"opt.{s}[{p}]" for p, st in list(plan.optimizer_state.items())[:1]
                                                     for s in st]]
    raise PartirError(f"no tensor named {name!r} in the plan; name a parameter, an input or an optimizer state, e.g. "
                      f"{', '.join(known)}")


def blocks(shape: list[int], spec: list, mesh: dict[str, int]) -> dict[tuple[int, ...], list[int]]:
    """Block index per dim -> the devices (row-major mesh indices) that hold that block."""
    axes = list(mesh)
    out: dict[tuple[int, ...], list[int]] = {}
    for dev, coord in enumerate(itertools.product(*(range(mesh[a]) for a in axes))):
        at = dict(zip(axes, coord))
        key = []
        for d in range(len(shape)):
            idx = 0
            for a in _entries(spec[d] if d < len(spec) else None):
                idx = idx * mesh[a] + at[a]
            key.append(idx)
        out.setdefault(tuple(key), []).append(dev)
    return out


def draw_tensor(plan: Any, name: str, path: str | Path) -> Path:
    """The blocks of tensor `name` and the devices holding each (module docstring) as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shape, spec = tensor_spec(plan, name)
    held = blocks(shape, spec, plan.mesh)
    counts = [math.prod(plan.mesh[a] for a in _entries(spec[d] if d < len(spec) else None)) for d in range(len(shape))]
    rows = counts[0] if shape else 1
    cols = counts[1] if len(shape) > 1 else 1
    fig, ax = plt.subplots(figsize=(max(4.0, 1.4 * cols), max(2.5, 0.9 * rows) + 0.8), dpi=100)
    cmap = plt.get_cmap("tab20")
    for (r, c) in itertools.product(range(rows), range(cols)):
        devs = sorted({d for k, ds in held.items() if (k[0] if shape else 0) == r
                       and (k[1] if len(shape) > 1 else 0) == c for d in ds})
        ax.add_patch(plt.Rectangle((c, rows - 1 - r), 1, 1, facecolor=cmap((r * cols + c) % 20), edgecolor="black"))
        label = ", ".join(map(str, devs)) if len(devs) <= 8 else f"{len(devs)} devices"
        ax.text(c + 0.5, rows - 0.5 - r, label, ha="center", va="center", fontsize=9)
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_xticks([])
    ax.set_yticks([])
    dims = " x ".join(map(str, shape)) or "scalar"
    rest = f"; dims 2+ ({', '.join(map(str, shape[2:]))}) not drawn" if len(shape) > 2 else ""
    ax.set_title(f"{name} [{dims}] {spec}\nmesh {plan.mesh}: devices holding each block{rest}", fontsize=9)
    path = Path(path)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def _rows(plan: Any) -> list[tuple[str, list, list[int]]]:
    """(label, spec, shape) of every input, parameter group and optimizer state split beyond its parameter."""
    out: list[tuple[str, list, list[int]]] = []
    shapes = plan.shapes
    for i, spec in enumerate(plan.inputs):
        shape = shapes["inputs"][i] if i < len(shapes.get("inputs", [])) else []
        out.append((f"inputs[{i}]", spec or [None] * len(shape), list(shape)))
    groups: dict[tuple[str, str], list[str]] = {}
    for n, spec in plan.params.items():
        groups.setdefault((re.sub(r"\.\d+\.", ".*.", n), repr(spec)), []).append(n)
    for (key, _), names in groups.items():
        label = f"{key} (x{len(names)})" if len(names) > 1 else names[0]
        out.append((label, plan.params[names[0]], list(shapes["params"].get(names[0], []))))
    states: dict[tuple[str, str], tuple[list, list[int], int]] = {}
    for n, st in plan.optimizer_state.items():
        for s, spec in st.items():
            if spec != plan.params.get(n):
                group = re.sub(r"\.\d+\.", ".*.", n)
                key = (f"opt.{s}[{group}]", repr(spec))
                got = states.get(key)
                states[key] = (spec, list(shapes["params"].get(n, [])), (got[2] if got else 0) + 1)
    out += [(f"{k} (x{c})" if c > 1 else k, spec, shape) for (k, _), (spec, shape, c) in states.items()]
    return out


def draw_plan(plan: Any, path: str | Path, top: int = 40) -> Path:
    """The whole plan as one chart (module docstring) as a PNG at `path`; `top` rows at most."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from partir_torch.plan.table import roles

    rows = _rows(plan)[:top]
    width = max((len(s) for _, s, _ in rows), default=1)
    combos = sorted({"+".join(_entries(e)) for _, s, _ in rows for e in s if e})
    cmap = plt.get_cmap("tab10")
    color = {c: cmap(i % 10) for i, c in enumerate(combos)}
    fig = plt.figure(figsize=(6 + 1.2 * width, 1.2 + 0.32 * max(len(rows), 6)), dpi=100)
    grid = fig.add_gridspec(2, 2, width_ratios=[3, 1.2])
    ax = fig.add_subplot(grid[:, 0])
    for r, (_, spec, shape) in enumerate(rows):
        y = len(rows) - 1 - r
        for d in range(width):
            e = spec[d] if d < len(spec) else None
            key = "+".join(_entries(e))
            face = color[key] if key else ("0.92" if d < len(spec) else "white")
            ax.add_patch(plt.Rectangle((d, y), 1, 1, facecolor=face, edgecolor="0.6"))
            size = shape[d] if d < len(shape) else ""
            ax.text(d + 0.5, y + 0.5, f"{size} {key}".strip() if d < len(spec) else "", ha="center", va="center",
                    fontsize=7)
    ax.set_xlim(0, width)
    ax.set_ylim(0, len(rows))
    ax.set_yticks([len(rows) - 0.5 - r for r in range(len(rows))], [label for label, _, _ in rows], fontsize=7)
    ax.set_xticks([d + 0.5 for d in range(width)], [f"dim {d}" for d in range(width)], fontsize=8)
    what = "; ".join(f"{a} ({n}): {', '.join(roles(plan)[a]) or 'nothing'}" for a, n in plan.mesh.items())
    ax.set_title(f"mesh {plan.mesh} — {what}", fontsize=8)
    c = plan.cost
    t = fig.add_subplot(grid[0, 1])
    parts = {"compute": c["compute_time_s"], **{f"comm {a}": s for a, s in c.get("comm_time_by_axis", {}).items()}}
    bottom = 0.0
    for i, (k, v) in enumerate(parts.items()):
        t.bar([0], [v * 1e3], bottom=bottom, color=plt.get_cmap("Set2")(i), label=k)
        bottom += v * 1e3
    t.set_ylabel("ms (sum of the parts)", fontsize=7)
    t.set_xticks([])
    t.set_title(f"step {c['step_time_s'] * 1e3:.3g} ms", fontsize=8)
    t.legend(fontsize=6)
    m = fig.add_subplot(grid[1, 1])
    by_role = c.get("memory_by_role", {})
    m.barh(list(by_role), [b / 2**20 for b in by_role.values()], color="0.5")
    m.set_xlabel("MiB per device", fontsize=7)
    m.tick_params(labelsize=7)
    m.set_title(f"peak {c['peak_memory_bytes'] / 2**20:.3g} MiB ({'fits' if c['feasible'] else 'does not fit'})",
                fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
