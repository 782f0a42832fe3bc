"""Capture a whole training step as one functional aten program, on fake tensors.

How: the step `params, buffers, optimizer states, inputs -> loss, gradients, updated params and states` is
written as a pure function (forward and loss through `_reparametrize_module`, backward through
`torch.func.grad_and_value`, the update through `capture.optim`), functionalized, and traced with `make_fx`
in a `FakeTensorMode`. No weight is ever allocated: a 7B model built on the meta device captures in seconds.

Module attribution: forward ops get the path of the innermost module running when they were traced (global
forward hooks write it into the FX node meta); backward ops inherit it from the forward op whose autograd
node produced them (the autograd sequence number, as aot_autograd does).
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import os
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module

from partir_torch.capture.decomp import FUNCTIONAL_DECOMPS
from partir_torch.capture.fold import KEEP, folded
from partir_torch.capture.groups import parameter_groups
from partir_torch.capture.opaque import OpaqueModules, OutputShapeVaries
from partir_torch.capture.optim import OptimizerSpec, optimizer_spec
from partir_torch.errors import CaptureError, InputShapeError
from partir_torch.ir.program import Group, Op, Phase, Program, Ref, Role, Value

_TORCH_DIR = os.path.dirname(torch.__file__)
log = logging.getLogger(__name__)
_OUR_DIR = os.path.dirname(os.path.dirname(__file__))


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
    _strict: bool = True,
) -> Program:
    """Capture `loss_fn(model, *example_inputs)`, its backward and the optimizer update as a `Program`.

    `mode` is "train" (the default; needs `loss_fn`) or "inference" (the forward pass `model(*inputs)`
    only, never implied by a missing `loss_fn`). The model and optimizer are only read: on success and on failure
    they are left as they were.
    `fold=True` captures two of every N identical container elements and records N in `program.fold`
    (see `capture/fold.py`): what the search uses on deep models. A container whose cut forward cannot be
    captured (e.g. the forward indexes a block by number) is left whole, with a warning, and the others are
    still folded (`_capture_folded`); with none left, the full model is captured.
    `assume_compiling=True` (opt-in) makes `torch.compiler.is_compiling()` true while tracing, so libraries
    that skip data-dependent checks under torch.compile take that path (HF transformers' SDPA attention-mask
    check `torch.all(mask == 1)`); the capture error for such a check suggests it.
    `fallback=True` (opt-in, CLI --fallback) captures a submodule whose forward has data-dependent shapes (MoE
    routing) as one opaque op, run replicated, with one warning naming it and its measured FLOPs
    (`capture/opaque.py`); without it, that is an error which suggests it.
    """
    if assume_compiling:
        with _compiling():
            return capture(model, example_inputs, loss_fn, optimizer, mode=mode, fold=fold, fallback=fallback,
                           _strict=_strict)
    if fold:
        program = _capture_folded(model, example_inputs, loss_fn, optimizer, mode, fallback)
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
    if mode not in ("train", "inference"):
        raise CaptureError(f"mode must be 'train' or 'inference', got {mode!r}")
    if mode == "train" and loss_fn is None:
        raise CaptureError("train mode needs loss_fn(model, *inputs) -> scalar loss; or pass mode='inference'")

    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    trainable = [n for n, p in params.items() if p.requires_grad] if mode == "train" else []
    spec = optimizer_spec(optimizer, params, strict=_strict) if mode == "train" else None
    updated = [n for n in trainable if spec is not None and n in spec.hparams]
    states = {n: spec.state_names(n) for n in updated} if spec else {}
    shared = spec.shared_states if spec and updated else ()

    # Flat argument list: params, buffers, optimizer states, inputs (this order is Program.run's too).
    flat_meta: list[tuple[tuple[int, ...], torch.dtype]] = [(tuple(p.shape), p.dtype) for p in params.values()]
    flat_meta += [(tuple(b.shape), b.dtype) for b in buffers.values()]
    flat_meta += [((), torch.float32) for _ in shared]
    for n in updated:
        p = params[n]
        flat_meta += [(tuple(p.shape), p.dtype) for _ in states[n]]
    flat_meta += [(tuple(x.shape), x.dtype) for x in inputs]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # tensor constants in the model become graph constants
    with fake_mode:
        fakes = [torch.empty(shape, dtype=dtype) for shape, dtype in flat_meta]

    names = list(params)
    bnames = list(buffers)
    n_p, n_b = len(names), len(bnames)
    n_s = len(shared) + sum(len(s) for s in states.values())
    tracker = _ModuleTracker(model)
    input_args: list[int | str | None] = [None] * len(inputs)  # where each input enters model.forward

    def step(*flat: torch.Tensor) -> list[torch.Tensor]:
        p_vals = dict(zip(names, flat[:n_p]))
        b_vals = dict(zip(bnames, flat[n_p : n_p + n_b]))
        s_iter = iter(flat[n_p + n_b : n_p + n_b + n_s])
        shared_vals = {s: next(s_iter) for s in shared}
        s_vals = {n: {s: next(s_iter) for s in states[n]} for n in updated}
        xs = flat[n_p + n_b + n_s :]
        if mode == "inference":
            with _reparametrize_module(model, {**p_vals, **b_vals}, tie_weights=True), \
                    _forward_args(model, xs, input_args):
                out = model(*xs)
            leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            if not leaves:
                raise CaptureError("the model returned no tensor")
            return leaves

        # Buffers go in as an argument of the differentiated function: torch.func lets it mutate those
        # (BatchNorm's running statistics); functionalization then turns each mutation into an output.
        def loss_of(train_vals: list[torch.Tensor], buf_vals: dict[str, torch.Tensor]) -> torch.Tensor:
            values = {**p_vals, **dict(zip(trainable, train_vals)), **buf_vals}
            with _reparametrize_module(model, values, tie_weights=True), \
                    _forward_args(model, xs, input_args):
                loss = loss_fn(model, *xs)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise CaptureError(f"loss_fn must return a scalar tensor, got {shape}; reduce it with .mean() or "
                                   ".sum()")
            _tag_backward(loss)
            return loss.reshape(())

        if opaque:  # torch.func's transforms cannot differentiate a custom op: autograd, as aot_autograd does
            leaves = [p_vals[n].detach().requires_grad_() for n in trainable]
            with torch.enable_grad():
                loss = loss_of(leaves, b_vals)
                got = torch.autograd.grad(loss, leaves, allow_unused=True) if leaves else ()
            grads_l = [g if g is not None else torch.zeros_like(x) for g, x in zip(got, leaves)]
            loss = loss.detach()
        else:
            grads_l, loss = torch.func.grad_and_value(loss_of)([p_vals[n] for n in trainable], b_vals)
        grads = dict(zip(trainable, grads_l))
        new_shared = spec.advance(shared_vals) if updated else {}
        new_params, new_states, cache = [], [new_shared[s] for s in shared], {}
        for n in updated:
            new_p, new_s = spec.update(n, p_vals[n], grads[n], s_vals[n], new_shared, cache)
            new_params.append(new_p)
            new_states += [new_s[s] for s in states[n]]
        return [loss, *(grads[n] for n in trainable), *new_params, *new_states]

    mkldnn = torch._C._get_mkldnn_enabled()
    # a library may re-tie or re-assign parameters inside forward (HF T5's shared embedding): every
    # parameter and buffer object is put back afterwards, so the model is left exactly as it was
    saved = [(mod, kind, n, obj) for mod in model.modules() for kind in ("_parameters", "_buffers")
             for n, obj in getattr(mod, kind).items()]
    opaque: list[str] = []  # modules captured as one op each (fallback=True, `capture/opaque.py`)
    own_state = {**params, **buffers}
    opaque_calls: dict = {}
    while True:
        try:
            # mkldnn off: CPU dispatch would pick `mkldnn_rnn_layer` for nn.LSTM/GRU; the portable composite
            # (linear + pointwise per time step) is what other devices run and what the rules cover
            torch._C._set_mkldnn_enabled(False)
            with fx_traceback.preserve_node_meta(), tracker, \
                    OpaqueModules(model, opaque, own_state, opaque_calls) as opaque_mods:
                traced = (_functionalize_autograd(step) if opaque else
                          torch.func.functionalize(step, remove="mutations"))
                gm = make_fx(traced, decomposition_table=FUNCTIONAL_DECOMPS, tracing_mode="fake",
                             record_stack_traces=True)(*fakes)
            break
        except Exception as e:  # translate torch's errors into ones that name what to change
            path = _opaque_candidate(e, tracker, opaque) if fallback else None
            if path is None:
                if isinstance(e, CaptureError):
                    raise
                raise _explain(e, tracker, inputs) from e
            opaque = [p for p in opaque if not p.startswith(f"{path}.") and p != path] + [path]
            tracker.failed_in, tracker.failed_stack = None, []
        finally:
            torch._C._set_mkldnn_enabled(mkldnn)
            for mod, kind, n, obj in saved:
                getattr(mod, kind)[n] = obj
    _check_functional(gm)
    for line in opaque_mods.summary():
        warnings.warn(f"capture (fallback): data-dependent shapes in {line}; it runs replicated on every device "
                      "(no sharding inside it, its FLOPs charged to each device, its inputs gathered first)",
                      stacklevel=2)

    out_roles: list[tuple[Role, str, int | None]] = []  # (role, name, index of the updated flat input)
    if mode == "train":
        out_roles.append((Role.OUTPUT, "loss", None))
        out_roles += [(Role.GRADIENT, f"grad[{n}]", None) for n in trainable]
        out_roles += [(Role.OUTPUT, f"updated[{n}]", names.index(n)) for n in updated]
        k = n_p + n_b
        for s in shared:
            out_roles.append((Role.OUTPUT, f"updated.opt.{s}", k))
            k += 1
        for n in updated:
            for s in states[n]:
                out_roles.append((Role.OUTPUT, f"updated.opt.{s}[{n}]", k))
                k += 1
    in_roles = [(Role.PARAMETER, n) for n in names] + [(Role.BUFFER, n) for n in bnames]
    in_roles += [(Role.OPT_STATE, f"opt.{s}") for s in shared]
    in_roles += [(Role.OPT_STATE, f"opt.{s}[{n}]") for n in updated for s in states[n]]
    in_roles += [(Role.INPUT, f"inputs[{i}]") for i in range(len(inputs))]
    program = to_program(gm, in_roles, out_roles, mode)
    _check_dtypes(program)
    program.params = {n: i for i, n in enumerate(names)}
    program.buffers = {n: n_p + i for i, n in enumerate(bnames)}
    k = n_p + n_b
    program.shared_states = {s: k + i for i, s in enumerate(shared)}
    k += len(shared)
    for n in updated:
        program.opt_states[n] = dict(program.shared_states)
        for s in states[n]:
            program.opt_states[n][s] = k
            k += 1
    program.inputs = list(range(k, k + len(inputs)))
    program.input_args = input_args
    if mode == "train":
        program.loss = program.outputs[0]
        program.grads = {n: program.outputs[1 + i] for i, n in enumerate(trainable)}
    program.optimizer = spec.kind if spec else None
    program.groups = _groups(model, program, spec)
    program.capture_time_s = time.perf_counter() - t0
    return program


# ops whose CPU/GPU kernels require one dtype for their tensor operands, which their fake (meta) kernels do not
# check: torch would reject the step at its first real run
_SAME_DTYPE = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
               "aten.addbmm.default", "aten.convolution.default"}
_CHECK_LIMIT = 1 << 26  # bytes: larger operands are not allocated to ask torch for its message


def _check_dtypes(program: Program) -> None:
    """A step real torch rejects (an int64 tensor into nn.Linear, float64 inputs into a float32 model) fails
    here, with torch's own message: the op is run for real, on empty tensors of its shapes and dtypes."""
    for op in program.ops:
        if op.target not in _SAME_DTYPE:
            continue
        refs: list[int] = []
        _real((*op.args, *(a for _, a in op.kwargs)), iter(()), refs)
        vals = [program.values[v] for v in refs]
        if len({v.dtype for v in vals}) <= 1:
            continue
        dtypes = ", ".join(f"{v.name} {str(v.dtype).removeprefix('torch.')}" for v in vals)
        msg = f"{op.target} got operands of different dtypes ({dtypes})"
        if sum(math.prod(v.shape) * v.dtype.itemsize for v in vals) <= _CHECK_LIMIT:
            it = iter(torch.empty(v.shape, dtype=v.dtype) for v in vals)
            try:
                op.overload(*_real(op.args, it), **{k: _real(a, it) for k, a in op.kwargs})
                continue  # torch accepts it
            except RuntimeError as e:
                msg = str(e).strip().splitlines()[0]
        raise CaptureError(
            f"torch rejects this step: {msg} (op {op.target} in module {op.module or '<root>'}"
            f"{f' ({op.source})' if op.source else ''}). Give the model inputs of the dtype its "
            "weights have (e.g. x.float() for integer data, or model.to(x.dtype)), or wrap the forward in "
            "torch.autocast")


