"""Capture a whole training step as one functional aten program, on fake tensors.

How: the step `params, buffers, optimizer states, inputs -> loss, gradients, updated params and states` is
written as a pure function (forward and loss through `_reparametrize_module`, backward through
`torch.func.grad_and_value`, the update through `capture.optim`), functionalized, and traced with `make_fx`
in a `FakeTensorMode`. No weight is ever allocated: a 7B model built on the meta device captures in seconds.

The parts: module attribution (`attribution`), the FX graph as a `Program` (`convert`), the checks fake
tensors skip (`checks`), errors explained (`explain`), opaque modules (`opaque`), folding (`fold`), and
what the traced code leaves in the model, taken back (`isolation`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module

from partir_torch import _compat
from partir_torch.capture.attribution import CallTracker, ForwardArgs, ModuleTracker, tag_backward
from partir_torch.capture.checks import check_dtypes, check_functional
from partir_torch.capture.convert import to_program
from partir_torch.capture.decomp import FUNCTIONAL_DECOMPS
from partir_torch.capture.draws import ScalarDraws, in_memory_order
from partir_torch.capture.explain import CompiledPathError, data_dependent, explain
from partir_torch.capture.fold import KEEP, folded
from partir_torch.capture.groups import parameter_groups
from partir_torch.capture.isolation import ModelState
from partir_torch.capture.loop import accumulated, cast_inputs, cast_params, clipped, stacked_shape, with_aux
from partir_torch.capture.opaque import TENSOR, OpaqueModules, OutputShapeVaries
from partir_torch.capture.optim import OptimizerSpec, optimizer_spec
from partir_torch.capture.remat import blocks as remat_blocks
from partir_torch.capture.remat import rematerialize
from partir_torch.capture.rewrites import Rewrites
from partir_torch.errors import CaptureError
from partir_torch.ir.program import Group, Loop, Program, Role

log = logging.getLogger(__name__)


def capture(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | str | None = "adamw",
    *,
    mode: str | None = None,
    fold: bool = False,
    assume_compiling: bool = False,
    fallback: bool = False,
    sources: bool = True,
    loop: Loop | None = None,
    _strict: bool = True,
    _compiled_path: bool = True,
) -> Program:
    """Capture `loss_fn(model, *example_inputs)`, its backward and the optimizer update as a `Program`.

    `mode` is "train" (the default; needs `loss_fn`) or "inference" (the forward pass `model(*inputs)`
    only, never implied by a missing `loss_fn`). The model and optimizer are only read: on success and on failure
    they are left as they were.
    `fold=True` captures two of every N identical container elements and records N in `program.fold`
    (see `capture/fold.py`): what the search uses on deep models. A container whose cut forward cannot be
    captured (e.g. the forward indexes a block by number) is left whole, with a warning, and the others are
    still folded (`_capture_folded`); with none left, the full model is captured.
    `assume_compiling=True` makes `torch.compiler.is_compiling()` true while tracing, so libraries that skip
    data-dependent checks under torch.compile take that path (HF transformers' SDPA attention-mask check
    `torch.all(mask == 1)`); without it, a capture that stops at such a check takes that path by itself, with
    one warning (`program.compiling`: backends run the forward so too).
    `fallback=True` (opt-in, CLI --fallback) captures a submodule whose forward has data-dependent shapes (MoE
    routing) as one opaque op, run replicated, with one warning naming it and its measured FLOPs
    (`capture/opaque.py`); without it, that is an error which suggests it.
    `sources=False` records no stack traces, so ops carry no user source line (`Op.source`): tracing is
    faster by torch's one-time set-up of stack filtering (half a second); the plan command captures so and
    captures again with sources when an error should name a line.
    `loop` (`ir.Loop`): microbatches accumulated and gradients clipped inside the step (`capture/loop.py`); with
    `accumulate=k` the program's inputs are the example inputs stacked `[k, b, ...]`.
    """
    if assume_compiling:
        with _compiling():
            program = capture(model, example_inputs, loss_fn, optimizer, mode=mode, fold=fold, fallback=fallback,
                              sources=sources, loop=loop, _strict=_strict)
        program.compiling = True  # (a backend runs the forward so too: the same path as captured)
        return program
    if _compiled_path and not torch.compiler.is_compiling():
        try:
            return capture(model, example_inputs, loss_fn, optimizer, mode=mode, fold=fold, fallback=fallback,
                           sources=sources, loop=loop, _strict=_strict, _compiled_path=False)
        except CompiledPathError as first:  # libraries skip such checks when compiled (HF's padding, SDPA mask)
            try:
                program = capture(model, example_inputs, loss_fn, optimizer, mode=mode, fold=fold, fallback=fallback,
                                  sources=sources, assume_compiling=True, loop=loop,
                                  _strict=_strict)
            except CaptureError:
                raise first from None
            warnings.warn("capture took the library's compiled path (as with assume_compiling=True: "
                          "torch.compiler.is_compiling() true), which skips a check on tensor values: "
                          f"{str(first).split(': capture traces')[0]}", stacklevel=2)
            return program
    if fold:
        program = _capture_folded(model, example_inputs, loss_fn, optimizer, mode, fallback, sources, loop)
        if program is not None:
            return program
    t0 = time.perf_counter()
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if not isinstance(model, nn.Module):
        raise CaptureError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise CaptureError(
                f"example input {i} is a {type(x).__name__}, not a tensor; pass tensors only and close over "
                "constants in loss_fn"
            )
    if mode is None and loss_fn is None:
        raise CaptureError(
            "no loss_fn: a training step needs loss_fn(model, *inputs) -> scalar loss; to capture the forward pass "
            "only, ask for it with mode='inference' (CLI --inference)"
        )
    mode = mode or "train"
    loop = loop or Loop()
    if mode == "inference" and dataclasses.replace(loop, param_dtype=None, reduce_dtype=None) != Loop():
        raise CaptureError(f"a forward pass has no gradients to accumulate or clip ({loop}); capture mode='train'")
    if mode not in ("train", "inference"):
        raise CaptureError(f"mode must be 'train' or 'inference', got {mode!r}")
    if mode == "train" and loss_fn is None:
        raise CaptureError("train mode needs loss_fn(model, *inputs) -> scalar loss; or pass mode='inference'")

    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    trainable = [n for n, p in params.items() if p.requires_grad] if mode == "train" else []
    spec = optimizer_spec(optimizer, params, strict=_strict) if mode == "train" else None
    updated = [n for n in trainable if spec is not None and n in spec.hparams]
    shapes = {n: spec.state_shapes(n, tuple(params[n].shape)) for n in updated} if spec else {}
    states = {n: tuple(shapes[n]) for n in updated}
    shared = spec.shared_states if spec and updated else ()
    hypers = spec.hypers(updated) if spec else {}

    # Flat argument list: params, buffers, shared optimizer states, hyperparameters, per-parameter states,
    # inputs (this order is Program.run's too).
    flat_meta: list[tuple[tuple[int, ...], torch.dtype]] = [(tuple(p.shape), p.dtype) for p in params.values()]
    flat_meta += [(tuple(b.shape), b.dtype) for b in buffers.values()]
    flat_meta += [((), torch.float32) for _ in shared]
    # a float64 step (the simulator's oracle) gets its lr in float64: torch.optim's Python float, exactly
    lr_dtype = torch.float64 if any(params[n].dtype == torch.float64 for n in updated) else torch.float32
    flat_meta += [((), lr_dtype) for _ in hypers]
    for n in updated:
        p = params[n]
        flat_meta += [(shapes[n][s], p.dtype) for s in states[n]]
    flat_meta += [(stacked_shape(tuple(x.shape), loop, i), x.dtype) for i, x in enumerate(inputs)]
    # tensor constants in the model become graph constants
    fake_mode = _compat.FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        fakes = [torch.empty(shape, dtype=dtype) for shape, dtype in flat_meta]

    names = list(params)
    bnames = list(buffers)
    n_p, n_b = len(names), len(bnames)
    n_s = len(shared) + len(hypers) + sum(len(s) for s in states.values())
    tracker = ModuleTracker(model)
    input_args: list[int | str | None] = [None] * len(inputs)  # where each input enters model.forward
    out_tree: list = []  # inference: the forward's output structure, its tensors marked (an engine rebuilds it)
    aux_names: list[str] = []  # the values the loss function returns beside the loss (`with_aux`)

    def step(*flat: torch.Tensor) -> list[torch.Tensor]:
        p_vals = dict(zip(names, flat[:n_p]))
        b_vals = dict(zip(bnames, flat[n_p : n_p + n_b]))
        s_iter = iter(flat[n_p + n_b : n_p + n_b + n_s])
        shared_vals = {s: next(s_iter) for s in shared}
        hyper_vals = {h: next(s_iter) for h in hypers}
        s_vals = {n: {s: next(s_iter) for s in states[n]} for n in updated}
        xs = flat[n_p + n_b + n_s :]
        if mode == "inference":
            with _reparametrize_module(model, {**cast_params(p_vals, names, loop), **b_vals}, tie_weights=True), \
                    ForwardArgs(model, xs, input_args), cast_inputs(model, loop):
                out = model(*xs)
            flat, tree = _compat.pytree.tree_flatten(out)
            out_tree[:] = [(tree, tuple(TENSOR if isinstance(t, torch.Tensor) else t for t in flat))]
            leaves = [t for t in flat if isinstance(t, torch.Tensor)]
            if not leaves:
                raise CaptureError("the model returned no tensor")
            return leaves

        # Buffers go in as an argument of the differentiated function: torch.func lets it mutate those
        # (BatchNorm's running statistics); functionalization then turns each mutation into an output.
        def loss_of(train_vals: list[torch.Tensor], buf_vals: dict[str, torch.Tensor], mb):
            values = {**cast_params({**p_vals, **dict(zip(trainable, train_vals))}, names, loop), **buf_vals}
            with _reparametrize_module(model, values, tie_weights=True), \
                    ForwardArgs(model, mb, input_args), cast_inputs(model, loop):
                loss, aux = with_aux(loss_fn(model, *mb))
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise CaptureError(f"loss_fn must return a scalar tensor, got {shape}; reduce it with .mean() or "
                                   ".sum()")
            tag_backward(loss)
            aux_names[:] = list(aux)
            return loss.reshape(()), aux

        def one(mb) -> tuple[list[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
            if by_autograd:  # torch.func cannot differentiate a custom op or an old-style autograd.Function
                leaves = [p_vals[n].detach().requires_grad_() for n in trainable]
                with torch.enable_grad():
                    loss, aux = loss_of(leaves, b_vals, mb)
                    got = torch.autograd.grad(loss, leaves, allow_unused=True) if leaves else ()
                grads_l = [g if g is not None else torch.zeros_like(x) for g, x in zip(got, leaves)]
                return grads_l, loss.detach(), {k: a.detach() for k, a in aux.items()}
            grads_l, (loss, aux) = torch.func.grad_and_value(loss_of, has_aux=True)(
                [p_vals[n] for n in trainable], b_vals, mb)
            return list(grads_l), loss, aux

        grads_l, loss, aux = accumulated(one, xs, loop)
        grads = dict(zip(trainable, clipped(grads_l, loop)))
        new_shared = spec.advance(shared_vals) if updated else {}
        new_params, new_states, cache = [], [new_shared[s] for s in shared], {}
        for n in updated:
            new_p, new_s = spec.update(n, p_vals[n], grads[n], s_vals[n], new_shared, cache, hyper_vals)
            new_params.append(new_p)
            new_states += [new_s[s] for s in states[n]]
        return [loss, *(aux[k] for k in aux_names), *(grads[n] for n in trainable), *new_params, *new_states]

    mkldnn = torch.backends.mkldnn.enabled
    # a library may re-tie or re-assign parameters inside forward (HF T5's shared embedding): every
    # parameter and buffer object is put back afterwards, so the model is left exactly as it was
    saved = [(mod, kind, n, obj) for mod in model.modules() for kind in ("_parameters", "_buffers")
             for n, obj in getattr(mod, kind).items()]
    opaque: list[str] = []  # modules captured as one op each (fallback=True, `capture/opaque.py`)
    old_function = False  # an autograd.Function without setup_context (BLOOM's GeLU): torch.func rejects it
    own_state = {**params, **buffers}
    opaque_calls: dict = {}
    while True:
        try:
            # mkldnn off: CPU dispatch would pick `mkldnn_rnn_layer` for nn.LSTM/GRU; the portable composite
            # (linear + pointwise per time step) is what other devices run and what the rules cover
            torch.backends.mkldnn.enabled = False
            by_autograd = bool(opaque) or old_function  # (read by `step`, as aot_autograd differentiates)
            draws = ScalarDraws()  # (a draw is a constant: `Constants` numbers none of its calls)
            with ModelState(model), fx_traceback.preserve_node_meta(), tracker, draws, Rewrites(), \
                    CallTracker(tracker), \
                    OpaqueModules(model, opaque, own_state, opaque_calls) as opaque_mods:
                traced = (_functionalize_autograd(step) if by_autograd else
                          torch.func.functionalize(step, remove="mutations"))
                gm = make_fx(traced, decomposition_table=FUNCTIONAL_DECOMPS, tracing_mode="fake",
                             record_stack_traces=sources)(*fakes)
            break
        except Exception as e:  # translate torch's errors into ones that name what to change
            if not old_function and mode == "train" and _old_style_function(e):
                old_function = True  # differentiated by autograd instead (its backward traced as it runs)
                tracker.failed_in, tracker.failed_stack = None, []
                continue
            path = _opaque_candidate(e, tracker, opaque) if fallback else None
            if path is None:
                if isinstance(e, CaptureError):
                    raise
                raise explain(e, tracker, inputs) from e
            opaque = [p for p in opaque if not p.startswith(f"{path}.") and p != path] + [path]
            tracker.failed_in, tracker.failed_stack = None, []
        finally:
            torch.backends.mkldnn.enabled = mkldnn
            for mod, kind, n, obj in saved:
                getattr(mod, kind)[n] = obj
    check_functional(gm)
    in_memory_order(gm)
    if loop.remat is not None and mode == "train":
        rematerialize(gm, remat_blocks(model), loop.remat)
    for where, p in dict(draws.skipping).items():
        warnings.warn(f"capture: the one-element torch.rand at {where} is compared with {p:g} (a LayerDrop-style "
                      "skip): the plan is made for the step that keeps every layer (the draw taken as 1.0); a step "
                      "that skips a layer runs a program the plan did not cost, compiled on its own. Set the drop "
                      "probability to 0 to train the planned step on every step", stacklevel=2)
    for line in opaque_mods.summary():
        warnings.warn(f"capture (fallback): data-dependent shapes in {line}; it runs replicated on every device "
                      "(no sharding inside it, its FLOPs charged to each device, its inputs gathered first)",
                      stacklevel=2)

    out_roles: list[tuple[Role, str, int | None]] = []  # (role, name, index of the updated flat input)
    if mode == "train":
        out_roles.append((Role.OUTPUT, "loss", None))
        out_roles += [(Role.OUTPUT, f"aux[{k}]", None) for k in aux_names]
        out_roles += [(Role.GRADIENT, f"grad[{n}]", None) for n in trainable]
        out_roles += [(Role.OUTPUT, f"updated[{n}]", names.index(n)) for n in updated]
        k = n_p + n_b
        for s in shared:
            out_roles.append((Role.OUTPUT, f"updated.opt.{s}", k))
            k += 1
        k += len(hypers)
        for n in updated:
            for s in states[n]:
                out_roles.append((Role.OUTPUT, f"updated.opt.{s}[{n}]", k))
                k += 1
    in_roles = [(Role.PARAMETER, n) for n in names] + [(Role.BUFFER, n) for n in bnames]
    in_roles += [(Role.OPT_STATE, f"opt.{s}") for s in [*shared, *hypers]]
    in_roles += [(Role.OPT_STATE, f"opt.{s}[{n}]") for n in updated for s in states[n]]
    in_roles += [(Role.INPUT, f"inputs[{i}]") for i in range(len(inputs))]
    program = to_program(gm, in_roles, out_roles, mode, opaque_mods.flops())
    check_dtypes(program)
    program.params = {n: i for i, n in enumerate(names)}
    program.buffers = {n: n_p + i for i, n in enumerate(bnames)}
    k = n_p + n_b
    program.shared_states = {s: k + i for i, s in enumerate(shared)}
    k += len(shared)
    program.hypers = {h: k + i for i, h in enumerate(hypers)}
    program.hyper_values = dict(hypers)
    k += len(hypers)
    for n in updated:
        program.opt_states[n] = dict(program.shared_states)
        for s in states[n]:
            program.opt_states[n][s] = k
            k += 1
    program.inputs = list(range(k, k + len(inputs)))
    program.input_args = input_args
    program.loop = loop
    program.out_tree = out_tree[0] if out_tree else None
    if mode == "train":
        program.loss = program.outputs[0]
        program.aux = {k: program.outputs[1 + i] for i, k in enumerate(aux_names)}
        program.grads = {n: program.outputs[1 + len(aux_names) + i] for i, n in enumerate(trainable)}
    program.optimizer = spec.kind if spec else None
    program.groups = _groups(model, program, spec)
    program.capture_time_s = time.perf_counter() - t0
    return program


def _old_style_function(e: BaseException) -> bool:
    """Whether `e` is torch.func's refusal of an `autograd.Function` that has no `setup_context`: autograd
    itself differentiates those (as eager training does), so capture takes that path instead."""
    while e is not None:
        if isinstance(e, RuntimeError) and ("must override the setup_context staticmethod" in str(e)
                                            or "Functionalize rule for custom_function_call" in str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def _opaque_candidate(e: Exception, tracker: ModuleTracker, opaque: list[str]) -> str | None:
    """The module to capture as an opaque op after `e`: the innermost module running when a data-dependent
    op was met (or the parent of an opaque module whose output shape varies); None if `e` is another
    error, or the model's own forward is the one to blame (making the whole model opaque shards nothing)."""
    stack = [path for path, _, _ in tracker.failed_stack]
    if isinstance(e, OutputShapeVaries) or isinstance(e.__cause__, OutputShapeVaries):
        err = e if isinstance(e, OutputShapeVaries) else e.__cause__
        parents = [p for p in stack if err.path.startswith(f"{p}.") or (p == "" and err.path)]  # type: ignore[union-attr]
        path = parents[-1] if parents else None
    elif data_dependent(e):
        path = stack[-1] if stack else None
    else:
        return None
    return path if path and path not in opaque else None


