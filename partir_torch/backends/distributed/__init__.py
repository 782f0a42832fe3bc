"""The torch.distributed backend: a plan run as an explicit per-rank program (`rank.py`) with the plan's
collectives as functional collectives (`reshard.py`, the steps of `layout.walk`), on DTensor parameters and
optimizer states (`engine.py`), planned once and agreed on by every rank (`shard.py`), launched by torchrun
or `launch.spawn` (`runtime.py`, `launch.py`), measured as it runs (`measure.py`)."""
