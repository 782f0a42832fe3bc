"""`nn.MultiheadAttention` written out batch-major with a heads dim (`capture/attention.py`): the values torch's
own code computes, and a packed q/k/v projection that plans like separate ones."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch import nn

from partir_torch.capture import capture
from partir_torch.capture.rewrites import Rewrites

E, H, L, S, B = 16, 4, 5, 7, 3


def _case(batch_first: bool, separate: bool, kpm: str | None, mask: str | None):
    kdim = 12 if separate else None
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, H, dropout=0.25, batch_first=batch_first, kdim=kdim, vdim=kdim).double()
    q = torch.randn((B, L, E) if batch_first else (L, B, E), dtype=torch.double)
    n = S if separate else L
    k = torch.randn((B, n, 12) if batch_first else (n, B, 12), dtype=torch.double) if separate else q
    pad = None if kpm is None else torch.arange(n).expand(B, n) >= n - torch.arange(B)[:, None]
    if kpm == "float" and pad is not None:
        pad = torch.zeros(B, n, dtype=torch.double).masked_fill(pad, float("-inf"))
    attn = {None: None, "2d": torch.randn(L, n, dtype=torch.double).tril(),
            "3d": torch.randn(B * H, L, n, dtype=torch.double)}[mask]
    if kpm == "bool" and attn is not None:
        attn = attn > 0
    return m, q, k, pad, attn


GRID = list(itertools.product([True, False], [False, True], [None, "bool", "float"], [None, "2d", "3d"]))


@pytest.mark.parametrize(("batch_first", "separate", "kpm", "mask"), GRID)
def test_the_rewrite_computes_torch_s_values(batch_first, separate, kpm, mask):
    """Outputs, averaged and per-head weights, gradients, and the dropout draws, for every mask kind."""
    m, q, k, pad, attn = _case(batch_first, separate, kpm, mask)
    for need_weights, average in ((False, True), (True, True), (True, False)):
        kw = dict(key_padding_mask=pad, attn_mask=attn, need_weights=need_weights, average_attn_weights=average)
        got = []
        for rewrite in (False, True):
            m.zero_grad()
            torch.manual_seed(1)
            with Rewrites() if rewrite else warnings.catch_warnings():
                out, weights = m(q, k, k, **kw)
            out.nan_to_num().square().sum().backward()
            got.append((out, weights, [p.grad.clone() for p in m.parameters()]))
        (a, wa, ga), (b, wb, gb) = got
        torch.testing.assert_close(b, a, equal_nan=True)
        assert (wa is None) == (wb is None)
        if wa is not None:
            torch.testing.assert_close(wb, wa, equal_nan=True)
        for x, y in zip(ga, gb):
            torch.testing.assert_close(y, x, equal_nan=True)


def test_options_it_does_not_write_out_run_torch_s_own_code():
    m = nn.MultiheadAttention(E, H, add_bias_kv=True, add_zero_attn=True)
    q = torch.randn(L, B, E)
    with Rewrites():
        a = m(q, q, q)[0]
        unbatched = m(q[:, 0], q[:, 0], q[:, 0])[0]
    torch.testing.assert_close(a, m(q, q, q)[0])
    torch.testing.assert_close(unbatched, m(q[:, 0], q[:, 0], q[:, 0])[0])


class EncoderLM(nn.Module):
    """A stock `nn.TransformerEncoder` under a causal mask (names of no issue or zoo model)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(64, 32)
        self.body = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2,
                                          enable_nested_tensor=False)
        self.out = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.out(self.body(self.tok(ids), mask=mask, is_causal=True))


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def test_the_packed_projection_plans_like_separate_q_k_v():
    """Megatron over the heads (the packed weight on its rows, the output projection on its columns) and the
    batch over the other axis, no dim blocking either, and the simulator proves the step (dropout included)."""
    import partir_torch
    from partir_torch.ir import Mesh
    from partir_torch.lower import lower, summarize
    from partir_torch.simulate import simulate
    from partir_torch.tactics import apply_schedule

    torch.manual_seed(0)
    model, ids = EncoderLM().train(), torch.randint(0, 64, (4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no blocked dim to warn of
        plan = partir_torch.find_plan(model, (ids,), {"batch": 2, "model": 2}, loss_fn=_lm_loss,
                                      schedule="batch:BatchParallel;model:Megatron", cache=False)
    assert not plan.blocked
    for i in range(2):
        assert plan.params[f"body.layers.{i}.self_attn.in_proj_weight"] == ["model", None]
        assert plan.params[f"body.layers.{i}.self_attn.out_proj.weight"] == [None, "model"]
    assert plan.inputs[0] == ["batch", None]

    program = capture(model, (ids,), _lm_loss, "adamw")
    state = apply_schedule(program, Mesh.parse("batch=2,model=2"), "batch:BatchParallel;model:Megatron")
    moved = summarize(lower(state))
    assert "batch" not in moved.get("all-gather", {}), moved  # the batch split reaches attention whole
    params = {n: p.detach() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    states = {n: {"exp_avg": torch.randn(p.shape, generator=g) * 0.01,
                  "exp_avg_sq": torch.rand(p.shape, generator=g) * 0.01, "step": torch.tensor(3.0)}
              for n, p in params.items()}
    torch.manual_seed(1)
    res = simulate(program, state, params, {}, (ids,), states)
    assert res.max_abs_diff <= 1e-5 and res.replica_mismatch <= 1e-5, res.diffs
