"""The plan cache (`partir_torch/cache.py`): a repeat returns the stored plan without searching, every key
ingredient misses, corrupt entries and unwritable directories warn, concurrent writers leave a whole entry,
`--no-cache` / `cache=False` bypass it, and the CLI's cached repeat imports no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from partir_torch import cache
from partir_torch.capture import capture
from partir_torch.cli import main
from partir_torch.cost.hardware import hardware
from partir_torch.errors import MeshError
from partir_torch.ir.mesh import Mesh
from partir_torch.search import Auto, Budget, SearchConfig, search
from partir_torch.search import api as search_api
from partir_torch.search.api import plan_key

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def count_searches(monkeypatch):
    """How many times a schedule was applied (searched) by `search()` / `partir-torch plan`."""
    calls = []
    real = search_api.apply_schedule

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(search_api, "apply_schedule", counted)
    return calls


def _search(tiny, **kw):
    model, inputs, loss_fn = tiny
    return search(model, inputs, kw.pop("mesh", "batch=2,model=2"), loss_fn=loss_fn, budget=kw.pop("budget", 3), **kw)


def test_a_repeat_search_returns_the_stored_plan_without_searching(tiny, count_searches):
    first = _search(tiny)
    assert first.cache is None and len(count_searches) == 1
    again = _search(tiny)
    assert len(count_searches) == 1, "the repeat searched"
    assert again.cache["level"] == "program" and Path(again.cache["file"]).is_file()
    assert again.params == first.params and again.cost == first.cost and again.search == first.search
    assert "plan from the cache (program key" in again.table() and again.to_json()["cache"] == again.cache
    assert Path(again.cache["file"]).is_relative_to(Path(os.environ["XDG_CACHE_HOME"]) / "partir_torch")


def test_cache_false_searches_and_stores_nothing(tiny, count_searches):
    _search(tiny, cache=False)
    _search(tiny, cache=False)
    assert len(count_searches) == 2
    assert not (cache.directory() / "plans").exists()


def test_a_changed_budget_misses(tiny, count_searches):
    _search(tiny, budget=3)
    plan = _search(tiny, budget=4)
    assert len(count_searches) == 2 and plan.cache is None


def _key(program, **change) -> str:
    mesh = change.pop("mesh", Mesh.parse("batch=2,model=2"))
    tactics = change.pop("tactics", [Auto()])
    fallback = change.pop("fallback", False)
    options = {"fold": True, "mode": None, **change.pop("options", {})}
    config = replace(SearchConfig(hardware("cpu-virtual"), frozenset(), None, 0, Budget.parse(3), "mcts"), **change)
    return plan_key(program, mesh, tactics, config, fallback=fallback, options=options)


def test_every_key_ingredient_changes_the_key(tiny, monkeypatch):
    model, inputs, loss_fn = tiny
    program = capture(model, inputs, loss_fn, "adamw")
    base = _key(program)
    assert _key(program) == base
    other = capture(model, (inputs[0][:, :4], inputs[1][:, :4]), loss_fn, "adamw")  # another program
    variants = {
        "program": _key(other),
        "mesh": _key(program, mesh=Mesh.parse("batch=2,model=4")),
        "axis names": _key(program, mesh=Mesh.parse("data=2,model=2")),
        "dcn axes": _key(program, dcn_axes=frozenset({"batch"})),
        "hardware name": _key(program, hw=hardware("tpu-v5e")),
        "a hardware figure": _key(program, hw=hardware("cpu-virtual", link_bandwidth=1e9)),
        "schedule": _key(program, tactics=[Auto(("batch",)), Auto(("model",))]),
        "goal": _key(program, tactics=[Auto(goal="communication")]),
        "mode": _key(program, tactics=[Auto(mode="joint")]),
        "budget": _key(program, budget=Budget.parse("3s")),
        "seed": _key(program, seed=1),
        "algorithm": _key(program, algorithm="greedy"),
        "memory limit": _key(program, memory_limit=2**20),
        "prune": _key(program, prune=False),
        "goals": _key(program, goals=False),
        "fallback": _key(program, fallback=True),
        "fold": _key(program, options={"fold": False}),
        "inference": _key(program, options={"mode": "inference"}),
    }
    same = [k for k, v in variants.items() if v == base]
    assert not same, f"these do not change the key: {same}"
    assert len(set(variants.values())) == len(variants)
    monkeypatch.setattr(cache, "version", lambda: {"partir_torch": "another source tree"})
    assert _key(program) != base, "the project's version does not change the key"


class _Mlp(torch.nn.Module):
    """Two linears with an activation: variants differ in one op or one scalar, never in a shape."""

    def __init__(self, act: torch.nn.Module, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.up, self.act, self.down = torch.nn.Linear(8, 16, dtype=dtype), act, torch.nn.Linear(16, 8, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def _mse(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _l1(model, x, y):
    return torch.nn.functional.l1_loss(model(x), y)


def test_programs_of_equal_shapes_that_compute_differently_have_other_keys():
    """The key reads what the step computes, not only its shapes: a plan cached for one of these is never
    served to another (a cache hit returns the stored plan without replaying it)."""

    def key(act=None, loss=_mse, opt=None, dtype=torch.float32):
        torch.manual_seed(0)
        model = _Mlp(act if act is not None else torch.nn.LeakyReLU(0.1), dtype)
        x, y = torch.randn(4, 8, dtype=dtype), torch.randn(4, 8, dtype=dtype)
        optimizer = opt(model) if opt else torch.optim.AdamW(model.parameters(), weight_decay=0.01)
        return _key(capture(model, (x, y), loss, optimizer))

    base = key()
    assert key() == base, "the same model, loss and optimizer must hit"
    variants = {
        "an op's scalar argument": key(act=torch.nn.LeakyReLU(0.2)),
        "one op for another": key(act=torch.nn.GELU()),
        "another loss": key(loss=_l1),
        "an optimizer hyperparameter the step reads": key(
            opt=lambda m: torch.optim.AdamW(m.parameters(), weight_decay=0.02)),
        "another optimizer": key(opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)),
        "another dtype": key(dtype=torch.float64),
    }
    same = [k for k, v in variants.items() if v == base]
    assert not same, f"these do not change the key: {same}"


def test_the_version_hashes_the_package_sources():
    v = cache.version()
    assert set(v) >= {"partir_torch", "torch", "python"} and len(v["partir_torch"]) == 16
    import torch

    assert v["torch"] == torch.__version__.split("+")[0] or torch.__version__.startswith(v["torch"])


def test_a_corrupt_entry_is_ignored_with_a_warning_and_rewritten(tiny, count_searches):
    _search(tiny)
    (entry,) = (cache.directory() / "plans").glob("*.json")
    entry.write_text('{"plan": {"mesh": ')  # a torn write from an older version, say
    with pytest.warns(cache.CacheWarning, match=rf"corrupt plan cache entry {entry}"):
        plan = _search(tiny)
    assert plan.cache is None and len(count_searches) == 2
    assert json.loads(entry.read_text())["plan"]["params"] == plan.to_json()["params"]
    entry.write_text(json.dumps({"key": entry.stem, "plan": {"mesh": 3}}))  # valid JSON, not a plan
    with pytest.warns(cache.CacheWarning, match=rf"corrupt plan cache entry {entry}"):
        _search(tiny)
    assert len(count_searches) == 3


def test_an_unwritable_cache_directory_warns_and_the_plan_is_returned(tiny, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # mkdir under a file fails, even for root
    with pytest.warns(cache.CacheWarning, match=r"cannot write the plan cache .*not-a-directory.*--no-cache"):
        plan = _search(tiny)
    assert plan.params and plan.cache is None


def test_the_default_directory_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.directory() == tmp_path / "partir_torch"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.directory() == tmp_path / "home" / ".cache" / "partir_torch"


def test_concurrent_writers_of_one_key_leave_a_whole_entry():
    """Threads of this process and two other processes write the same key at once, many times, while a reader
    reads it: the reader never sees a torn entry, and one whole entry is left."""
    script = ("import sys; from partir_torch import cache\n"
              "for i in range(20): cache.write('plans', 'k', {'plan': {'writer': sys.argv[1], 'i': i, "
              "'params': {f'p{j}': [None, 'batch'] for j in range(5000)}}})\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(n)], env=env) for n in range(2)]
    big = {"plan": {"params": {f"p{i}": [None, "model"] for i in range(5000)}}}
    done, seen, torn = threading.Event(), [], []

    def writer(n: int) -> None:
        for i in range(20):
            cache.write("plans", "k", {**big, "writer": n, "i": i})

    def reader() -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while not done.is_set():
                entry = cache.read("plans", "k")
                if entry is not None:
                    seen.append(len(entry["plan"]["params"]))
        torn.extend(str(w.message) for w in caught)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(3)]
    watch = threading.Thread(target=reader)
    watch.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(p.wait(120) == 0 for p in procs)
    done.set()
    watch.join()
    assert not torn, torn[:2]
    assert seen and set(seen) == {5000}
    entry = cache.read("plans", "k")
    assert entry is not None and len(entry["plan"]["params"]) == 5000
    assert [f.name for f in (cache.directory() / "plans").iterdir()] == ["k.json"], "temporary files left"


CLI = ["plan", "tiny-mlp", "--mesh", "batch=2,model=2", "--budget", "3"]


def test_cli_repeat_comes_from_the_request_cache_and_no_cache_bypasses_it(capsys, count_searches):
    assert main(CLI) == 0
    first = capsys.readouterr().out
    assert "from the cache" not in first and len(count_searches) == 1
    assert main(CLI) == 0
    again = capsys.readouterr().out
    assert "plan from the cache (request key" in again and len(count_searches) == 1
    assert again.startswith(first.rstrip("\n")), "the cached repeat prints another report"
    assert main([*CLI, "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "from the cache" not in out and len(count_searches) == 2
    assert main([*CLI, "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["cache"]["level"] == "request" and len(count_searches) == 2


@pytest.mark.slow
def test_cli_a_changed_option_misses_the_request_cache(capsys, count_searches):
    variants = [["--budget", "4"], ["--seed", "1"], ["--mesh", "batch=2,model=4"], ["--mesh", "batch=2:dcn,model=2"],
                ["--hardware", "tpu-v5e"], ["--schedule", "batch:BatchParallel;model:Auto"], ["--memory", "1GiB"],
                ["--config", "hidden=64"], ["--optimizer", "sgd"], ["--algorithm", "greedy"], ["--no-fold"]]
    assert main(CLI) == 0
    for extra in variants:
        assert main([*CLI, *extra]) == 0
        assert "from the cache" not in capsys.readouterr().out, extra
    assert len(count_searches) == 1 + len(variants)


FACTORY = """
import torch, torch.nn as nn, torch.nn.functional as F
# {comment}
def make(width: int = 8):
    model = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
    x = torch.randn(4, width)
    return model, (x, torch.randn(4, width)), lambda m, x, y: F.mse_loss(m(x), y)
