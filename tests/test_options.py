"""`Options`: one frozen type for every entry point, its defaults in one place, the CLI's flags its fields."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from partir_torch import models
from partir_torch.cli import build_parser
from partir_torch.errors import PartirError
from partir_torch.options import Options, from_args

FIELDS = [f.name for f in dataclasses.fields(Options)]


def test_options_are_frozen_and_an_unknown_keyword_names_the_closest_field():
    o = Options.of(budget=5, fallback=True)
    assert (o.budget, o.fallback, o.seed) == (5, True, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.budget = 6  # type: ignore[misc]
    assert Options.of(o, seed=3) == dataclasses.replace(o, seed=3) and o.seed == 0
    with pytest.raises(PartirError, match=r"unknown option 'budjet'; did you mean 'budget'\?"):
        Options.of(budjet=5)
    with pytest.raises(PartirError, match="algorithm must be one of"):
        Options(algorithm="annealing")


def test_no_entry_point_declares_an_option_of_its_own():
    """Every default is `Options`': the entry points take `options` and keywords named like its fields, and
    declare none of those names themselves (where a default could drift)."""
    from partir_torch.api import auto_shard, checked_plan
    from partir_torch.backends.distributed.shard import auto_shard as torch_auto_shard
    from partir_torch.lightning import AutoShardStrategy, TorchAutoShardStrategy
    from partir_torch.search.api import search

    for fn in (search, auto_shard, checked_plan, torch_auto_shard, AutoShardStrategy.__init__,
               TorchAutoShardStrategy.__init__):
        params = set(inspect.signature(fn).parameters)
        assert "options" in params and not params & set(FIELDS), (fn.__qualname__, params & set(FIELDS))


def test_the_cli_flags_are_the_fields_and_read_back_as_python_takes_them():
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices
    for command in ("plan", "train"):
        dests = {a.dest for a in sub[command]._actions}
        hidden = {f.name for f in dataclasses.fields(Options) if f.metadata["flag"] == ""}
        assert set(FIELDS) - hidden <= dests, (command, set(FIELDS) - hidden - dests)
    args = parser.parse_args(["plan", "tiny-mlp", "--mesh", "batch=2", "--budget", "30", "--no-fold", "--no-cache",
                              "--memory", "1GiB", "--goal", "communication", "--devices", "2", "--fallback"])
    assert from_args(args) == Options(budget="30", fold=False, cache=False, memory="1GiB", goal="communication",
                                      devices=2, fallback=True)
    assert from_args(parser.parse_args(["train", "tiny-mlp", "--mesh", "batch=2"])) == Options()


def test_lightning_takes_every_option_auto_shard_takes():
    """The strategy used to copy seven options by hand (no `cache`, no `progress`): now it holds an `Options`."""
    from partir_torch.lightning import AutoShardStrategy

    s = AutoShardStrategy("batch=2", budget=7, cache=False, progress=False, goal="zero")  # (the torch backend's)
    assert s.options == Options(budget=7, cache=False, progress=False, goal="zero")
    with pytest.raises(PartirError, match="did you mean 'memory'"):
        AutoShardStrategy("batch=2", memroy="1GiB")


def test_find_plan_takes_an_options_object_or_its_keywords_alike():
    import partir_torch

    model, inputs, loss_fn = models.build("tiny-mlp")
    opts = Options(budget=10, schedule="batch:BatchParallel", cache=False, progress=False)
    a = partir_torch.find_plan(model, inputs, "batch=2", loss_fn=loss_fn, options=opts)
    b = partir_torch.find_plan(model, inputs, "batch=2", loss_fn=loss_fn, budget=10, schedule="batch:BatchParallel",
                               cache=False, progress=False)
    assert a.to_json()["params"] == b.to_json()["params"] and a.schedule == b.schedule == "batch:BatchParallel"
    with pytest.raises(PartirError, match="did you mean 'schedule'"):
        partir_torch.find_plan(model, inputs, "batch=2", loss_fn=loss_fn, schedul="batch:BatchParallel")


def test_the_default_backend_is_torch_and_xla_without_torch_xla_says_how_to_get_it(monkeypatch):
    import importlib.util

    from partir_torch.api import choose_backend

    assert choose_backend(None) == "torch"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_xla" else object())
    with pytest.raises(PartirError, match=r"backend='xla' needs torch_xla, .*\./dev setup xla.*torch-xla==2\.9\.0"):
        choose_backend("xla")
    with pytest.raises(PartirError, match=r"backend must be one of 'torch', 'xla', got 'tpu'"):
        choose_backend("tpu")
