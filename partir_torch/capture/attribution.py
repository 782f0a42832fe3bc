"""Module attribution at capture: which module runs each traced op, and which forward argument each input is.

Forward ops get the path of the innermost module running when they were traced (global forward hooks write it
into the FX node meta); backward ops inherit it from the forward op whose autograd node produced them (the
autograd sequence number, as aot_autograd does).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from partir_torch import _compat


class ForwardArgs:
    """Records, on the model's first call, which forward argument (position, or keyword name) each example
    input is passed as, so a backend can shard the batches that reach `model.forward` as the plan says."""

    def __init__(self, model: nn.Module, xs: Sequence[torch.Tensor], found: list[int | str | None]) -> None:
        self.model, self.xs, self.found, self.done = model, xs, found, False

    def _pre(self, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.done:
            return
        self.done = True
        slots: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
        for i, x in enumerate(self.xs):
            self.found[i] = next((k for k, a in slots if a is x), None)

    def __enter__(self) -> ForwardArgs:
        self.handle = self.model.register_forward_pre_hook(self._pre, with_kwargs=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.remove()


class ModuleTracker:
    """Global forward hooks that stamp FX nodes with the running module's path (and remember it on errors)."""

    def __init__(self, model: nn.Module) -> None:
        self.paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
        self.stack: list[tuple[str, nn.Module, list[Any]]] = []
        self.failed_in: tuple[str, nn.Module, list[Any]] | None = None
        self.failed_stack: list[tuple[str, nn.Module, list[Any]]] = []  # every module running at the failure

    def _pre(self, mod: nn.Module, args: tuple[Any, ...]) -> None:
        path = self.paths.get(id(mod))
        if path is None:
            return
        shapes = [list(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args]
        self.stack.append((path, mod, shapes))
        fx_traceback.current_meta["custom"] = {"module": path}

    def _post(self, mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if self.paths.get(id(mod)) is None or not self.stack:
            return
        self.stack.pop()
        if self.stack:
            fx_traceback.current_meta["custom"] = {"module": self.stack[-1][0]}
        else:
            fx_traceback.current_meta.pop("custom", None)

    def __enter__(self) -> ModuleTracker:
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        if exc[0] is not None and self.stack:
            self.failed_in = self.stack[-1]
            self.failed_stack = list(self.stack)
        self.stack.clear()


def returns_tensor(out: Any) -> bool:
    """Whether a torch-function call made a tensor: calls that return none (`.shape`, `.dim()`, `.item()`)
    are not counted, so a backend's own reads of shapes do not shift the count."""
    return any(isinstance(t, torch.Tensor) for t in _compat.pytree.tree_leaves(out))


def counted(func: Any, out: Any) -> bool:
    """Whether a torch-function call is one of a module's numbered calls: it made a tensor
    (`returns_tensor`) through torch's Python API, not an operator itself (`torch.ops.aten.*`). Tracing runs
    some code's ops through torch functions as operators that eagerly run unseen (a `@torch.jit.script`
    function's, HF DeBERTa-v2's scale; torch's own on the autograd path): counted at capture only, they
    would shift every later call of the module on the engine."""
    return returns_tensor(out) and not isinstance(func, _compat.OpOverload | _compat.OpOverloadPacket)


class Constants:
    """The tensors a model's forward makes from no tensor of its own: factory calls (`torch.arange`,
    `torch.tensor`) and calls on their results only (a relative-position index, a causal mask). Such calls
    are not numbered (`constant`): a model may cache their result and skip them on later forwards (HF
    BEiT's `lru_cache`d index: made on the engine's first step only, while the capture, which empties
    caches it filled, always makes it), and the plan has nothing to move in them (each device computes
    them). Capture and engine track them alike, per forward call of the model and across calls."""

    def __init__(self) -> None:
        self.refs: dict[int, weakref.ref] = {}

    def _known(self, t: torch.Tensor) -> bool:
        r = self.refs.get(id(t))
        return r is not None and r() is t

    def constant(self, args: tuple, kwargs: dict[str, Any] | None) -> bool:
        """Whether a call on these arguments is a constant one (every tensor among them a constant)."""
        return all(self._known(t) for t in _compat.pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))

    def add(self, out: Any) -> None:
        for t in _compat.pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.refs[id(t)] = weakref.ref(t, functools.partial(self._drop, id(t)))

    def _drop(self, key: int, ref: weakref.ref) -> None:
        """A constant is gone: its entry goes too (a mask made every step would otherwise add one per step)."""
        if self.refs.get(key) is ref:
            del self.refs[key]


def call_name(func: Any) -> str:
    """How a torch-function call is named in a plan (`F.linear` -> "linear", `Tensor.__mul__` -> "__mul__"): the
    capture and a backend's mode see the same function objects, so a backend can check it meets the call the
    plan numbered, not only one of the same result shape."""
    return getattr(func, "__name__", None) or type(func).__name__


class CallStamp:
    """The number a call's FX nodes carry (`meta["custom"]["call"]`), the shape of its result (a backend
    meets that tensor; the graph may hold it as a reshaped value) and the function's name (`call_name`),
    settled when the call returns: None for a call that made no tensor (an in-place `__setitem__`), whose
    nodes are no call of their own; node meta is copied shallowly, so every node made during the call shares
    this object."""

    __slots__ = ("fn", "k", "shape")

    def __init__(self, k: int, fn: str) -> None:
        self.k: int | None = k
        self.shape: tuple[int, ...] | None = None  # the call's result, when it is one tensor
        self.fn = fn

    def __repr__(self) -> str:
        return f"call {self.k}"


class CallTracker(TorchFunctionMode):
    """Numbers the torch-function calls that make tensors inside each module's forward (per module path, from
    the model's call on) and stamps the FX nodes each call makes with its number (`meta["custom"]["call"]`),
    so a plan can name an op inside a module's own `forward` (a `torch.cat` of two activations) as the engine
    meets it: a backend counts the same calls in the same order (`backends/xla.CallConstraints`)."""

    def __init__(self, tracker: ModuleTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.counts: dict[str, int] = {}
        self.root: Any = None  # the model call being counted (its tracker entry): a new call counts from zero
        self.constants = Constants()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        stack = self.tracker.stack
        if not stack:
            return func(*args, **(kwargs or {}))
        if stack[0] is not self.root:
            self.root = stack[0]
            self.counts.clear()
        path = stack[-1][0]
        if self.constants.constant(args, kwargs):  # (not numbered: each device makes it, maybe only once)
            out = func(*args, **(kwargs or {}))
            self.constants.add(out)
            return out
        k = self.counts.get(path, 0)
        meta = fx_traceback.current_meta
        before = meta.get("custom")
        stamp = CallStamp(k, call_name(func))
        meta["custom"] = {**(before or {}), "call": stamp}
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            if before is None:
                meta.pop("custom", None)
            else:
                meta["custom"] = before
        if counted(func, out):
            self.counts[path] = k + 1
            if isinstance(out, torch.Tensor):
                stamp.shape = tuple(out.shape)
        else:
            stamp.k = None
        return out


def _enter_grad_fn(seq: int) -> None:
    fx_traceback.set_grad_fn_seq_nr(seq)
    fx_traceback.current_meta["custom"] = {"backward": True}  # (forward ops' sequence numbers can collide)


def _leave_grad_fn() -> None:
    fx_traceback.reset_grad_fn_seq_nr()
    fx_traceback.current_meta.pop("custom", None)


def tag_backward(loss: torch.Tensor) -> None:
    """Make backward ops carry the autograd sequence number of the forward op they differentiate, and say
    that they are backward ops (only those inherit their forward op's call, `capture.convert`)."""
    seen: set[Any] = set()
    todo = [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        seq = node._sequence_nr()
        node.register_prehook(lambda _g, seq=seq: _enter_grad_fn(seq))
        node.register_hook(lambda _gi, _go: _leave_grad_fn())
        todo.extend(fn for fn, _ in node.next_functions)
