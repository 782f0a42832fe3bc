"""Cost model: presets and their errors, the alpha-beta formulas, compute, communication and memory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.cost import PRESETS, HardwareError, collective_time, evaluate, hardware
from partir_torch.ir import Mesh, Tile
from partir_torch.lower import Collective, lower, summarize
from partir_torch.propagate import ShardingState
from partir_torch.tactics import apply_schedule


def test_presets_and_overrides():
    assert {
        "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "a100-80gb", "h100-sxm", "h200-sxm", "cpu-virtual"
    } <= set(PRESETS)
    hw = hardware("tpu-v5e", memory=8 * 2**30)
    assert hw.memory == 8 * 2**30 and hw.peak_flops_bf16 == PRESETS["tpu-v5e"].peak_flops_bf16
    with pytest.raises(HardwareError, match=r"unknown hardware preset 'tpu-v9'; presets: tpu-v4, tpu-v5e"):
        hardware("tpu-v9")
    with pytest.raises(HardwareError, match=r"memory must be a positive number, got -1"):
        hardware("h100-sxm", memory=-1)
    with pytest.raises(HardwareError, match=r"unknown hardware figure\(s\) \['flops'\]"):
        hardware("h100-sxm", flops=1.0)
    with pytest.raises(HardwareError, match=r"flash_attention must be True or False, got 1"):
        hardware("h100-sxm", flash_attention=1)


def test_mesh_larger_than_a_fast_domain_is_an_error():
    model, inputs, loss_fn = models.build("tiny-mlp", device="meta")
    p = capture(model, inputs, loss_fn, "adamw")
    state = apply_schedule(p, Mesh.parse("batch=4,model=4"), "batch:BatchParallel")
    with pytest.raises(HardwareError, match=r"batch=4 x model=4 span 16 devices over h100-sxm's fast links, but "
                       r"one fast domain .* holds 8; mark the axes that cross slices or nodes, e.g. `batch=4:dcn`"):
        evaluate(state, hardware("h100-sxm"))
    assert evaluate(state, hardware("h100-sxm"), dcn_axes=frozenset({"batch"})).feasible  # 4 nodes of 4 GPUs
    assert evaluate(state, hardware("tpu-v5e")).feasible  # 16 chips in one slice


def test_alpha_beta_ring_formulas():
    def c(kind):
        return Collective(kind, "x", 1000, 0, 0, "", "")

    assert collective_time(c("all-reduce"), 4, 100.0, 0.5) == pytest.approx(2 * 3 / 4 * 10 + 2 * 3 * 0.5)
    for kind in ("all-gather", "reduce-scatter", "all-to-all"):
        assert collective_time(c(kind), 4, 100.0, 0.5) == pytest.approx(3 / 4 * 10 + 3 * 0.5)
    assert collective_time(c("all-reduce"), 1, 100.0, 0.5) == 0.0


class _MM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 32))

    def forward(self, x):
        return x @ self.w


def test_matmul_flops_are_per_device():
    p = capture(_MM(), (torch.randn(128, 64),), mode="inference")
    hw = hardware("cpu-virtual")
    whole = evaluate(ShardingState(p, Mesh.parse("x=4")), hw)
    st = ShardingState(p, Mesh.parse("x=4"))
    st.apply(Tile("inputs[0]", 0, "x"))
    quarter = evaluate(st, hw)
    assert whole.flops_per_device == 2 * 128 * 64 * 32
    assert quarter.flops_per_device == whole.flops_per_device / 4


def test_communication_matches_lowering_and_dcn_is_slower():
    model, inputs, loss_fn = models.build("tiny-gpt2", device="meta")
    p = capture(model, inputs, loss_fn, "adamw")
    st = apply_schedule(p, Mesh.parse("batch=2,model=2"), "batch:BatchParallel;model:Megatron")
    hw = hardware("h100-sxm")
    r = evaluate(st, hw)
    assert r.comm_bytes == summarize(lower(st))
    slow = evaluate(st, hw, dcn_axes=frozenset({"batch"}))
    assert slow.comm_time_by_axis["batch"] > r.comm_time_by_axis["batch"]
    assert slow.comm_time_by_axis["model"] == r.comm_time_by_axis["model"]
    assert r.to_json()["comm_bytes"]["all-reduce"] == sum(r.comm_bytes["all-reduce"].values())


def test_memory_accounts_sharding():
    model, inputs, loss_fn = models.build("tiny-gpt2", device="meta")
    p = capture(model, inputs, loss_fn, "adamw")
    hw = hardware("cpu-virtual")
    dp = evaluate(apply_schedule(p, Mesh.parse("batch=4"), "batch:BatchParallel"), hw)
    fsdp = evaluate(apply_schedule(p, Mesh.parse("batch=4"), "batch:FSDP"), hw)
    assert dp.param_bytes_per_device == p.param_bytes()
    assert dp.opt_state_bytes_per_device == 2 * p.param_bytes() + 8  # exp_avg, exp_avg_sq, the step and the lr
    assert fsdp.param_bytes_per_device < 0.3 * p.param_bytes()  # most tensors split 4 ways
    assert fsdp.peak_memory_bytes < dp.peak_memory_bytes
    assert dp.peak_memory_bytes >= dp.param_bytes_per_device + dp.opt_state_bytes_per_device
    assert dp.feasible and "peak memory per device" in str(dp)
    tight = evaluate(apply_schedule(p, Mesh.parse("batch=4"), "batch:BatchParallel"), hw, memory_limit=1024)
    assert not tight.feasible and "DOES NOT FIT" in str(tight)



class _Double(torch.autograd.Function):
    """y * 2, saving a wide tensor whose backward reads it for its dtype only, or (`values`) its values."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, wide: torch.Tensor, values: bool) -> torch.Tensor:
        ctx.save_for_backward(wide)
        ctx.values = values
        return y * 2

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (wide,) = ctx.saved_tensors
        temp = torch.cos(g.repeat(1, 64)).sum(1, keepdim=True)  # a backward temporary as wide as `wide`
        return g * 2 + temp + (wide[:, : g.shape[1]] if ctx.values else wide.new_zeros(g.shape)), None, None


