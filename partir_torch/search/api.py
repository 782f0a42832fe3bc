"""`Auto`, the search tactic, and `search()`, the one-call entry point that returns a `ShardingPlan`.

`Auto(axes, goal)` sits in a schedule beside the manual tactics: `"batch:BatchParallel;model:Auto"` searches
the model axis starting from the batch-parallel state; `"*:Auto"` (or `Auto(("batch", "model"))`) searches
every axis the earlier tactics left free. Several axes are searched one after the other, each with its
share of the budget, from the state the previous one left ("incremental", the method's), or all in one
tree ("joint"). They land in different basins on different models (`benchmarks/search.py` measures both;
docs/search.md has the figures), so the default ("both") gives each
30 % of the budget, then spends the last 40 % on the MCTS refinement (prune, then hill-climb; see `mcts.py`)
from both plans and from the expert composites (`seeds.py`), over all the axes at once, and keeps the best.
No name is read anywhere: the action space comes from roles and groups (`space.py`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar

from partir_torch.cost.hardware import Hardware, format_bytes, parse_bytes
from partir_torch.cost.hardware import hardware as get_hardware
from partir_torch.errors import PartirError
from partir_torch.options import DEFAULT_HARDWARE, Options
from partir_torch.propagate import ShardingState
from partir_torch.search.baselines import ALGORITHMS
from partir_torch.search.budget import Budget, Result
from partir_torch.search.goals import GOAL_ACTIONS, Evaluator, check_goal
from partir_torch.search.mcts import MCTS
from partir_torch.search.seeds import composites
from partir_torch.search.space import replay
from partir_torch.tactics import Context, apply_schedule, parse_schedule, register_tactic, wants_fallback

log = logging.getLogger(__name__)


class InfeasibleError(PartirError):
    """No plan found fits in memory; the message reports the best one and what would help."""


@dataclass(frozen=True)
class SearchConfig:
    """What `Auto` needs beyond its axes: the cost model's setting, the budget, the algorithm. What a search
    did (its log) is the schedule's `Context`'s, not the options'."""

    hw: Hardware = field(default_factory=lambda: get_hardware("cpu-virtual"))
    dcn_axes: frozenset[str] = frozenset()
    memory_limit: float | None = None
    seed: int = 0
    budget: Budget = field(default_factory=Budget)
    algorithm: str = "mcts"
    progress: bool | str | None = None  # None: a bar on a terminal, a line every few seconds elsewhere
    # ablations (benchmarks/search.py): prune=False offers every syntactically possible action (no
    # propagation-based pruning); goals=False searches all axes in one tree for the plain step time with a
    # memory penalty (no per-axis goals, no relaxed memory limit for earlier axes, no goal's action kinds)
    prune: bool = True
    goals: bool = True

    @classmethod
    def of(cls, options: Options, dcn_axes: frozenset[str] = frozenset()) -> SearchConfig:
        """The search's setting of the user's `options`, resolved: the hardware preset, the memory limit in
        bytes, the budget."""
        hw = get_hardware(options.hardware or DEFAULT_HARDWARE)
        cap = parse_bytes(options.bucket_cap)
        hw = hw if cap == hw.bucket_cap else replace(hw, bucket_cap=cap)  # (the engine's buckets, priced)
        return cls(hw, frozenset(dcn_axes), parse_bytes(options.memory),
                   options.seed, Budget.parse(options.budget), options.algorithm, options.progress,
                   prune=options.prune, goals=options.goals)


