"""Opaque modules: a submodule whose forward cannot be traced with shapes only, captured as one op.

Some forwards have data-dependent shapes (an MoE block that routes tokens with `one_hot` / `nonzero` /
`torch.where` and loops over the experts hit). Capture traces with shapes only, so it cannot follow them.
With `capture(..., fallback=True)` such a module becomes one custom op `partir_opaque.<Class>_<n>` whose
arguments are the tensors of the call followed by the module's parameters and buffers (so gradients reach
them), and whose backward is a second op `…_backward` (the vector-Jacobian product of a recomputed
forward). Neither has a tile-mapping rule: the plan runs them replicated (the rules' fallback, which warns
with the communication it adds), and the simulator and `Program.run` run the module's own forward for real.

What capture learns by running the module (on the CPU, at the captured shapes, once per input signature,
with the model's weights, or random ones for a meta model, and random inputs): its output shapes and
dtypes — checked to be the same for two different random inputs, else the output shape itself depends on
the data and the parent module is made opaque instead — and its FLOPs forward and backward, counted by
`torch.utils.flop_counter` (kept on the program's op, `Op.flops`; the cost model charges them to the op, per
device, since it is replicated). The module must be functional: a forward that writes its buffers is refused.

Randomness inside the module (dropout) is drawn from a fixed seed per op, in the forward and in the
backward's recomputation alike, so the unsharded run, the simulator and the backward agree.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module

from partir_torch import _compat
from partir_torch.errors import CaptureError

NAMESPACE = "partir_opaque"
TENSOR = object()  # a tensor's slot among a call's (or its output's) pytree leaves; other leaves are kept as is
_COUNTER = itertools.count()
class OutputShapeVaries(CaptureError):
    """An opaque module's output shape depends on its input values: its parent must be opaque instead."""

    def __init__(self, path: str, a: list, b: list) -> None:
        super().__init__(f"module {path!r} returns shapes {a} for one input and {b} for another of the same "
                         "shape: its output shape depends on the data")
        self.path = path


