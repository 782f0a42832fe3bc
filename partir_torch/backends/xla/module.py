"""Applying a plan to a module and its optimizer, and undoing it: `shard_module` (parameters moved and
annotated, hooks, lowerings, call constraints), `shard_batch`, `shard_optimizer`, `unshard`, `train_step`."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from partir_torch import _compat
from partir_torch.backends.common import initial_states, rebuild_optimizer
from partir_torch.backends.common import slots as tensor_slots
from partir_torch.backends.held import hold, release
from partir_torch.backends.xla.constraints import CallConstraints, _ReadAs, constrain, constrain_by_shape, grad_hook
from partir_torch.backends.xla.lowerings import Lowerings
from partir_torch.backends.xla.runtime import XlaError, _mark, _materialize, _spec, _to_device, _xla, device_mesh
from partir_torch.ir.mesh import Mesh
from partir_torch.plan import ShardingPlan, divisibility
from partir_torch.rules.conv import depthwise

log = logging.getLogger(__name__)

# -- applying a plan to a module ------------------------------------------------------------------------------
@dataclass(eq=False)
class Sharded:
    """What `shard_module` did to one model: enough to undo it, to shard its batches and to verify it."""

    plan: ShardingPlan
    mesh: Any  # torch_xla's Mesh
    originals: list[tuple[nn.Module, str, torch.Tensor]]  # (owner, attribute, the caller's tensor)
    names: dict[int, str]  # id of the caller's parameter -> its name (for the optimizer)
    handles: list[Any] = field(default_factory=list)
    lowerings: Lowerings | None = None
    loss_fn: Callable[..., torch.Tensor] | None = None
    optimizer: torch.optim.Optimizer | None = None  # the caller's, as it was given (a template for verify)
    warned_shapes: set[tuple] = field(default_factory=set)


_SHARDED: weakref.WeakKeyDictionary[nn.Module, Sharded] = weakref.WeakKeyDictionary()


def sharded(model: nn.Module) -> Sharded | None:
    """The record of `shard_module` on `model`, or None when it is not sharded."""
    return _SHARDED.get(model)


def shard_module(model: nn.Module, plan: ShardingPlan, mesh=None, *, lowerings: Lowerings | None = None,
                 loss_fn=None) -> Sharded:
    """Move `model` to the XLA device with the plan's shardings, constraints and batch hook (module docstring).
    On any failure the model is left as it was."""
    torch_xla, _, _ = _xla()
    if model in _SHARDED:
        raise XlaError(f"{type(model).__name__} is already sharded by partir_torch (plan for mesh "
                       f"{_SHARDED[model].plan.mesh}); call partir_torch.unshard(model) first to shard it again")
    if mesh is None:
        mesh = device_mesh(Mesh.of(plan.mesh), plan.dcn_axes)
    slots = tensor_slots(model)
    on_meta = sorted({id(t) for _, _, t, _ in slots if t.is_meta})
    if on_meta and len(on_meta) != len({id(t) for _, _, t, _ in slots}):
        meta_names = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        raise XlaError(f"some parameters or buffers are on the meta device and others are not "
                       f"({', '.join(meta_names[:5])}{' …' if len(meta_names) > 5 else ''}): "
                       "build the model wholly on meta, or wholly with weights")
    names = {id(p): n for n, p in model.named_parameters()}
    bnames = {id(b): n for n, b in model.named_buffers()}
    record = Sharded(plan, mesh, [(m, a, t) for m, a, t, _ in slots], names, lowerings=lowerings or Lowerings(),
                     loss_fn=loss_fn)
    dev = torch_xla.device()
    try:
        moved: dict[int, torch.Tensor] = {}
        for mod, attr, t, is_param in slots:
            new = moved.get(id(t))
            if new is None:
                name = names.get(id(t)) or bnames.get(id(t))
                # replicated ones too: an unannotated parameter's update may come out sharded like its states
                spec = plan.params.get(name) if id(t) in names else plan.buffers.get(name)
                data = torch.empty_like(t, device=dev) if t.is_meta else _to_device(t, mesh, spec)
                new = nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data
                moved[id(t)] = new
            setattr(mod, attr, new)
        if on_meta:
            _initialize(model, [bnames[i] for i in on_meta if i in bnames])
            for i, t in moved.items():  # marked after their initialization (lazy: computed sharded)
                name = names.get(i) or bnames.get(i)
                spec = plan.params.get(name) if i in names else plan.buffers.get(name)
                _mark(t, mesh, _spec(spec, t.dim()))
        _install_hooks(model, record)
        _materialize(moved.values())  # (and, from meta, initialize) the sharded parameters now
    except BaseException:
        _restore(model, record)
        raise
    _SHARDED[model] = record
    model.partir_plan = plan
    from partir_torch.backends.xla.held import XlaEngine

    hold(model, XlaEngine())
    return record


def _initialize(model: nn.Module, meta_buffers: list[str]) -> None:
    """Parameters of a model built on meta, as `Module.to_empty` users initialize them."""
    covered: set[int] = set()
    for mod in model.modules():
        reset = getattr(mod, "reset_parameters", None)
        if callable(reset):
            with torch.no_grad():
                reset()
            covered.update(id(p) for p in mod.parameters(recurse=False))
    left = [n for n, p in model.named_parameters() if id(p) not in covered]
    if left:
        with torch.no_grad():
            for n in left:
                model.get_parameter(n).zero_()
        log.warning("built on meta, %d parameters have no module reset_parameters() and start at zero: %s",
                    len(left), ", ".join(left[:6]) + (" …" if len(left) > 6 else ""))
    if meta_buffers:
        log.warning("built on meta, buffers %s have no values (buffers are not reset); compute them after "
                    "auto_shard or build the model with weights", ", ".join(meta_buffers[:6]))


def _install_hooks(model: nn.Module, rec: Sharded) -> None:
    _, xs, _ = _xla()
    plan, mesh = rec.plan, rec.mesh

    def constrain_to(spec: tuple):
        def hook(mod, args, out):
            if isinstance(out, torch.Tensor) and out.dim() == len(spec):
                with _compat.DisableTorchFunction():  # not one of the model's calls
                    return xs.mark_sharding_with_gradients(out, mesh, spec)
            return None

        return hook

    for path, spec in plan.activations.items():  # module outputs and their gradients as the plan has them
        try:
            mod = model.get_submodule(path)
        except AttributeError as e:
            raise XlaError(f"the plan constrains the output of module {path!r}, which this model does not have; "
                           "the plan was made for another model (search again)") from e
        rec.handles.append(mod.register_forward_hook(constrain_to(_spec(spec, len(spec)))))

    def as_the_loss_reads(shape: list[int], spec: tuple, grad: tuple | None):
        def hook(mod, args, out):
            with _compat.DisableTorchFunction():  # not one of the model's calls
                return constrain_by_shape(out, mesh, [(shape, 0, spec, grad)], unique=True)

        return hook

    def read_as(spec: tuple, grad: tuple | None, shape: list[int] | None):
        def hook(mod, args, kwargs):
            slots = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            slots += [(k, a) for k, a in kwargs.items() if isinstance(a, torch.Tensor)]
            hits = [(k, a) for k, a in slots if (list(a.shape) == shape if shape else a.dim() == len(spec))]
            if len(hits) != 1:
                return None
            k, a = hits[0]
            with _compat.DisableTorchFunction():  # not one of the model's calls
                a = constrain(a, mesh, spec, grad)
            if isinstance(k, int):
                return (*args[:k], a, *args[k + 1:]), kwargs
            return args, {**kwargs, k: a}

        return hook

    if plan.output is not None:  # the model's output as the loss reads it (`plan/reads.model_output`)
        shape, spec, grad = plan.output
        rec.handles.append(model.register_forward_hook(
            as_the_loss_reads(shape, _spec(spec, len(spec)), _spec(grad, len(grad)) if grad is not None else None)))

    in_shapes = plan.shapes.get("module_inputs", {})
    for path, (spec, grad) in plan.module_inputs.items():  # where the plan reshards a module's input on entry
        rec.handles.append(model.get_submodule(path).register_forward_pre_hook(
            read_as(_spec(spec, len(spec)), _spec(grad, len(grad)) if grad is not None else None,
                    in_shapes.get(path)), with_kwargs=True))

    held: dict[int, list[tuple[str, nn.Module, str]]] = {}  # id(parameter) -> where it is held (tied: several)
    for path, m in model.named_modules(remove_duplicate=False):
        for a, p in m._parameters.items():
            if isinstance(p, nn.Parameter):
                held.setdefault(id(p), []).append((path, m, a))
    for name, spec in plan.param_reads.items():  # parameters gathered once, as the plan reads them
        owner, _, attr = name.rpartition(".")
        p = model.get_submodule(owner)._parameters.get(attr)
        if not isinstance(p, nn.Parameter):
            continue
        places = list({(id(m), a): (m, a) for _, m, a in held[id(p)]}.values())
        paths = list(zip(*[path.split(".") if path else [] for path, _, _ in held[id(p)]]))
        n = next((i for i, names in enumerate(paths) if len(set(names)) > 1), len(paths))
        mod = model.get_submodule(".".join(names[0] for names in paths[:n]))  # the module around all of them
        grad = plan.read_grads.get(name)
        swap = _ReadAs(places, mesh, _spec(spec, len(spec)), _spec(grad, len(grad)) if grad is not None else None)
        rec.handles += [mod.register_forward_pre_hook(swap.enter),
                        mod.register_forward_hook(swap.leave, always_call=True)]

    grouped = _grouped_conv_weights(model)
    params = dict(model.named_parameters())
    for n, spec in plan.grads.items():  # parameter gradients reduced as planned
        p = params.get(n)
        if p is not None and p.requires_grad and spec is not None:  # replicated ones too (as parameters)
            made = plan.grads_made.get(n)
            first = (_spec(made, p.dim()) if made is not None else (None,) * p.dim() if n in grouped else None)
            rec.handles.append(p.register_hook(grad_hook(mesh, _spec(spec, p.dim()), first=first)))
    rec.handles.append(model.register_forward_pre_hook(_batch_hook(rec), with_kwargs=True))
    if rec.lowerings is not None:
        rec.lowerings.compiling = plan.compiling
    if rec.lowerings is not None and plan.calls:
        calls = rec.lowerings.calls = CallConstraints(model, mesh, plan.calls, tuple(plan.mesh))
        for m in {id(m): m for m in model.modules()}.values():  # first in, last out: around the user's hooks
            rec.handles += [m.register_forward_pre_hook(calls.push, prepend=True),
                            m.register_forward_hook(calls.pop, prepend=True, always_call=True)]
    if rec.lowerings is not None and rec.lowerings.active:
        rec.handles.append(model.register_forward_pre_hook(rec.lowerings.enter))
        rec.handles.append(model.register_forward_hook(rec.lowerings.leave, always_call=True))


def _grouped_conv_weights(model: nn.Module) -> set[str]:
    """The weights of the model's grouped convolutions but depthwise ones. Their convolution runs with its
    channels whole (`rules/conv.py`), so the plan makes their gradient whole and then reduces it to its tiles;
    the engine is told so. (Left to GSPMD's convolution handler, the weight-gradient convolution partitioned
    over output channels that do not divide the groups, a RegNetY stage of 3 groups tiled by 2, aborted XLA
    2.9: "Check failed: new_input_batch_size % new_output_batch_size == 0"; docs/apply.md.) A depthwise
    convolution's channels are its groups: the plan tiles its gradient as it makes it, and made whole first
    it would be gathered."""
    return {f"{path}.weight" if path else "weight" for path, m in model.named_modules()
            if isinstance(m, nn.modules.conv._ConvNd) and m.groups > 1
            and not depthwise(m.in_channels, m.weight.shape, m.groups)}


def _batch_hook(rec: Sharded):
    slots = {k: i for i, k in enumerate(rec.plan.input_args) if k is not None}

    def hook(mod, args, kwargs):
        args = list(args)
        for k, i in slots.items():
            if isinstance(k, int) and k < len(args) and isinstance(args[k], torch.Tensor):
                args[k] = shard_input(rec, i, args[k])
            elif isinstance(k, str) and isinstance(kwargs.get(k), torch.Tensor):
                kwargs[k] = shard_input(rec, i, kwargs[k])
        return tuple(args), kwargs

    return hook


def shard_input(rec: Sharded, i: int, x: torch.Tensor) -> torch.Tensor:
    """Input `i` of the step on the device with the plan's sharding. A batch of another shape than the
    example's (the last, smaller batch of an epoch) is sharded the same way when its dims still divide,
    with one warning (XLA compiles a second program for it); otherwise it is an error."""
    plan = rec.plan
    spec = plan.inputs[i] if i < len(plan.inputs) else None
    shapes = plan.shapes.get("inputs") or []
    want = shapes[i] if i < len(shapes) else None
    if want is not None and list(x.shape) != list(want):
        bad = divisibility(f"input {i}", tuple(x.shape), spec or [], plan.mesh)
        if bad or x.dim() != len(want):
            raise XlaError(f"input {i} has shape {list(x.shape)}, the plan was made for {want}: " + "; ".join(bad)
                           + ". Drop the last partial batch (DataLoader(drop_last=True)) "
                           "or pad it to the planned shape")
        if (i, tuple(x.shape)) not in rec.warned_shapes:
            rec.warned_shapes.add((i, tuple(x.shape)))
            log.warning("input %d has shape %s, the plan was made for %s: sharded as planned; XLA compiles "
                        "another program for this shape", i, list(x.shape), want)
    return _to_device(x, rec.mesh, spec)


def shard_batch(model: nn.Module, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The step's inputs (all of them, targets included) on the device with the plan's shardings."""
    rec = _require(model)
    return tuple(shard_input(rec, i, x) for i, x in enumerate(batch))


