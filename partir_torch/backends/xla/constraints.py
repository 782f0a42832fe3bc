"""Sharding constraints with their gradients: on a call's operands and results (`CallConstraints`), on
parameter reads (`_ReadAs`), on gradients (`grad_hook`), and a dot's sum reduced in place (`reduce_in_place`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from partir_torch import _compat
from partir_torch.backends.xla import runtime
from partir_torch.backends.xla.runtime import _mark, _spec, _xla, sharding_of
from partir_torch.capture.attribution import Constants, call_name, counted

log = logging.getLogger(__name__)

_MUTATING = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ior__", "__iand__"}


def _mutates(func: Callable, kwargs: dict[str, Any]) -> bool:
    name = getattr(func, "__name__", "")
    return "out" in kwargs or name in _MUTATING or (name.endswith("_") and not name.endswith("__"))


class CallConstraints:
    """The plan's constraints at the torch-function calls inside modules' forwards (`plan.calls`,
    `plan/reads.call_constraints`): calls are numbered per module path as the capture numbered them
    (`capture.attribution.CallTracker`: calls that make tensors, from the model's call on), an operand the
    plan reshards is constrained (with its gradient) before the call, and the call's result after it.
    A result whose shape is not the captured one means the forward took another path than at capture: the
    module's remaining calls are left alone (one warning)."""

    def __init__(self, model: nn.Module, mesh, calls: dict[str, dict[str, dict]], axes: tuple[str, ...]) -> None:
        self.mesh, self.axes = mesh, axes
        self.paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
        self.table = {path: {int(k): c for k, c in cs.items()} for path, cs in calls.items()}
        self.last = {path: max(cs) for path, cs in self.table.items() if cs}  # each module's last constrained call
        self.stack: list[str] = []
        self.counts: dict[str, int] = {}
        self.lost: set[str] = set()  # modules whose calls stopped matching the capture's (warned once)
        self.short: set[str] = set()  # modules that ended a forward before their last constrained call (warned)
        self.constants = Constants()  # (tracked as the capture tracks them: their calls are not numbered)

    def push(self, mod: nn.Module, *_: Any) -> None:
        path = self.paths.get(id(mod))
        if path is not None:
            self.stack.append(path)

    def pop(self, mod: nn.Module, *_: Any) -> None:
        if self.paths.get(id(mod)) is not None and self.stack:
            self.stack.pop()

    def run(self, func: Callable, impl: Callable, args: tuple, kwargs: dict[str, Any]):
        if not self.stack:
            return impl(*args, **kwargs)
        path = self.stack[-1]
        if self.constants.constant(args, kwargs):
            out = impl(*args, **kwargs)
            self.constants.add(out)
            return out
        k = self.counts.get(path, 0)
        c = self.table.get(path, {}).get(k) if path not in self.lost else None
        other = c is not None and c.get("fn") and c["fn"] != call_name(func)  # (or a call that makes no tensor)
        if c is not None and not other and c["ins"] and not _mutates(func, kwargs):
            args, kwargs = self._inputs(c["ins"], args, kwargs)
        out = impl(*args, **kwargs)
        if not counted(func, out) or (other and _moved(args, kwargs, out)):
            return out  # (a move to the device the capture never made is none of its calls)
        self.counts[path] = k + 1
        if other:
            self._stray(path, k, f"is {call_name(func)}() where the capture had {c['fn']}()")
            return out
        if c is None or c["out"] is None or not isinstance(out, torch.Tensor):
            return out
        shape, spec, *rest = c["out"]
        if list(out.shape) != shape:
            self._stray(path, k, f"makes {list(out.shape)} where the capture had {shape}")
            return out
        if out._is_view() or _mutates(func, kwargs) or any(out is a for a in args):
            return out  # aliasing kept: a constrained copy would not see later in-place writes
        if out.device.type != "xla" or out.dim() == 0:
            return out  # a host constant the model makes (`torch.tensor(d ** 0.5)`), or a scalar
        if rest and reduce_in_place(rest[0], spec, self.axes):  # all-reduced in place, then sliced
            reduced, grad = rest[0]["reduced"], rest[0]["grad"]
            out = constrain(out, self.mesh, _spec(reduced, len(reduced)),
                            _spec(grad, len(grad)) if grad is not None else None)
        return constrain(out, self.mesh, _spec(spec, len(spec)), _spec(spec, len(spec)))

    def finish(self) -> None:
        """At the end of the model's forward: a module that made fewer calls than the plan constrains (the
        capture numbered calls this forward did not make) had its later constraints silently unmet; say so,
        once per module (a module skipped on this step, as LayerDrop skips layers, is one of them)."""
        for path, last in self.last.items():
            n = self.counts.get(path, 0)
            if n <= last and path not in self.lost and path not in self.short:
                self.short.add(path)
                log.warning("module %r made %d calls in this forward where the plan constrains its call %d: its "
                            "constraints from call %d on were not applied (the forward takes another path than at "
                            "capture, or skipped the module)", path, n, last, n)

    def _stray(self, path: str, k: int, what: str) -> None:
        self.lost.add(path)
        log.warning("module %r: call %d of its forward %s; its remaining calls are not constrained (the forward "
                    "takes another path than at capture)", path, k, what)

    def _inputs(self, ins: list, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        picks = [(shape, nth, _spec(spec, len(spec)), _spec(grad, len(grad)) if grad is not None else None)
                 for shape, nth, spec, grad in ins]
        return constrain_by_shape((args, kwargs), self.mesh, picks)


_DOTS = {"mm", "addmm", "bmm", "baddbmm"}  # rules of the ops GSPMD's dot partitioner takes


def _moved(args: tuple, kwargs: dict[str, Any], out: Any) -> bool:
    """Whether a call moved tensors to another device. The capture runs on one device: a model that moves a
    host tensor it keeps as a plain attribute only when the devices differ (HF CodeGen's sinusoid table,
    `if t.device != x.device: self.t = t.to(x.device)`) makes that call on the engine's first forward and
    never at capture, so where the plan's call of that number is another function, the move is not
    counted (a move the capture also made, a no-op there, is one of its calls: `.to(x.device)` of a host
    constant)."""
    given = {t.device for t in _compat.pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    made = [t for t in _compat.pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return bool(given) and bool(made) and all(t.device not in given for t in made)


def reduce_in_place(summed: dict, spec: list, axes: tuple[str, ...]) -> bool:
    """Whether a call's result the plan makes as a sum and reduce-scatters into `spec` (`summed`:
    `reads.PendingSum` as JSON) is constrained reduced in place first: a dot's sum with a mesh axis idle on
    it (neither tiling nor summing it). Left to itself, GSPMD's dot partitioner splits such a dot over the
    idle axis (a QKV projection's rows), all-reduces a part and moves it to its devices with a
    collective-permute, and gathers its gradient the same way; reduced in place, it all-reduces and slices,
    an XLA reduce-scatter in the CPU's form. Other sums (a convolution's, a dot's with no idle axis) it
    reduce-scatters as the plan does, and reduced in place first it partitions them otherwise (measured:
    docs/apply.md), so they are left as they are."""
    used = {a for e in spec if e is not None for a in ([e] if isinstance(e, str) else e)}
    return summed["by"] in _DOTS and bool(set(axes) - used - set(summed["over"]))


def constrain_by_shape(tree: Any, mesh, picks: list[tuple], *, unique: bool = False) -> Any:
    """`tree` with, for each (shape, nth, spec, grad spec) of `picks`, its `nth` tensor leaf of that shape
    constrained (`unique`: only when it is the one tensor of that shape). A plan names a call's operands and a
    model's output so; a leaf off the XLA device (a host constant) is left alone."""
    leaves, spec_tree = _compat.pytree.tree_flatten(tree)
    for shape, nth, spec, grad in picks:
        hits = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and list(t.shape) == shape]
        if nth < len(hits) and not (unique and len(hits) > 1) and leaves[hits[nth]].device.type == "xla":
            leaves[hits[nth]] = constrain(leaves[hits[nth]], mesh, spec, grad)
    return _compat.pytree.tree_unflatten(leaves, spec_tree)


class _Constrain(torch.autograd.Function):
    """A sharding constraint on a new tensor (the caller's keeps its own), and on its gradient when `grad_spec`
    is given: `mark_sharding_with_gradients` with the gradient left to GSPMD when the plan does not say."""

    @staticmethod
    def forward(ctx, t, mesh, spec, grad_spec):
        _, xs, _ = _xla()
        ctx.mesh, ctx.grad_spec = mesh, grad_spec
        out = t.clone()
        if sharding_of(t):  # a sharded parameter's data keeps its sharding: annotate the use instead
            xs.annotate_custom_sharding(out, mesh, spec)
        else:
            _mark(out, mesh, spec)
        return out

    @staticmethod
    def backward(ctx, g):
        if ctx.grad_spec is not None:
            g = g.clone()
            _mark(g, ctx.mesh, ctx.grad_spec)
        return g, None, None, None


def constrain(t: torch.Tensor, mesh, spec: tuple, grad_spec: tuple | None) -> torch.Tensor:
    """`t` constrained to `spec` (and its gradient to `grad_spec`). A boolean tensor is left to GSPMD: torch_xla
    2.9 lowers `cumsum` of a bool as a `pred` reduce-window, and with a sharding annotation before it XLA's
    HLO verifier rejects the program after sharding propagation ("Expected instruction to have shape equal to
    u8[4,8], actual shape is pred[4,8]": HF Gemma-2's packed-sequence mask). A mask's resharding is cheap."""
    if t.dtype == torch.bool or t.dim() > runtime.MAX_RANK:  # (and a tensor torch_xla cannot annotate: `_mark`)
        return t
    return _Constrain.apply(t, mesh, spec, grad_spec)


class _ReadAs:
    """Hands the modules holding a parameter (`places`: (module, attribute), several when it is tied) the
    parameter constrained to the sharding the plan reads it in, for the duration of the forward of the
    module around them: the engine then reshards it once, and the backward reuses the resharded tensor
    autograd saved (the parameter object and `state_dict` are untouched). `grad`: the sharding the read's
    gradient is constrained to (`plan.read_grads`: a tied weight's readers' gradients, summed at the read)."""

    def __init__(self, places: list[tuple[nn.Module, str]], mesh, spec: tuple, grad: tuple | None = None) -> None:
        self.places, self.mesh, self.spec, self.grad = places, mesh, spec, grad
        self.saved: list[torch.Tensor] = []

    def enter(self, mod: nn.Module, args: Any) -> None:
        holder, attr = self.places[0]
        p = holder._parameters[attr]
        self.saved.append(p)
        with _compat.DisableTorchFunction():  # not one of the model's calls (`CallConstraints` counts those)
            read = constrain(p, self.mesh, self.spec, self.grad)
        for m, a in self.places:
            m._parameters[a] = read

    def leave(self, mod: nn.Module, args: Any, out: Any) -> None:
        if self.saved:
            p = self.saved.pop()
            for m, a in self.places:
                m._parameters[a] = p




def grad_hook(mesh, spec: tuple, *, first: tuple | None = None) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """A parameter's gradient hook: the gradient constrained to `spec`, as the plan keeps it; with `first`,
    constrained to `first` before, as the plan makes it (`plan.grads_made`; replicated for a grouped
    convolution's weight, `_grouped_conv_weights`)."""
    if first is None or first == spec:
        def mark(g: torch.Tensor) -> None:
            _mark(g, mesh, spec)

        return mark

    def made_first(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        _mark(g, mesh, first)
        g = g.clone()
        _mark(g, mesh, spec)
        return g

    return made_first
