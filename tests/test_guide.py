"""`docs/guide.md` runs as written: its blocks in document order in one directory (bash commands through the
CLI's `main`, Python blocks in one namespace), so a newcomer who follows it gets a plan, its pictures, a
simulated and a trained sharded model, and the errors it shows."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from partir_torch.cli import main
from tests.docblocks import commands

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"


def test_every_block_of_the_guide_runs_in_order(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ordered = re.findall(r"^```(bash|python)\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)
    assert [lang for lang, _ in ordered].count("python") >= 2 and len(ordered) >= 8
    namespace: dict = {}
    for lang, block in ordered:
        if lang == "python":
            exec(compile(block, str(GUIDE), "exec"), namespace)
            continue
        for cmd in commands(block):
            argv = shlex.split(cmd)
            assert argv[0] == ".venv/bin/partir-torch", cmd
            assert main(argv[1:]) == 0, (cmd, capsys.readouterr().err[-2000:])
    out = capsys.readouterr().out
    assert (tmp_path / "pics" / "plan.png").stat().st_size > 5000  # the pictures section
    assert (tmp_path / "pics" / "plan.h.0.attn.c_attn.weight.png").exists()
    assert (tmp_path / "mine.json").exists() and "step 1: loss" in out  # Python's plan, XLA training
    assert "loss after 3 steps" in out  # auto_shard on torch_xla from Python
    for said in ("write 'batch=2'", "did you mean 'budget'?", "no plan found fits in memory"):
        assert said in out, said  # the troubleshooting section's errors, as the guide quotes them