@register_tactic("Auto")
@dataclass(frozen=True)
class Auto:
    """Search the sharding of `axes` (None: every axis not used by an earlier tactic); a `tactics.Tactic`."""

    axes: tuple[str, ...] | None = None
    goal: str = "time"
    mode: str = "both"  # incremental | joint | both (30 % of the budget each, then a refinement from both)
    searched: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_goal(self.goal)
        if self.mode not in ("incremental", "joint", "both"):
            raise PartirError(f"Auto mode must be 'incremental', 'joint' or 'both', got {self.mode!r}")

    @classmethod
    def from_text(cls, axes: tuple[str, ...] | None, args: list[str]) -> Auto:
        """`axes:Auto`, `axes:Auto(goal)`, `axes:Auto(goal, mode)`."""
        if len(args) > 2:
            raise PartirError(f"Auto takes a goal and a mode, got {args}")
        return cls(axes, *args)

    def text(self) -> str:
        """The schedule text that reads back as this tactic (`from_text`), defaults left out: `*:Auto`."""
        args = [self.goal, self.mode]
        while args and args[-1] == ("time", "both")[len(args) - 1]:
            args.pop()
        return f"{','.join(self.axes) if self.axes else '*'}:Auto" + (f"({', '.join(args)})" if args else "")

    def free_axes(self, state: ShardingState) -> tuple[str, ...]:
        if self.axes is not None:
            for a in self.axes:
                state.mesh.size(a)
            return self.axes
        used = {a for sh in state.shard for a in sh.axes}
        return tuple(a for a in state.mesh.names if a not in used)

    def apply(self, state: ShardingState, context: Context[SearchConfig] | None = None) -> ShardingState:
        """The best state found from `state` (which is left as it was) with `context.search`'s setting; what
        the search did goes to `context.log`, and `context.cancel` ends it with its best plan."""
        context = context if context is not None else Context()
        config = context.search or SearchConfig()
        n0, t0 = len(context.log), time.perf_counter()
        out = self._search(state, context, config)
        _warn_small_budget(config, context.log[n0:], time.perf_counter() - t0)
        return out

    def _search(self, state: ShardingState, context: Context, config: SearchConfig) -> ShardingState:
        axes = self.free_axes(state)
        if not axes:
            return state
        if not config.goals:  # ablation: one joint tree, the plain reward, the full memory limit
            res = run_search(state, axes, "time", config, config.budget, context.cancel, seed=config.seed)
            context.log.append({"axes": list(axes), "goal": None, "algorithm": config.algorithm,
                                "actions": [str(a) for a in res.actions], **res.stats.to_json()})
            context.trace.append(list(res.actions))
            return res.state.copy()
        if self.mode == "both" and len(axes) > 1:
            # the two orders of search fall into different basins (benchmarks/search.py): run both (30 % of the
            # budget each), then refine from the plans of both and from the expert composites (`seeds.py`; the
            # last 40 %) and keep the best
            part, share = config.budget.share(0.3), config.budget.share(0.4)
            ev = Evaluator(config.hw, config.dcn_axes, config.memory_limit, self.goal)
            runs = []
            for mode in ("incremental", "joint"):
                sub = Context(replace(config, budget=part), cancel=context.cancel)
                trial = replace(self, mode=mode)._search(state.copy(), sub, sub.search)
                runs.append((ev.key(ev.report(trial)), mode, trial, sub.log, [a for r in sub.trace for a in r]))
            _, mode, best, _, _ = min(runs, key=lambda r: r[0])
            for r in runs:
                for e in r[3]:
                    e["mode"], e["chosen"] = r[1], r[1] == mode and config.algorithm != "mcts"
                context.log.extend(r[3])
            if config.algorithm != "mcts":
                return best
            experts = self._composites(state, axes, config, ev)
            res = refine_from(state, axes, self.goal, config, share, [r[4] for r in runs] + experts, context.cancel)
            taken = ev.key(ev.report(res.state)) <= min(r[0] for r in runs)
            if taken:
                best = res.state.copy()
            else:  # the better of the two runs stands (the log's chosen entries are its plan)
                for e in next(r[3] for r in runs if r[1] == mode):
                    e["chosen"] = True
            context.log.append({"axes": list(axes), "goal": self.goal, "algorithm": config.algorithm,
                                "mode": "refine", "chosen": taken, "from": mode,
                                "actions": [str(a) for a in res.actions], **res.stats.to_json()})
            context.trace.append(list(res.actions))
            if context.cancel.is_set():  # Ctrl-C: the best plan seen, fitting when one was (an expert composite
                best = self._best_seen(state, best, experts, ev, context.log)  # fits where a cut-short one did not)
            return best
        groups = [axes] if self.mode == "joint" else [(a,) for a in axes]
        budget = config.budget.split(len(groups))
        limit = config.hw.memory if config.memory_limit is None else config.memory_limit
        for i, ax in enumerate(groups):
            # axis by axis, the axes still to come will divide memory further: an earlier axis need only fit
            # within the limit times their sizes (else it would spend itself on memory the next axis saves)
            later = math.prod(state.mesh.size(a) for g in groups[i + 1:] for a in g)
            cfg = replace(config, memory_limit=limit * later)
            res = run_search(state, ax, self.goal, cfg, budget, context.cancel, seed=config.seed + i)
            context.log.append({"axes": list(ax), "goal": self.goal, "algorithm": config.algorithm,
                                "actions": [str(a) for a in res.actions], **res.stats.to_json()})
            context.trace.append(list(res.actions))
            state = res.state.copy()  # the next axis continues from the best plan
        return state

    def _best_seen(self, state: ShardingState, best: ShardingState, experts: list[list], ev: Evaluator,
                   entries: list[dict[str, Any]]) -> ShardingState:
        """`best`, or the expert composite (replayed from `state`) that scores better: after Ctrl-C the search's
        own plan may be one of its first phase's, made under that phase's relaxed memory limit."""
        key, chosen = ev.key(ev.report(best)), None
        for actions in experts:
            s = replay(state, actions)
            if s is not None and (k := ev.key(ev.report(s))) < key:
                best, key, chosen = s.copy(), k, actions
        entries[-1]["interrupted"] = True
        if chosen is not None:
            for e in entries:
                e["chosen"] = False
            entries.append({"axes": list(self.free_axes(state)), "goal": self.goal, "algorithm": "expert",
                               "mode": "expert", "chosen": True, "actions": [str(a) for a in chosen], "episodes": 0,
                               "states": 1, "evaluations": 1, "time_s": 0.0, "propagation_time_s": 0.0,
                               "cost_time_s": 0.0})
        return best

    def _composites(self, state: ShardingState, axes: tuple[str, ...], config: SearchConfig, ev: Evaluator
                    ) -> list[list]:
        """The expert composites' actions (`seeds.py`), where the goal allows their moves; with FSDP or Megatron
        over a DCN axis too when none of the others fits in memory."""
        if not GOAL_ACTIONS[self.goal] >= {"input", "param", "optimizer"}:
            return []
        out = [a for _, a in composites(state, axes, config.dcn_axes)]
        if set(axes) & config.dcn_axes and not any(
                (s := replay(state, a)) is not None and not ev.key(ev.report(s)).infeasible for a in out):
            out += [a for _, a in composites(state, axes, config.dcn_axes, over_dcn=True)]
        return out