def _real(a: Any, it, found: list[int] | None = None) -> Any:
    """`a` with each `Ref` replaced by the next tensor of `it` (or, with `found`, their value ids collected)."""
    if isinstance(a, Ref):
        if found is not None:
            found.append(a.id)
            return a
        return next(it)
    return type(a)(_real(x, it, found) for x in a) if isinstance(a, (list, tuple)) else a


def _opaque_candidate(e: Exception, tracker: _ModuleTracker, opaque: list[str]) -> str | None:
    """The module to capture as an opaque op after `e`: the innermost module running when a data-dependent
    op was met (or the parent of an opaque module whose output shape varies); None if `e` is another
    error, or the model's own forward is the one to blame (making the whole model opaque shards nothing)."""
    stack = [path for path, _, _ in tracker.failed_stack]
    if isinstance(e, OutputShapeVaries) or isinstance(e.__cause__, OutputShapeVaries):
        err = e if isinstance(e, OutputShapeVaries) else e.__cause__
        parents = [p for p in stack if err.path.startswith(f"{p}.") or (p == "" and err.path)]  # type: ignore[union-attr]
        path = parents[-1] if parents else None
    elif _data_dependent(e):
        path = stack[-1] if stack else None
    else:
        return None
    return path if path and path not in opaque else None