@dataclass
class OpaqueCall:
    """One (module, call structure): its forward op, its backward op, and what the probe run measured."""

    path: str
    module: nn.Module
    forward: Callable[..., Any]  # the module's own forward
    state_names: tuple[str, ...]  # parameters and buffers, the op's last arguments
    in_spec: _compat.pytree.TreeSpec  # of (args, kwargs)
    consts: tuple[Any, ...]  # the call's pytree leaves, `TENSOR` where a tensor goes
    seed: int
    name: str = ""
    out_spec: _compat.pytree.TreeSpec | None = None
    out_consts: tuple[Any, ...] = ()
    shapes: dict[tuple, list[tuple[tuple[int, ...], torch.dtype]]] = field(default_factory=dict)
    real_state: dict[str, torch.Tensor] = field(default_factory=dict)  # the module's own weights (not meta)
    flops: tuple[float, float] = (0.0, 0.0)  # forward, backward (recomputation included), per call
    op: Callable[..., Any] | None = None  # the registered forward and backward ops (`torch.library.custom_op`)
    backward_op: Callable[..., Any] | None = None

    @property
    def target(self) -> str:
        return f"{NAMESPACE}.{self.name}.default"

    # -- running the module for real --------------------------------------------------------------------
    def run(self, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], _compat.pytree.TreeSpec, tuple[Any, ...]]:
        n = len(xs) - len(self.state_names)
        it = iter(xs[:n])
        leaves = [next(it) if c is TENSOR else c for c in self.consts]
        args, kwargs = _compat.pytree.tree_unflatten(leaves, self.in_spec)
        with torch.random.fork_rng(devices=[]), \
                _reparametrize_module(self.module, dict(zip(self.state_names, xs[n:])), tie_weights=True):
            torch.manual_seed(self.seed)
            out = self.forward(*args, **kwargs)
        leaves, spec = _compat.pytree.tree_flatten(out)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        consts = tuple(TENSOR if isinstance(t, torch.Tensor) else t for t in leaves)
        return tensors, spec, consts

    def vjp(self, grads: list[torch.Tensor], xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients of the floating outputs (weighted by `grads`) w.r.t. the floating arguments."""
        full = [x.detach().requires_grad_() if x.is_floating_point() else x for x in xs]
        leaves = [x for x in full if x.is_floating_point()]
        with torch.enable_grad():
            outs = [t for t in self.run(full)[0] if t.is_floating_point()]
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
            if pairs:  # backward(), not autograd.grad(): FlopCounterMode's module hooks reject the latter
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return [torch.zeros_like(x) if x.grad is None else x.grad for x in leaves]

    def probe(self, xs: list[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Output shapes for these argument shapes, from real runs (see the module docstring)."""
        key = tuple((tuple(x.shape), x.dtype) for x in xs)
        if key not in self.shapes:
            try:
                self.shapes[key] = _in_fresh_thread(self._probe, [(tuple(x.shape), x.dtype) for x in xs])
            except CaptureError:
                raise
            except Exception as e:
                raise CaptureError(
                    f"fallback: module {self.path!r} ({type(self.module).__name__}) has data-dependent shapes and was "
                    f"to be captured as one opaque op, but running it for real at the captured shapes (random inputs) "
                    f"failed: {type(e).__name__}: {e}. Make its forward depend on shapes only, or check that it runs "
                    "on CPU tensors") from e
        return self.shapes[key]

    def _probe(self, metas: list[tuple[tuple[int, ...], torch.dtype]]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        from torch.utils.flop_counter import FlopCounterMode

        n = len(metas) - len(self.state_names)
        runs = []
        for seed in (0, 1):
            g = torch.Generator().manual_seed(seed)
            real = [_random(s, d, g) for s, d in metas[:n]]
            real += [self.real_state[k].detach().clone() if k in self.real_state else _random(s, d, g)
                     for k, (s, d) in zip(self.state_names, metas[n:])]
            before = [t.clone() for t in real[n:]]
            with torch.no_grad(), FlopCounterMode(display=False) as fwd:
                outs, spec, consts = self.run(real)
            for k, b, t in zip(self.state_names, before, real[n:]):
                if not _same(b, t):
                    raise CaptureError(
                        f"module {self.path!r} ({type(self.module).__name__}) writes its {k!r} in forward, so it "
                        "cannot be captured as an opaque op (which must be functional); make its forward "
                        "data-independent, or keep that state outside the module")
            runs.append(([(tuple(t.shape), t.dtype) for t in outs], spec, consts, real, outs, fwd))
        (meta, spec, consts, real, outs, fwd), (meta2, *_) = runs
        if [m[0] for m in meta] != [m[0] for m in meta2]:
            raise OutputShapeVaries(self.path, [list(m[0]) for m in meta], [list(m[0]) for m in meta2])
        flo = [t for t in outs if t.is_floating_point()]
        bwd_flops = 0.0
        if flo and any(x.is_floating_point() for x in real):
            with FlopCounterMode(display=False) as bwd:
                self.vjp([torch.ones_like(t) for t in flo], real)
            bwd_flops = float(bwd.get_total_flops())
        self.out_spec, self.out_consts = spec, consts
        self.flops = (float(fwd.get_total_flops()), bwd_flops)
        return meta


def _in_fresh_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` with none of the caller's thread-local dispatch state: the dispatcher runs an op's kernel
    (and capture its fake one) with autograd excluded, under fake and tracing modes; a new thread has none."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def _random(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b) or (a.is_floating_point() and torch.isnan(a).any()
                                                          and torch.equal(a.nan_to_num(), b.nan_to_num())))


def define(call: OpaqueCall) -> OpaqueCall:
    """Register `call`'s forward and backward ops with torch.library (a fresh name per call structure)."""
    call.name = f"{re.sub(r'[^A-Za-z0-9_]', '_', type(call.module).__name__)}_{next(_COUNTER)}"

    def fwd_impl(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.clone() for t in call.run(list(xs))[0]]  # fresh tensors: an op's outputs never alias its inputs

    def fwd_fake(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [xs[0].new_empty(s, dtype=d) for s, d in call.probe(list(xs))]

    def bwd_impl(grads: list[torch.Tensor], xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return _in_fresh_thread(call.vjp, list(grads), list(xs))

    def bwd_fake(grads: list[torch.Tensor], xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.empty_like(x) for x in xs if x.is_floating_point()]

    fwd = torch.library.custom_op(f"{NAMESPACE}::{call.name}", fwd_impl, mutates_args=(),
                                  schema="(Tensor[] xs) -> Tensor[]")
    fwd.register_fake(fwd_fake)
    bwd = torch.library.custom_op(f"{NAMESPACE}::{call.name}_backward", bwd_impl, mutates_args=(),
                                  schema="(Tensor[] grads, Tensor[] xs) -> Tensor[]")
    bwd.register_fake(bwd_fake)

    def setup_context(ctx: Any, inputs: tuple, output: list[torch.Tensor]) -> None:
        ctx.save_for_backward(*inputs[0])
        ctx.out_meta = [(t.shape, t.dtype) for t in output]

    def backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple:
        xs = list(ctx.saved_tensors)
        gs = [g if g is not None else xs[0].new_zeros(s, dtype=d)
              for g, (s, d) in zip(grads, ctx.out_meta) if d.is_floating_point]
        it = iter(bwd(gs, xs))
        return ([next(it) if x.is_floating_point() else None for x in xs],)

    fwd.register_autograd(backward, setup_context=setup_context)
    call.op, call.backward_op = fwd, bwd  # torch.library holds the ops, so the module stays alive with them
    return call


class OpaqueModules:
    """While active, the forward of each listed module is replaced by its opaque op (see module docstring)."""

    def __init__(self, model: nn.Module, paths: list[str], real_state: dict[str, torch.Tensor],
                 calls: dict[tuple, OpaqueCall] | None = None) -> None:
        self.model, self.paths, self.real_state = model, paths, real_state
        # shared by capture's retries (one more module made opaque each): ops defined and probed once
        self.calls: dict[tuple, OpaqueCall] = {} if calls is None else calls
        self.used: set[tuple] = set()

    def __enter__(self) -> OpaqueModules:
        self._saved: list[tuple[nn.Module, Any]] = []
        for path in self.paths:
            mod = self.model.get_submodule(path)
            self._saved.append((mod, mod.__dict__.get("forward")))
            mod.forward = self._wrapper(path, mod, mod.forward)
        return self

    def __exit__(self, *exc: Any) -> None:
        for mod, own in self._saved:
            if own is None:
                del mod.forward
            else:
                mod.forward = own

    def _wrapper(self, path: str, mod: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        names = tuple(n for n, _ in itertools.chain(mod.named_parameters(), mod.named_buffers()))

        def opaque_forward(*args: Any, **kwargs: Any) -> Any:
            leaves, spec = _compat.pytree.tree_flatten((args, kwargs))
            consts = tuple(TENSOR if isinstance(t, torch.Tensor) else t for t in leaves)
            key = (path, spec, repr([c if c is not TENSOR else "<tensor>" for c in consts]))
            call = self.calls.get(key)
            self.used.add(key)
            if call is None:
                prefix = f"{path}." if path else ""
                real = {n: self.real_state[prefix + n] for n in names
                        if prefix + n in self.real_state and self.real_state[prefix + n].device.type != "meta"}
                call = self.calls[key] = define(OpaqueCall(path, mod, forward, names, spec, consts,
                                                           seed=len(self.calls), real_state=real))
            state = dict(itertools.chain(mod.named_parameters(), mod.named_buffers()))
            outs = call.op([t for t in leaves if isinstance(t, torch.Tensor)] + [state[n] for n in names])
            it = iter(outs)
            assert call.out_spec is not None  # set by the fake implementation's probe
            return _compat.pytree.tree_unflatten([next(it) if c is TENSOR else c for c in call.out_consts],
                                                 call.out_spec)

        return opaque_forward

    def flops(self) -> dict[str, float]:
        """FLOPs per call of each opaque op used, forward and backward, by op target (kept on the program's ops)."""
        out = {}
        for k, c in self.calls.items():
            if k in self.used:
                out[c.target] = c.flops[0]
                out[f"{NAMESPACE}.{c.name}_backward.default"] = c.flops[1]
        return out

    def summary(self) -> list[str]:
        """One line per opaque op: module, op, FLOPs per call (forward, backward)."""
        return [f"module {c.path!r} ({type(c.module).__name__}) as op {c.target}: {c.flops[0]:,.0f} FLOPs forward, "
                f"{c.flops[1]:,.0f} backward per call" for k, c in self.calls.items() if k in self.used]

