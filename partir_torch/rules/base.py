"""Tile-mapping rules: what a sharded operand dimension means for an op, as factors (PartIR §3).

A rule lists the op's *factors* (named loop dimensions) and, for each tensor operand and result, which
factor each dimension carries (or none). Tiling a factor over a mesh axis tiles every dimension that
carries it. A factor carried by operands but missing from a result makes that result *partial* (a pending
sum) when the factor is tiled — `reduced`; a factor whose tiling would change the op's meaning (softmax's
normalized dim, a gathered index dim, a convolution's spatial dims) is in `replicate`.

Rules are written as einsum-like specs, e.g. matmul `"mk,kn->mn"`; `_` marks a dimension that carries no
factor (a broadcast or a size-1 dim). The lookup chain (`lookup`): an explicit rule keyed by the aten op;
else a rule keyed by one of the op's torch tags (every op torch tags `pointwise` gets the broadcasting
elementwise rule: `fmod`, `signbit`, `logical_and`, `bitwise_*`, … need no entry of their own); else a
decomposition into ops that have rules (`rules.decompose.prepare`, run before propagation); else the opt-in
replicate fallback (`replicated_rule`; `tactics.warn_fallbacks` warns once per op with its module, source line
and the communication it adds); else `MissingRuleError` naming the op, module and source line and how to add a
rule. Tags need `torch.ops` to resolve an op's name, the one use of torch beyond `ir` here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from partir_torch.errors import PartirError
from partir_torch.ir.program import Op, Program, Ref


class MissingRuleError(PartirError):
    """An op of the program has no tile-mapping rule."""


@dataclass(frozen=True, slots=True)
class TMap:
    """One tensor of an op: its value id and, per dimension, the factor it carries (None: no factor)."""

    value: int
    dims: tuple[int | None, ...]
    chunks: tuple[tuple[int, int], ...] = ()  # ((dim, n), ...): the op reads/writes dim as n equal chunks


@dataclass(frozen=True, slots=True)
class OpRule:
    name: str
    letters: str  # factor i is letters[i]; for printing
    operands: tuple[TMap, ...]
    results: tuple[TMap, ...]
    replicate: frozenset[int]
    reduced: tuple[frozenset[int], ...]  # per result: factors it is a sum over
    mean_over: tuple[frozenset[int], ...]  # per result: tiling these divides the local result by the tiling
    partialize: frozenset[int]  # operand positions that join a sum (addmm's bias): given as a partial

    def __str__(self) -> str:
        def fmt(t: TMap) -> str:
            ch = dict(t.chunks)
            return "".join(("_" if f is None else self.letters[f]) + (f"/{ch[d]}" if d in ch else "")
                           for d, f in enumerate(t.dims)) or "()"

        rep = f" replicate {{{','.join(self.letters[f] for f in sorted(self.replicate))}}}" if self.replicate else ""
        return f"{self.name}: {','.join(map(fmt, self.operands))}->{','.join(map(fmt, self.results))}{rep}"


RuleFn = Callable[[Op, Program], OpRule]
_RULES: dict[str, tuple[str, RuleFn]] = {}
_TAG_RULES: dict[str, tuple[str, RuleFn]] = {}  # torch tag name (`pointwise`) -> rule


def register(*targets: str) -> Callable[[RuleFn], RuleFn]:
    """Register a rule for aten ops named like `aten.mm.default` (the IR's `Op.target`)."""

    def deco(fn: RuleFn) -> RuleFn:
        for t in targets:
            if t in _RULES:
                raise ValueError(f"two rules for {t}: {_RULES[t][0]} and {fn.__module__}.{fn.__name__}")
            _RULES[t] = (f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}", fn)
        return fn

    return deco


def register_tag(*tags: str) -> Callable[[RuleFn], RuleFn]:
    """Register a rule for every op carrying one of torch's tags (`torch.Tag.pointwise` -> "pointwise")."""

    def deco(fn: RuleFn) -> RuleFn:
        for t in tags:
            _TAG_RULES[t] = (f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}", fn)
        return fn

    return deco


@functools.cache
def op_tags(target: str) -> tuple[str, ...]:
    """The torch tags of the op named `target` (`aten.fmod.Tensor`), () if it cannot be resolved."""
    ns, _, rest = target.partition(".")
    name, _, overload = rest.rpartition(".")
    try:
        packet = getattr(getattr(torch.ops, ns), name)
        return tuple(str(t).rsplit(".", 1)[-1] for t in getattr(packet, overload).tags)
    except (AttributeError, RuntimeError):
        return ()


def lookup(target: str) -> tuple[str, RuleFn] | None:
    """The rule of an op by name: an explicit entry, else one keyed by the op's torch tags."""
    _load()
    entry = _RULES.get(target)
    if entry is None:
        entry = next((_TAG_RULES[t] for t in op_tags(target) if t in _TAG_RULES), None)
    return entry


def rule_name(target: str) -> str | None:
    entry = lookup(target)
    return entry[0] if entry else None


def registered() -> dict[str, str]:
    _load()
    return {t: n for t, (n, _) in _RULES.items()}


def where(op: Op) -> str:
    """`module h.0.attn (modeling_gpt2.py:123)`: where the op came from, for messages."""
    src = f" ({op.source})" if op.source else ""
    return f"module {op.module or '<root>'}{src}" if op.module is not None or src else "module ? (no attribution)"


def rule_for(op: Op, program: Program, *, fallback: bool = False) -> OpRule:
    entry = lookup(op.target)
    if entry is not None:
        return entry[1](op, program)
    if fallback:
        return replicated_rule(op, program)
    raise MissingRuleError(
        f"no tile-mapping rule for {op.target} (op {op.id}, {where(op)}); add one in "
        f"partir_torch/rules/<family>.py with @register({op.target!r}), or pass fallback=True (CLI --fallback, "
        "schedule text `fallback;...`) to run it replicated"
    )


def replicated_rule(op: Op, program: Program) -> OpRule:
    """Every dim its own factor, all of them replicated: correct for any op, never sharded."""
    results = [o for o in op.outputs if o >= 0]
    spec = ",".join(_fresh(program, tensor_args(op), 0)) + "->" + ",".join(_fresh(program, results, 1 << 12))
    return spec_rule(op, program, spec, replicate="*", name="replicated")


def _fresh(program: Program, vids: Iterable[int], base: int) -> list[str]:
    """Distinct single-character letters for every dim of `vids` (outside the ASCII range used by specs)."""
    out, k = [], base
    for v in vids:
        n = len(program.values[v].shape)
        out.append("".join(chr(0x100 + k + i) for i in range(n)))
        k += n
    return out


@functools.cache
def _load() -> None:
    """Import every family once (a family imported directly, e.g. by the simulator, must not stop it)."""
    from partir_torch.rules import (  # noqa: F401  (registration side effects)
        attention,
        conv,
        indexing,
        loss,
        matrix,
        normalization,
        pointwise,
        random,
        reduction,
        scan,
        view,
    )


# -- building rules from specs -------------------------------------------------------------------------------
def tensor_args(op: Op) -> list[int]:
    """Value ids of the op's tensor arguments in argument order (lists flattened; duplicates kept)."""
    out: list[int] = []

    def walk(a: Any) -> None:
        if isinstance(a, Ref):
            out.append(a.id)
        elif isinstance(a, (list, tuple)):
            for x in a:
                walk(x)

    for a in op.args:
        walk(a)
    for _, a in op.kwargs:
        walk(a)
    return out


def spec_rule(
    op: Op,
    program: Program,
    spec: str,
    *,
    operands: list[int] | None = None,
    results: list[int] | None = None,
    replicate: str = "",
    mean: str | tuple[str, ...] = "",
    partialize: Iterable[int] = (),
    reduced: tuple[str, ...] | None = None,
    name: str | None = None,
) -> OpRule:
    """Build a rule from `"ab,bc->ac"`; `replicate="*"` replicates every factor; `mean` letters scale.

    By default a result is a sum over every operand factor it does not carry; `reduced` (letters per
    result) says otherwise for multi-output ops whose results depend on different operands.
    """
    lhs, _, rhs = spec.partition("->")
    operands = tensor_args(op) if operands is None else operands
    results = [o for o in op.outputs if o >= 0] if results is None else results
    # "" is one scalar tensor when the op has one, else none
    ins = lhs.split(",") if lhs or len(operands) == 1 else []
    outs = rhs.split(",") if rhs or len(results) == 1 else []
    if len(ins) != len(operands) or len(outs) != len(results):
        raise ValueError(f"rule spec {spec!r} has {len(ins)}->{len(outs)} tensors, {op.target} has "
                         f"{len(operands)}->{len(results)}")
    letters: dict[str, int] = {}
    for s in (*ins, *outs):
        for ch in s:
            if ch != "_" and ch not in letters:
                letters[ch] = len(letters)

    def tmap(v: int, s: str) -> TMap:
        if len(s) != len(program.values[v].shape):
            raise ValueError(f"rule spec {spec!r}: {s!r} does not match {program.values[v].name} "
                             f"{list(program.values[v].shape)} of {op.target}")
        return TMap(v, tuple(None if ch == "_" else letters[ch] for ch in s))

    in_letters = {ch for s in ins for ch in s if ch != "_"}
    rep = set(letters.values()) if replicate == "*" else {letters[c] for c in replicate if c in letters}
    return OpRule(
        name or op.target,
        "".join(letters),
        tuple(tmap(v, s) for v, s in zip(operands, ins)),
        tuple(tmap(v, s) for v, s in zip(results, outs)),
        frozenset(rep),
        tuple(frozenset(letters[c] for c in in_letters - set(s)) for s in outs) if reduced is None else
        tuple(frozenset(letters[c] for c in r if c in letters) for r in reduced),
        tuple(frozenset(letters[c] for c in m if c in letters)
              for m in ((mean,) * len(outs) if isinstance(mean, str) else mean)),
        frozenset(partialize),
    )


LETTERS = "abcdefghijklmnopqrstuvwxyz"


def dims_of(program: Program, v: int) -> tuple[int, ...]:
    return program.values[v].shape


def arg(op: Op, i: int, name: str | None = None, default: Any = None) -> Any:
    if i < len(op.args):
        return op.args[i]
    if name is not None:
        for k, a in op.kwargs:
            if k == name:
                return a
    return default


def named_arg(op: Op, name: str, default: Any = None) -> Any:
    """The argument called `name` in the op's schema, positional or keyword (`dim` of `sort.stable`)."""
    schema = getattr(op.overload, "_schema", None)
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.name == name:
            if a.has_default_value():
                default = a.default_value
            return dict(op.kwargs).get(name, default) if a.kwarg_only else arg(op, i, name, default)
    return dict(op.kwargs).get(name, default)
