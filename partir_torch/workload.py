"""Resolve a MODEL argument (a zoo name or `path/to/file.py:factory`) into (model, inputs, loss_fn).

Every CLI subcommand takes MODEL this way. A factory is called as `factory(**overrides)` and returns
`(model, example_inputs, loss_fn)` with `loss_fn(model, *example_inputs)` the scalar loss.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from partir_torch.errors import PartirError

Workload = tuple[nn.Module, tuple[torch.Tensor, ...], Callable[..., torch.Tensor]]


def parse_overrides(items: Sequence[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or ():
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise PartirError(f"--config expects key=value, got {item!r} (e.g. --config layers=2)")
        out[key.strip()] = val.strip()
    return out


def parse_value(text: str, like: Any = None) -> Any:
    """`"4"` -> 4, `"0.1"` -> 0.1, `"true"` -> True, else the string; typed as `like` (a default) when given."""
    low = text.strip().lower()
    if isinstance(like, str):
        return text
    if isinstance(like, bool) or (like is None and low in ("true", "false")):
        if low not in ("true", "false", "1", "0", "yes", "no"):
            raise PartirError(f"--config value {text!r} must be a boolean (true/false)")
        return low in ("true", "1", "yes")
    for kind in ((int,) if isinstance(like, int) else (float,) if isinstance(like, float) else (int, float)):
        try:
            return kind(text)
        except ValueError:
            if like is not None and not isinstance(like, str):
                raise PartirError(f"--config value {text!r} must be {kind.__name__} (default {like!r})") from None
    return text


def typed_overrides(factory: Callable[..., Any], overrides: dict[str, str]) -> dict[str, Any]:
    """`--config key=value` strings typed like the factory's defaults (int, float, bool), else by their
    literal form, as zoo configs are; unknown keys are an error naming the parameters."""
    import inspect

    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out = {}
    for k, v in overrides.items():
        if params and k not in params and not takes_any:
            raise PartirError(f"--config {k}={v}: the factory takes {', '.join(params) or 'no parameters'}")
        default = params[k].default if k in params and params[k].default is not inspect.Parameter.empty else None
        out[k] = parse_value(v, default)
    return out


def load(spec: str, overrides: dict[str, str] | None = None, *, device: str = "meta") -> Workload:
    """Build the workload named by `spec`; zoo models are built on `device` (meta: no weights allocated)."""
    if ":" in spec and spec.rsplit(":", 1)[0].endswith(".py"):
        path, factory_name = spec.rsplit(":", 1)
        return _from_file(Path(path), factory_name, overrides or {})
    from partir_torch import models

    try:
        return models.build(spec, overrides, device=device)
    except ValueError as e:  # unknown name or config key: the zoo's message lists the valid ones
        raise PartirError(str(e)) from e


def _from_file(path: Path, factory_name: str, overrides: dict[str, str]) -> Workload:
    if not path.is_file():
        raise PartirError(f"no file {str(path)!r} (MODEL is a zoo name or path/to/file.py:factory)")
    mod_name = f"_partir_user_{abs(hash(path.resolve()))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    factory: Any = getattr(module, factory_name, None)
    if not callable(factory):
        found = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        raise PartirError(f"{path} has no callable {factory_name!r}; callables there: {found}")
    result = factory(**typed_overrides(factory, overrides))
    if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], nn.Module)):
        raise PartirError(f"{path}:{factory_name}() must return (model, example_inputs, loss_fn)")
    model, inputs, loss_fn = result
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return model, inputs, loss_fn
