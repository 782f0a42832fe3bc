"""Pictures of a plan (`plan/picture.py`, `partir-torch show`): the blocks each device holds, and the chart."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from partir_torch import models
from partir_torch.cli import main
from partir_torch.errors import PartirError
from partir_torch.plan.picture import blocks, draw_plan, draw_tensor


@pytest.fixture(scope="module")
def plan():
    from partir_torch.search.api import search

    model, inputs, loss_fn = models.build("tiny-gpt2", device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return search(model, inputs, "batch=2,model=4", loss_fn=loss_fn, schedule="batch:FSDP;model:Megatron",
                      progress=False, cache=False)


def test_blocks_are_held_by_the_devices_of_their_mesh_coordinates():
    mesh = {"batch": 2, "model": 2}  # device = 2 * batch + model
    assert blocks([8, 4], [["batch", "model"], None], mesh) == {(0, 0): [0], (1, 0): [1], (2, 0): [2], (3, 0): [3]}
    assert blocks([8, 4], [["model", "batch"], None], mesh) == {(0, 0): [0], (2, 0): [1], (1, 0): [2], (3, 0): [3]}
    assert blocks([8, 4], [None, "model"], mesh) == {(0, 0): [0, 2], (0, 1): [1, 3]}  # replicated over batch
    assert blocks([8], [None], mesh) == {(0,): [0, 1, 2, 3]}


def _picture(path):
    import matplotlib.image

    img = matplotlib.image.imread(path)
    colours = np.unique(img[..., :3].reshape(-1, 3).round(2), axis=0)
    return img.shape, len(colours)


def test_a_tensor_picture_has_a_block_per_tile(plan, tmp_path):
    (h, w, _), colours = _picture(draw_tensor(plan, "h.0.attn.c_attn.weight", tmp_path / "t.png"))
    assert plan.params["h.0.attn.c_attn.weight"] == [["batch", "model"], None]
    assert h > w > 100 and colours > 8  # 8 blocks stacked on dim 0, one colour each (and the text's)
    (h2, _, _), _ = _picture(draw_tensor(plan, "inputs[0]", tmp_path / "i.png"))
    assert h2 < h  # the batch split in 2 only
    with pytest.raises(PartirError, match=r"no tensor named 'h\.0\.nope'"):
        draw_tensor(plan, "h.0.nope", tmp_path / "x.png")


def test_the_plan_chart_and_the_show_command(plan, tmp_path, capsys):
    (h, w, _), colours = _picture(draw_plan(plan, tmp_path / "p.png"))
    assert w > h / 2 and colours > 5
    plan.save(tmp_path / "plan.json")
    assert main(["show", str(tmp_path / "plan.json"), "--tensor", "opt.exp_avg[h.1.mlp.c_fc.weight]",
                 "--out", str(tmp_path / "pics")]) == 0
    printed = capsys.readouterr().out.split()
    assert [p.split("/")[-1] for p in printed] == ["plan.png", "plan.opt.exp_avg_h.1.mlp.c_fc.weight_.png"]
    assert all((tmp_path / "pics" / p.split("/")[-1]).stat().st_size > 5000 for p in printed)
    assert main(["show", str(tmp_path / "plan.json"), "--tensor", "nothing"]) == 2
