"""Sharding plans: JSON form and round trip, and `partir-torch plan` for manual schedules."""

from __future__ import annotations

import json

import pytest
import torch

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.cli import main, parse_mesh
from partir_torch.cost import evaluate, hardware
from partir_torch.errors import PartirError
from partir_torch.ir import Mesh
from partir_torch.plan import ShardingPlan
from partir_torch.tactics import apply_schedule


def test_plan_json_round_trip():
    model, inputs, loss_fn = models.build("tiny-llama", device="meta")
    p = capture(model, inputs, loss_fn, "adamw")
    st = apply_schedule(p, Mesh.parse("batch=2,model=4"), "batch:BatchParallel;model:Megatron;batch:ZeRO(1)")
    plan = ShardingPlan.from_state(st, evaluate(st, hardware("tpu-v5e")), schedule="x", hardware="tpu-v5e")
    d = plan.to_json()
    assert d["mesh"]["axes"] == {"batch": 2, "model": 4} and "search" not in d
    assert d["params"]["layers.0.self_attn.q_proj.weight"] == ["model", None]
    assert d["inputs"][0] == ["batch", None]
    assert d["optimizer_state"]["layers.0.mlp.down_proj.weight"]["exp_avg"] == ["batch", "model"]
    assert set(d["cost"]) >= {"step_time_s", "peak_memory_bytes", "comm_bytes"}
    assert ShardingPlan.from_json(json.dumps(d)).to_json() == d
    assert "parameters sharded" in plan.table()


