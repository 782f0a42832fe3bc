"""The layers of docs/architecture.md, read from the source: what each module imports, where torch_xla is
imported, how long the core's files are, and that no module patches attributes onto another's objects."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "partir_torch"

# lowest first; a unit may import units of its own layer or of a lower one (docs/architecture.md)
LAYERS: list[set[str]] = [
    {"errors", "ir", "models", "cache"},  # the IR every stage reads; the model zoo (torch only); the plan cache
    {"capture", "workload"},
    {"rules"},
    {"analysis", "propagate"},
    {"lower", "layout"},  # layout: the walk between two shardings, its steps (lower counts them, backends run them)
    {"tactics", "simulate"},
    {"cost"},
    {"plan"},  # the result type: search() returns one, so it sits below search
    {"search", "explain"},
    {"backends", "sweep"},  # only backends import torch_xla
    {"api", "lightning", "cli", "launch", "__init__"},  # the facades
]
LAYER = {u: i for i, layer in enumerate(LAYERS) for u in layer}
CORE = ("capture", "ir", "rules", "analysis", "propagate", "lower", "layout", "tactics", "cost", "search", "plan")
MAX_LINES = 500


def _unit(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, unit) of every partir_torch import in the file, module-level or inside functions."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "partir_torch":
            parts = node.module.split(".")
            if len(parts) > 1:
                out.append((node.lineno, parts[1]))
            else:  # `from partir_torch import x`: the submodule x, or the package facade
                for a in node.names:
                    sub = a.name if (PKG / a.name).is_dir() or (PKG / f"{a.name}.py").exists() else "__init__"
                    out.append((node.lineno, sub))
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "partir_torch":
                    out.append((node.lineno, parts[1] if len(parts) > 1 else "__init__"))
    return out


def _files() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def test_every_unit_has_a_layer():
    units = {_unit(f) for f in _files()}
    assert units <= set(LAYER), f"units without a layer in LAYERS: {sorted(units - set(LAYER))}"


def test_modules_import_only_their_layer_and_the_layers_below():
    bad = []
    for f in _files():
        u = _unit(f)
        for line, v in _imports(f):
            if v != u and LAYER[v] > LAYER[u]:
                bad.append(f"{f.relative_to(PKG.parent)}:{line} ({u}, layer {LAYER[u]}) imports {v} (layer {LAYER[v]})")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_only_the_backends_import_torch_xla():
    bad = []
    for f in _files():
        if _unit(f) == "backends":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{f.relative_to(PKG.parent)}:{node.lineno}" for n in names if n.split(".")[0] == "torch_xla"]
    assert not bad, f"torch_xla imported outside partir_torch/backends: {bad}"


def test_core_files_stay_short():
    long = [f"{f.relative_to(PKG.parent)}: {n} lines" for f in _files() if _unit(f) in CORE
            for n in [len(f.read_text().splitlines())] if n > MAX_LINES]
    assert not long, f"core files over {MAX_LINES} lines (split them by job): {long}"


def test_no_attributes_are_patched_onto_other_objects():
    """Caches are declared fields of their owner (`analysis.Analysis`), not attributes set from outside."""
    bad = [f"{f.relative_to(PKG.parent)}:{i}" for f in _files()
           for i, line in enumerate(f.read_text().splitlines(), 1)
           if "type: ignore[attr-defined]" in line or ("__dict__.update(" in line and "self.__dict__" not in line
           and "c.__dict__" not in line)]
    assert not bad, f"attributes set on another module's objects: {bad}"


def test_the_layer_test_fails_on_an_upward_import(tmp_path):
    """The check itself: an import of a higher layer is reported."""
    f = PKG / "lower.py"
    assert ("search" not in dict((v, ln) for ln, v in _imports(f)))
    fake = tmp_path / "x.py"
    fake.write_text("def f():\n    from partir_torch.search.api import search\n")
    assert _imports(fake) == [(2, "search")] and LAYER["search"] > LAYER["lower"]
