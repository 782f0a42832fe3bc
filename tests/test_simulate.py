"""End to end: the zoo's training steps under expert and random plans, proven by the simulator (fp32, 1e-5)."""

from __future__ import annotations

import zlib

import pytest
import torch

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.ir import Mesh, Tile
from partir_torch.simulate import simulate
from partir_torch.tactics import apply_schedule
from tests import needs
from tests.plans import random_plan

ZOO = ["tiny-mlp", "tiny-gpt2", "tiny-llama", pytest.param("tiny-unet", marks=pytest.mark.slow), "tiny-gns", "tiny-moe",
       "tiny-vit"]  # (the U-Net: the slowest capture, in CI only)
PLANS = [  # (the single-axis data-parallel plans, parts of the composite: in CI only)
    pytest.param("batch=2", "batch:BatchParallel", marks=pytest.mark.slow, id="batch=2:batch:BatchParallel"),
    pytest.param("model=4", "model:Megatron", id="model=4:model:Megatron"),
    pytest.param("batch=4", "batch:FSDP", marks=pytest.mark.slow, id="batch=4:batch:FSDP"),
    pytest.param("batch=2,model=4", "batch:BatchParallel;model:Megatron;batch:ZeRO(1)",
                 id="batch=2,model=4:batch:BatchParallel;model:Megatron;batch:ZeRO(1)"),
    pytest.param("batch=2,model=4", "random", id="batch=2,model=4:random"),
]
_CACHE: dict[str, tuple] = {}


def workload(name):
    if name not in _CACHE:
        torch.manual_seed(0)
        model, inputs, loss_fn = models.build(name, device="cpu")
        program = capture(model, inputs, loss_fn, "adamw")
        params = {n: p.detach() for n, p in model.named_parameters()}
        g = torch.Generator().manual_seed(1)
        states = {n: {"exp_avg": torch.randn(p.shape, generator=g) * 0.01,
                      "exp_avg_sq": torch.rand(p.shape, generator=g) * 0.01, "step": torch.tensor(3.0)}
                  for n, p in model.named_parameters()}
        _CACHE[name] = (program, params, dict(model.named_buffers()), inputs, states)
    return _CACHE[name]


@pytest.mark.parametrize(("mesh", "schedule"), PLANS)
@pytest.mark.parametrize("name", ZOO)
def test_zoo_plan_matches_unsharded(name, mesh, schedule):
    program, params, buffers, inputs, states = workload(name)
    mesh = Mesh.parse(mesh)
    if schedule == "random":
        state = random_plan(program, mesh, zlib.crc32(name.encode()) % 1000)  # (the same plan in every process)
    else:
        state = apply_schedule(program, mesh, schedule)
    res = simulate(program, state, params, buffers, inputs, states)
    assert res.max_abs_diff <= 1e-5, sorted(res.diffs.items(), key=lambda kv: -kv[1])[:3]
    assert res.replica_mismatch <= 1e-5
    if schedule != "random":
        assert any(state.shard[v].axes for v in program.params.values()) or "BatchParallel" in schedule


def test_fused_qkv_chunks_are_simulated():
    """The chunked layout of GPT-2's QKV split and its gradient's concat (`Sharding.chunks`) runs per device:
    each all-to-all is emulated, and the step still equals the unsharded one."""
    program, params, buffers, inputs, states = workload("tiny-gpt2")
    state = apply_schedule(program, Mesh.parse("model=4"), "model:Megatron")
    res = simulate(program, state, params, buffers, inputs, states)
    n_split = sum(op.target == "aten.split.Tensor" for op in program.ops)
    assert res.executed.get("all-to-all") == 2 * n_split and "all-gather" not in res.executed
    assert res.max_abs_diff <= 1e-5


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-t5"])
def test_vocab_parallel_embeddings_of_transformers_models_match_unsharded(name):
    """A users' model's token table tiled on its rows (HF GPT-2's tied `wte`, T5's `shared` read by encoder,
    decoder and LM head): each lookup is a masked lookup summed over the row axis, and the step is exact."""
    needs.need("transformers")
    from benchmarks.workloads.thirdparty import BUILDERS
    from partir_torch.propagate import ShardingState
    from partir_torch.rules.decompose import prepare

    torch.manual_seed(0)
    model, inputs, loss_fn = BUILDERS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    program = prepare(capture(model, inputs, loss_fn, opt))
    state = ShardingState(program, Mesh.parse("x=4,y=2"))
    table = {"hf-gpt2": "transformer.wte.weight", "hf-t5": "shared.weight"}[name]
    state.apply(Tile(table, 0, "x"))
    state.apply(Tile(program.values[program.inputs[0]].name, 0, "y"))
    lookups = [o for o in program.ops if o.target == "aten.embedding.default"]
    assert any(state.op_output(o.id, 0).partial == {"x"} for o in lookups)
    params = {n: p.detach() for n, p in model.named_parameters()}
    states = {n: {"momentum_buffer": torch.randn_like(p) * 0.1} for n, p in model.named_parameters()}
    res = simulate(program, state, params, dict(model.named_buffers()), inputs, states)
    assert res.max_rel_diff < 1e-5 and res.replica_mismatch < 1e-6, res.diffs


def test_the_sweep_replays_a_zero_plan_on_the_float64_step():
    """The sweep's float64 verdict replays a plan's actions on the step captured in float64: ZeRO's moves
    are actions too (`benchmarks/workloads/sweep.py`), and the replayed plan is the same plan."""
    from benchmarks.workloads.sweep import _fp64_rel_diff, _replay

    torch.manual_seed(0)
    model, inputs, loss_fn = models.build("tiny-gpt2", device="cpu")
    state = apply_schedule(capture(model, inputs, loss_fn, "adamw"), Mesh.parse("batch=2,model=2"),
                           "batch:BatchParallel;model:Megatron;batch:ZeRO(1)")
    again = _replay(state, state.program)
    assert again is not None and again.shard == state.shard
    diff = _fp64_rel_diff(state, model, inputs, loss_fn, "batch=2,model=2", 0)
    assert diff is not None and diff <= 1e-9, diff
