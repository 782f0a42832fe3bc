"""`TorchAutoShardStrategy`: Lightning's whole `fit` on the torch backend (torch.distributed), one process a device.

Lightning launches the ranks (`Trainer(accelerator="cpu", devices=4)` on gloo, GPUs on NCCL, or torchrun's).
On the first training batch rank 0 plans the module's own `training_step` and every rank applies the plan
(`auto_shard`); from then on:
- a training batch is the plan's step (`partir_torch.step`): forward, backward, clipping and update in one
  program, so Lightning's backward and optimizer step are no-ops here. `Trainer(gradient_clip_val=...,
  gradient_clip_algorithm="norm"|"value")` clips inside it (`Options.max_grad_norm` / `max_grad_value`), by the
  global norm over every shard.
- `accumulate_grad_batches=k`: the window's k batches run as one step of k microbatches (gradients summed and
  divided by k, as Lightning's `loss / k` backward calls leave them), when its last batch arrives; the window's
  earlier batches return a NaN loss (their losses are known at the window's end, where they are logged). A
  short last window (the epoch's end) divides by k too, as Lightning does.
- what `training_step` logs (`self.log`, `self.log_dict`) is returned by the step and logged after it, one
  value per batch, with the keywords the module gave; so is `loss`.
- `validation_step`, `test_step` and `predict_step` run as written: the module's forward (`self(x)`) is the
  plan's forward program (`steps.py`), its outputs whole on every rank.
- a last batch of another size runs the plan made again for it; one the plan cannot split (or that cannot join
  its window's microbatches) is dropped with one warning: `DataLoader(drop_last=True)` leaves it out.
- checkpoints hold whole tensors (`get_model_state_dict(full_state_dict=True)`), so a `.ckpt` resumes here,
  on another mesh, or without partir_torch; at teardown the module is unsharded.
Every rank reads the whole batch (the sampler is not split by rank: the plan splits it), and the ranks check
they read the same first batch. With `use_distributed_sampler=False` the loader's own order is kept.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from pytorch_lightning.strategies import DDPStrategy

from partir_torch import _compat
from partir_torch.backends.distributed.variants import Undivided
from partir_torch.backends.held import held_by
from partir_torch.errors import PartirError
from partir_torch.lightning.common import _loss_of, _repoint, _Silenced
from partir_torch.options import Options

log = logging.getLogger(__name__)


class TorchAutoShardStrategy(DDPStrategy):
    """`AutoShardStrategy(mesh, backend="torch")` (the module docstring)."""

    strategy_name = "partir_auto_shard_torch"

    def __init__(self, mesh, *, options: Options | None = None, compile: bool = False, plan=None,
                 **overrides: Any) -> None:
        from partir_torch.ir.mesh import parse_mesh

        self.mesh, _ = parse_mesh(mesh)
        self._mesh_arg, self.plan, self.compile = mesh, plan, compile
        self.options = Options.of(options, **overrides)
        self._sharded = False
        self._window: list[list[torch.Tensor]] = []  # the accumulation window's batches so far
        self._how: dict[str, dict] = {}  # each logged name's keywords, as training_step gave them
        self._dropped = False
        super().__init__()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # every rank the global batch

    def configure_ddp(self) -> None:
        """No DDP wrapper: the plan is the parallelism."""

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        module = self.lightning_module
        if not self._sharded and module is not None and module.trainer.training:
            leaves, spec = _compat.pytree.tree_flatten(batch)
            self._shard(module, leaves, spec, [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)])
        return batch

    def _loop_options(self, trainer) -> Options:
        """The trainer's clipping and accumulation as the plan's options."""
        from pytorch_lightning.utilities.model_helpers import is_overridden

        if is_overridden("configure_gradient_clipping", self.lightning_module):
            raise PartirError("configure_gradient_clipping is overridden: on the torch backend the gradients are "
                              "clipped inside the planned step, by Trainer(gradient_clip_val=..., "
                              "gradient_clip_algorithm='norm'|'value'); remove the override")
        clip, how = trainer.gradient_clip_val, trainer.gradient_clip_algorithm or "norm"
        over: dict[str, Any] = {"accumulate": trainer.accumulate_grad_batches}
        if clip:
            over["max_grad_norm" if str(how) in ("norm", "GradClipAlgorithmType.NORM") else "max_grad_value"] = \
                float(clip)
        return Options.of(self.options, **over)

    def _shard(self, module, leaves: list, spec, tensors: list[int]) -> None:
        from partir_torch.backends.distributed import shard

        if len(self.optimizers) != 1:
            raise PartirError(f"AutoShardStrategy shards one optimizer; configure_optimizers returned "
                              f"{len(self.optimizers)}")
        template, how = self.optimizers[0], self._how
        options = self._loop_options(module.trainer)

        def loss_fn(model, *xs: torch.Tensor):
            full = list(leaves)
            for i, x in zip(tensors, xs):
                full[i] = x
            logged: dict[str, Any] = {}
            with _Silenced(model, logged, how):
                loss = _loss_of(model.training_step(_compat.pytree.tree_unflatten(full, spec), 0))
            return loss, {k: v for k, v in logged.items() if isinstance(v, torch.Tensor)}

        first = [leaves[i] for i in tensors]
        shard.same_tensors(first, "first training batch",
                           "every rank must pass the whole global batch: keep Lightning's distributed sampler "
                           "(`use_distributed_sampler=True`, one seed on every rank), or give the loader's sampler "
                           "the same seed on every rank")
        k = options.accumulate  # the plan is made for a whole window: k batches stacked
        example = [torch.cat([x] * k) if k > 1 else x for x in first]
        _, opt = shard.auto_shard(module, example, self._mesh_arg, loss_fn=loss_fn, optimizer=template,
                                  plan=self.plan, compile=self.compile, options=options)
        _repoint(self, template, opt)
        self.plan, self._sharded, self._tensors = module.partir_plan, True, tensors
        if self.global_rank == 0:
            module.print(f"partir_torch: {type(module).__name__} sharded over {self.mesh} on torch.distributed\n"
                         f"{self.plan.table()}")

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        leaves, _ = _compat.pytree.tree_flatten(args[0])
        module = self.lightning_module
        trainer = module.trainer
        self._window.append([leaves[i] for i in self._tensors])
        if trainer.fit_loop.epoch_loop._should_accumulate():  # (Lightning steps at the window's last batch)
            return torch.tensor(math.nan)
        window, self._window = self._window, []
        return self._step(module, window, trainer.accumulate_grad_batches)

    def _step(self, module, window: list[list[torch.Tensor]], k: int) -> torch.Tensor:
        """The window's batches as one step of len(window) microbatches, their sum divided by k; the values
        the step returns logged per batch."""
        from partir_torch.backends.distributed import steps

        shapes = [[tuple(x.shape) for x in b] for b in window]
        kept = [b for b, s in zip(window, shapes) if s == shapes[0]]
        if len(kept) < len(window):
            self._drop(f"a batch of shape {shapes[-1]} cannot join its window's microbatches of {shapes[0]}")
        batch = [torch.cat(parts) for parts in zip(*kept)] if len(kept) > 1 else kept[0]
        aux: dict[str, torch.Tensor] = {}
        try:
            loss = steps.step(module, self.optimizers[0], *batch, accumulate=len(kept), divide=k, aux=aux)
        except Undivided as e:
            self._drop(str(e))
            return torch.tensor(math.nan)
        for i in range(len(kept)):
            for name, values in aux.items():
                module.log(name, values.reshape(-1)[i], **self._how.get(name, {}))
        if "loss" not in aux:
            module.log("loss", loss, prog_bar=True)
        return loss

    def _drop(self, why: str) -> None:
        if not self._dropped:
            self._dropped = True
            log.warning("partir_torch: a training batch is dropped (%s); DataLoader(drop_last=True) leaves such "
                        "batches out", why)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        return closure_loss  # the rank program's backward ran in `training_step`

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        return closure()  # the step (forward, backward, clipping, update) is the rank program, run by the closure

    def lightning_module_state_dict(self) -> dict[str, Any]:
        engine = held_by(self.lightning_module)
        return super().lightning_module_state_dict() if engine is None else engine.state_dict(self.lightning_module)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if not self._sharded:
            return super().optimizer_state(optimizer)
        return get_optimizer_state_dict(self.lightning_module, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def teardown(self) -> None:
        module = self.lightning_module
        engine = held_by(module) if module is not None else None
        if engine is not None:
            engine.unshard(module)
        self.optimizers = []
        super().teardown()