class _Saved(nn.Module):
    """Not a zoo model: a wide tensor saved for the backward, which reads it for its dtype or its values."""

    def __init__(self, values: bool) -> None:
        super().__init__()
        self.a, self.values = nn.Linear(16, 16), values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.tanh(self.a(x)).repeat(1, 64)  # [8, 1024], read by the forward too
        return _Double.apply(wide[:, :16], wide, self.values)


def test_a_tensor_read_only_for_its_dtype_is_not_kept_alive():
    """`new_zeros` reads its tensor for dtype and device only: a wide tensor the backward reads so dies where
    it is made, and the peak (in the backward) is under the one of the model that reads its values there by
    all of the tensor's 32 KiB."""
    x = torch.randn(8, 16)
    peaks = {}
    for values in (True, False):
        p = capture(_Saved(values), (x,), lambda m, t: m(t).square().mean(), "sgd")
        peaks[values] = evaluate(ShardingState(p, Mesh.parse("x=1")), hardware("cpu-virtual")).peak_memory_bytes
    assert peaks[True] - peaks[False] >= 8 * 1024 * 4, peaks


def test_attention_without_flash_kernel_saves_probabilities():
    """Without a flash kernel the [B, H, T, S] probabilities are saved instead of the [B, H, T] log-sum-exp:
    the peak (at the loss, where every layer's saved tensors are live) grows by exactly (S - 1) times the
    local log-sum-exp bytes of every attention, and a head-sharded plan saves a quarter of that."""
    model, inputs, loss_fn = models.build("tiny-gpt2", device="meta")
    p = capture(model, inputs, loss_fn, "adamw")
    attn = [op for op in p.ops if op.target == "aten._scaled_dot_product_flash_attention_for_cpu.default"]
    assert len(attn) == 2
    growth = {}
    for name, schedule in (("dp", "batch:BatchParallel"), ("megatron", "batch:BatchParallel;model:Megatron")):
        state = apply_schedule(p, Mesh.parse("batch=2,model=4"), schedule)
        # (buckets of one gradient: the peak is the activations', not a bucket's buffer at the end of backward)
        flash = evaluate(state, hardware("cpu-virtual", flash_attention=True, bucket_cap=1))
        math_ = evaluate(state, hardware("cpu-virtual", bucket_cap=1))
        lse = sum(math.prod(state.shard[op.outputs[1]].local_shape(p.values[op.outputs[1]].shape, state.mesh))
                  * 4 * (p.values[op.inputs[1]].shape[-2] - 1) for op in attn)
        growth[name] = math_.peak_memory_bytes - flash.peak_memory_bytes
        assert growth[name] == lse, (name, growth[name], lse)
        assert flash.step_time_s == math_.step_time_s
    assert growth["megatron"] * 4 == growth["dp"]


def _report(r) -> tuple:
    return r.to_json(), r.comm_bytes, r.collectives


