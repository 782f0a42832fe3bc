"""The expert tactics as action lists (`tactics/experts.py`): HSDP, written from the others' actions, and expert
parallelism, found from structure."""

from __future__ import annotations

import warnings

import pytest
import torch

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.ir import Mesh, ShardOptimizer, Tile
from partir_torch.lower import lower, summarize
from partir_torch.simulate import simulate
from partir_torch.tactics import HSDP, apply_schedule, parse_schedule
from tests import needs


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


class _Routed(torch.nn.Module):
    """A user's MoE with its own names: a gate, experts stacked as `[E, d, f]` banks, top-1 dense dispatch."""

    def __init__(self, d: int = 8, f: int = 16, e: int = 4) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(d, e, bias=False)
        self.bank_a = torch.nn.Parameter(torch.randn(e, d, f) * 0.1)
        self.bank_b = torch.nn.Parameter(torch.randn(e, f, d) * 0.1)
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.gate(x), -1)  # [T, E]
        pick = (w == w.amax(-1, keepdim=True)).to(x.dtype) * w  # top-1, dense
        h = torch.einsum("te,td->etd", pick, x)  # [E, T, d]
        h = torch.bmm(torch.relu(torch.bmm(h, self.bank_a)), self.bank_b)  # [E, T, d]
        return self.head(h.sum(0))


def test_expert_parallel_tiles_stacked_expert_weights_found_from_structure():
    """GShard's expert parallelism as a tactic: the zoo MoE's and a user's differently named stacked expert
    weights are tiled on their expert dim (nothing else on that axis), the step stays exact (simulator), and a
    model without stacked experts is told why nothing changed."""
    torch.manual_seed(0)
    net, x, y = _Routed(), torch.randn(8, 8), torch.randint(0, 3, (8,))
    program = capture(net, (x, y), lambda m, a, b: torch.nn.functional.cross_entropy(m(a), b), "adamw")
    mesh = Mesh.parse("batch=2,expert=4")
    state = apply_schedule(program, mesh, "batch:BatchParallel;expert:ExpertParallel")
    assert [str(a) for a in state.actions[-2:]] == ["tile(bank_a, 0, expert)", "tile(bank_b, 0, expert)"]
    assert [n for n, v in program.params.items() if "expert" in state.shard[v].axes] == ["bank_a", "bank_b"]
    params = {n: p.detach() for n, p in net.named_parameters()}
    states = {n: {"exp_avg": torch.randn(p.shape) * 0.01, "exp_avg_sq": torch.rand(p.shape) * 0.01,
                  "step": torch.tensor(3.0)} for n, p in params.items()}
    res = simulate(program, state, params, {}, (x, y), states)
    assert res.max_abs_diff <= 1e-5 and res.replica_mismatch <= 1e-5

    moe, inputs, loss_fn = models.build("tiny-moe", device="meta")
    state = apply_schedule(capture(moe, inputs, loss_fn, "adamw"), mesh, "expert:EP")
    assert {str(a) for a in state.actions} == {"tile(h.*.moe.w_in, 0, expert)", "tile(h.*.moe.w_out, 0, expert)"}
    gpt, inputs, loss_fn = models.build("tiny-gpt2", device="meta")
    with pytest.warns(UserWarning, match="ExpertParallel on 'expert' changes nothing: no stacked expert weight"):
        apply_schedule(capture(gpt, inputs, loss_fn, "adamw"), mesh, "expert:ExpertParallel")


def test_sequence_parallel_after_megatron_turns_its_all_reduce_into_reduce_scatter_and_all_gather():
    """Megatron's sequence parallelism as two tactics' actions (`model:Megatron;model:SP`) on a Llama: the
    inputs' sequence dim tiled on `model` after the weights, so the norms between a row and the next column
    linear run on a sequence tile: no all-reduce on `model` is left, a reduce-scatter and an all-gather take
    its place, and the step stays exact; alone on an axis (context parallelism) it is exact too."""
    torch.manual_seed(0)
    model, inputs, loss_fn = models.build("tiny-llama", device="cpu")
    program = capture(model, inputs, loss_fn, "adamw")
    params = {n: p.detach() for n, p in model.named_parameters()}
    states = {n: {"exp_avg": torch.randn(p.shape) * 0.01, "exp_avg_sq": torch.rand(p.shape) * 0.01,
                  "step": torch.tensor(3.0)} for n, p in params.items()}
    mesh = Mesh.parse("batch=2,model=2")
    megatron = summarize(lower(apply_schedule(program, mesh, "batch:DP;model:Megatron")))
    assert megatron["all-reduce"].get("model", 0) > 0 and "reduce-scatter" not in megatron
    for schedule in ("batch:DP;model:Megatron;model:SequenceParallel", "batch:DP;model:ContextParallel"):
        state = apply_schedule(program, mesh, schedule)
        assert [str(a) for a in state.actions if "inputs" in str(a) and "model" in str(a)] == [
            "tile(inputs[0], 1, model)", "tile(inputs[1], 1, model)"]
        comm = summarize(lower(state))
        assert "model" not in comm.get("all-reduce", {}) and comm["reduce-scatter"]["model"] > 0, comm
        res = simulate(program, state, params, dict(model.named_buffers()), inputs, states)
        assert res.max_abs_diff <= 1e-5 and res.replica_mismatch <= 1e-5, schedule


@pytest.mark.parametrize("schedule", ["batch:DP;model:Megatron;model:SequenceParallel", "batch:DP;model:CP"])
def test_sequence_and_context_parallelism_on_a_transformers_llama(schedule):
    """The same tactics on HF transformers' `LlamaForCausalLM` (tiny config, no download): exact, and the model
    axis reduces by reduce-scatter, not all-reduce."""
    needs.need("transformers")
    from benchmarks.workloads.thirdparty import BUILDERS

    torch.manual_seed(0)
    model, inputs, loss_fn = BUILDERS["hf-llama"]()
    program = capture(model, inputs, loss_fn, "adamw")
    state = apply_schedule(program, Mesh.parse("batch=2,model=2"), schedule)
    comm = summarize(lower(state))
    assert "model" not in comm.get("all-reduce", {}) and comm["reduce-scatter"]["model"] > 0, comm
    params = {n: p.detach() for n, p in model.named_parameters()}
    states = {n: {"exp_avg": torch.randn(p.shape) * 0.01, "exp_avg_sq": torch.rand(p.shape) * 0.01,
                  "step": torch.tensor(3.0)} for n, p in params.items()}
    res = simulate(program, state, params, dict(model.named_buffers()), inputs, states)
    assert res.max_abs_diff <= 1e-5 and res.replica_mismatch <= 1e-5
