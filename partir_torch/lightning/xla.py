"""`AutoShardStrategy` on torch_xla SPMD (`backend="xla"`).

    trainer = Trainer(strategy=AutoShardStrategy({"batch": 2, "model": 4}), max_steps=100)
    trainer.fit(MyLightningModule(), train_loader)

How it fits Lightning (2.6): torch_xla SPMD is one process driving every device through one virtual XLA
device, so the strategy is a single-device strategy on that device, with a small accelerator that reports
it (Lightning's own XLA accelerator and strategies spawn a process per device, which is not SPMD). On the
first training batch the strategy captures the module's own `training_step` on that batch with the
optimizer `configure_optimizers` returned, searches a plan (or takes `plan=`), applies it with
`partir_torch.backends.xla` (the same path as `auto_shard`), rebuilds the optimizer on the sharded
parameters (LR schedulers are pointed at it), and logs the plan table. Each batch is then sharded as the
plan says, and each optimizer step ends the XLA graph (`zero_grad(set_to_none=True)`, then
`torch_xla.sync()`: gradients are temporaries of the step, as in the costed program). At teardown the
module is unsharded: its own parameters come back holding the trained values (Lightning then moves it to
the CPU, as it does for every strategy). While the step is captured, `self.log` / `self.log_dict` of the
module are silenced (they would log fake tensors).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from pytorch_lightning.accelerators import Accelerator
from pytorch_lightning.strategies import SingleDeviceStrategy

from partir_torch import _compat
from partir_torch.errors import PartirError
from partir_torch.lightning.common import _loss_of, _repoint, _Silenced
from partir_torch.options import Options

log = logging.getLogger(__name__)


class SpmdXlaAccelerator(Accelerator):
    """The one virtual XLA device of torch_xla's SPMD mode (the mesh's devices sit behind it)."""

    def setup_device(self, device: torch.device) -> None:
        pass

    def teardown(self) -> None:
        pass

    @staticmethod
    def parse_devices(devices: Any) -> int:
        return 1

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("xla", 0)]

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        import importlib.util

        return importlib.util.find_spec("torch_xla") is not None

    @staticmethod
    def name() -> str:
        return "partir_spmd_xla"

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return {}

    @classmethod
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        pass


class AutoShardStrategy(SingleDeviceStrategy):
    """Search a sharding plan for the `LightningModule`'s training step on `mesh` and train with it.

    `mesh`, `options` (an `Options`, and keywords named like its fields: `budget`, `schedule`, `memory`, ...),
    `plan` and `backend` are `auto_shard`'s (`backend="torch"`: `TorchAutoShardStrategy`, one process per
    device). After `fit`, `strategy.plan` is the applied `ShardingPlan`."""

    strategy_name = "partir_auto_shard"

    def __new__(cls, mesh=None, *, backend: str | None = None, **options: Any):
        """`backend` as `auto_shard` chooses it (`api.choose_backend`): "torch" gives a
        `TorchAutoShardStrategy`."""
        from partir_torch.api import choose_backend

        if cls is AutoShardStrategy and choose_backend(backend) == "torch":
            from partir_torch.lightning.distributed import TorchAutoShardStrategy

            return TorchAutoShardStrategy(mesh, **options)
        return super().__new__(cls)

    def __init__(self, mesh, *, options: Options | None = None, plan=None, backend: str | None = None,
                 **overrides: Any) -> None:
        from partir_torch.ir.mesh import parse_mesh

        self.mesh, _ = parse_mesh(mesh)  # a bad mesh (or option) is reported when the Trainer is built
        self._mesh_arg = mesh
        self.options = Options.of(options, **overrides)
        self.plan = plan
        self._sharded = False
        super().__init__(device=torch.device("xla", 0), accelerator=SpmdXlaAccelerator())

    def setup_environment(self) -> None:
        from partir_torch.backends import xla

        note = xla.start_runtime(self.mesh.devices)
        if note:
            log.info(note)
        super().setup_environment()

    def model_to_device(self) -> None:
        """Nothing yet: the model moves with its plan's shardings on the first batch."""

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        from partir_torch.backends import xla

        module = self.lightning_module
        leaves, spec = _compat.pytree.tree_flatten(batch)
        tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if not self._sharded:
            if module is None or not module.trainer.training:
                return super().batch_to_device(batch, device, dataloader_idx)
            self._shard(module, leaves, spec, tensors)
        xs = xla.shard_batch(module, *(leaves[i] for i in tensors))
        for i, x in zip(tensors, xs):
            leaves[i] = x
        return _compat.pytree.tree_unflatten(leaves, spec)

    def _shard(self, module, leaves: list, spec, tensors: list[int]) -> None:
        from partir_torch.api import checked_plan
        from partir_torch.backends import xla

        if len(self.optimizers) != 1:
            raise PartirError(f"AutoShardStrategy shards one optimizer; configure_optimizers returned "
                              f"{len(self.optimizers)}")
        template = self.optimizers[0]

        def loss_fn(model, *xs: torch.Tensor) -> torch.Tensor:
            full = list(leaves)
            for i, x in zip(tensors, xs):
                full[i] = x
            return _loss_of(model.training_step(_compat.pytree.tree_unflatten(full, spec), 0))

        example = [leaves[i] for i in tensors]
        options = self.options if self.options.hardware else Options.of(self.options, hardware=xla.hardware_preset())
        with _Silenced(module):
            plan, m = checked_plan(module, example, self._mesh_arg, loss_fn=loss_fn, optimizer=template,
                                   options=options, plan=self.plan)
        opt = xla.apply(module, template, plan, xla.device_mesh(m, plan.dcn_axes), loss_fn=loss_fn)
        _repoint(self, template, opt)
        self.plan, self._sharded = plan, True
        module.print(f"partir_torch: {type(module).__name__} sharded over {m}\n{plan.table()}")

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        from partir_torch.backends import xla

        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        optimizer.zero_grad(set_to_none=True)  # gradients are temporaries of the step, not graph outputs
        xla.sync()
        return out

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                for k, v in super().lightning_module_state_dict().items()}

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return _compat.pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v,
                               super().optimizer_state(optimizer))

    def teardown(self) -> None:
        from partir_torch.backends.held import held_by

        module = self.lightning_module
        engine = held_by(module) if module is not None else None
        if engine is not None:
            engine.unshard(module)
        self.optimizers = []
        super().teardown()
