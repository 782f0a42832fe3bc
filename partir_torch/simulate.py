"""The oracle for rules, propagation and lowering: run a sharded program as N per-device programs in torch.

Every value lives as one local tensor per device of the mesh, laid out by its sharding (a tile of the
global tensor, or a summand when partial). Each op runs on every device with its operands converted to the
layout its factor assignment needs; the collectives between layouts are emulated exactly (assemble the
global tensor from the locals, cut the new locals). Shape arguments (view sizes, creation sizes) are
localized from the result's local shape. The result — loss, gradients, updated parameters and states — is
compared with the unsharded `Program.run`. Replicated values are checked to be equal on every device.

Random ops (torch tag `nondeterministic_seeded`: dropout's `bernoulli`, `rand_like`) model a per-device
stream indexed by the global element (`rules/random.py`): the simulator restores the generator state the
unsharded run started from, draws each random tensor whole, in program order, and gives every device its
tile, so a sharded dropout mask is the unsharded one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from partir_torch.ir.mesh import Mesh
from partir_torch.ir.program import Program
from partir_torch.ir.sharding import Sharding
from partir_torch.lower import Collective, lower, required_operand, transitions
from partir_torch.lower.local import local_args, region, run_local, subst
from partir_torch.propagate import ShardingState
from partir_torch.rules.base import op_tags, tensor_args
from partir_torch.rules.random import SEEDED_TAG


@dataclass
class SimResult:
    max_abs_diff: float
    diffs: dict[str, float]  # per output value name
    max_rel_diff: float  # max over outputs of diff / max(1, max |reference|)
    replica_mismatch: float
    collectives: list[Collective]
    executed: dict[str, int] = field(default_factory=dict)  # collective kind -> times emulated
    rel_diffs: dict[str, float] = field(default_factory=dict)  # per output: diff / max(1, max |reference|)


class _Mesh:
    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.coords = [dict(zip(mesh.names, c)) for c in itertools.product(*(range(s) for _, s in mesh.axes))]

    def region(self, sh: Sharding, shape: tuple[int, ...], c: dict[str, int]) -> tuple[slice | torch.Tensor, ...]:
        return region(self.mesh, sh, shape, c)

    def scatter(self, g: torch.Tensor, sh: Sharding) -> list[torch.Tensor]:
        locs = []
        for c in self.coords:
            t = g[self.region(sh, tuple(g.shape), c)].clone()
            if sh.partial and any(c[a] != 0 for a in sh.partial):
                t = torch.zeros_like(t)
            locs.append(t)
        return locs

    def gather(
        self, locs: list[torch.Tensor], sh: Sharding, shape: tuple[int, ...], dtype
    ) -> tuple[torch.Tensor, float]:
        used = {a for ax in sh.dims for a in ax} | set(sh.partial)
        g = torch.zeros(shape, dtype=dtype)
        for c, t in zip(self.coords, locs):
            if all(c[a] == 0 for a in self.mesh.names if a not in used):
                reg = self.region(sh, shape, c)
                if sh.partial:
                    g[reg] += t
                else:
                    g[reg] = t
        mismatch = 0.0
        if not sh.partial and g.is_floating_point():
            for c, t in zip(self.coords, locs):
                mismatch = max(mismatch, (t - g[self.region(sh, shape, c)]).abs().max().item() if t.numel() else 0.0)
        return g, mismatch


def simulate(
    program: Program,
    state: ShardingState,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    inputs: Sequence[torch.Tensor],
    opt_states: dict[str, dict[str, torch.Tensor]] | None = None,
) -> SimResult:
    rng = torch.get_rng_state()
    ref = program.run(params, buffers, inputs, opt_states)
    torch.set_rng_state(rng)  # random ops below draw what the unsharded run drew
    m = _Mesh(state.mesh)
    env: dict[int, list[torch.Tensor]] = {}
    layout: dict[int, Sharding] = {}
    executed: dict[str, int] = {}
    mismatch = 0.0

    def convert(v: int, dst: Sharding) -> list[torch.Tensor]:
        nonlocal mismatch
        src = layout[v]
        if src == dst:
            return env[v]
        val = program.values[v]
        for kind, _, _ in transitions(src, dst, val.shape, val.dtype.itemsize, state.mesh):
            executed[kind] = executed.get(kind, 0) + 1
        g, mm = m.gather(env[v], src, val.shape, val.dtype)
        if not _uninitialized(program, v):  # `empty` memory differs per device until it is written
            mismatch = max(mismatch, mm)
        return m.scatter(g, dst)

    # program inputs
    flat = {}
    for n, vid in program.params.items():
        flat[vid] = params[n]
    for n, vid in program.buffers.items():
        flat[vid] = buffers[n]
    first = next(iter(program.opt_states), None)
    for s, vid in program.shared_states.items():
        flat[vid] = (opt_states or {})[first][s]
    for p, st in program.opt_states.items():
        for s, vid in st.items():
            if s not in program.shared_states:
                flat[vid] = (opt_states or {})[p][s]
    for h, vid in program.hypers.items():
        flat[vid] = torch.tensor(program.hyper_values[h], dtype=program.values[vid].dtype)
    for i, vid in enumerate(program.inputs):
        flat[vid] = inputs[i]
    for attr, vid in program.constants.items():
        flat[vid] = getattr(program.graph_module, attr)
    for vid, g in flat.items():
        env[vid] = m.scatter(g.detach(), state.shard[vid])
        layout[vid] = state.shard[vid]

    for op in program.ops:
        rule = state.rules[op.id]
        results = [o for o in op.outputs if o >= 0]
        if SEEDED_TAG in op_tags(op.target):  # drawn whole from the global stream, each device keeps its tile
            it = iter(m.gather(env[t.value], layout[t.value], program.values[t.value].shape,
                               program.values[t.value].dtype)[0] for t in rule.operands)
            out = op.overload(*subst(op.args, it), **{k: subst(a, it) for k, a in op.kwargs})
            outs = [t for o_id, t in zip(op.outputs, out if isinstance(out, (tuple, list)) else [out]) if o_id >= 0]
            for r, (v, t) in enumerate(zip(results, outs)):
                env[v], layout[v] = m.scatter(t, state.op_output(op.id, r)), state.op_output(op.id, r)
                env[v] = convert(v, state.shard[v])
                layout[v] = state.shard[v]
            continue
        operands = [convert(t.value, required_operand(state, op.id, i)) for i, t in enumerate(rule.operands)]
        if not rule.operands and (meta := tensor_args(op)):  # read for dtype and device only (`new_zeros`)
            operands = [env[v] for v in meta]
        out_locals: list[list[torch.Tensor]] = [[] for _ in results]
        contiguous = op.target in ("aten.view.default", "aten._unsafe_view.default")
        for d in range(len(m.coords)):
            # a local shard's strides differ from the global tensor's: views need contiguous inputs
            it = iter(ops_[d].contiguous() if contiguous else ops_[d] for ops_ in operands)
            args, kwargs = local_args(op, subst(op.args, it), {k: subst(a, it) for k, a in op.kwargs}, state)
            out = run_local(op, args, kwargs, state, m.coords[d])
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            j = 0
            for o_id, t in zip(op.outputs, outs):
                if o_id < 0:
                    continue
                out_locals[j].append(t)
                j += 1
        for r, v in enumerate(results):
            k = state.mean_scale(op.id, r)
            locs = [t / k for t in out_locals[r]] if k > 1 else out_locals[r]
            env[v], layout[v] = locs, state.op_output(op.id, r)
            env[v] = convert(v, state.shard[v])
            layout[v] = state.shard[v]

    diffs: dict[str, float] = {}
    rels: dict[str, float] = {}
    for vid in program.outputs:
        val = program.values[vid]
        g, mm = m.gather(env[vid], layout[vid], val.shape, val.dtype)
        mismatch = max(mismatch, mm)
        r = ref[vid]
        diffs[val.name] = (g.double() - r.double()).abs().max().item() if r.numel() and r.is_floating_point() else (
            float((g != r).any().item()))
        scale = max(1.0, r.double().abs().max().item()) if r.numel() and r.is_floating_point() else 1.0
        rels[val.name] = diffs[val.name] / scale
    return SimResult(max(diffs.values(), default=0.0), diffs, max(rels.values(), default=0.0), mismatch,
                     lower(state), executed, rels)


def _uninitialized(program: Program, v: int) -> bool:
    p = program.values[v].producer
    return p >= 0 and "empty" in program.ops[p].target


TOLERANCE = 1e-5  # max relative difference, fp32, sharded vs unsharded, that is read as exact
FP64_TOLERANCE = 1e-9  # the same in fp64, when fp32 rounding alone exceeds TOLERANCE
# Sums taken in another order round differently: the relative difference a sharded output of each dtype may
# show from rounding alone (bf16 keeps 8 significant bits, eps 7.8e-3; fp16 11, eps 9.8e-4). Beyond it the
# plan is wrong; within it, the float64 re-run tells rounding from a wrong plan.
ROUNDING = {torch.float64: FP64_TOLERANCE, torch.float32: TOLERANCE, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def rounding(dtype: torch.dtype) -> float:
    """The relative difference rounding alone explains in a step computing in `dtype`."""
    return ROUNDING.get(dtype, 0.0)


def simulate_fp64(state, model, inputs: Sequence[torch.Tensor], loss_fn, optimizer, opt_states, *,
                  seed: int = 0, **capture_options: Any) -> float | None:
    """The plan of `state` simulated on the same step captured in fp64: its max relative difference (where
    fp32 rounding alone exceeds `TOLERANCE`, e.g. BatchNorm over a few elements, this tells rounding from a
    wrong plan). The state's decisions are replayed on the fp64 program; None if they shard it otherwise."""
    import copy

    from partir_torch.capture import capture
    from partir_torch.capture.precision import all_float64
    from partir_torch.tactics.schedule import replay

    m64 = copy.deepcopy(model).double()
    in64 = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    with all_float64():  # the model's own casts (`x.float()`, `.to(torch.bfloat16)`) too
        p64 = capture(m64, in64, loss_fn, optimizer, **capture_options)
    st64 = replay(p64, state.mesh, list(state.actions), fallback=state.analysis.fallback)
    same = [(n, st64.shard[v]) for n, v in st64.program.params.items()]
    if same != [(n, state.shard[v]) for n, v in state.program.params.items()]:
        return None
    shared = set(p64.shared_states)
    states = {n: {k: v if k in shared else v.double() for k, v in st.items()} for n, st in opt_states.items()}
    torch.manual_seed(seed)
    return simulate(st64.program, st64, {n: q.detach() for n, q in m64.named_parameters()},
                    dict(m64.named_buffers()), in64, states).max_rel_diff
