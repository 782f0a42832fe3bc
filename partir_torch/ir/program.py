"""The captured program: flat, integer-indexed values and ops.

The search walks this thousands of times, so it is plain lists of frozen records with integer ids,
not FX nodes. The FX graph is kept beside it only to *execute* the program (oracles, tests).

>>> # v = program.value("h.0.attn.c_attn.weight"); v.shape, v.role
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class Role(enum.Enum):
    """What a value is to the training step; tactics and the cost model key off this."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    OPT_STATE = "optimizer_state"
    GRADIENT = "gradient"
    ACTIVATION = "activation"
    OUTPUT = "output"


class Phase(enum.Enum):
    """Which part of the step an op belongs to (by data flow: ancestors of the loss are forward)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True, slots=True)
class Ref:
    """A value reference inside an op's argument structure."""

    id: int

    def __str__(self) -> str:
        return f"%{self.id}"


@dataclass(frozen=True, slots=True)
class Value:
    """A tensor of the program. `producer` is the op id, or -1 for program inputs."""

    id: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: Role
    producer: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        dims = ",".join(map(str, self.shape))
        return f"%{self.id} {self.name}: {str(self.dtype).removeprefix('torch.')}[{dims}] ({self.role.value})"


@dataclass(frozen=True, slots=True)
class Op:
    """One aten op. `inputs`/`outputs` are value ids; outputs hold -1 where the op returns None."""

    id: int
    target: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    phase: Phase
    module: str | None = None
    overload: Callable[..., Any] | None = field(default=None, compare=False, repr=False)  # the aten op itself
    source: str | None = field(default=None, compare=False)  # `file.py:123` of the user code that emitted it
    call: int | None = field(default=None, compare=False)  # which torch-function call of its module made it
    call_shape: tuple[int, ...] | None = field(default=None, compare=False)  # that call's result, when one tensor
    call_fn: str | None = field(default=None, compare=False)  # that call's function (`capture.attribution.call_name`)
    flops: float | None = None  # an opaque op's FLOPs per call, measured at capture (`capture/opaque.py`)

    def __str__(self) -> str:
        outs = ", ".join(f"%{o}" for o in self.outputs)
        args = ", ".join(map(str, self.args))
        where = f"  # {self.module}" if self.module else ""
        return f"{outs} = {self.target}({args}){where}"


@dataclass(frozen=True, slots=True)
class Group:
    """The same parameter of a repeated layer, with its gradients and optimizer states.

    `key` is the relative path with the repeated index written `*` (`h.*.attn.c_attn.weight`).
    One action on a group addresses every member at once.
    """

    id: int
    key: str
    shape: tuple[int, ...]
    params: tuple[str, ...]
    members: tuple[int, ...]

    def __str__(self) -> str:
        return f"group {self.id} {self.key} x{len(self.params)} {list(self.shape)}"


COMPUTE_DTYPES = ("bfloat16", "float16", "float32", "float64")  # what a mixed-precision policy may name


def float_dtype_name(value: Any, field: str) -> str | None:
    """A floating dtype (`torch.bfloat16`, "bfloat16", "bf16", "torch.float16") as its torch name; None stays
    None; anything else is an error naming `field` and the floating dtypes."""
    from partir_torch.errors import PartirError

    if value is None:
        return None
    short = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
             "fp64": "float64", "double": "float64"}
    name = str(value).removeprefix("torch.")
    name = short.get(name, name)
    if name not in COMPUTE_DTYPES:
        why = (" (float8 has no matmul kernels but torch._scaled_mm's: keep such scaling in the model)"
               if name.startswith("float8") else "")
        raise PartirError(f"{field}={value!r} is not a floating dtype the step can compute in{why}; use one of "
                          f"{', '.join(COMPUTE_DTYPES)}")
    return name


