"""Starting ranks from Python: `spawn(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in
`world_size` processes with the default process group initialized (gloo on the CPU; NCCL, one GPU a rank,
when there are enough GPUs), as `torchrun` would; `Workers` keeps such ranks alive and runs one function
after another on them (tests, notebooks: the group is started once).
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from partir_torch.errors import PartirError


class RankError(PartirError):
    """A rank raised (its traceback in the message), or ranks did not answer in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(world: int, backend: str | None) -> str:
    if backend is not None:
        return backend
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


def _join(rank: int, world: int, port: int, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if backend != "nccl":  # ranks share the CPU's cores (torchrun sets OMP_NUM_THREADS=1 likewise)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)


def _run(rank: int, fn: Callable, world: int, port: int, backend: str, args: tuple) -> None:
    _join(rank, world, port, backend)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` new processes with the process group started; raises
    when a rank fails. `fn` must be importable (a module-level function)."""
    mp.spawn(_run, args=(fn, world_size, free_port(), _backend(world_size, backend), args), nprocs=world_size)


def _outlive_not(parent: int) -> None:
    """Stop this rank when the process that started it is gone, even in the middle of a job."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _serve(rank: int, world: int, port: int, backend: str, jobs: Any, results: Any) -> None:
    parent = os.getppid()
    threading.Thread(target=_outlive_not, args=(parent,), daemon=True).start()
    _join(rank, world, port, backend)
    try:
        while True:
            try:
                job = jobs.get(timeout=2.0)
            except queue.Empty:
                if os.getppid() != parent:  # the process that started the ranks was killed: stop with it
                    break
                continue
            if job is None:
                break
            fn, args = job
            try:
                value = fn(rank, world, *args)
                ForkingPickler.dumps(value)  # (the queue pickles in a thread of its own, where a failure is lost)
                results.put((rank, True, value))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class Workers:
    """`world_size` ranks kept alive; `run(fn, *args)` runs `fn(rank, world_size, *args)` on each and returns
    their results in rank order. A rank that raises fails the call (its traceback in the message), a rank
    process that ends fails it at once (its exit code), and ranks that do not answer within `timeout` seconds
    (a collective left waiting) are stopped."""

    def __init__(self, world_size: int, *, backend: str | None = None, timeout: float = 600.0) -> None:
        ctx = mp.get_context("spawn")
        self.world, self.timeout = world_size, timeout
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port, b = free_port(), _backend(world_size, backend)
        self.procs = [ctx.Process(target=_serve, args=(r, world_size, port, b, self.jobs[r], self.results),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        if not self.alive:
            raise RankError(f"the worker ranks have stopped ({self._exits()}); start new Workers")
        for q in self.jobs:
            q.put((fn, args))
        got: dict[int, Any] = {}
        failed: list[str] = []
        deadline = time.monotonic() + self.timeout
        while len(got) + len(failed) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                if not self.alive:  # a rank process is gone: nothing will answer for it
                    gone = self._exits()
                    self.close(abandon=True)
                    raise RankError(f"{fn.__name__}: {gone} before answering; a rank that exits before "
                                    "its first job is often a script that starts Workers outside `if __name__ == "
                                    "'__main__':` (each rank imports it)" + ("\n" + "\n".join(failed) if failed
                                                                          else "")) from None
                if time.monotonic() > deadline:
                    self.close(abandon=True)
                    raise RankError(f"{self.world - len(got) - len(failed)} rank(s) did not finish {fn.__name__} in "
                                    f"{self.timeout:.0f} s (a collective waiting for a rank that failed?)"
                                    + ("\n" + "\n".join(failed) if failed else "")) from None
                continue
            if ok:
                got[rank] = value
            else:
                failed.append(f"rank {rank}:\n{value}")
                deadline = min(deadline, time.monotonic() + 20.0)  # after a failure, the others get a short while
        if failed:
            raise RankError(f"{fn.__name__} failed on {len(failed)} rank(s):\n" + "\n".join(failed))
        return [got[r] for r in range(self.world)]

    def _exits(self) -> str:
        """Which ranks' processes have ended, with their exit codes."""
        gone = [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(self.procs) if p.exitcode is not None]
        return ", ".join(gone) or "stopped after a timeout"

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, *, abandon: bool = False) -> None:
        """Stop the ranks: each after its current job, or (`abandon`: a call given up on, whose ranks may wait in
        a collective for ever) at once."""
        for q, p in zip(self.jobs, self.procs):
            if p.is_alive() and not abandon:
                q.put(None)
        for p in self.procs:
            if not abandon:
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