def input_sharding(plan: ShardingPlan, i: int, mesh=None):
    """torch_xla's `ShardingSpec` of input `i`, for `MpDeviceLoader(loader, dev, input_sharding=...)`."""
    _, xs, _ = _xla()
    if not 0 <= i < len(plan.inputs):
        raise XlaError(f"the plan has {len(plan.inputs)} inputs; there is no input {i}")
    mesh = mesh or device_mesh(Mesh.of(plan.mesh), plan.dcn_axes)
    spec = plan.inputs[i]
    n = len(spec) if spec is not None else len(plan.shapes.get("inputs", [[]])[i])
    return xs.ShardingSpec(mesh, _spec(spec, n))


def _require(model: nn.Module) -> Sharded:
    rec = _SHARDED.get(model)
    if rec is None:
        raise XlaError(f"{type(model).__name__} is not sharded by partir_torch; call partir_torch.auto_shard first")
    return rec


def _restore(model: nn.Module, rec: Sharded) -> None:
    for h in rec.handles:
        h.remove()
    rec.handles.clear()
    for mod, attr, t in rec.originals:
        setattr(mod, attr, t)


def discard(model: nn.Module) -> None:
    """Undo `shard_module` without keeping its values (a failed `auto_shard`): the model as it was given."""
    rec = _require(model)
    _restore(model, rec)
    del _SHARDED[model]
    release(model)
    model.__dict__.pop("partir_plan", None)


