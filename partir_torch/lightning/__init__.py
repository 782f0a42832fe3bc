"""`AutoShardStrategy`: a Lightning user shards a `LightningModule` by changing one argument of `Trainer`.

    trainer = Trainer(strategy=AutoShardStrategy({"batch": 2, "model": 2}), accelerator="cpu", devices=4)
    trainer.fit(MyLightningModule(), train_loader, val_loader)

`AutoShardStrategy(mesh, backend=None|"torch"|"xla", **options)`: on the torch backend (the default)
`TorchAutoShardStrategy` (`distributed.py`: Lightning launches a process per device), with `backend="xla"`
the torch_xla SPMD strategy (`xla.py`: one process drives every device).
"""

try:
    import pytorch_lightning  # noqa: F401
except ImportError as e:  # pragma: no cover - the environment pins it
    from partir_torch.errors import PartirError

    raise PartirError(
        f"partir_torch.lightning needs pytorch-lightning ({e}); pip install 'pytorch-lightning==2.6.6'"
    ) from e

from partir_torch.lightning.distributed import TorchAutoShardStrategy
from partir_torch.lightning.xla import AutoShardStrategy, SpmdXlaAccelerator

__all__ = ["AutoShardStrategy", "SpmdXlaAccelerator", "TorchAutoShardStrategy"]