def _data_dependent(e: Exception) -> bool:
    """A value read (`.item()`, a branch on a tensor) or an op whose output shape depends on values (`nonzero`)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    text = str(e)
    return (isinstance(e, DataDependentOutputException | DynamicOutputShapeException) or "data-dependent" in text
            or "data dependent" in text)


def _functionalize_autograd(fn: Callable[..., list[torch.Tensor]]) -> Callable[..., list[torch.Tensor]]:
    """`torch.func.functionalize(fn, remove="mutations")` by `FunctionalTensorMode`, which (unlike functorch's
    transform) lets autograd run through custom ops; inputs `fn` wrote are copied back at the end."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    def inner(*args: torch.Tensor) -> list[torch.Tensor]:
        keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
        with torch._C._ExcludeDispatchKeyGuard(keys), FunctionalTensorMode():
            fargs = [FunctionalTensor.to_functional(a) for a in args]
            outs = fn(*fargs)

            def plain(t: Any) -> Any:
                if not isinstance(t, FunctionalTensor):
                    return t
                torch._sync(t)
                return torch._from_functional_tensor(t.elem)

            outs = [plain(o) for o in outs]
            written = [(a, plain(f)) for a, f in zip(args, fargs) if torch._functionalize_has_data_mutation(f.elem)]
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