def unshard(model: nn.Module) -> nn.Module:
    """Undo `shard_module`: hooks removed, the caller's own parameter and buffer objects put back, holding the
    trained values (on their original device; a model built on meta gets CPU tensors)."""
    rec = _require(model)
    current = {(id(mod), attr): getattr(mod, attr) for mod, attr, _ in rec.originals}
    copied: dict[int, torch.Tensor] = {}
    for mod, attr, orig in rec.originals:
        now = current[(id(mod), attr)]
        if id(orig) not in copied:
            with torch.no_grad():
                if orig.is_meta:
                    data = now.detach().cpu()
                    copied[id(orig)] = (
                        nn.Parameter(data, orig.requires_grad) if isinstance(orig, nn.Parameter) else data
                    )
                else:
                    orig.copy_(now.detach().to(orig.device))
                    copied[id(orig)] = orig
    _restore(model, rec)
    for mod, attr, orig in rec.originals:
        setattr(mod, attr, copied[id(orig)])
    del _SHARDED[model]
    release(model)
    model.__dict__.pop("partir_plan", None)
    return model


# -- the optimizer ---------------------------------------------------------------------------------------------
def shard_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    """`optimizer` (built on the caller's parameters of `model`) rebuilt on the sharded ones: same class, param
    groups and hyperparameters; its states (moved, or created as torch would) sharded as the plan says. The
    caller's optimizer is not modified."""
    torch_xla, _, _ = _xla()
    rec = _require(model)
    plan, dev = rec.plan, torch_xla.device()
    if isinstance(optimizer, torch.optim.SGD) and any(g.get("dampening", 0) for g in optimizer.param_groups):
        raise XlaError("SGD with dampening != 0 starts its momentum buffer from the first gradient undamped, which a "
                       "buffer created up front (to shard it) cannot reproduce; use dampening=0")
    new = rebuild_optimizer(optimizer, rec.names, dict(model.named_parameters()), foreach=False, capturable=True)
    for og, ng in zip(optimizer.param_groups, new.param_groups):
        for old_p, p in zip(og["params"], ng["params"]):
            name = rec.names[id(old_p)]
            had = optimizer.state.get(old_p)
            st = dict(had) if had else initial_states(new, ng, p, dev)
            for s, t in st.items():
                spec = plan.optimizer_state.get(name, {}).get(s, plan.params.get(name))
                if isinstance(t, torch.Tensor):
                    st[s] = _to_device(t, rec.mesh, spec if t.dim() else [])
            new.state[p] = st
    rec.optimizer = optimizer
    _materialize(t for st in new.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    return new


def apply(model: nn.Module, optimizer: torch.optim.Optimizer, plan: ShardingPlan, mesh=None, *,
          lowerings: Lowerings | None = None, loss_fn=None) -> torch.optim.Optimizer:
    """`shard_module` then `shard_optimizer`, all or nothing: returns the sharded optimizer; on a failure the
    model is as it was given."""
    shard_module(model, plan, mesh, lowerings=lowerings, loss_fn=loss_fn)
    try:
        return shard_optimizer(optimizer, model)
    except BaseException:
        discard(model)
        raise


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, batch: Sequence[torch.Tensor]
               ) -> torch.Tensor:
    """One step of the sharded model, ending the XLA graph: batch sharded as planned, backward, update,
    gradients dropped (temporaries of the step, not outputs of the graph), `torch_xla.sync()`."""
    torch_xla, _, _ = _xla()
    loss = loss_fn(model, *shard_batch(model, *batch))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch_xla.sync()
    return loss.detach()
