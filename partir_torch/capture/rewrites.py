"""Torch functions written out while capturing, into ops the rules can split and the engines draw alike.

- `F.multi_head_attention_forward`: batch-major with a heads dim (`capture/attention.py`);
- `F.dropout` on a tensor that is not row-major: drawn in its memory order (`capture/draws.py`).

Each computes the values torch's own function computes. `Rewrites` is entered below
`attribution.CallTracker`, so a rewritten call is still numbered once, as the engines count it.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from partir_torch.capture.attention import multi_head_attention_forward
from partir_torch.capture.draws import dropout

TABLE = {F.multi_head_attention_forward: multi_head_attention_forward, F.dropout: dropout}


class Rewrites(TorchFunctionMode):
    """While capturing: each function of `TABLE` as its rewrite."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return TABLE.get(func, func)(*args, **(kwargs or {}))