@dataclass(frozen=True)
class Loop:
    """What a training loop asks of the step beyond one forward, backward and update: `accumulate` microbatches
    (each input's dim 0 split in that many, in order; their gradients averaged before one update, as k calls of
    `(loss / k).backward()` leave them), the gradients clipped by their global 2-norm (as
    `torch.nn.utils.clip_grad_norm_` clips them) or by value (`clip_grad_value_`) before the update; and a
    mixed-precision policy, FSDP2's `MixedPrecisionPolicy`: floating parameters (kept as they are, the
    optimizer's master copy) cast to `param_dtype` for forward and backward, with the model's floating inputs,
    and their gradients reduced in `reduce_dtype` (None: in `param_dtype`) before the cast back. Dtypes are
    held by name ("bfloat16"), as a plan's JSON holds them. And activation checkpointing (`remat`): each
    repeated block's forward run again in backward, as the step's own ops."""

    accumulate: int = 1
    max_grad_norm: float | None = None
    max_grad_value: float | None = None
    divide: int | None = None  # the gradients' sum divided by this (None: by `accumulate`, their mean)
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    remat: str | None = None  # "full" | "selective": every repeated block recomputed in backward (`capture/remat.py`)

    @property
    def divide_by(self) -> int:
        return self.divide or self.accumulate

    def __post_init__(self) -> None:
        from partir_torch.errors import PartirError

        if self.divide == self.accumulate:
            object.__setattr__(self, "divide", None)  # (the default, one Loop for one step)
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise PartirError(f"accumulate must be a whole number of microbatches >= 1, got {self.accumulate!r}")
        for name in ("max_grad_norm", "max_grad_value"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int | float) and v > 0):
                raise PartirError(f"{name} must be a positive number (or None: no clipping), got {v!r}")
        for name in ("param_dtype", "reduce_dtype"):
            object.__setattr__(self, name, float_dtype_name(getattr(self, name), name))
        if self.remat not in (None, "full", "selective"):
            raise PartirError(f"remat={self.remat!r}: 'full' (each repeated block's forward run again in backward), "
                              "'selective' (the same, its matmul and attention outputs kept) or None")
        if self.reduce_dtype is not None and self.param_dtype is None:
            raise PartirError(f"reduce_dtype={self.reduce_dtype!r} without param_dtype: the gradients are reduced "
                              "in the parameters' own dtype; set param_dtype too (FSDP2's MixedPrecisionPolicy)")

    def dtype(self, name: str) -> torch.dtype | None:
        """`param_dtype` or `reduce_dtype` as a torch dtype."""
        v = getattr(self, name)
        return None if v is None else getattr(torch, v)

    def __str__(self) -> str:
        parts = [f"accumulate={self.accumulate}"] if self.accumulate > 1 else []
        parts += [f"divide={self.divide}"] if self.divide not in (None, self.accumulate) else []
        parts += [f"{k}={v:g}" for k, v in (("max_grad_norm", self.max_grad_norm),
                                              ("max_grad_value", self.max_grad_value)) if v is not None]
        parts += [f"{k}={v}" for k, v in (("param_dtype", self.param_dtype), ("reduce_dtype", self.reduce_dtype),
                                           ("remat", self.remat)) if v is not None]
        return ", ".join(parts) or "one step"