def test_plan_cli_json_and_memory_override(capsys):
    argv = ["plan", "tiny-gpt2", "--mesh", "batch=2:dcn,model=4", "--hardware", "h100-sxm", "--memory", "1KiB",
            "--schedule", "batch:BatchParallel;model:Megatron", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mesh"] == {"axes": {"batch": 2, "model": 4}, "dcn": ["batch"]}
    assert d["cost"]["memory_limit"] == 1024 and d["cost"]["feasible"] is False
    assert d["cost"]["comm_bytes"]["all-reduce"] > 0


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["plan", "tiny-mlp", "--mesh", "batch=8", "--schedule", "batch:Auto(speed)"], "goals: time, communication"),
        (["plan", "tiny-mlp", "--mesh", "batch=8", "--schedule", "model:Auto"], "names axis 'model'"),
        (["plan", "tiny-mlp", "--mesh", "batch=8", "--budget", "soon"], "30s"),
        (["plan", "tiny-mlp", "--mesh", "batch=8", "--hardware", "tpu-v9"], "presets: tpu-v4"),
        (["plan", "tiny-mlp", "--mesh", "batch=8", "--memory", "lots"], "16GiB"),
        (["plan", "tiny-mlp", "--mesh", "batch=8:fast"], ":dcn"),
        (["plan", "tiny-mlp", "--mesh", "batch:2,model:4"], "write 'batch=2'"),
        (["plan", "tiny-mlp", "--mesh", "bacth=2,model=4", "--schedule", "batch:BatchParallel"],
         "is the mesh's 'bacth' a typo of 'batch'?"),
    ],
)
def test_plan_cli_errors(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_parse_mesh_marks_dcn_axes():
    mesh, dcn = parse_mesh("data=8:dcn,model=8")
    assert mesh.names == ("data", "model") and dcn == {"data"}
    with pytest.raises(PartirError):
        parse_mesh("data=8:nvme")


def _tiny_plan(mesh: str = "batch=2,model=4"):
    from partir_torch.search.api import search

    model, inputs, loss_fn = models.build("tiny-gpt2", device="meta")
    return model, inputs, search(model, inputs, mesh, loss_fn=loss_fn, optimizer="adamw",
                                 schedule="batch:BatchParallel;model:Megatron")


def test_a_saved_plan_has_everything_to_apply_it_and_loads_back(tmp_path):
    model, inputs, plan = _tiny_plan("batch=2:dcn,model=4")
    plan.save(tmp_path / "p.json")
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["format"] == 7 and d["mesh"] == {"axes": {"batch": 2, "model": 4}, "dcn": ["batch"]}
    # the tactics' actions: each input's batch dim, then each column / row weight group (every layer at once)
    assert d["decisions"] == ["tile(inputs[0], 0, batch)", "tile(inputs[1], 0, batch)",
                              "tile(h.*.attn.c_attn.weight, 0, model)", "tile(h.*.attn.c_proj.weight, 1, model)",
                              "tile(h.*.mlp.c_fc.weight, 0, model)", "tile(h.*.mlp.c_proj.weight, 1, model)"]
    assert len(d["state_hash"]) == 16
    assert d["hardware"] == "cpu-virtual" and d["schedule"] == "batch:BatchParallel;model:Megatron"
    assert d["optimizer"] == "adamw" and len(d["program_hash"]) == 16
    assert d["input_args"] == [0, None]  # tokens reach forward() as its first argument, targets do not
    assert d["activations"]["h.1.mlp"] == ["batch", None, None]  # a module output, constrained
    assert d["grads"]["h.0.mlp.c_fc.weight"] == ["model", None]
    assert d["shapes"]["params"]["h.1.mlp.c_fc.weight"] == [128, 32] and d["shapes"]["inputs"] == [[4, 16], [4, 16]]
    assert set(d["buffers"]) == {n for n, _ in model.named_buffers()}
    back = ShardingPlan.load(tmp_path / "p.json")
    assert back.to_json() == plan.to_json()
    back.check(model, inputs, mesh={"batch": 2, "model": 4})  # fits: no error


def test_a_plan_file_of_another_format_says_what_to_do(tmp_path):
    _, _, plan = _tiny_plan()
    (tmp_path / "old.json").write_text(json.dumps({**plan.to_json(), "format": 5}))
    with pytest.raises(PartirError, match=r"plan format 5 is not this version's \(7\).*search the plan again"):
        ShardingPlan.load(tmp_path / "old.json")


def test_a_plan_is_its_decisions_replayed_to_the_state_it_was_costed_on():
    """Manual tactics (their actions, ZeRO's fences in its move) and searched axes: one replay of the saved
    decisions gives the same state (digest), and a replay that gives another state is refused (the search's ZeRO moves:
    `tests/test_cli.py::test_simulate_a_saved_plan_replays_its_decisions`)."""
    from partir_torch.plan import PlanMismatchError
    from partir_torch.search.api import search

    model, inputs, loss_fn = models.build("tiny-gpt2", device="meta")
    program = capture(model, inputs, loss_fn, "adamw")
    for schedule in ("batch:FSDP;model:Megatron", "batch:BatchParallel;model:Auto", "*:Auto"):
        plan = search(model, inputs, "batch=2,model=4", loss_fn=loss_fn, optimizer="adamw", schedule=schedule,
                      budget=40, memory="600KiB", require_fit=False, cache=False)
        back = ShardingPlan.from_json(json.loads(json.dumps(plan.to_json())))
        assert back.to_state(program).digest() == plan.state_hash, schedule
    back.decisions = back.decisions[:-1]
    with pytest.raises(PlanMismatchError, match="does not rebuild the state it was costed on"):
        back.to_state(program)


def test_a_plan_that_does_not_fit_says_every_mismatch(tmp_path):
    from partir_torch.plan import PlanMismatchError

    _, _, plan = _tiny_plan()
    other, inputs, _ = models.build("tiny-gpt2", {"layers": "3", "width": "48", "batch": "3"}, device="meta")
    with pytest.raises(PlanMismatchError) as e:
        plan.check(other, inputs, mesh={"batch": 8})
    msg = str(e.value)
    assert "the plan is for mesh {'batch': 2, 'model': 4}, not {'batch': 8}" in msg
    assert "parameters in the model but not in the plan: h.2.ln_1.weight" in msg
    assert "parameter h.0.mlp.c_fc.weight has shape [192, 48], the plan was made for [128, 32]" in msg
    assert "input 0 has shape [3, 16], the plan was made for [4, 16]" in msg
    same, small, _ = models.build("tiny-gpt2", {"batch": "3"}, device="meta")
    with pytest.raises(PlanMismatchError, match=r"input 0 has shape \[3, 16\]"):
        plan.check(same, small)
    plan.shapes["inputs"][0] = [3, 16]  # shape as planned, but the batch axis no longer divides it
    with pytest.raises(PlanMismatchError,
                       match=r"input 0 dim 0 \(size 3\) does not divide over \['batch'\] \(2 devices\)"):
        plan.check(same, small)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(PartirError, match=r"is not a saved ShardingPlan"):
        ShardingPlan.load(tmp_path / "bad.json")
    with pytest.raises(PartirError, match=r"cannot read a plan from"):
        ShardingPlan.load(tmp_path / "missing.json")


class _Tied(torch.nn.Module):
    """Not a zoo model: two linears in a row and an output head tied to the embedding."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.a, self.b = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.out = torch.nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.out(self.b(torch.relu(self.a(self.emb(t)))))


def test_parameters_an_fsdp_plan_gathers_for_use_are_read_as_gathered_tied_ones_too():
    """`param_reads`: FSDP stores weights tiled over the axis and gathers them for the forward, which the
    backward reuses; a backend hands each module its weight gathered. A tied weight (read by the embedding
    and, transposed, by the output layer) is gathered once too: it is read so by both."""
    from partir_torch.search.api import search

    model = _Tied()
    batch = (torch.randint(0, 32, (8, 4)), torch.randint(0, 32, (8, 4)))

    def loss(m, t, y):
        return torch.nn.functional.cross_entropy(m(t).flatten(0, 1), y.flatten())

    plan = search(model, batch, {"batch": 2, "model": 4}, loss_fn=loss, optimizer="adamw",
                  schedule="batch:BatchParallel;model:FSDP")
    stored_tiled = {n for n, s in plan.params.items() if any(s)}
    assert {"a.weight", "b.weight"} <= stored_tiled
    assert {"a.weight", "b.weight"} <= set(plan.param_reads)
    assert all(not any(plan.param_reads[n]) for n in ("a.weight", "b.weight"))  # gathered whole
    assert "emb.weight" in stored_tiled and not any(plan.param_reads["emb.weight"])
    assert "out.weight" not in plan.param_reads  # (one parameter: its first name)
    assert ShardingPlan.from_json(json.loads(json.dumps(plan.to_json()))).param_reads == plan.param_reads


def test_a_module_output_that_is_a_pending_sum_is_constrained_as_its_reader_reduces_it():
    """The MLP's row-parallel output over `(model, batch)` is a sum pending over both axes; the residual add
    reads it batch-tiled (a reduce-scatter over batch, an all-reduce over model). Its constraint is that
    tiling, not its dims alone (replicated: the engine would all-reduce it whole and gather the residual)."""
    from partir_torch.plan.reads import module_outputs
    from partir_torch.tactics import BatchParallel, Manual

    net, inputs, loss_fn = models.build("tiny-gpt2", {"batch": "8"}, device="meta")
    program = capture(net, inputs, loss_fn, "adamw")
    mesh = Mesh.parse("batch=2,model=4")
    mlp = {"h.*.mlp.c_fc.weight": [["model", "batch"], None], "h.*.mlp.c_fc.bias": [["model", "batch"]],
           "h.*.mlp.c_proj.weight": [None, ["model", "batch"]]}
    state = apply_schedule(program, mesh, [Manual(mlp), BatchParallel("batch")])
    out = module_outputs(state.program)["h.0.mlp"]
    assert state.shard[out].partial == {"batch", "model"}
    plan = ShardingPlan.from_state(state, evaluate(state, hardware("cpu-virtual")), schedule="manual")
    assert plan.activations["h.0.mlp"] == ["batch", None, None]
    rebuilt = ShardingPlan.from_json(json.loads(json.dumps({**plan.to_json(), "schedule": "searched: Auto"})))
    assert rebuilt.to_state(program).shard[out].partial == {"batch", "model"}  # rebuilt as it was searched


@pytest.mark.parametrize("split, expected", [(("batch", "model"), ["model", None]), (("model",), [None, None])])
def test_a_gradient_pending_over_every_axis_is_constrained_as_the_optimizer_reads_it(split, expected):
    """Rows split over both axes make each weight gradient a sum over both, which a ZeRO optimizer on `model`
    reads tiled: the gradient's constraint is that tiling. Rows split over
    `model` alone leave `batch` idle: that sum keeps its dims (constrained tiled, GSPMD would reduce-scatter it
    over the idle axis too and move tiles with collective-permutes)."""
    from partir_torch.ir import Tile
    from partir_torch.propagate import ShardingState
    from partir_torch.tactics import ZeRO

    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    program = capture(net, (torch.randn(64, 16),), lambda m, x: m(x).square().mean(), "adamw")
    state = ShardingState(program, Mesh.parse("batch=2,model=4"))
    for axis in split:
        state.apply(Tile("inputs[0]", 0, axis))
    state = ZeRO("model").apply(state)
    grad = program.grads["0.weight"]
    assert state.shard[grad].partial == set(split)
    plan = ShardingPlan.from_state(state, evaluate(state, hardware("cpu-virtual")), schedule="manual")
    assert plan.grads["0.weight"] == expected


class _Skip(torch.nn.Module):
    """A `cat` in the model's own forward, where no module boundary can carry a constraint."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(3, 8, 1), torch.nn.Conv2d(3, 4, 1)
        self.c = torch.nn.Conv2d(12, 2, 1)

    def forward(self, x):
        return self.c(torch.cat([self.a(x), self.b(x)], 1))


def test_an_operand_the_plan_reshards_in_a_model_s_own_forward_is_named_by_its_call():
    """`plan.calls`: the `cat` reads the channel-tiled conv output batch-tiled (an all-to-all in the plan); the
    plan names that call (the root's first), the operand (the first of its shape) and both shardings, so a
    backend constrains it there and the engine re-tiles it where the cost model does."""
    from partir_torch.ir import Tile
    from partir_torch.propagate import ShardingState

    p = capture(_Skip(), (torch.randn(8, 3, 4, 4),), lambda m, x: m(x).sum(), "sgd")
    state = ShardingState(p, Mesh.parse("batch=2,model=4"))
    for a in (Tile("b.weight", 0, "model"), Tile("inputs[0]", 0, "model")):
        state.apply(a)
    plan = ShardingPlan.from_state(state, evaluate(state, hardware("cpu-virtual")), schedule="manual")
    batch_tiled = ["model", None, None, None]
    assert plan.calls[""]["0"] == {"ins": [[[8, 4, 4, 4], 0, batch_tiled, batch_tiled]],
                                   "out": [[8, 12, 4, 4], batch_tiled], "fn": "cat"}
    assert plan.calls["b"]["0"]["out"] == [[8, 4, 4, 4], [None, "model", None, None]]  # made channel-tiled
    assert ShardingPlan.from_json(json.loads(json.dumps(plan.to_json()))).calls == plan.calls


class _Proj(torch.nn.Module):
    """A projection whose contraction is tiled: its result is a sum pending over that axis."""

    def __init__(self, conv: bool) -> None:
        super().__init__()
        self.conv = conv
        self.proj = torch.nn.Conv1d(8, 12, 1) if conv else torch.nn.Linear(8, 12)

    def forward(self, x):
        y = self.proj(x.transpose(1, 2)).transpose(1, 2) if self.conv else self.proj(x)
        return torch.relu(y)


@pytest.mark.parametrize("conv,mesh", [(False, "batch=2,model=4"), (True, "batch=2,model=4"), (False, "batch=2")])
def test_a_sum_the_plan_reduce_scatters_is_stated_with_what_a_backend_decides_by(conv, mesh):
    """`plan.calls` out of a sum its readers reduce-scatter (batch-tiled targets pull the relu batch-tiled)
    says so (`reads.PendingSum`): the axes it is summed over, the rule that sums (a convolution's through
    the transpose after it), the sum reduced in place (the contraction's axis off its dims) and the
    gradient the call's backward reads (gathered: the weight gradient reads its tiles). Facts only: the
    XLA backend reduces a dot's sum in place when `model` is idle on it (`backends.xla.reduce_in_place`),
    and leaves the convolution's and the one-axis mesh's as they are."""
    from partir_torch.backends.xla import reduce_in_place
    from partir_torch.ir import Tile
    from partir_torch.propagate import ShardingState

    x, y = torch.randn(8, 4, 8), torch.randn(8, 4, 12)
    p = capture(_Proj(conv), (x, y), lambda m, a, b: torch.nn.functional.mse_loss(m(a), b), "sgd")
    state = ShardingState(p, Mesh.parse(mesh))
    for a in (Tile("proj.weight", 1, "batch"), Tile("inputs[0]", 2, "batch"), Tile("inputs[1]", 0, "batch")):
        state.apply(a)
    plan = ShardingPlan.from_state(state, evaluate(state, hardware("cpu-virtual")), schedule="manual")
    sums = [c["out"] for cs in plan.calls.values() for c in cs.values() if c["out"] is not None and len(c["out"]) == 3]
    assert len(sums) == 1, plan.calls
    shape, spec, summed = sums[0]
    assert (shape, spec) == ([8, 4, 12], ["batch", None, None])
    assert summed == {"over": ["batch"], "by": "convolution" if conv else "addmm", "reduced": [None, None, None],
                      "grad": None if conv else [None, None, None]}
    assert reduce_in_place(summed, spec, tuple(plan.mesh)) == (not conv and mesh == "batch=2,model=4")
    assert ShardingPlan.from_json(json.loads(json.dumps(plan.to_json()))).calls == plan.calls


def test_the_model_s_output_is_constrained_as_the_loss_reads_it():
    """`plan.output`: a head tiled on vocab makes vocab-tiled logits, and the loss's softmax reads them
    gathered (the plan's all-gather); the plan says so, with the gradient the softmax's backward sends back
    (vocab-tiled, sliced locally), so a backend gathers at the model's end as the cost model does. A loss
    that reads the output as it is leaves no constraint."""
    from partir_torch.tactics import BatchParallel, Manual

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)

        def forward(self, t):
            return self.head(self.emb(t))

    def xent(m, t, y):
        return torch.nn.functional.cross_entropy(m(t).flatten(0, 1), y.flatten())

    batch = (torch.randint(0, 32, (8, 4)), torch.randint(0, 32, (8, 4)))
    mesh = Mesh.parse("batch=2,model=4")
    tactics = [Manual({"head.weight": ["model", None], "head.bias": ["model"]}), BatchParallel("batch")]
    state = apply_schedule(capture(Head(), batch, xent, "sgd"), mesh, tactics)
    plan = ShardingPlan.from_state(state, evaluate(state, hardware("cpu-virtual")), schedule="manual")
    assert plan.output == [[8, 4, 32], ["batch", None, None], ["batch", None, "model"]]
    assert ShardingPlan.from_json(json.loads(json.dumps(plan.to_json()))).output == plan.output
    state = apply_schedule(capture(Head(), batch, lambda m, t, y: m(t).square().mean(), "sgd"), mesh, tactics)
    assert ShardingPlan.from_state(state, evaluate(state, hardware("cpu-virtual")), schedule="m").output is None


