"""What a traced forward leaves behind in the user's objects, taken back after the capture.

Tracing runs the model's own Python on fake tensors, so whatever that code stores for later is a fake tensor
(a functional wrapper around a `FakeTensor`): an attribute a forward assigns (a cached mask or rotary
table), or an entry of an `functools.lru_cache` on a method or a library function (HF BEiT caches its
relative-position index per window size). Left there, the model's next real forward reads it: eagerly it
returns a fake loss, on an engine it fails far from the cause. `ModelState` restores every module's
attributes and empties the caches that gained entries while it was open (emptying a cache is always safe:
its next call computes the value again, for real). The tracer's own caches (torch's, sympy's) are left
alone: they hold no state of the model.
"""

from __future__ import annotations

import functools
import gc
from types import TracebackType

import torch.nn as nn

_TRACER = {"torch", "torchgen", "functorch", "sympy", "triton", "partir_torch"}  # caches of the tracing itself


def _lru_caches() -> dict[int, tuple[functools._lru_cache_wrapper, int]]:
    """{id: (cache, entries)} of the live `lru_cache`s that are not the tracer's own."""
    out = {}
    for obj in gc.get_objects():
        if type(obj) is functools._lru_cache_wrapper:  # (type, not isinstance: no proxy's __class__ runs)
            module = getattr(getattr(obj, "__wrapped__", None), "__module__", None) or ""
            if module.split(".")[0] not in _TRACER:
                out[id(obj)] = (obj, obj.cache_info().currsize)
    return out


class ModelState:
    """A context that leaves `model`'s modules' attributes, and the caches its code fills, as they were on
    entry. Parameters and buffers are the capture's to restore (it re-ties them); hooks and submodules are
    kept in the dicts that hold them, which are restored by identity like any attribute."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.saved: list[tuple[nn.Module, dict]] = []
        self.caches: dict[int, tuple[functools._lru_cache_wrapper, int]] = {}

    def __enter__(self) -> ModelState:
        self.saved = [(m, dict(m.__dict__)) for m in {id(m): m for m in self.model.modules()}.values()]
        self.caches = _lru_caches()
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for mod, before in self.saved:
            now = mod.__dict__
            for k in [k for k in now if k not in before]:
                del now[k]
            for k, v in before.items():
                if now.get(k, _MISSING) is not v:
                    now[k] = v
        for key, (cache, _) in _lru_caches().items():
            if cache.cache_info().currsize != self.caches.get(key, (None, 0))[1]:
                cache.cache_clear()


_MISSING = object()