@dataclass(eq=False)
class Program:
    """A whole training step (or a forward pass) as one functional aten program."""

    values: list[Value]
    ops: list[Op]
    params: dict[str, int]
    buffers: dict[str, int]
    inputs: list[int]
    opt_states: dict[str, dict[str, int]]  # param -> state name -> value id (shared states included)
    grads: dict[str, int]
    updates: dict[int, int]
    outputs: list[int]
    loss: int | None
    groups: list[Group]
    mode: str
    optimizer: str | None
    shared_states: dict[str, int] = field(default_factory=dict)
    hypers: dict[str, int] = field(default_factory=dict)  # hyperparameter inputs (each group's `lr[g]`) -> value id
    hyper_values: dict[str, float] = field(default_factory=dict)  # their values when captured
    constants: dict[str, int] = field(default_factory=dict)  # tensor constants of the graph, by attribute
    input_args: list[int | str | None] = field(default_factory=list)  # forward arg of each input (None: not one)
    aux: dict[str, int] = field(default_factory=dict)  # values the loss function returns beside the loss -> value id
    n_graph_outputs: int = 0  # outputs beyond these are functionalized buffer mutations
    capture_time_s: float = 0.0
    compiling: bool = False  # traced with torch.compiler.is_compiling() true (capture's assume_compiling)
    loop: Loop = field(default_factory=Loop)  # microbatches and clipping in the step (inputs: [k, b, ...] if k > 1)
    # inference: (the pytree spec of the forward's output, its leaves with each tensor as `capture.opaque.TENSOR`)
    out_tree: object | None = field(default=None, repr=False)
    fold: dict[str, int] = field(default_factory=dict)  # folded container path -> its full length (capture/fold.py)
    graph_module: torch.fx.GraphModule | None = field(default=None, repr=False)
    _users: list[tuple[int, ...]] | None = field(default=None, repr=False)
    _by_name: dict[str, int] | None = field(default=None, repr=False)
    _hash: str | None = field(default=None, repr=False)
    _input_names: frozenset[str] | None = field(default=None, repr=False)
    # the `analysis.Analysis` of this program on each mesh it was sharded on (built and read there only)
    analyses: dict[Any, Any] = field(default_factory=dict, init=False, repr=False)

    # -- lookups -------------------------------------------------------------------------------------
    @property
    def users(self) -> list[tuple[int, ...]]:
        """For each value id, the ids of the ops that read it."""
        if self._users is None:
            acc: list[list[int]] = [[] for _ in self.values]
            for op in self.ops:
                for v in dict.fromkeys(op.inputs):
                    acc[v].append(op.id)
            self._users = [tuple(u) for u in acc]
        return self._users

    @property
    def input_names(self) -> frozenset[str]:
        """The names of the program's inputs (the search asks whether an action's target is one)."""
        if self._input_names is None:
            self._input_names = frozenset(self.values[v].name for v in self.inputs)
        return self._input_names

    def value(self, name: str) -> Value:
        """The value called `name`; a KeyError suggests near names when there is none."""
        if self._by_name is None:
            self._by_name = {v.name: v.id for v in self.values}
        try:
            return self.values[self._by_name[name]]
        except KeyError:
            import difflib

            near = difflib.get_close_matches(name, list(self._by_name), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise KeyError(f"no value named {name!r} in the program{hint}") from None

    def content_hash(self) -> str:
        """A hash of what the step computes (values' names, shapes, dtypes, roles; ops' targets, operands and
        arguments; the fold): equal for the same model, inputs, loss and optimizer, so a saved plan can tell
        whether it was made for this program."""
        if self._hash is None:
            import hashlib

            h = hashlib.sha256()
            for v in self.values:
                h.update(f"{v.name}|{v.shape}|{v.dtype}|{v.role.value}\n".encode())
            for op in self.ops:
                flops = "" if op.flops is None else f"|{op.flops!r}"  # (an opaque op's: it decides the cost)
                h.update(f"{op.target}|{op.inputs}|{op.outputs}|{op.args!r}|{op.kwargs!r}{flops}\n".encode())
            h.update(repr(sorted(self.fold.items())).encode())
            self._hash = h.hexdigest()[:16]
        return self._hash

    def values_by_role(self, role: Role) -> list[Value]:
        return [v for v in self.values if v.role is role]

    # -- summaries -----------------------------------------------------------------------------------
    def op_counts(self) -> Counter[str]:
        return Counter(op.target for op in self.ops)

    def param_count(self) -> int:
        return sum(self.values[i].numel for i in self.params.values())

    def param_bytes(self) -> int:
        return sum(self.values[i].nbytes for i in self.params.values())

    def summary(self) -> dict[str, Any]:
        """The JSON form of `partir-torch capture --json`."""
        roles = Counter(v.role.value for v in self.values)
        role_bytes: Counter[str] = Counter()
        for v in self.values:
            role_bytes[v.role.value] += v.nbytes
        phases = Counter(op.phase.value for op in self.ops)
        return {
            "mode": self.mode,
            "optimizer": self.optimizer,
            "ops": len(self.ops),
            "ops_by_target": dict(self.op_counts().most_common()),
            "ops_by_phase": dict(phases),
            "values": len(self.values),
            "values_by_role": dict(roles),
            "bytes_by_role": dict(role_bytes),
            "params": self.param_count(),
            "param_bytes": self.param_bytes(),
            "param_tensors": len(self.params),
            "groups": [[self.values[m].name for m in g.members] for g in self.groups],
            "group_keys": [g.key for g in self.groups],
            "capture_time_s": self.capture_time_s,
        }

    # -- execution (oracle) --------------------------------------------------------------------------
    def run(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        inputs: Sequence[torch.Tensor],
        opt_states: dict[str, dict[str, torch.Tensor]] | None = None,
        hypers: Mapping[str, float] | None = None,
    ) -> dict[int, torch.Tensor]:
        """Execute the captured graph on real tensors; returns {output value id: tensor}.

        This is the unsharded reference every later oracle compares against. Buffers the model mutates
        (BatchNorm statistics) are cloned first, so the caller's tensors are never written. `hypers` (each
        group's `lr[g]`) default to their values when captured.
        """
        buffers = {k: v.clone() for k, v in buffers.items()}
        flat: list[torch.Tensor] = []
        placeholders = self.graph_module.graph.find_nodes(op="placeholder")
        sources = self._placeholder_sources()
        for (kind, key, sub), vid in zip(sources, self._placeholder_ids()):
            if kind == "param":
                flat.append(params[key])
            elif kind == "buffer":
                flat.append(buffers[key])
            elif kind == "state":
                flat.append((opt_states or {})[key][sub])
            elif kind == "hyper":
                flat.append(torch.tensor({**self.hyper_values, **(hypers or {})}[key], dtype=self.values[vid].dtype))
            else:
                flat.append(inputs[key])
        assert len(flat) == len(placeholders)
        outs = list(self.graph_module(*flat))
        by_id = {vid: flat[i] for i, vid in enumerate(self._placeholder_ids())}
        outs += [by_id[self.updates[o]] for o in self.outputs[self.n_graph_outputs :]]
        return dict(zip(self.outputs, outs))

    def _placeholder_ids(self) -> list[int]:
        ids = [*self.params.values(), *self.buffers.values(), *self.shared_states.values(), *self.hypers.values()]
        ids += [vid for st in self.opt_states.values() for s, vid in st.items() if s not in self.shared_states]
        return [*ids, *self.inputs]

    def _placeholder_sources(self) -> list[tuple[str, Any, str | None]]:
        srcs: list[tuple[str, Any, str | None]] = [("param", n, None) for n in self.params]
        srcs += [("buffer", n, None) for n in self.buffers]
        first = next(iter(self.opt_states), None)
        srcs += [("state", first, s) for s in self.shared_states]
        srcs += [("hyper", h, None) for h in self.hypers]
        srcs += [("state", p, s) for p, st in self.opt_states.items() for s in st if s not in self.shared_states]
        srcs += [("input", i, None) for i in range(len(self.inputs))]
        return srcs

    def __str__(self) -> str:
        head = f"Program({self.mode}, {len(self.ops)} ops, {len(self.values)} values, {len(self.groups)} groups)"
        return "\n".join([head, *(f"  {op}" for op in self.ops)])
