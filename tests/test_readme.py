"""Every code block of the README runs as written: the Python blocks in order in one namespace (the
quickstart, a whole script, in its own process), every `partir-torch` command of the bash blocks through the
CLI's own entry point (in process: the same `main`, without a Python start-up per line)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from partir_torch.cli import main
from tests.docblocks import blocks as doc_blocks
from tests.docblocks import commands

README = Path(__file__).resolve().parents[1] / "README.md"
# the two set-up commands are CI's own (`./dev test`) and the demo (run on a fresh machine by hand)
NOT_RUN = ("./dev demo", "./dev test")


def blocks(lang: str) -> list[str]:
    return doc_blocks(README, lang)


def test_the_readme_has_the_blocks_this_test_runs():
    assert len(blocks("python")) >= 3 and len(blocks("bash")) >= 3
    cmds = [c for b in blocks("bash") for c in commands(b)]
    assert all(c.startswith(".venv/bin/partir-torch ") or c.startswith(NOT_RUN) for c in cmds), cmds


def test_the_quickstart_script_trains_on_four_ranks(tmp_path):
    script = blocks("python")[0]
    assert "launch.spawn(train, 4)" in script
    (tmp_path / "train.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_USE_SPMD")}
    res = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loss " in res.stdout and "predicted" in res.stdout, res.stdout[-2000:]


def test_the_python_blocks_run_in_order():
    namespace: dict = {}
    for block in blocks("python")[1:]:
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["plan"].params and namespace["state"].mesh.devices == 8


@pytest.mark.parametrize("index", range(1, len(blocks("bash"))))
def test_the_bash_blocks_run(index, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # (the plans they write)
    for cmd in commands(blocks("bash")[index]):
        argv = shlex.split(cmd)
        assert argv[0] == ".venv/bin/partir-torch", cmd
        assert main(argv[1:]) == 0, (cmd, capsys.readouterr().err[-2000:])