def refine_from(state: ShardingState, axes: tuple[str, ...], goal: str, config: SearchConfig, budget: Budget,
                starts: list[list], cancel: threading.Event) -> Result:
    """The local search (`local.LocalSearch`: prune, then hill-climb) from each of `starts` (action lists
    from `state`), run by an `MCTS` with no share of its own: under a time budget, the time the refinement
    leaves when it reaches a local optimum goes to a tree search from `state` (then refines again)."""
    ev = Evaluator(config.hw, config.dcn_axes, config.memory_limit, goal)
    # seed + 1: another tree than "joint"'s
    m = MCTS(state, ev, axes, GOAL_ACTIONS[goal], seed=config.seed + 1, prune=config.prune, cancel=cancel)
    return m.run(budget, refine=1.0, starts=starts)


def run_search(state: ShardingState, axes: tuple[str, ...], goal: str, config: SearchConfig, budget: Budget,
               cancel: threading.Event, *, seed: int = 0) -> Result:
    ev = Evaluator(config.hw, config.dcn_axes, config.memory_limit, goal, goals=config.goals)
    kinds = GOAL_ACTIONS[goal]
    if config.algorithm == "mcts":
        return MCTS(state, ev, axes, kinds, seed=seed, progress=config.progress, prune=config.prune,
                    cancel=cancel).run(budget)
    fn = ALGORITHMS.get(config.algorithm)
    if fn is None:
        raise PartirError(f"unknown search algorithm {config.algorithm!r}; known: mcts, {', '.join(ALGORITHMS)}")
    return fn(state, ev, axes, kinds, budget, seed=seed)


