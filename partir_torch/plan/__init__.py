"""Sharding plans: per-parameter / input / optimizer-state partition specs with their cost, as JSON.

Specs are torch_xla's form: one entry per tensor dim, `None`, an axis name, or a list of axis names (major
to minor). `ShardingPlan.to_json()` keeps at least `mesh.axes`, `params`, `inputs`, `optimizer_state`,
`cost` (`step_time_s`, `peak_memory_bytes`, `comm_bytes` by collective kind) and, for searched plans,
`search`; `ShardingPlan.from_json` reads it back.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from partir_torch.capture.fold import full_names
from partir_torch.errors import PartirError
from partir_torch.ir.mesh import Mesh
from partir_torch.ir.program import Loop
from partir_torch.ir.sharding import divides, tile_count
from partir_torch.plan.reads import (
    call_constraints,
    grad_shardings,
    grads_made,
    model_output,
    module_inputs,
    output_shardings,
    param_reads,
    read_grads,
)
from partir_torch.propagate import ShardingState

Spec = list  # one entry per dim: None, an axis name, or a list of axis names (major to minor)


_POLICY = ("param_dtype", "reduce_dtype", "remat")  # `Loop` fields written only where set (older plans lack them)


@dataclass(frozen=True)
class PlanSpecs:
    params: dict[str, Spec]
    inputs: list[Spec]
    optimizer_state: dict[str, dict[str, Spec]]  # per parameter, per per-parameter state
    activations: dict[str, Spec] = field(default_factory=dict)  # module path -> spec of its output
    grads: dict[str, Spec] = field(default_factory=dict)  # parameter -> spec its gradient is reduced to
    module_inputs: dict[str, list] = field(default_factory=dict)  # module path -> [input spec, its gradient's or None]
    param_reads: dict[str, Spec] = field(default_factory=dict)  # parameter -> spec its module's forward reads it in
    calls: dict[str, dict[str, dict]] = field(default_factory=dict)  # module path -> call number -> constraints
    output: list | None = None  # [shape, spec the loss reads the model's output in, its gradient's or None]
    grads_made: dict[str, Spec] = field(default_factory=dict)  # parameter -> spec its gradient is made in (reads)
    read_grads: dict[str, Spec] = field(default_factory=dict)  # parameter -> spec its shared read's gradient is made in


def _output_json(state: ShardingState) -> list | None:
    got = model_output(state)
    if got is None:
        return None
    v, need, grad = got
    return [list(state.program.values[v].shape), need.to_spec(), grad.to_spec() if grad is not None else None]


def _out_json(out) -> list | None:
    if out is None:
        return None
    shape, sh, summed = out
    if summed is None:
        return [list(shape), sh.to_spec()]
    return [list(shape), sh.to_spec(), summed.to_json()]


def _calls_json(state: ShardingState) -> dict[str, dict[str, dict]]:
    """`reads.call_constraints` as JSON: {path: {call: {"ins": [[shape, nth, spec, grad spec or None]], "out":
    [shape, spec] or [shape, spec, {"over": axes, "by": rule, "reduced": spec, "grad": spec or None}] (a sum
    its readers reduce-scatter: `reads.PendingSum`) or None, "fn": the function's
    name}}}, a folded program's element 1 standing for elements 1..N-1."""
    out: dict[str, dict[str, dict]] = {}
    for (path, k), c in sorted(call_constraints(state).items()):
        entry = {"ins": [[list(shape), nth, need.to_spec(), grad.to_spec() if grad is not None else None]
                         for shape, nth, need, grad in c["ins"]],
                 "out": _out_json(c["out"]), "fn": c["fn"]}
        names = [k2.removesuffix(".") for k2 in full_names(path + ".", state.program.fold)] if path else [""]
        for name in names:
            out.setdefault(name, {})[str(k)] = entry
    return out


