"""`backends/distributed/launch.py`: the ranks `Workers` starts stop with the process that started them, even
in the middle of a job."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.engine

SCRIPT = """
import os, sys, time
from partir_torch.launch import Workers

def pid(rank, world):
    return os.getpid()

def busy(rank, world):
    time.sleep(120)

if __name__ == "__main__":
    w = Workers(2, timeout=300)
    print("ranks", *w.run(pid), flush=True)
    w.run(busy)  # killed while the ranks are in the middle of a job
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ranks_stop_when_the_process_that_started_them_is_killed(tmp_path):
    script = tmp_path / "start.py"
    script.write_text(SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    line = next(ln for ln in parent.stdout if ln.startswith("ranks"))
    ranks = [int(p) for p in line.split()[1:]]
    assert len(ranks) == 2 and all(_alive(p) for p in ranks)
    parent.kill()  # SIGKILL: no atexit, no daemon clean-up
    parent.wait()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [p for p in ranks if _alive(p)]
    for p in left:
        os.kill(p, 9)
    assert not left, f"ranks {left} outlived the killed process that started them"


def exits(rank, world):
    if rank == 1:
        os._exit(3)
    time.sleep(120)  # (left waiting, as in a collective with the rank that is gone)


def test_a_rank_that_exits_fails_the_call_at_once_with_its_exit_code():
    import pytest

    from partir_torch.backends.distributed.launch import RankError
    from partir_torch.launch import Workers

    with Workers(2, timeout=60) as w:
        start = time.monotonic()
        with pytest.raises(RankError, match=r"exits: rank 1 exited with code 3 before answering.*__main__"):
            w.run(exits)
        assert time.monotonic() - start < 30
        with pytest.raises(RankError, match=r"stopped \(.*rank 1 exited with code 3\); start new Workers"):
            w.run(exits)


def _unsendable(rank, world):
    import torch

    return torch.ones(2, requires_grad=True) * 2  # autograd refuses to cross processes


def test_a_result_that_cannot_be_sent_fails_the_call_at_once():
    from partir_torch.backends.distributed.launch import RankError
    from partir_torch.launch import Workers

    with Workers(2, timeout=120) as w:
        t0 = time.monotonic()
        with pytest.raises(RankError, match="Cowardly refusing to serialize"):
            w.run(_unsendable)
        assert time.monotonic() - t0 < 60  # not the timeout
