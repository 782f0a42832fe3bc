"""`docs/guide.md` runs as written: its blocks in document order in one directory (bash commands through the
CLI's `main`, Python blocks in one namespace, a Python block titled with a file name written there and run
alone, as a script of its own), so a newcomer who follows it gets a plan, its pictures, a simulated and a
trained sharded model, and the errors it shows."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from partir_torch.cli import main
from tests.docblocks import commands

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"


@pytest.mark.engine
def test_every_block_of_the_guide_runs_in_order(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    ordered = re.findall(r"^```(bash|python)( [\w.]+)?\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)
    assert [lang for lang, _, _ in ordered].count("python") >= 3 and len(ordered) >= 8
    namespace: dict = {}
    scripts = []
    for lang, file, block in ordered:
        if file:  # a script of its own: nothing of the blocks before it
            (tmp_path / file.strip()).write_text(block)
            res = subprocess.run([sys.executable, file.strip()], cwd=tmp_path, capture_output=True, text=True,
                                 timeout=600)
            assert res.returncode == 0, res.stderr[-3000:]
            scripts.append(res.stdout)
            continue
        if lang == "python":
            exec(compile(block, str(GUIDE), "exec"), namespace)
            continue
        for cmd in commands(block):
            argv = shlex.split(cmd)
            assert argv[0] == ".venv/bin/partir-torch", cmd
            assert main(argv[1:]) == 0, (cmd, capfd.readouterr().err[-2000:])
    out = capfd.readouterr().out
    assert (tmp_path / "pics" / "plan.png").stat().st_size > 5000  # the pictures section
    assert (tmp_path / "pics" / "plan.h.0.attn.c_attn.weight.png").exists()
    assert (tmp_path / "mine.json").exists() and "step 1: loss" in out  # Python's plan, CLI training
    assert len(scripts) == 1 and "loss after 3 steps" in scripts[0]  # auto_shard from a script of its own
    for said in ("write 'batch=2'", "did you mean 'budget'?", "no plan found fits in memory"):
        assert said in out, said  # the troubleshooting section's errors, as the guide quotes them
