"""Every code block of the README and of docs/reference.md runs as written: the README's quickstart (a whole
script) in its own process, the reference's Python blocks in order in one namespace, every `partir-torch`
command of the bash blocks through the CLI's own entry point (in process: the same `main`, without a Python
start-up per line; the ranks `train` starts write to the process's own output)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from partir_torch.cli import main
from tests.docblocks import blocks as doc_blocks
from tests.docblocks import commands

README = Path(__file__).resolve().parents[1] / "README.md"
REFERENCE = README.parent / "docs" / "reference.md"
# the two set-up commands are CI's own (`./dev test`) and the demo (run on a fresh machine by hand)
NOT_RUN = ("./dev demo", "./dev test")


def blocks(lang: str, doc: Path = README) -> list[str]:
    return doc_blocks(doc, lang)


def test_the_docs_have_the_blocks_this_test_runs():
    assert len(blocks("python")) == 1 and len(blocks("bash")) >= 2
    assert len(blocks("python", REFERENCE)) >= 2 and len(blocks("bash", REFERENCE)) >= 2
    cmds = [c for doc in (README, REFERENCE) for b in blocks("bash", doc) for c in commands(b)]
    assert all(c.startswith(".venv/bin/partir-torch ") or c.startswith(NOT_RUN) for c in cmds), cmds
    assert len(README.read_bytes()) <= 8192, "the README is the front page: the reference goes to docs/"


@pytest.mark.engine
def test_the_quickstart_script_trains_on_four_ranks(tmp_path):
    script = blocks("python")[0]
    assert "launch.spawn(train, 4)" in script
    (tmp_path / "train.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_USE_SPMD")}
    res = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loss " in res.stdout and "predicted" in res.stdout, res.stdout[-2000:]
    # the quickstart shows a plan that shards (its memory limit asks for it) and the collectives it ran
    sharded = re.search(r"(\d+) of \d+ parameters sharded", res.stdout)
    assert sharded and int(sharded.group(1)) > 0, res.stdout[:3000]
    assert "all-gather" in res.stdout or "all-reduce" in res.stdout, res.stdout[-2000:]


def test_the_reference_python_blocks_run_in_order():
    namespace: dict = {}
    for block in blocks("python", REFERENCE):
        exec(compile(block, str(REFERENCE), "exec"), namespace)
    assert namespace["plan"].params and namespace["state"].mesh.devices == 8


BASH = [(README, i) for i in range(1, len(blocks("bash")))] + [(REFERENCE, i) for i in range(len(blocks("bash",
                                                                                                       REFERENCE)))]


@pytest.mark.engine
@pytest.mark.parametrize(("doc", "index"), BASH, ids=[f"{d.name}-{i}" for d, i in BASH])
def test_the_bash_blocks_run(doc, index, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # (the plans they write)
    for cmd in commands(blocks("bash", doc)[index]):
        argv = shlex.split(cmd)
        assert argv[0] == ".venv/bin/partir-torch", cmd
        assert main(argv[1:]) == 0, (cmd, capfd.readouterr().err[-2000:])
