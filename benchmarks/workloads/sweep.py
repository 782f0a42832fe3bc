"""The model sweep: each third-party architecture (`benchmarks/workloads/thirdparty.py`) through the whole pipeline.

For one architecture: build it from a tiny config, capture its training step with AdamW, run `coverage`,
plan on a mesh (`Auto` on every axis, a small episode budget) — without fallback, and, when that stops on an
op without a rule, again with fallback — then run the plan in the per-device simulator against unsharded
execution. `SweepResult.stage` is the first stage that failed ("ok" if none); coverage and plan must agree
(`agrees`). `tests/models/test_sweep.py` asserts this per architecture; `benchmarks/models.py` writes the
table (`docs/models.md`, `benchmarks/results/models.json`) and regenerates the test's known failures.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch

from partir_torch.errors import CaptureError, PartirError
from partir_torch.simulate import FP64_TOLERANCE, TOLERANCE

STAGES = ("build", "capture", "plan", "simulate", "ok")
TOL, TOL64 = TOLERANCE, FP64_TOLERANCE  # (simulate's: fp32, and fp64 where fp32 rounding alone exceeds TOL)
# the batch axis data-parallel (so every plan shards something and the simulation is never vacuous), the
# model axis searched
SCHEDULE = "batch:BatchParallel;model:Auto"
# the device memory the search gets: this fraction of the batch-parallel plan's peak, so it must shard the
# model axis too (at these sizes, communication would otherwise always lose to replication)
MEMORY_FRACTION = 0.6


def _plan(program, mesh, budget: int, seed: int, *, fallback: bool):
    """`SCHEDULE` with the memory limit `MEMORY_FRACTION` of the batch-parallel peak."""
    from partir_torch.cost import evaluate, hardware
    from partir_torch.search.api import SearchConfig
    from partir_torch.search.mcts import Budget
    from partir_torch.tactics import apply_schedule

    hw = hardware("cpu-virtual")
    base = apply_schedule(program, mesh, SCHEDULE.split(";")[0], fallback=fallback)
    limit = MEMORY_FRACTION * evaluate(base, hw).peak_memory_bytes
    config = SearchConfig(hw, memory_limit=limit, seed=seed, budget=Budget(episodes=budget))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the base plan's fallback warnings: the plan below warns again
        return apply_schedule(program, mesh, SCHEDULE, search=config, fallback=fallback)


@dataclass
class SweepResult:
    name: str
    stage: str = "build"  # the first stage that failed, or "ok"
    error: str | None = None
    params: int = 0
    ops: int = 0
    coverage_missing: list[str] = field(default_factory=list)
    planned_without_fallback: bool = False
    planned_with_fallback: bool = False
    fallback_warnings: list[str] = field(default_factory=list)
    agrees: bool = True  # coverage said ok exactly when plan without fallback succeeded
    sharded_params: str = ""
    max_rel_diff: float | None = None
    fp64_rel_diff: float | None = None  # the same plan simulated in fp64, when fp32 exceeded TOL
    comm_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _opt_states(params: dict[str, torch.Tensor], seed: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {n: {"exp_avg": torch.randn(p.shape, generator=g) * 0.01,
                "exp_avg_sq": torch.rand(p.shape, generator=g) * 0.01, "step": torch.tensor(3.0)}
            for n, p in params.items()}


def run(name: str, *, mesh: str = "batch=2,model=2", budget: int = 30, seed: int = 0,
        simulate_plan: bool = True) -> SweepResult:
    """One architecture through build, capture, coverage, plan (and fallback plan), simulate."""
    from benchmarks.workloads import thirdparty
    from partir_torch.ir import Mesh
    from partir_torch.lower import lower, summarize
    from partir_torch.rules.base import MissingRuleError
    from partir_torch.rules.decompose import coverage
    from partir_torch.simulate import simulate

    res = SweepResult(name)
    t = time.perf_counter()
    try:
        model, inputs, loss_fn = thirdparty.build(name, seed)
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.params = sum(p.numel() for p in model.parameters())
    res.stage = "capture"
    try:
        program = _capture(model, inputs, loss_fn, res.notes)
    except Exception as e:
        res.error = f"{type(e).__name__}: {str(e)[:600]}"
        return res
    res.ops = len(program.ops)
    res.times["capture_s"] = time.perf_counter() - t
    cov = coverage(program)
    res.coverage_missing = [str(u) for u in cov.missing] + cov.errors
    res.stage = "plan"
    t = time.perf_counter()
    m = Mesh.parse(mesh)
    state = None
    try:
        state = _plan(program, m, budget, seed, fallback=False)
        res.planned_without_fallback = True
    except MissingRuleError as e:
        res.error = str(e)[:600]
    except PartirError as e:
        res.error = f"{type(e).__name__}: {str(e)[:600]}"
        return res
    res.agrees = cov.ok == res.planned_without_fallback
    if state is None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                state = _plan(program, m, budget, seed, fallback=True)
            except PartirError as e:
                res.error = f"{type(e).__name__}: {str(e)[:600]}"
                return res
        res.fallback_warnings = [str(w.message) for w in caught if "no tile-mapping rule" in str(w.message)]
    res.planned_with_fallback = True
    res.times["plan_s"] = time.perf_counter() - t
    p = state.program
    sharded = sum(bool(state.shard[v].axes) for v in p.params.values())
    res.sharded_params = f"{sharded}/{len(p.params)}"
    res.comm_bytes = summarize(lower(state))
    if not simulate_plan:
        res.stage = "ok" if res.planned_without_fallback else "plan"
        return res
    res.stage = "simulate"
    t = time.perf_counter()
    params = {n: q.detach() for n, q in model.named_parameters()}
    torch.manual_seed(seed + 1)  # dropout draws: the same in the reference and the simulation
    try:
        sim = simulate(p, state, params, dict(model.named_buffers()), inputs, _opt_states(params, seed))
    except Exception as e:
        res.error = f"{type(e).__name__}: {str(e)[:600]}"
        return res
    res.times["simulate_s"] = time.perf_counter() - t
    res.max_rel_diff = sim.max_rel_diff
    if sim.max_rel_diff > TOL or sim.replica_mismatch > TOL:
        # fp32 itself can be further than TOL from the exact step (BatchNorm over a few elements is
        # ill-conditioned): the same plan is then run in fp64, where any rule error would still show
        res.fp64_rel_diff = _fp64_rel_diff(state, model, inputs, loss_fn, mesh, seed)
        if res.fp64_rel_diff is None or res.fp64_rel_diff > TOL64:
            worst = sorted(sim.diffs.items(), key=lambda kv: -kv[1])[:3]
            res.error = (f"sharded differs from unsharded: max relative {sim.max_rel_diff:.3g} in fp32, "
                         f"{res.fp64_rel_diff} in fp64; worst {worst}")
            return res
        res.notes.append(f"fp32 {sim.max_rel_diff:.1e} is rounding: the same plan in fp64 differs by "
                         f"{res.fp64_rel_diff:.1e}")
    res.stage = "ok" if res.planned_without_fallback else "plan"
    if res.stage == "plan":
        res.error = "plans and simulates only with fallback: " + "; ".join(res.coverage_missing)
    return res


def _capture(model, inputs, loss_fn, notes: list[str]):
    """Capture; when the error names the library's supported way through (its compile path, or its eval
    path for training-only constructs), or a submodule with data-dependent shapes that fallback=True captures
    as one replicated op, take it as a user would, and note it."""
    from partir_torch.capture import capture
    from partir_torch.capture.explain import EVAL_HINT

    kw: dict = {}
    for _ in range(4):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                program = capture(model, inputs, loss_fn, "adamw", **kw)
            notes += [str(w.message).split(";")[0] for w in caught if "capture (fallback)" in str(w.message)]
            return program
        except CaptureError as e:
            # the library's own ways first; fallback (an opaque, replicated module) only when nothing else helps
            if "assume_compiling=True" in str(e) and "assume_compiling" not in kw:
                kw["assume_compiling"] = True
                notes.append("captured with assume_compiling=True")
            elif EVAL_HINT in str(e) and model.training:
                model.eval()
                notes.append("captured in eval mode (a training-only construct)")
            elif "fallback=True" in str(e) and "fallback" not in kw:
                kw["fallback"] = True
                notes.append("captured with fallback=True")
            else:
                raise
    return capture(model, inputs, loss_fn, "adamw", **kw)


def _fp64_rel_diff(state, model, inputs, loss_fn, mesh: str, seed: int) -> float | None:
    """The plan of `state` simulated on the same step captured in fp64 (None if that program's ops differ)."""
    import copy

    from partir_torch.capture.precision import all_float64
    from partir_torch.rules.decompose import prepare
    from partir_torch.simulate import simulate

    m64 = copy.deepcopy(model).double()
    in64 = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    with all_float64():  # the model's own casts too
        p64 = prepare(_capture(m64, in64, loss_fn, []), fallback=True)
    p32 = state.program
    if [(o.target, o.outputs) for o in p64.ops] == [(o.target, o.outputs) for o in p32.ops] and [
            v.shape for v in p64.values] == [v.shape for v in p32.values]:
        st64 = state.copy()
        st64.program = p64  # same ops and value ids: the shardings and rules carry over
    else:  # fp64 adds or drops casts: replay the plan's actions by name, and check it is the same plan
        st64 = _replay(state, p64)
        if st64 is None:
            return None
    params = {n: q.detach() for n, q in m64.named_parameters()}
    states = {n: {k: v.double() for k, v in st.items()} for n, st in _opt_states(params, seed).items()}
    torch.manual_seed(seed + 1)
    return simulate(p64, st64, params, dict(m64.named_buffers()), in64, states).max_rel_diff


def _replay(state, program):
    """`state`'s actions applied to `program` (the same step in another dtype); None unless every value
    both programs name alike ends up with the same sharding."""
    from partir_torch.propagate import ShardingState

    new = ShardingState(program, state.mesh)
    for a in state.actions:  # tiles, replications and ZeRO moves alike (a plan is its actions)
        with contextlib.suppress(PartirError):  # one the other dtype's program does not take: checked below
            new.apply(a)
    ours = {v.name: state.shard[v.id] for v in state.program.values}
    same = all(ours[v.name] == new.shard[v.id] for v in program.values if v.name in ours)
    return new if same else None