def _functionalize_autograd(fn: Callable[..., list[torch.Tensor]]) -> Callable[..., list[torch.Tensor]]:
    """`torch.func.functionalize(fn, remove="mutations")` by `FunctionalTensorMode`, which (unlike functorch's
    transform) lets autograd run through custom ops; inputs `fn` wrote are copied back at the end."""
    FunctionalTensor, FunctionalTensorMode = _compat.FunctionalTensor, _compat.FunctionalTensorMode

    def inner(*args: torch.Tensor) -> list[torch.Tensor]:
        keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
        with _compat.ExcludeDispatchKeyGuard(keys), FunctionalTensorMode():
            fargs = [FunctionalTensor.to_functional(a) for a in args]
            outs = fn(*fargs)

            def plain(t: Any) -> Any:
                if not isinstance(t, FunctionalTensor):
                    return t
                _compat.sync(t)
                return _compat.from_functional_tensor(t.elem)

            outs = [plain(o) for o in outs]
            written = [(a, plain(f)) for a, f in zip(args, fargs) if _compat.functionalize_has_data_mutation(f.elem)]
        for a, new in written:
            a.copy_(new)
        return outs

    return inner


@contextlib.contextmanager
def _compiling():
    """`torch.compiler.is_compiling()` returns True inside (see `capture(assume_compiling=True)`)."""
    orig = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True
    try:
        yield
    finally:
        torch.compiler.is_compiling = orig