def search(model, example_inputs, mesh, *, loss_fn=None, optimizer="adamw", options: Options | None = None,
           mode: str | None = None, require_fit: bool = True, dcn_axes=(), **overrides: Any):
    """Find a sharding plan for one training step of `model` on `mesh` (`{"batch": 2, "model": 4}`,
    `"batch=2:dcn,model=4"` or a `Mesh`, with `dcn_axes` its cross-node axes) and return it as a
    `ShardingPlan` (specs, cost report, statistics); `partir_torch.find_plan`.

    `options` (an `Options`) and keywords named like its fields (`budget="30s"`, `schedule=...`, `memory=...`,
    `hardware=...`, `fallback=True`, ...; they override `options`) say how: `options.py` documents each.
    `optimizer`: a name ("adamw") or the user's torch.optim instance. With `require_fit` an `InfeasibleError`
    reports the best plan when none fits. `mode="inference"` plans the forward pass only (`loss_fn` unused);
    without it a missing `loss_fn` is an error.
    """
    from partir_torch.capture import capture
    from partir_torch.ir.mesh import check_devices, parse_mesh

    opts = Options.of(options, **overrides)
    mesh, marked = parse_mesh(mesh)
    check_devices(mesh, opts.devices)
    config = SearchConfig.of(opts, frozenset(dcn_axes) | marked)
    schedule = opts.schedule
    tactics = parse_schedule(schedule, mesh) if isinstance(schedule, str) else list(schedule or [Auto(goal=opts.goal)])
    fallback = opts.fallback or wants_fallback(schedule)
    from partir_torch.capture.loop import loop_of

    text = schedule if isinstance(schedule, str) else ";".join(t.text() for t in tactics)

    def plan_with(remat: str | None):
        program = capture(model, example_inputs, loss_fn, optimizer, fold=opts.fold, mode=mode, fallback=fallback,
                          assume_compiling=opts.assume_compiling,
                          loop=loop_of(Options.of(opts, remat=remat)) if mode != "inference" else None)
        return plan_program(program, mesh, tactics, config, schedule=text, fallback=fallback, cache=opts.cache,
                            options={"fold": opts.fold, "mode": mode})

    plan, _ = best_remat(opts, plan_with)
    if plan.blocked:  # said, not hidden: the table has them too
        warnings.warn(f"{len(plan.blocked)} dim(s) keep mesh axes from splitting the step: "
                      + "; ".join(b["text"] for b in plan.blocked[:3]), stacklevel=2)
    from partir_torch.plan.table import roles

    idle = [a for a, what in roles(plan).items() if not what and plan.mesh[a] > 1 and
            not any(b["axis"] == a for b in plan.blocked)]
    if idle:  # a replicated step is a choice of the cost model, said as such
        warnings.warn(f"the plan splits nothing over {', '.join(f'{a!r} ({plan.mesh[a]} devices)' for a in idle)}: "
                      "those devices repeat the same step, which the cost model prices below splitting it (each "
                      "collective's fixed cost exceeds the compute it would save: a small step); a larger batch "
                      "or model, or schedule='batch:BatchParallel', splits it", stacklevel=2)
    if require_fit and not plan.cost["feasible"]:
        raise InfeasibleError(infeasible_message(plan, mesh))
    return plan


REMAT_MODES = (None, "selective", "full")  # what remat="auto" searches, each with the whole budget


def better(a, b) -> bool:
    """Plan `a` over `b`: fitting first, then the faster predicted step."""
    return (not a.cost["feasible"], a.cost["step_time_s"]) < (not b.cost["feasible"], b.cost["step_time_s"])


def best_remat(opts: Options, plan_with: Callable[[str | None], tuple]) -> tuple:
    """`plan_with(remat)` (a tuple, the plan first) for the remat mode `opts` asks for; under "auto", for each
    of `REMAT_MODES`, the one whose plan is `better`."""
    best = None
    for remat in REMAT_MODES if opts.remat == "auto" else (opts.remat,):
        got = plan_with(remat)
        if best is None or better(got[0], best[0]):
            best = got
    return best


def plan_key(program, mesh, tactics: list, config: SearchConfig, *, fallback: bool, options: dict[str, Any]) -> str:
    """The program-level key of the plan cache (`partir_torch/cache.py`): the program's content hash, the
    mesh and its DCN axes, every figure of the hardware, the tactics, the search options."""
    from partir_torch import cache

    return cache.digest({"program": program.content_hash(), "mesh": list(mesh.axes),
                         "dcn": sorted(config.dcn_axes), "hardware": asdict(config.hw),
                         "tactics": [repr(t) for t in tactics], "memory_limit": config.memory_limit,
                         "seed": config.seed, "budget": repr(config.budget), "algorithm": config.algorithm,
                         "prune": config.prune, "goals": config.goals, "fallback": fallback, **options})