def test_the_table_says_what_each_axis_does_and_shows_inputs_and_optimizer_states():
    """Roles from the specs, never the names: data parallel, tensor parallel, ZeRO (states split beyond their
    parameters), FSDP, expert parallel; an axis that splits no compute is warned about."""
    from partir_torch.plan.table import roles
    from partir_torch.tactics import Manual

    net, inputs, loss_fn = models.build("tiny-gpt2", {"batch": "8"}, device="meta")
    program = capture(net, inputs, loss_fn, "adamw")
    mesh = Mesh.parse("batch=2,model=4")

    def plan_of(schedule):
        state = apply_schedule(program, mesh, schedule)
        return ShardingPlan.from_state(state, evaluate(state, hardware("cpu-virtual")))

    expert = plan_of("batch:BatchParallel;model:Megatron;batch:ZeRO(1)")
    assert roles(expert) == {"batch": ["data parallel", "ZeRO-1/2 (optimizer states)"], "model": ["tensor parallel"]}
    text = expert.table()
    assert "inputs: 0 [8, 16] ['batch', None]; 1 [8, 16] ['batch', None]" in text
    assert "h.*.mlp.c_fc.weight [exp_avg, exp_avg_sq] (x2)  [['model', 'batch'], None]" in text
    assert "splits no compute" not in text
    fsdp = plan_of("batch:FSDP")
    assert roles(fsdp)["batch"] == ["data parallel", "FSDP / ZeRO-3"] and roles(fsdp)["model"] == []
    assert "warning: axis 'model' splits no compute: its 4 devices each repeat the same work" in fsdp.table()

    moe, moe_inputs, moe_loss = models.build("tiny-moe", {"batch": "8"}, device="meta")
    state = apply_schedule(capture(moe, moe_inputs, moe_loss, "adamw"), mesh, [
        Manual({"h.*.moe.w_in": ["model", None, None], "h.*.moe.w_out": ["model", None, None]})])
    assert roles(ShardingPlan.from_state(state, evaluate(state, hardware("cpu-virtual"))))["model"][0] == \
        "expert parallel"
