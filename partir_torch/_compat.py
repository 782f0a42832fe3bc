"""Every private PyTorch name partir_torch uses, resolved here and nowhere else.

partir_torch installs beside the user's torch (2.9 through the newest release), and private names move
between releases: `torch._prims_common.is_non_overlapping_and_dense` became `..._or_false`, the functional
collectives `all_gather_tensor` / `reduce_scatter_tensor` became `all_gather_single` / `reduce_scatter_single`.
Each name below lists where it lives, newest first, and the feature that needs it. A name resolves when it is
first read (`_compat.FakeTensorMode`, `_compat.get("MemTracker")`), never at `import partir_torch`: a
release without it fails at the call that needs it, with the name, the release and the feature
(`PrivateNameMissing`). `tests/test_compat.py` resolves every name on the installed torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from partir_torch.errors import PartirError

MIN_TORCH = (2, 9)


@dataclass(frozen=True)
class Name:
    """A private name: the places it lives (module, attribute), newest release first, and who needs it."""

    places: tuple[tuple[str, str], ...]
    feature: str


NAMES: dict[str, Name] = {
    "is_non_overlapping_and_dense": Name(
        (("torch._prims_common", "is_non_overlapping_and_dense_or_false"),
         ("torch._prims_common", "is_non_overlapping_and_dense")),
        "capture (random draws in memory order)"),
    "pytree": Name((("torch.utils._pytree", ""),), "capture and the engines (torch's pytree: no public twin)"),
    "FakeTensorMode": Name((("torch._subclasses.fake_tensor", "FakeTensorMode"),), "capture (shapes-only tracing)"),
    "DataDependentOutputException": Name(
        (("torch._subclasses.fake_tensor", "DataDependentOutputException"),), "capture's error messages"),
    "DynamicOutputShapeException": Name(
        (("torch._subclasses.fake_tensor", "DynamicOutputShapeException"),), "capture's error messages"),
    "UnsupportedOperatorException": Name(
        (("torch._subclasses.fake_tensor", "UnsupportedOperatorException"),), "capture's error messages"),
    "FunctionalTensor": Name(
        (("torch._subclasses.functional_tensor", "FunctionalTensor"),), "capture of custom autograd functions"),
    "FunctionalTensorMode": Name(
        (("torch._subclasses.functional_tensor", "FunctionalTensorMode"),), "capture of custom autograd functions"),
    "ExcludeDispatchKeyGuard": Name((("torch._C", "_ExcludeDispatchKeyGuard"),),
                                    "capture of custom autograd functions"),
    "sync": Name((("torch", "_sync"),), "capture of custom autograd functions"),
    "from_functional_tensor": Name((("torch", "_from_functional_tensor"),), "capture of custom autograd functions"),
    "functionalize_has_data_mutation": Name((("torch", "_functionalize_has_data_mutation"),),
                                            "capture of custom autograd functions"),
    "get_decompositions": Name((("torch._decomp", "get_decompositions"),), "rules' decompositions"),
    "OpOverload": Name((("torch._ops", "OpOverload"),), "capture's call attribution"),
    "OpOverloadPacket": Name((("torch._ops", "OpOverloadPacket"),), "capture's call attribution"),
    "TorchDispatchMode": Name((("torch.utils._python_dispatch", "TorchDispatchMode"),),
                              "the torch backend's collective counter"),
    "MemTracker": Name((("torch.distributed._tools.mem_tracker", "MemTracker"),),
                       "the torch backend's memory measurement (verify)"),
    "StridedShard": Name((("torch.distributed.tensor.placement_types", "_StridedShard"),),
                         "the torch backend's DTensor placements of a tile read in chunks"),
    "inductor_config": Name((("torch._inductor.config", ""),), "the torch backend's compile=True"),
    "disabled_torch_function_impl": Name((("torch._C", "_disabled_torch_function_impl"),),
                                         "the torch backend's stand-in gradients"),
    "DisableTorchFunction": Name((("torch._C", "DisableTorchFunction"),), "the torch_xla backend's constraints"),
    "all_gather": Name((("torch.distributed._functional_collectives", "all_gather_single"),
                        ("torch.distributed._functional_collectives", "all_gather_tensor")),
                       "the torch backend's collectives"),
    "reduce_scatter": Name((("torch.distributed._functional_collectives", "reduce_scatter_single"),
                            ("torch.distributed._functional_collectives", "reduce_scatter_tensor")),
                           "the torch backend's collectives"),
    "all_reduce": Name((("torch.distributed._functional_collectives", "all_reduce"),),
                       "the torch backend's collectives"),
    "all_to_all_single": Name((("torch.distributed._functional_collectives", "all_to_all_single"),),
                              "the torch backend's collectives"),
    "c10d_functional": Name((("torch.ops", "_c10d_functional"),), "the torch backend's collective ops"),
}

_resolved: dict[str, Any] = {}


class PrivateNameMissing(PartirError, ImportError):
    """The installed torch lacks a private name a feature needs."""


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch() -> None:
    """One line naming the minimum when torch is older than partir_torch supports."""
    if torch_version() < MIN_TORCH:
        raise PartirError(f"partir_torch needs torch >= {'.'.join(map(str, MIN_TORCH))}, "
                          f"but torch {torch.__version__} is installed: pip install 'torch>=2.9'")


def get(name: str) -> Any:
    """The private object `name` (a key of `NAMES`) on the installed torch, from the first place that has it."""
    if name in _resolved:
        return _resolved[name]
    entry = NAMES[name]
    for module, attr in entry.places:
        try:
            obj = importlib.import_module(module)
            obj = getattr(obj, attr) if attr else obj
        except (ImportError, AttributeError):
            continue
        _resolved[name] = obj
        return obj
    tried = ", ".join(f"{m}.{a}" for m, a in entry.places)
    raise PrivateNameMissing(
        f"{entry.feature} needs a private PyTorch name that torch {torch.__version__} does not have: {tried}. "
        f"partir_torch is tested on torch 2.9 through 2.14 (docs/status.md): install one of those, or report "
        f"the release.")


def __getattr__(name: str) -> Any:
    """`_compat.FakeTensorMode`: the name resolved when read (PEP 562), so a missing one fails where it is used."""
    if name in NAMES:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


check_torch()  # (every path that runs torch imports this module)
