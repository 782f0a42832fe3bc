"""A copy of a model in which every module and parameter name is replaced by a meaningless one.

Each module's class is swapped for a subclass whose attribute lookup maps the old names to the new ones,
so the model's own forward code still runs; `named_parameters()` and `named_modules()` show only `m3.w0`-
style names. Used to prove that the search reads no names.
"""

from __future__ import annotations

import copy

import torch.nn as nn

_CLASSES: dict[type, type] = {}


def _aliasing(cls: type) -> type:
    if cls not in _CLASSES:
        def __getattr__(self, name):
            alias = self.__dict__.get("_alias", {})
            return super(new, self).__getattr__(alias.get(name, name))

        new = type(f"X{len(_CLASSES)}", (cls,), {"__getattr__": __getattr__})
        _CLASSES[cls] = new
    return _CLASSES[cls]


def renamed(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model)
    for _i, mod in enumerate(model.modules()):
        alias = {}
        if not isinstance(mod, nn.ModuleList | nn.Sequential):  # container indices carry no meaning already
            mods = {}
            for j, (k, v) in enumerate(mod._modules.items()):
                alias[k] = f"m{j}"
                mods[f"m{j}"] = v
            mod._modules = mods
        params = {}
        for j, (k, v) in enumerate(mod._parameters.items()):
            alias[k] = f"w{j}"
            params[f"w{j}"] = v
        mod._parameters = params
        bufs = {}
        for j, (k, v) in enumerate(mod._buffers.items()):
            alias[k] = f"b{j}"
            bufs[f"b{j}"] = v
        mod._buffers = bufs
        mod._non_persistent_buffers_set = {alias.get(b, b) for b in mod._non_persistent_buffers_set}
        mod.__dict__["_alias"] = alias
        mod.__class__ = _aliasing(type(mod))
    return model
