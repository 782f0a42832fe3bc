"""Budgets, statistics and results of a search, shared by the tree search, the local search and the
baselines; Ctrl-C sets the search's cancellation token (`tactics.Context.cancel`), which ends every phase with
its best plan."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from partir_torch.errors import PartirError
from partir_torch.propagate import ShardingState
from partir_torch.search.goals import Score
from partir_torch.search.space import Action

__all__ = ["DEFAULT_EPISODES", "Budget", "Result", "Stats", "ctrl_c_ends_search"]

DEFAULT_EPISODES = 200  # the budget when none is given (`Budget()`, `Budget.parse(None)`, `SearchConfig()`)


@contextmanager
def ctrl_c_ends_search(cancel: threading.Event) -> Iterator[None]:
    """While a search runs in the main thread with Python's default Ctrl-C handling, Ctrl-C sets `cancel`
    (the search then ends with its best plan) instead of raising: a KeyboardInterrupt raised while a
    finalizer runs (garbage collection of an XLA tensor, say) is printed and dropped by Python, and the
    search would run to its budget. A second Ctrl-C raises as usual. Elsewhere the search catches the
    KeyboardInterrupt itself."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def handler(signum, frame) -> None:
        if cancel.is_set():
            signal.default_int_handler(signum, frame)
        cancel.set()

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@dataclass(frozen=True)
class Budget:
    """Stop after `episodes`, or after `seconds`, whichever comes first (None: no limit on that). With
    neither given, the search is bounded by `DEFAULT_EPISODES` episodes: it never runs unbounded."""

    episodes: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if self.episodes is None and self.seconds is None:  # the one place the default is decided
            object.__setattr__(self, "episodes", DEFAULT_EPISODES)

    @classmethod
    def parse(cls, text: str | int | float | Budget | None) -> Budget:
        """`"30s"`, `"2m"`, `"500"` / `"500ep"` (episodes), a number of episodes, or None (the default)."""
        if text is None:
            return cls()
        if isinstance(text, Budget):
            out = text
        elif isinstance(text, int | float):
            out = cls(episodes=int(text))
        else:
            t = text.strip().lower()
            try:
                if t.endswith("ms"):
                    out = cls(seconds=float(t[:-2]) / 1e3)
                elif t.endswith("s"):
                    out = cls(seconds=float(t[:-1]))
                elif t.endswith("m"):
                    out = cls(seconds=60 * float(t[:-1]))
                else:
                    out = cls(episodes=int(t.removesuffix("ep")))
            except ValueError:
                raise PartirError(f"cannot read search budget {text!r}; write e.g. 30s, 2m or 500 (episodes)") from None
        if (out.episodes is not None and out.episodes <= 0) or (out.seconds is not None and out.seconds <= 0):
            raise PartirError(f"search budget {text!r} must be positive; give e.g. 30s, 2m or 500 (episodes), or "
                              f"nothing for the default ({DEFAULT_EPISODES} episodes)")
        return out

    def split(self, k: int) -> Budget:
        return self.share(1 / k)

    def share(self, f: float) -> Budget:
        """`f` of this budget (at least one episode)."""
        return Budget(None if self.episodes is None else max(1, int(self.episodes * f + 1e-9)),
                      None if self.seconds is None else self.seconds * f)


@dataclass
class Stats:
    episodes: int = 0
    nodes: int = 0
    evaluations: int = 0
    time_s: float = 0.0
    propagation_time_s: float = 0.0
    cost_time_s: float = 0.0
    best_at_episode: int = 0

    def to_json(self) -> dict:
        return {"episodes": self.episodes, "states": self.nodes, "evaluations": self.evaluations,
                "time_s": self.time_s, "evaluations_per_s": self.evaluations / self.time_s if self.time_s else 0.0,
                "propagation_time_s": self.propagation_time_s, "cost_time_s": self.cost_time_s,
                "best_at_episode": self.best_at_episode}


@dataclass
class Result:
    state: ShardingState
    actions: list[Action]
    key: Score
    stats: Stats