def _expander(p):
    """Names of the full model: for a folded program, element 1's entries stand for elements 1..N-1."""
    fold = p.fold

    def expand(d: dict[str, Any]) -> dict[str, Any]:
        return {full: spec for n, spec in d.items() for full in full_names(n, fold)} if fold else d

    return expand


def _names(names: list[str], top: int = 8) -> str:
    return ", ".join(names[:top]) + (f" … ({len(names) - top} more)" if len(names) > top else "")


def divisibility(what: str, shape: tuple[int, ...], spec: Spec, mesh: dict[str, int]) -> list[str]:
    out = []
    for d, entry in enumerate(spec[: len(shape)]):
        axes = [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
        unknown = [a for a in axes if a not in mesh]
        if unknown:
            out.append(f"{what} dim {d} is tiled over {unknown}, which the mesh {mesh} does not have")
            continue
        k = tile_count(Mesh.of(mesh), axes)
        if not divides(shape[d], Mesh.of(mesh), axes):
            out.append(f"{what} dim {d} (size {shape[d]}) does not divide over {axes} ({k} devices)")
    return out


def specs(state: ShardingState) -> PlanSpecs:
    """Specs of the full model: for a folded program, element 1's specs stand for elements 1..N-1."""
    p = state.program
    fold = p.fold
    expand = _expander(p)
    reads, ends = param_reads(state), grad_shardings(state)

    return PlanSpecs(
        expand({n: state.shard[v].to_spec() for n, v in p.params.items()}),
        [state.shard[v].to_spec() for v in p.inputs],
        expand({n: {s: state.shard[v].to_spec() for s, v in st.items() if s not in p.shared_states}
                for n, st in p.opt_states.items()}),
        {k.removesuffix("."): spec for path, sh in output_shardings(state).items()
         for k in full_names(path + ".", fold) for spec in [sh.to_spec()]},
        expand({n: sh.to_spec() for n, sh in ends.items()}),
        {k.removesuffix("."): [need.to_spec(), grad.to_spec() if grad is not None else None]
         for path, (_, need, grad) in module_inputs(state).items() for k in full_names(path + ".", fold)},
        expand({n: need.to_spec() for n, need in reads.items()}),
        _calls_json(state),
        _output_json(state),
        expand({n: sh.to_spec() for n, sh in grads_made(state, ends).items()}),
        expand({n: sh.to_spec() for n, sh in read_grads(state, reads).items()}),
    )


FORMAT = 7  # the version of the saved plan's JSON; `load` refuses other versions (2: `calls` outs; 3: calls
# on constants are not numbered, `capture.attribution.Constants`; 4: a pending sum's gradient spec is where the
# optimizer reads it, `reads.grad_shardings`; 5: `grads_made`, the tiling a reduce-scattered gradient is made
# in, and `read_grads`, a tied weight's read's gradient; 6: `decisions` and `state_hash`, the plan is its
# decisions, replayed to rebuild the state it was costed on; 7: the decisions are actions only, a manual
# tactic's as the actions it took)


class PlanMismatchError(PartirError):
    """A saved plan does not fit the model (or mesh) it is applied to; the message lists every mismatch."""


@dataclass
class ShardingPlan:
    """Everything needed to apply a plan (parameter, buffer, input, optimizer-state, activation and gradient
    specs), what it was made for (mesh with its DCN axes, hardware, schedule, the shapes and the content
    hash of the captured program) and what the cost model predicts for it."""

    mesh: dict[str, int]
    params: dict[str, Spec]
    inputs: list[Spec]
    optimizer_state: dict[str, dict[str, Spec]]
    cost: dict[str, Any]
    schedule: str | None = None
    hardware: str | None = None
    dcn_axes: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    search: dict[str, Any] | None = None
    buffers: dict[str, Spec] = field(default_factory=dict)
    activations: dict[str, Spec] = field(default_factory=dict)  # module path -> spec of its output
    grads: dict[str, Spec] = field(default_factory=dict)
    module_inputs: dict[str, list] = field(default_factory=dict)  # module path -> [input spec, its gradient's or None]
    param_reads: dict[str, Spec] = field(default_factory=dict)  # parameter -> spec its module's forward reads it in
    calls: dict[str, dict[str, dict]] = field(default_factory=dict)  # module path -> call -> constraints (PlanSpecs)
    output: list | None = None  # the model's output as the loss reads it (PlanSpecs)
    grads_made: dict[str, Spec] = field(default_factory=dict)  # parameter -> spec its gradient is made in (PlanSpecs)
    read_grads: dict[str, Spec] = field(default_factory=dict)  # parameter -> its shared read's gradient (PlanSpecs)
    shapes: dict[str, Any] = field(default_factory=dict)  # {"params": {n: shape}, "buffers": ..., "inputs": [...]}
    input_args: list[int | str | None] = field(default_factory=list)  # forward argument of each input
    optimizer: str | None = None
    program_hash: str | None = None
    # dims that keep a mesh axis from being used (`search.blocked`): {"axis", "what", "size", "divisor", "text"}
    blocked: list[dict[str, Any]] = field(default_factory=list)
    cache: dict[str, Any] | None = None  # set when the plan came from the plan cache: {"level", "key", "file"}
    # the program was captured with torch.compiler.is_compiling() true (`capture(assume_compiling=True)`): a
    # backend runs the model's forward so too, on the path the library takes when compiled, as captured
    compiling: bool = False
    # the state's decisions in order (`str(action)`, `ir.actions`): replayed, they rebuild it exactly
    decisions: list[str] = field(default_factory=list)
    state_hash: str | None = None  # `ShardingState.digest()` of that state (a replay is checked against it)
    # what the CLI built the program from ({"model": zoo name or /abs/file.py:factory, "config": [KEY=VALUE]}),
    # so `partir-torch verify plan.json` needs no MODEL; None for a plan made in Python
    workload: dict[str, Any] | None = None
    # what the step does beyond one update (`ir.Loop`: accumulate, max_grad_norm, max_grad_value; where set,
    # the mixed-precision policy's param_dtype and reduce_dtype, and remat); its inputs are then the example
    # inputs stacked [k, b, ...]
    loop: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_state(cls, state: ShardingState, cost, *, schedule: str | None = None, hardware: str | None = None,
                   dcn_axes=(), search: dict[str, Any] | None = None) -> ShardingPlan:
        sp, p = specs(state), state.program
        expand = _expander(p)
        shapes = {"params": expand({n: list(p.values[v].shape) for n, v in p.params.items()}),
                  "buffers": expand({n: list(p.values[v].shape) for n, v in p.buffers.items()}),
                  "inputs": [list(p.values[v].shape) for v in p.inputs],
                  "module_inputs": {k.removesuffix("."): list(p.values[v].shape)
                                    for path, (v, _, _) in module_inputs(state).items()
                                    for k in full_names(path + ".", p.fold)}}
        return cls(dict(state.mesh.axes), cost=cost.to_json(), schedule=schedule, hardware=hardware,
                   dcn_axes=sorted(dcn_axes), conflicts=[c.describe(p) for c in state.conflicts], search=search,
                   buffers=expand({n: state.shard[v].to_spec() for n, v in p.buffers.items()}), shapes=shapes,
                   input_args=list(p.input_args), optimizer=p.optimizer, program_hash=p.content_hash(),
                   compiling=p.compiling, decisions=[str(d) for d in state.actions],
                   loop={k: v for k, v in asdict(p.loop).items() if k != "divide" and (v is not None or k not in
                                                                                          _POLICY)}
                   if p.loop != Loop() else {},
                   state_hash=state.digest(), **{f.name: getattr(sp, f.name) for f in fields(PlanSpecs)})

    @property
    def specs(self) -> PlanSpecs:
        """What a backend applies (every `PlanSpecs` field, by name)."""
        return PlanSpecs(**{f.name: getattr(self, f.name) for f in fields(PlanSpecs)})

    def to_json(self) -> dict[str, Any]:
        out = {"format": FORMAT, "mesh": {"axes": self.mesh, "dcn": self.dcn_axes}, "schedule": self.schedule,
               "hardware": self.hardware, "optimizer": self.optimizer, "program_hash": self.program_hash,
               "params": self.params, "buffers": self.buffers, "inputs": self.inputs, "input_args": self.input_args,
               "optimizer_state": self.optimizer_state, "activations": self.activations, "grads": self.grads,
               "module_inputs": self.module_inputs, "param_reads": self.param_reads, "calls": self.calls,
               "output": self.output, "grads_made": self.grads_made, "read_grads": self.read_grads,
               "shapes": self.shapes,
               "cost": self.cost, "conflicts": self.conflicts, "blocked": self.blocked,
               "decisions": self.decisions, "state_hash": self.state_hash}
        if self.compiling:
            out["compiling"] = True
        if self.loop:
            out["loop"] = self.loop
        if self.workload is not None:
            out["workload"] = self.workload
        if self.search is not None:
            out["search"] = self.search
        if self.cache is not None:
            out["cache"] = self.cache
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any] | str) -> ShardingPlan:
        d = json.loads(d) if isinstance(d, str) else d
        if d["format"] != FORMAT:  # (no format at all: not a plan, a KeyError)
            raise PlanMismatchError(f"plan format {d['format']!r} is not this version's ({FORMAT}): a plan is now "
                                    "saved with its decisions as actions, which older files lack; search the plan "
                                    "again with this version of partir_torch (partir_torch.find_plan(...) or "
                                    "`partir-torch plan`) and save it")
        return cls(dict(d["mesh"]["axes"]), d["params"], d["inputs"], d["optimizer_state"], d["cost"],
                   d.get("schedule"), d.get("hardware"), list(d["mesh"].get("dcn", [])), d.get("conflicts", []),
                   d.get("search"), d.get("buffers", {}), d.get("activations", {}), d.get("grads", {}),
                   d.get("module_inputs", {}), d.get("param_reads", {}), d.get("calls", {}), d.get("output"),
                   d.get("grads_made", {}), d.get("read_grads", {}), d.get("shapes", {}),
                   d.get("input_args", []),
                   d.get("optimizer"), d.get("program_hash"), d.get("blocked", []), d.get("cache"),
                   bool(d.get("compiling", False)), list(d.get("decisions", [])), d.get("state_hash"),
                   d.get("workload"), dict(d.get("loop", {})))

    def save(self, path: str | os.PathLike) -> None:
        """The plan as JSON (`ShardingPlan.load` reads it back)."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> ShardingPlan:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise PartirError(f"cannot read a plan from {str(path)!r}: {e.strerror}; write one with plan.save(path) "
                              "or `partir-torch plan ... --out PATH`") from e
        try:
            return cls.from_json(text)
        except (ValueError, KeyError, TypeError) as e:
            raise PartirError(f"{str(path)!r} is not a saved ShardingPlan ({e!r}); write one with plan.save(path) "
                              "or `partir-torch plan ... --out PATH`") from e

    def check(self, model, example_inputs=None, mesh: dict[str, int] | None = None) -> None:
        """Raise `PlanMismatchError` listing every way the plan does not fit `model` (and `example_inputs`,
        and `mesh` when given): missing and extra names, shape mismatches, an axis that no longer divides."""
        problems: list[str] = []
        if mesh is not None and dict(mesh) != dict(self.mesh):
            problems.append(f"the plan is for mesh {self.mesh}, not {dict(mesh)}: search again for this mesh "
                            "or apply the plan on its own mesh")
        tensors = {"parameter": (dict(model.named_parameters()), self.params, self.shapes.get("params", {})),
                   "buffer": (dict(model.named_buffers()), self.buffers, self.shapes.get("buffers", {}))}
        for kind, (have, planned, shapes) in tensors.items():
            missing = [n for n in planned if n not in have]
            extra = [n for n in have if n not in planned and (kind == "parameter" or n in shapes)]
            if missing:
                problems.append(f"{kind}s in the plan but not in the model: {_names(missing)}")
            if extra:
                problems.append(f"{kind}s in the model but not in the plan: {_names(extra)}")
            for n, t in have.items():
                want = shapes.get(n)
                if want is not None and list(t.shape) != list(want):
                    problems.append(f"{kind} {n} has shape {list(t.shape)}, the plan was made for {want}")
                elif n in planned:
                    problems += divisibility(f"{kind} {n}", tuple(t.shape), planned[n], self.mesh)
        if example_inputs is not None:
            xs = (example_inputs,) if hasattr(example_inputs, "shape") else tuple(example_inputs)
            if len(xs) != len(self.inputs):
                problems.append(f"{len(xs)} example inputs given, the plan has {len(self.inputs)}")
            k = self.loop.get("accumulate", 1)  # (the step takes the inputs' rows as k microbatches stacked)
            for i, (x, want) in enumerate(zip(xs, self.shapes.get("inputs", [None] * len(xs)))):
                shape = list(x.shape) if k == 1 or not x.shape or x.shape[0] % k else [k, x.shape[0] // k,
                                                                                       *x.shape[1:]]
                if want is not None and shape != list(want):
                    problems.append(f"input {i} has shape {list(x.shape)}, the plan was made for {want}")
                elif i < len(self.inputs):
                    problems += divisibility(f"input {i}", tuple(shape), self.inputs[i], self.mesh)
        if problems:
            raise PlanMismatchError("the plan does not fit this model:\n  - " + "\n  - ".join(problems))

    def to_state(self, program, *, fallback: bool = False) -> ShardingState:
        """The state the plan was costed on, on `program` (the step of the model the plan was made for, folded
        or not): its decisions replayed (`tactics.schedule.replay`), checked against `state_hash`, so a
        backend runs, and the simulator proves, exactly what was searched. A mismatch (another model, config
        or version) raises `PlanMismatchError`."""
        from partir_torch.ir.actions import parse_action
        from partir_torch.tactics.schedule import replay

        mesh = Mesh.of(self.mesh)
        try:
            state = replay(program, mesh, [parse_action(t) for t in self.decisions], fallback=fallback)
        except (PartirError, ValueError) as e:
            raise PlanMismatchError(f"the plan's decisions do not apply to this program (was it made for another "
                                    f"model, config or partir_torch version?): {e}") from e
        same_program = self.program_hash is None or program.content_hash() == self.program_hash
        got, mine = specs(state), self.specs
        diff = [f"parameter {n}: the plan says {mine.params[n]}, its decisions give {got.params.get(n)}"
                for n in mine.params if got.params.get(n) != mine.params[n]]
        diff += [f"input {i}: the plan says {b}, its decisions give {a}"
                 for i, (a, b) in enumerate(zip(got.inputs, mine.inputs)) if a != b]
        # on the program it was searched on, the whole state is checked; on the same model's step captured
        # unfolded (a backend runs every layer), the specs of every parameter, input and optimizer state
        if (same_program and self.state_hash is not None and state.digest() != self.state_hash) or diff or (
                got.optimizer_state != mine.optimizer_state):
            raise PlanMismatchError("replaying the plan's decisions does not rebuild the state it was costed on (was "
                                    "it made for another model, config or partir_torch version?)"
                                    + "".join(f"\n  - {x}" for x in diff[:20]))
        return state

    def table(self, top: int = 20) -> str:
        """What each mesh axis does, the inputs, the sharded parameters and optimizer states, the cost, what
        blocks an axis: readable in a terminal (`plan/table.py`)."""
        from partir_torch.plan.table import table

        return table(self, top)