"""


def test_cli_a_factory_s_repeat_is_served_by_program_never_by_request(tmp_path, capsys, count_searches):
    """A factory is user code: its repeat is captured and served by the program's key (an edited comment: the
    same program, served; another program: searched)."""
    f = tmp_path / "mine.py"
    f.write_text(FACTORY.format(comment="v1"))
    argv = ["plan", f"{f}:make", "--mesh", "batch=2", "--budget", "3"]
    assert main(argv) == 0 and main(argv) == 0
    out = capsys.readouterr().out
    assert "(request key" not in out and "(program key" in out and len(count_searches) == 1
    f.write_text(FACTORY.format(comment="v2, same program"))
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(request key" not in out and "(program key" in out and len(count_searches) == 1
    f.write_text(FACTORY.format(comment="v3").replace("4, width", "8, width"))  # another program
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 2 * 10**9))
    assert main(argv) == 0
    assert "from the cache" not in capsys.readouterr().out and len(count_searches) == 2


def test_cli_cached_repeat_imports_no_torch(capsys):
    """The request level is read before torch is imported: the repeat process never loads it."""
    assert main(CLI) == 0
    first = capsys.readouterr().out
    code = ("import sys; from partir_torch.cli import main; rc = main(sys.argv[1:]); "
            "print('TORCH LOADED' if 'torch' in sys.modules else 'NO TORCH'); sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code, *CLI], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "plan from the cache (request key" in r.stdout and "NO TORCH" in r.stdout
    assert r.stdout.startswith(first.rstrip("\n"))


def test_cli_infeasible_plan_is_cached_with_its_error(capsys, count_searches):
    argv = [*CLI, "--memory", "1KB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no plan found fits in memory" in err
    assert main(argv) == 2
    again = capsys.readouterr()
    assert "plan from the cache" in again.out and "no plan found fits in memory" in again.err
    assert len(count_searches) == 1


def test_cli_out_writes_the_plan_without_the_cache_note(tmp_path, capsys):
    assert main([*CLI, "--out", str(tmp_path / "a.json")]) == 0
    assert main([*CLI, "--out", str(tmp_path / "b.json")]) == 0
    capsys.readouterr()
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert "cache" not in b and a == b


def test_train_passes_no_cache_to_auto_shard(monkeypatch, capsys):
    import partir_torch
    from partir_torch.errors import PartirError

    seen = {}

    def stub(*args, **kwargs):
        seen.update(kwargs)
        raise PartirError("stub: stop before applying")

    from partir_torch import launch

    monkeypatch.setattr(launch, "spawn", lambda fn, n, *args: fn(0, n, *args))  # the ranks' job, in this process
    monkeypatch.setattr(partir_torch, "auto_shard", stub)
    assert main(["train", "tiny-mlp", "--mesh", "batch=2", "--no-cache", "--steps", "1"]) == 2
    assert seen["options"].cache is False
    assert main(["train", "tiny-mlp", "--mesh", "batch=2", "--steps", "1"]) == 2
    assert seen["options"].cache is True


def test_a_mesh_that_does_not_span_the_given_devices_names_both_counts(tiny, capsys):
    with pytest.raises(MeshError, match=r"spans 4 devices \(2 x 2\), but 8 devices were given"):
        _search(tiny, devices=8)
    assert main([*CLI, "--devices", "16"]) == 2
    assert "spans 4 devices (2 x 2), but 16 devices were given" in capsys.readouterr().err
    assert main(["train", "tiny-mlp", "--mesh", "batch=2,model=4", "--devices", "4"]) == 2
    assert "spans 8 devices (2 x 4), but 4 devices were given" in capsys.readouterr().err
    assert _search(tiny, devices=4).params


def test_cli_with_an_unwritable_cache_warns_once_and_prints_the_plan(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(CLI) == 0
    assert "parameters sharded" in capsys.readouterr().out
    cw = [str(w.message) for w in caught if issubclass(w.category, cache.CacheWarning)]
    assert len(cw) == 1 and "cannot write the plan cache" in cw[0] and str(blocker) in cw[0]


ENV_FACTORY = """
import os, torch, torch.nn as nn, torch.nn.functional as F
def make():
    width = {"small": 8, "wide": 16}[os.environ["ARCH"]]  # what the factory builds comes from the environment
    model = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
    return model, (torch.randn(4, width), torch.randn(4, width)), lambda m, x, y: F.mse_loss(m(x), y)
"""


def test_cli_a_factory_reading_the_environment_never_gets_another_program_s_plan(tmp_path, capsys, monkeypatch,
                                                                                  count_searches):
    f = tmp_path / "models.py"
    f.write_text(ENV_FACTORY)
    argv = ["plan", f"{f}:make", "--mesh", "batch=2", "--budget", "3", "--json"]
    monkeypatch.setenv("ARCH", "small")
    assert main(argv) == 0
    small = json.loads(capsys.readouterr().out)
    monkeypatch.setenv("ARCH", "wide")
    assert main(argv) == 0
    wide = json.loads(capsys.readouterr().out)
    assert small["shapes"]["params"]["0.weight"] == [16, 8] and wide["shapes"]["params"]["0.weight"] == [32, 16]
    assert "cache" not in wide and len(count_searches) == 2
    monkeypatch.setenv("ARCH", "small")
    assert main(argv) == 0  # a repeat of the first: served, by program
    assert json.loads(capsys.readouterr().out)["cache"]["level"] == "program"
