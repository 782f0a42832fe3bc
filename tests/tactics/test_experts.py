"""The expert tactics as action lists: HSDP, written in one file (`tactics/experts.py`) from the others' actions."""

from __future__ import annotations

import warnings

import torch

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.ir import Mesh, ShardOptimizer, Tile
from partir_torch.lower import lower, summarize
from partir_torch.simulate import simulate
from partir_torch.tactics import HSDP, apply_schedule, parse_schedule


def test_hsdp_shards_within_the_node_replicates_across_and_trains_exactly():
    """`node,gpu:HSDP` on a transformer from HF's architecture family (the zoo's GPT-2, AdamW): the batch over
    both axes, every parameter and optimizer state over `gpu` only; across `node` only the gradients'
    all-reduce; the per-device step equals the unsharded one (simulator). Its decisions are the actions of
    BatchParallel on both axes and the one ZeRO-3 move on `gpu`."""
    torch.manual_seed(0)
    model, inputs, loss_fn = models.build("tiny-gpt2", {"batch": "8"}, device="cpu")
    program = capture(model, inputs, loss_fn, "adamw")
    mesh = Mesh.parse("node=2,gpu=4")
    (tactic,) = parse_schedule("node,gpu:HSDP", mesh)
    assert tactic == HSDP("node", "gpu") and tactic.text() == "node,gpu:HSDP"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the axis-order note: parameters tiled on gpu, the batch node-major)
        state = apply_schedule(program, mesh, "node,gpu:HSDP")
    assert state.actions == [Tile("inputs[0]", 0, "node"), Tile("inputs[1]", 0, "node"), Tile("inputs[0]", 0, "gpu"),
                             Tile("inputs[1]", 0, "gpu"), ShardOptimizer("*", -1, "gpu", 3)]
    for i in program.inputs:
        assert state.shard[i].dims[0] == ("node", "gpu")
    for n, v in program.params.items():
        axes = state.shard[v].axes
        assert "node" not in axes, n
        opt = [state.shard[s].axes for s in program.opt_states[n].values() if s not in program.shared_states.values()]
        assert all("node" not in a for a in opt), n
    sharded = [n for n, v in program.params.items() if "gpu" in state.shard[v].axes]
    assert len(sharded) >= len(program.params) - 2, sharded  # (a [2]-sized bias does not divide by 4)
    comm = summarize(lower(state))
    assert set(comm) >= {"all-gather", "reduce-scatter", "all-reduce"}
    assert all(set(axes) <= {"gpu"} for kind, axes in comm.items() if kind != "all-reduce"), comm
    assert comm["all-reduce"].get("node", 0) > 0  # the gradients' reduction across nodes
    params = {n: p.detach() for n, p in model.named_parameters()}
    states = {n: {"exp_avg": torch.randn(p.shape) * 0.01, "exp_avg_sq": torch.rand(p.shape) * 0.01,
                  "step": torch.tensor(3.0)} for n, p in params.items()}
    res = simulate(program, state, params, dict(model.named_buffers()), inputs, states)
    assert res.max_abs_diff <= 1e-5 and res.replica_mismatch <= 1e-5
