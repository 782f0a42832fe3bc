"""The layers of docs/architecture.md, read from the source: what each module imports, where torch_xla is
imported, how long the core's files are, and that no module patches attributes onto another's objects."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "partir_torch"

# lowest first; a unit may import units of its own layer or of a lower one (docs/architecture.md)
LAYERS: list[set[str]] = [
    {"errors", "ir", "models", "cache", "_compat"},  # the IR; the zoo; the plan cache; torch's private names
    {"capture", "workload"},
    {"rules"},
    {"propagate"},  # the analysis of a program on a mesh, the sharding state, the ZeRO action's fences
    {"lower"},  # the collectives; layout: the walk between two shardings (lower counts its steps, backends run them)
    {"tactics", "simulate"},
    {"cost"},
    {"plan"},  # the result type: search() returns one, so it sits below search
    {"search", "explain", "options"},  # options: every entry point's `Options` (names cost types when typing)
    {"backends"},  # only backends import torch_xla
    {"api", "lightning", "cli", "launch", "bench", "__init__"},  # the facades
]
LAYER = {u: i for i, layer in enumerate(LAYERS) for u in layer}
CORE = ("capture", "ir", "rules", "propagate", "lower", "tactics", "cost", "search", "plan")
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


def test_every_module_stays_short():
    """Every module of the package, backends and CLI included: one module, one job."""
    long = [f"{f.relative_to(PKG.parent)}: {n} lines" for f in _files()
            for n in [len(f.read_text().splitlines())] if n > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_no_attributes_are_patched_onto_other_objects():
    """Caches are declared fields of their owner (`analysis.Analysis`), not attributes set from outside."""
    bad = [f"{f.relative_to(PKG.parent)}:{i}" for f in _files()
           for i, line in enumerate(f.read_text().splitlines(), 1)
           if "type: ignore[attr-defined]" in line or ("__dict__.update(" in line and "self.__dict__" not in line
           and "c.__dict__" not in line)]
    assert not bad, f"attributes set on another module's objects: {bad}"


def test_the_layer_test_fails_on_an_upward_import(tmp_path):
    """The check itself: an import of a higher layer is reported."""
    f = PKG / "lower" / "collectives.py"
    assert ("search" not in dict((v, ln) for ln, v in _imports(f)))
    fake = tmp_path / "x.py"
    fake.write_text("def f():\n    from partir_torch.search.api import search\n")
    assert _imports(fake) == [(2, "search")] and LAYER["search"] > LAYER["lower"]


# Module-level containers of the core that a function changes after import, each with why it may: a registry
# filled as its module family is imported (read-only after), an interning table of immutable values (a
# pure function's memo), or a name source for a process-global registry that is not ours.
SHARED_STATE = {
    "rules/base.py": {"_RULES", "_TAG_RULES"},  # the rule registry keyed by the aten op (`register`)
    "tactics/schedule.py": {"_REGISTRY"},  # the tactic registry (`register_tactic`)
    "ir/sharding.py": {"_REPLICATED", "_TILED"},  # interned `Sharding`s: equal inputs, the same immutable value
    "capture/opaque.py": {"_COUNTER"},  # unique names in torch.library's registry (process-global, torch's)
}
_MUTATORS = {"append", "add", "update", "setdefault", "pop", "popitem", "clear", "extend", "insert", "remove",
             "discard", "set", "__setitem__"}
_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "Event", "count",
                  "WeakKeyDictionary", "WeakValueDictionary"}


def _changed_module_state(path: Path) -> set[str]:
    """Module-level names bound to a mutable container that a function of the module changes (an item or
    attribute written, a mutating method called, `next()` of it, or rebound through `global`)."""
    tree = ast.parse(path.read_text())
    mutable = set()
    for n in tree.body:
        if isinstance(n, ast.Assign | ast.AnnAssign) and n.value is not None:
            v = n.value
            call = isinstance(v, ast.Call) and (getattr(v.func, "id", None) or getattr(v.func, "attr", None))
            if isinstance(v, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp) or \
                    call in _MUTABLE_CALLS:
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                mutable |= {t.id for t in targets if isinstance(t, ast.Name)}
    changed = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Global):
                changed |= set(n.names)
            elif isinstance(n, ast.Assign | ast.AugAssign | ast.Delete):
                for t in (n.targets if isinstance(n, ast.Assign | ast.Delete) else [n.target]):
                    if isinstance(t, ast.Subscript | ast.Attribute) and isinstance(t.value, ast.Name):
                        changed.add(t.value.id)
            elif isinstance(n, ast.Call):
                f = n.func
                if isinstance(f, ast.Attribute) and f.attr in _MUTATORS and isinstance(f.value, ast.Name):
                    changed.add(f.value.id)
                elif isinstance(f, ast.Name) and f.id == "next" and n.args and isinstance(n.args[0], ast.Name):
                    changed.add(n.args[0].id)
    return mutable & changed | {g for g in changed if g in mutable}


def test_no_module_level_state_in_the_core():
    """A program's plan and cost never depend on what the process did before: the core's caches are owned
    by an object (`Analysis.stage`, the search's `Context`), opaque ops' FLOPs are on the op, Ctrl-C is a
    token of one search; what is left at module level is listed in `SHARED_STATE` with its reason."""
    found = {str(f.relative_to(PKG)): names for f in _files() if _unit(f) in CORE
             for names in [_changed_module_state(f)] if names}
    assert found == SHARED_STATE, f"module-level state changed by functions (own it by an object): {found}"


def test_the_state_check_finds_a_global_cache(tmp_path):
    fake = tmp_path / "x.py"
    fake.write_text("_SEEN = {}\nTABLE = {1: 2}\n\ndef f(k):\n    _SEEN[k] = TABLE[k]\n    return _SEEN\n")
    assert _changed_module_state(fake) == {"_SEEN"}


def test_no_untyped_slots_cross_the_layers():
    """A declared field or attribute of the core typed `Any` is a slot a later layer fills with its own type:
    such a stage keeps its table through `Analysis.stage(kind, build)` (typed by `kind`) instead."""
    bad = []
    for f in _files():
        if _unit(f) not in CORE:
            continue
        for cls in ast.walk(ast.parse(f.read_text())):
            if isinstance(cls, ast.ClassDef):
                bad += [f"{f.relative_to(PKG.parent)}:{n.lineno} {cls.name}.{ast.unparse(n.target)}"
                        for n in cls.body if isinstance(n, ast.AnnAssign) and ast.unparse(n.annotation) == "Any"]
    assert not bad, f"fields typed Any: {bad}"


FACADE = ["PartirError", "ShardingPlan", "auto_shard", "find_plan", "load", "shard_batch", "start_runtime", "step",
          "unshard", "verify"]


def test_the_facade_is_the_users_verbs_and_shadows_no_module():
    """`partir_torch`'s names: the listed verbs and types, each resolving to what it names, none the name of
    a subpackage or module (so `import partir_torch.search` never changes what `partir_torch.search` is)."""
    import importlib

    import partir_torch

    assert sorted(partir_torch.__all__) == FACADE
    modules = {f.stem for f in PKG.glob("*.py")} | {d.name for d in PKG.iterdir() if (d / "__init__.py").exists()}
    assert not set(FACADE) & modules
    for name in FACADE:
        assert getattr(partir_torch, name) is not None
    assert partir_torch.find_plan is importlib.import_module("partir_torch.search.api").search
    importlib.import_module("partir_torch.search")
    importlib.import_module("partir_torch.capture")
    assert callable(partir_torch.capture.capture) and hasattr(partir_torch.search, "Auto")  # the subpackages
