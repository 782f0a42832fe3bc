"""`auto_shard` on torch.distributed: plan once, agree, apply on every rank.

    the ranks compare their model's weights (digests): a rank that built its own (another seed) fails at once;
    rank 0 searches (or loads the plan given) and broadcasts it (or its error) to every rank;
    every rank captures the step unfolded and replays the plan's decisions (`ShardingPlan.to_state`);
    the ranks compare what they hold (the plan's and the state's digests) and all raise if any differs or
        failed: a time budget or a rank's failure never leaves ranks on different plans or waiting;
    every rank applies it (`engine.apply`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from partir_torch.backends.distributed import engine, steps
from partir_torch.backends.distributed.runtime import DistributedError, RankMesh, connect
from partir_torch.errors import PartirError
from partir_torch.ir.mesh import parse_mesh
from partir_torch.options import Options
from partir_torch.plan import ShardingPlan


def hardware_of(device: torch.device) -> tuple[str, str | None]:
    """(preset, note): the preset of the accelerator this rank runs on; `cpu-virtual`, with a one-line note,
    when it is none the presets know."""
    from partir_torch.cost.hardware import preset_for

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        preset = preset_for(name)
        if preset is not None:
            return preset, None
        return "cpu-virtual", f"partir_torch: no preset for {name!r}; planning for cpu-virtual (give hardware=)"
    return "cpu-virtual", f"partir_torch: no accelerator found ({device.type}); planning for cpu-virtual"


def _everyone(rm: RankMesh, what: str, ok: bool, value: Any) -> list[Any]:
    """Every rank's (ok, value); all raise when any rank failed."""
    got: list[Any] = [None] * rm.world
    dist.all_gather_object(got, (ok, value))
    failed = [(r, v) for r, (k, v) in enumerate(got) if not k]
    if failed:
        r, v = failed[0]
        raise DistributedError(f"{what} failed on rank {r}" + (f" (and {len(failed) - 1} more)" if len(failed) > 1
                                                               else "") + f": {v}")
    return [v for _, v in got]


def same_tensors(batch: Sequence[torch.Tensor], what: str, fix: str) -> None:
    """Every rank holds the same tensors (compared by digest), else every rank raises: the plan splits one
    global batch of one model, so ranks that read different data (or built different weights) would each train
    a part of none of them, silently."""
    h = hashlib.sha256()
    for t in batch:
        h.update(f"{tuple(t.shape)} {t.dtype};".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # (no copy if CPU)
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, h.hexdigest()[:12])
    _agree(got, what, "digests", fix)


def _agree(held: list[Any], what: str, of: str, fix: str) -> None:
    """Every rank raises, naming the ranks of each value, unless all ranks hold the same."""
    if len(set(held)) != 1:
        ranks = {h: [r for r, x in enumerate(held) if x == h] for h in dict.fromkeys(held)}
        raise DistributedError(f"the ranks hold different {what} ({of} by rank: {ranks}); {fix}")


def plan_on_rank0(rm: RankMesh, make: Callable[[], ShardingPlan]) -> ShardingPlan:
    """`make()` on rank 0, its plan (or its error) broadcast to every rank."""
    box: list[Any] = [None]
    if rm.rank == 0:
        try:
            box[0] = (True, make().to_json())
        except PartirError as e:
            box[0] = (False, f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    ok, payload = box[0]
    if not ok:
        raise DistributedError(f"planning failed on rank 0: {payload}")
    return ShardingPlan.from_json(payload)


def auto_shard(model: nn.Module, example_inputs: Sequence[torch.Tensor] | torch.Tensor, mesh, *,
               loss_fn: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer,
               options: Options, plan: ShardingPlan | str | None = None,
               compile: bool = False, init_fn: Callable[[nn.Module], None] | None = None
               ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Plan (rank 0) with `options`, agree and apply `model`'s step over `mesh` on this rank (module
    docstring)."""
    import partir_torch.search  # noqa: F401  (the search's actions, read back from a plan's decisions)
    from partir_torch.backends.distributed import materialize
    from partir_torch.capture import capture
    from partir_torch.ir.program import Loop
    from partir_torch.search.api import search

    rng = torch.get_rng_state()  # a meta model is initialized from the generator as the caller left it
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        materialize.check(model, init_fn)  # (before the search: a model it cannot initialize fails at once)
    m, dcn = parse_mesh(mesh)
    rm = connect(m, dcn)
    if options.hardware in (None, "measure"):  # the ranks' own collectives and compute (`calibrate.py`)
        from partir_torch.backends.distributed.calibrate import measured

        options = Options.of(options, hardware=measured(rm, base=hardware_of(rm.device)[0]))
    fallback = options.fallback

    def make() -> ShardingPlan:
        if plan is None:
            return search(model, example_inputs, m, loss_fn=loss_fn, optimizer=optimizer, options=options,
                          dcn_axes=dcn)
        return plan if isinstance(plan, ShardingPlan) else ShardingPlan.load(plan)

    same_tensors([t for t in (*model.parameters(), *model.buffers()) if not t.is_meta], "initial weights",
                 "build the model alike on every rank (the same seed: torch.manual_seed before building it, or "
                 "load the same checkpoint); partir_torch shards one model, it does not average ranks' models")
    the_plan = plan_on_rank0(rm, make)
    try:
        the_plan.check(model, example_inputs, mesh=dict(m.axes))
        program = capture(model, example_inputs, loss_fn, optimizer, fold=False, fallback=fallback,
                          assume_compiling=the_plan.compiling, loop=Loop(**the_plan.loop))
        state = the_plan.to_state(program, fallback=fallback)
        mine = (the_plan.state_hash, state.digest())
        ok: tuple[bool, Any] = (True, mine)
    except PartirError as e:
        ok = (False, f"{type(e).__name__}: {e}")
    _agree(_everyone(rm, "rebuilding the plan", *ok), "plans", "plan, state digests",
           "every rank must capture the same model, inputs and loss (seed them alike)")
    from partir_torch.cost.hardware import parse_bytes

    opt = engine.apply(model, optimizer, the_plan, state, rm, compile=compile, loss_fn=loss_fn, fallback=fallback,
                       bucket_cap=int(parse_bytes(options.bucket_cap)), hardware=options.hardware, init_fn=init_fn,
                       rng=rng)
    steps.install_forward(model)
    return model, opt
