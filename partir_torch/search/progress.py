"""Search progress, where the user can see it: a live bar on a terminal; when stderr is piped or logged
(CI, Lightning's logs) a plain line every `EVERY_S` seconds with the budget used, the best plan's cost and
the episode rate, which a log keeps readable where a redrawn bar would be noise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from partir_torch.search.budget import Budget

EVERY_S = 5.0


def mode_of(progress: bool | str | None, stream: TextIO | None = None) -> str | None:
    """None / True / "auto": a bar on a terminal, else lines; "bar" or "lines" as asked; False: nothing."""
    if progress is False:
        return None
    if progress in (None, True, "auto"):
        return "bar" if (stream or sys.stderr).isatty() else "lines"
    if progress not in ("bar", "lines"):
        raise ValueError(f"progress must be True, False, 'auto', 'bar' or 'lines', got {progress!r}")
    return progress


class Reporter:
    """One search phase's progress (`with Reporter(...) as r: ... r.update(...)`)."""

    def __init__(self, mode: str | None, title: str, budget: Budget, stream: TextIO | None = None) -> None:
        self.mode, self.title, self.budget = mode, title, budget
        self.stream = stream or sys.stderr
        self.t0 = self.last = time.perf_counter()
        self.bar = self.task = None

    def __enter__(self) -> Reporter:
        self.t0 = self.last = time.perf_counter()
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(transient=True, console=Console(file=self.stream))
            self.bar.start()
            self.task = self.bar.add_task(self.title, total=self.budget.episodes or None)
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, episodes: int, best_s: float | None, fits: bool) -> None:
        """After each episode: the bar redrawn, or a line when `EVERY_S` has passed since the last."""
        now = time.perf_counter()
        if self.mode is None or (self.bar is None and now - self.last < EVERY_S):
            return
        best = "no plan yet" if best_s is None else f"best {best_s * 1e3:.2f} ms, {'fits' if fits else 'does not fit'}"
        if self.bar is not None:
            self.bar.update(self.task, completed=episodes, description=f"{self.title}: {best}")
            return
        self.last = now
        spent = now - self.t0
        used = (f"{episodes}/{self.budget.episodes} episodes" if self.budget.episodes is not None
                else f"{episodes} episodes")
        if self.budget.seconds is not None:
            used += f", {spent:.1f} s of {self.budget.seconds:g} s"
        print(f"partir_torch: {self.title}: {used} ({episodes / max(spent, 1e-9):.0f}/s); {best}",
              file=self.stream, flush=True)