@pytest.mark.parametrize("fold", [False, True])
def test_incremental_evaluation_equals_from_scratch(fold):
    """A copy starts from its parent's cost cache (keyed by the record of changes they share); after every
    action on a copy, the incremental evaluation is the from-scratch one (no history, fresh memo), and the
    states it branched from keep theirs."""
    import random

    from partir_torch.cost.tables import tables
    from partir_torch.propagate import Changes
    from partir_torch.search.space import apply_action, candidates

    model, inputs, loss_fn = models.build("tiny-gpt2", device="meta")
    p = capture(model, inputs, loss_fn, "adamw", fold=fold)
    hw = hardware("tpu-v5e")
    root = apply_schedule(p, Mesh.parse("batch=2,model=2"), "batch:DP")
    pool = [(root, _report(evaluate(root, hw)))]
    rng = random.Random(0)
    steps = 0
    while steps < 16:
        parent, before = rng.choice(pool)
        acts = candidates(parent, ("batch", "model"), frozenset({"input", "param", "optimizer"}))
        if not acts:
            continue
        child = parent.copy()
        assert child.record.parent in tables(parent)[0].caches  # the parent's evaluated record: shared
        if not apply_action(child, rng.choice(acts)):
            continue
        steps += 1
        h = hardware("h100-sxm") if steps % 4 == 0 else hw
        dcn = frozenset({"batch"}) if steps % 3 == 0 else frozenset()
        got = _report(evaluate(child, h, dcn_axes=dcn))
        scratch = child.copy()
        scratch.record = Changes()  # no history: costed from the replicated state
        scratch.analysis.clear_memos()  # the memoized results start over too
        want = _report(evaluate(scratch, h, dcn_axes=dcn))
        assert got == want
        assert got[1] == summarize(lower(child))
        assert _report(evaluate(parent, hw)) == before  # the parent's cache was not touched by the child's
        pool.append((child, _report(evaluate(child, hw))))


def test_an_activation_resharded_by_the_one_view_that_reads_it_is_free_after_the_view():
    """MoE's dispatch einsum: the permuted mask and expert inputs (`clone_*`) are read only by the view that
    gathers them over the experts' axis, and the backward reads the view of the gathered copy; their local
    tiles are free after the view (`tables.Static.cut_*`), and the peak counts the gathered copies alone."""
    from partir_torch.cost.tables import tables

    net, inputs, loss_fn = models.build("tiny-moe", {"batch": "8"})
    program = capture(net, inputs, loss_fn, "adamw")
    mesh = Mesh.parse("batch=2,model=4")
    state = ShardingState(program, mesh)
    for a in (Tile("inputs[0]", 0, "batch"), Tile("h.*.moe.w_in", 0, "model"),
              Tile("h.*.attn.c_attn.weight", 1, "batch")):
        state.apply(a)
    hw = hardware("cpu-virtual")
    freed = evaluate(state, hw)
    st, _ = tables(state)
    masks = [v for v in program.values if v.name in ("clone_1", "clone_2", "clone_4", "clone_5")]
    assert {v.id for v in masks} <= set(st.cut_val.tolist())
    st.cut_val, st.cut_slot = st.cut_val[:0], st.cut_slot[:0]  # (the model before: held to their views' end)
    held = evaluate(state, hw)
    local = sum(math.prod(state.shard[v.id].local_shape(v.shape, mesh)) * 4 for v in masks)
    assert held.peak_memory_bytes - freed.peak_memory_bytes == local > 0
    for r in (freed, held):
        assert sum(r.memory_by_role.values()) == r.peak_memory_bytes
    assert {v.name for v in masks} & {n for n, _, _ in held.top_at_peak[:40]}
    assert not {v.name for v in masks} & {n for n, _, _ in freed.top_at_peak}


def test_what_autograd_saves_through_a_detach_is_its_operand_s_memory():
    """A step differentiated by autograd (an old-style `autograd.Function`, as BLOOM's GeLU; HF Gemma-2) reads
    parameters and saved tensors through `detach` ops (Gemma-2 has 127), which alias their operand: no memory
    of their own (the torch backend measured Gemma-2's peak at 0.80 x the prediction when they had)."""
    from partir_torch.cost.tables import tables
    from tests.capture.test_trace import _OldStyle

    program = capture(_OldStyle(), (torch.randn(32, 4),), lambda m, x: m(x).square().mean(), "adamw")
    detached = {o for op in program.ops if op.target == "aten.detach.default" for o in op.outputs}
    assert detached
    st, _ = tables(ShardingState(program, Mesh.parse("batch=2")))
    assert not detached & set(st.m_vid.tolist())