# -- functional form ---------------------------------------------------------------------------------------
aten = torch.ops.aten


def _capture_folded(model, example_inputs, loss_fn, optimizer, mode, fallback=False, sources=True,
                    loop: Loop | None = None) -> Program | None:
    """The folded capture (`capture/fold.py`), container by container: if the model with every repeated
    container cut to two cannot be captured (its forward indexes a block by number, or pops a stack of skip
    connections once per block), the containers are tried one at a time, the one holding the most
    parameters first, each kept if the model still captures with it and those kept before cut; the others
    stay whole. None when no container folds (the caller captures the full model)."""
    _, repeats = folded(model)
    if not repeats:
        return None
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # a failed folded trace is expected for some models: not an error

    def attempt(only: set[str] | None, new: str | None = None) -> tuple[Program | None, Exception | None]:
        view, rep = folded(model, only=only)
        if new is not None and new not in rep:  # inside an element another fold already leaves out
            return None, None
        try:
            program = capture(view, example_inputs, loss_fn, optimizer, mode=mode, fallback=fallback, sources=sources,
                              loop=loop, _strict=False)
        except CaptureError as e:
            return None, e
        program.fold = rep
        return program, None

    try:
        program, err = attempt(None)
        if program is not None:
            return program
        kept: set[str] = set()
        if len(repeats) > 1:
            def removed(path: str) -> int:  # parameters the fold of this container leaves out
                mod = model.get_submodule(path) if path else model
                return sum(p.numel() for m in list(mod)[KEEP:] for p in m.parameters())

            for c in sorted(repeats, key=lambda c: (-removed(c), c)):
                trial, _ = attempt(kept | {c}, c)
                if trial is not None:
                    kept.add(c)
                    program = trial
        whole = ", ".join(f"{repeats[c]} of {c}" for c in repeats if c not in kept)
        log.warning("could not capture the model with %s cut to two (%s); capturing all %s layers",
                    "every repeated container" if len(repeats) > 1 else "its repeated container", err, whole)
        return program
    finally:
        fake_log.setLevel(level)


def _groups(model: nn.Module, program: Program, spec: OptimizerSpec | None) -> list[Group]:
    shapes = {n: program.values[i].shape for n, i in program.params.items()}
    by_name = {v.name: v.id for v in program.values}
    groups = []
    for key, members in parameter_groups(model, list(program.params), shapes):
        ids: list[int] = []
        for n in members:
            ids.append(program.params[n])
            names = [f"grad[{n}]", f"updated[{n}]"]
            for s, sid in program.opt_states.get(n, {}).items():
                ids.append(sid)
                names.append(f"updated.opt.{s}[{n}]")
            ids += [by_name[x] for x in names if x in by_name]
        groups.append(Group(len(groups), key, shapes[members[0]], tuple(members), tuple(ids)))
    return groups