def plan_program(program, mesh, tactics: list, config: SearchConfig, *, schedule: str | None, fallback: bool,
                 cache: bool = True, options: dict[str, Any] | None = None, need_state: bool = False):
    """(plan, state) of a captured program: the plan cache's plan for this program and setting when it holds
    one (state None), else the schedule applied (searching its `Auto` tactics) and the plan stored.
    `need_state`: always plan (the caller needs the state), and store the plan."""
    from partir_torch import cache as plan_cache
    from partir_torch.cost.model import evaluate
    from partir_torch.plan import ShardingPlan
    from partir_torch.search.blocked import blocked_axes

    key = plan_key(program, mesh, tactics, config, fallback=fallback, options=options or {}) if cache else None
    if key is not None and not need_state:
        hit = plan_cache.read("plans", key)
        if hit is not None:
            try:
                plan = ShardingPlan.from_json(hit["plan"])
            except (KeyError, TypeError, ValueError, PartirError) as e:
                warnings.warn(f"ignoring the corrupt plan cache entry {plan_cache.path('plans', key)} ({e!r}); "
                              "planning again", plan_cache.CacheWarning, stacklevel=3)
            else:
                plan.cache = {"level": "program", "key": key, "file": str(plan_cache.path("plans", key))}
                log.info("partir_torch: plan from the cache (%s)", plan.cache["file"])
                return plan, None
    context = Context(config)
    state = apply_schedule(program, mesh, tactics, context=context, fallback=fallback)
    report = evaluate(state, config.hw, dcn_axes=config.dcn_axes, memory_limit=config.memory_limit)
    plan = ShardingPlan.from_state(state, report, schedule=schedule, hardware=config.hw.name,
                                   dcn_axes=config.dcn_axes, search=summarize_log(context.log, config.budget))
    plan.blocked = blocked_axes(state)
    if key is not None:
        plan_cache.write("plans", key, {"plan": plan.to_json()})
    return plan, state


def _warn_small_budget(config: SearchConfig, entries: list[dict], elapsed: float) -> None:
    """A time budget the search overran (each sub-search runs at least one episode) was too small to search."""
    seconds = config.budget.seconds
    if seconds is None or not entries or elapsed <= 2 * seconds:
        return
    episodes = sum(e.get("episodes", 0) for e in entries)
    warnings.warn(f"search budget {seconds:g} s is too small for this program: the search ran {episodes} episode(s) "
                  f"(at least one per sub-search) in {elapsed:.2f} s, and the plan is what those found; give it more "
                  f"time (e.g. --budget {max(10, math.ceil(20 * elapsed))}s) or a number of episodes", stacklevel=4)


def summarize_log(entries: list[dict[str, Any]], budget: Budget | None = None) -> dict[str, Any] | None:
    if not entries:
        return None
    keys = ("episodes", "states", "evaluations", "time_s", "propagation_time_s", "cost_time_s")
    out: dict[str, Any] = {k: sum(e[k] for e in entries) for k in keys}
    if budget is not None:
        out["budget"] = {"episodes": budget.episodes, "seconds": budget.seconds}
    out["evaluations_per_s"] = out["evaluations"] / out["time_s"] if out["time_s"] else 0.0
    out["algorithm"] = entries[0]["algorithm"]
    if any(e.get("interrupted") for e in entries):
        out["interrupted"] = True
    out["per_axis"] = entries
    return out


def infeasible_message(plan, mesh) -> str:
    c = plan.cost
    best = plan.search and [e["actions"] for e in plan.search["per_axis"] if e.get("chosen", True)]
    if plan.search and plan.search.get("interrupted"):
        s = plan.search
        return (f"the search was interrupted (Ctrl-C) after {s['episodes']} episodes in {s['time_s']:.1f} s and saw no "
                f"plan that fits in {format_bytes(c['memory_limit'])} per device (the best seen needs "
                f"{format_bytes(c['peak_memory_bytes'])}; neither did the expert plans): let it run longer, or give "
                "a number of episodes (--budget 200, the default, runs to the end however long it takes)")
    return (f"no plan found fits in memory: the best one needs {format_bytes(c['peak_memory_bytes'])} per device, "
            f"the limit is {format_bytes(c['memory_limit'])} (mesh {mesh}; best plan: {best}). "
            "To fit: use more devices or a bigger mesh axis, add an axis to shard the model over, lower the batch "
            "size, or raise the budget (--budget) so the search explores further.")