def _capture_folded(model, example_inputs, loss_fn, optimizer, mode, fallback=False) -> Program | None:
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
            program = capture(view, example_inputs, loss_fn, optimizer, mode=mode, fallback=fallback, _strict=False)
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




def _check_functional(gm: torch.fx.GraphModule) -> None:
    """No op of the captured program may write its arguments (except the final buffer copies)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is aten.copy_.default:
            continue
        schema = getattr(node.target, "_schema", None)
        if schema and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            raise CaptureError(
                f"operator {node.target} writes one of its inputs in place and could not be made functional; "
                "use its out-of-place form in the model, or report the op so a functional rewrite is added"
            )


class _forward_args:
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

    def __enter__(self) -> _forward_args:
        self.handle = self.model.register_forward_pre_hook(self._pre, with_kwargs=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.remove()


# -- module attribution ------------------------------------------------------------------------------------
class _ModuleTracker:
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

    def __enter__(self) -> _ModuleTracker:
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


def _tag_backward(loss: torch.Tensor) -> None:
    """Make backward ops carry the autograd sequence number of the forward op they differentiate."""
    seen: set[Any] = set()
    todo = [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        seq = node._sequence_nr()
        node.register_prehook(lambda _g, seq=seq: fx_traceback.set_grad_fn_seq_nr(seq))
        node.register_hook(lambda _gi, _go: fx_traceback.reset_grad_fn_seq_nr())
        todo.extend(fn for fn, _ in node.next_functions)


# -- FX graph -> Program -----------------------------------------------------------------------------------
def to_program(gm: torch.fx.GraphModule, in_roles, out_roles, mode: str) -> Program:
    values: list[Value] = []
    ops: list[Op] = []
    env: dict[torch.fx.Node, Any] = {}  # node -> value id, or tuple of value ids for multi-output ops
    fwd_module_by_seq: dict[int, str] = {}
    fwd_source_by_seq: dict[int, str] = {}

    def new_value(name: str, val: Any, role: Role, producer: int) -> int:
        if not isinstance(val, torch.Tensor):
            return -1
        vid = len(values)
        values.append(Value(vid, name, tuple(int(s) for s in val.shape), val.dtype, role, producer))
        return vid

    def ref(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = env[a]
            return Ref(v) if isinstance(v, int) else tuple(Ref(x) for x in v)
        if isinstance(a, (list, tuple)):
            return type(a)(ref(x) for x in a)
        return a

    placeholders = gm.graph.find_nodes(op="placeholder")
    for node, (role, name) in zip(placeholders, in_roles):
        env[node] = new_value(name, node.meta["val"], role, -1)
    placeholder_ids = {env[n] for n in placeholders}
    mutated: list[tuple[int, int]] = []  # (input value, its new value): functionalized buffer mutations
    constants: dict[str, int] = {}

    for node in gm.graph.nodes:
        if node.op == "get_attr":  # a tensor constant the model created (e.g. torch.tensor(-inf))
            if node.target not in constants:
                const = getattr(gm, node.target)
                constants[node.target] = new_value(f"constant[{node.target}]", const, Role.BUFFER, -1)
            env[node] = constants[node.target]
            continue
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.copy_.default and env.get(node.args[0]) in placeholder_ids:
            mutated.append((env[node.args[0]], env[node.args[1]]))
            env[node] = env[node.args[1]]
            continue
        if node.target is operator.getitem:
            env[node] = env[node.args[0]][node.args[1]]
            continue
        oid = len(ops)
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            outs = tuple(new_value(f"{node.name}.{i}", v, Role.ACTIVATION, oid) for i, v in enumerate(val))
            env[node] = outs
        else:
            outs = (new_value(node.name, val, Role.ACTIVATION, oid),)
            env[node] = outs[0]
        inputs: list[int] = []
        for a in node.all_input_nodes:
            v = env[a]
            inputs += [v] if isinstance(v, int) else [x for x in v if x >= 0]
        custom = node.meta.get("custom") or {}
        module, source = custom.get("module"), custom.get("source") or _user_line(node.meta.get("stack_trace"))
        seq = node.meta.get("seq_nr")
        if module is not None and seq is not None:
            fwd_module_by_seq.setdefault(seq, module)
        elif module is None and seq is not None:
            module = fwd_module_by_seq.get(seq)
        if source is not None and seq is not None:
            fwd_source_by_seq.setdefault(seq, source)
        elif source is None and seq is not None:
            source = fwd_source_by_seq.get(seq)
        # kept on the node, so a re-trace that decomposes it (rules/decompose.py) attributes its parts too
        node.meta["custom"] = {"module": module, "source": source}
        ops.append(
            Op(
                oid,
                str(node.target),
                tuple(inputs),
                outs,
                tuple(ref(a) for a in node.args),
                tuple((k, ref(a)) for k, a in node.kwargs.items()),
                Phase.FORWARD,
                module,
                node.target,
                source,
            )
        )

    (out_args,) = gm.graph.find_nodes(op="output")[0].args
    outputs = [env[a] for a in out_args]
    for old, new in mutated:
        outputs.append(new)
        out_roles = [*out_roles, (Role.OUTPUT, f"updated[{values[old].name}]", old)]
    updates: dict[int, int] = {}
    renamed: set[int] = set()
    for vid, (role, name, src) in zip(outputs, out_roles):
        if vid < 0 or values[vid].producer < 0 or vid in renamed:
            continue
        renamed.add(vid)
        v = values[vid]
        values[vid] = Value(vid, name, v.shape, v.dtype, role, v.producer)
        if src is not None:
            updates[vid] = src

    if mode == "train":
        assign_phases(ops, values, outputs)
    program = Program(values, ops, {}, {}, [], {}, {}, updates, outputs, None, [], mode, None, graph_module=gm)
    program.constants = constants
    program.n_graph_outputs = len(out_args)
    return program


def _user_line(stack_trace: str | None) -> str | None:
    """`modeling_gpt2.py:123` of the innermost frame outside torch and partir_torch in an FX stack trace."""
    if not stack_trace:
        return None
    found = None
    for line in stack_trace.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[6:].partition('", line ')
            if not path.startswith(_TORCH_DIR) and not path.startswith(_OUR_DIR) and "<" not in path:
                found = f"{os.path.basename(path)}:{rest.split(',')[0]}"
    return found


def assign_phases(ops: list[Op], values: list[Value], outputs: list[int]) -> None:
    """Forward = ancestors of the loss; backward = other ancestors of the gradients; the rest optimizer."""

    def ancestors(roots: list[int]) -> set[int]:
        seen: set[int] = set()
        todo = [values[r].producer for r in roots if r >= 0 and values[r].producer >= 0]
        while todo:
            o = todo.pop()
            if o in seen:
                continue
            seen.add(o)
            todo += [values[i].producer for i in ops[o].inputs if values[i].producer >= 0]
        return seen

    fwd = ancestors(outputs[:1])
    bwd = ancestors([v for v in outputs if v >= 0 and values[v].role is Role.GRADIENT]) - fwd
    for i, op in enumerate(ops):
        phase = Phase.FORWARD if i in fwd else Phase.BACKWARD if i in bwd else Phase.OPTIMIZER
        if phase is not Phase.FORWARD:
            ops[i] = Op(op.id, op.target, op.inputs, op.outputs, op.args, op.kwargs, phase, op.module, op.overload,
                        op.source)


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


# -- errors ------------------------------------------------------------------------------------------------
def _user_frame(e: BaseException) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(e.__traceback__)
    for f in reversed(frames):
        if not f.filename.startswith(_TORCH_DIR) and not f.filename.startswith(_OUR_DIR):
            return f
    return None


def _explain(e: Exception, tracker: _ModuleTracker, inputs: tuple[torch.Tensor, ...]) -> CaptureError:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    frame = _user_frame(e)
    where = f" at {frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)" if frame else ""
    text = str(e)
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

    if _data_dependent(e):
        return CaptureError(
            f"the model has data-dependent Python control flow or reads a tensor's value{where}: capture traces "
            "with shapes only, so a branch or `.item()` on tensor values cannot be followed. Replace it with "
            f"torch.where / masking, or make it depend on shapes only.{_compile_hint(frame)}{_opaque_hint(tracker)} "
            f"(torch said: {msg})"
        )
    if isinstance(e, UnsupportedOperatorException):
        return CaptureError(
            f"operator {e.func} has no shape (meta/fake) implementation, so it cannot be captured{where}. Use a "
            "standard op instead, or register a fake implementation with torch.library.register_fake."
        )
    given = ", ".join(f"inputs[{i}]: {list(x.shape)} {str(x.dtype).removeprefix('torch.')}"
                      for i, x in enumerate(inputs))
    in_module = ""
    if tracker.failed_in is not None:
        path, mod, shapes = tracker.failed_in
        own = ", ".join(f"{n} {list(p.shape)}" for n, p in mod.named_parameters(recurse=False))
        in_module = f" in module {path or '<root>'!r} ({type(mod).__name__}{'; ' + own if own else ''})"
    if tracker.failed_in is not None and any(w in text.lower() for w in _SHAPE_WORDS):
        expect = _expected(mod)
        return InputShapeError(
            f"capture failed in module {path or '<root>'!r} ({type(mod).__name__}{'; ' + own if own else ''}){where}: "
            f"{msg}. It received input shapes {shapes}{'; it expects ' + expect if expect else ''}. "
            f"Example inputs given: {given}. Check that the example inputs have the shapes the model expects."
        )
    patched = ""
    if tracker.failed_in is not None and type(mod).__module__.startswith("torch_xla"):
        orig = f"torch.nn.{type(mod).__name__}._orig"
        patched = (f" {type(mod).__name__} here is torch_xla's replacement ({type(mod).__module__}): importing "
                   "torch_xla "
                   f"patches torch.nn.{type(mod).__name__} with it, and it cannot be traced; build the module with "
                   f"{orig} (the original torch class), or build the model before torch_xla is imported.")
    return CaptureError(f"capture failed{in_module}{where}: {msg}.{patched}{_training_hint(frame)} "
                        f"Example inputs given: {given}.")


def _opaque_hint(tracker: _ModuleTracker) -> str:
    """Inside a submodule, fallback=True captures that module as one replicated op."""
    if tracker.failed_in is None or not tracker.failed_in[0]:
        return ""
    path, mod, _ = tracker.failed_in
    return (f" Or capture with fallback=True (CLI --fallback): module {path!r} ({type(mod).__name__}) then "
            f"becomes one opaque op that runs replicated ({OPAQUE_HINT}).")


OPAQUE_HINT = "no sharding inside it; its FLOPs measured by running it once"
EVAL_HINT = "capture the model in eval mode (model.eval(): no dropout)"


def _near(frame: traceback.FrameSummary | None) -> str:
    """The failing line of user code and the 3 lines before it."""
    if frame is None:
        return ""
    try:
        with open(frame.filename) as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[max(0, (frame.lineno or 1) - 4): frame.lineno or 1])


def _training_hint(frame: traceback.FrameSummary | None) -> str:
    """A construct that only runs in training mode (LayerDrop's branch on torch.rand(), a training-only
    autograd.Function) is avoided by the library's own eval path."""
    if "self.training" not in _near(frame):
        return ""
    return f" The failing code runs only in training mode: {EVAL_HINT}, or turn the library's option off."


def _compile_hint(frame: traceback.FrameSummary | None) -> str:
    """When the failing check is skipped under torch.compile, say how to take that branch."""
    near = _near(frame)
    if not any(w in near for w in ("is_tracing", "is_compiling", "is_torchdynamo_compiling")):
        return _training_hint(frame)
    hf = (" For HF transformers models, attn_implementation=\"eager\" in the config also avoids the SDPA mask "
          "check." if "transformers" in frame.filename else "")
    return (" This library skips the check when it is compiled: capture(..., assume_compiling=True) (CLI "
            f"--assume-compiling) takes that path.{hf}")


_SHAPE_WORDS = ("shape", "size", "dimension", "mat1 and mat2", "expected input", "must match", "broadcast")


def _expected(mod: nn.Module) -> str:
    if isinstance(mod, nn.Linear):
        return f"[..., {mod.in_features}]"
    if isinstance(mod, nn.Conv2d | nn.Conv1d | nn.Conv3d):
        return f"[N, {mod.in_channels}, ...]"
    if isinstance(mod, nn.Embedding):
        return f"integer indices < {mod.num_embeddings}"
    if isinstance(mod, nn.LayerNorm):
        return f"[..., {', '.join(map(str, mod.normalized_shape))}]"
    return ""
