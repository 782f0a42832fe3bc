"""Monte Carlo Tree Search over sharding actions, with propagation and the cost model in the loop (PartIR §6).

    root: the state left by the schedule's earlier tactics; a node is the set of actions applied so far
    until the budget (episodes or seconds) is spent:
      1. select   from the root, while a node has no untried action and has children, go to the child
                  maximizing  Q/n + c * sqrt(ln N / n)   (UCT; rewards lie in (0, 2], see goals.py)
      2. expand   pop one untried action of the node (the candidates are pruned by propagation: only
                  legal actions not already implied are offered), apply it to a copy of the node's state
                  and propagate; an action that leaves every decision as it was is dropped, and states
                  with the same shardings of parameters, inputs and optimizer states (the same set of
                  actions in another order, or different actions that propagate to the same plan) are
                  one node (transposition table)
      3. simulate score the new node as it stands (STOP here), then roll out: up to `rollout_depth`
                  random candidate actions, stopping with probability `p_stop` before each; score that
      4. back up  the better of the two rewards along the selected path
    the answer is the best state ever scored, in the goal's order (anytime: the budget can end it at any
    episode). Deterministic for a seed under an episode budget; a time budget varies the episode count.

`prune=False` is the ablation of `benchmarks/search.py` (what the propagation analysis buys): every
syntactically possible action is offered (`candidates(..., prune=False)`), an illegal one expands to a
child with its parent's plan (a no-op, scored like any node), and there is no transposition by shardings
and no dropping of actions that change nothing: only action sets are merged (an action is not offered
twice on one path).

Refinement (the last `refine` share of the budget): rollouts leave incidental actions in the best plan, and
the tree rarely reaches the last small improvement. So the best plan is (1) pruned: each action whose
removal keeps the plan within `simplicity` (0.5 %) of the best step time found is dropped, and (2)
hill-climbed: the single candidate action that improves it most is added, while one improves it by more
than `simplicity` (or makes it fit). Sharding more than a plan needs costs what the cost model does not
see (more collectives to launch, more to debug) and the model is not accurate to 0.5 %: a decision must
earn its place.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from partir_torch.propagate import ShardingState
from partir_torch.search.goals import Evaluator
from partir_torch.search.space import Action, apply_action, candidates


@dataclass
class Budget:
    """Stop after `episodes`, or after `seconds`, whichever comes first (None: no limit on that)."""

    episodes: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str | int | float | Budget | None) -> Budget:
        """`"30s"`, `"2m"`, `"500"` / `"500ep"` (episodes), a number of episodes, or None (200 episodes)."""
        from partir_torch.errors import PartirError

        if isinstance(text, Budget):
            return text
        if text is None:
            return cls(episodes=200)
        if isinstance(text, int | float):
            return cls(episodes=int(text))
        t = text.strip().lower()
        try:
            if t.endswith("ms"):
                return cls(seconds=float(t[:-2]) / 1e3)
            if t.endswith("s"):
                return cls(seconds=float(t[:-1]))
            if t.endswith("m"):
                return cls(seconds=60 * float(t[:-1]))
            return cls(episodes=int(t.removesuffix("ep")))
        except ValueError:
            raise PartirError(f"cannot read search budget {text!r}; write e.g. 30s, 2m or 500 (episodes)") from None

    def split(self, k: int) -> Budget:
        return Budget(None if self.episodes is None else max(1, self.episodes // k),
                      None if self.seconds is None else self.seconds / k)


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
class _Node:
    key: frozenset
    state: ShardingState
    untried: list[Action]
    depth: int
    acts: list[Action]  # the legal actions that made `state` from the root, in order
    children: list[tuple[Action, _Node]] = field(default_factory=list)
    n: int = 0
    q: float = 0.0


@dataclass
class Result:
    state: ShardingState
    actions: list[Action]
    key: tuple
    stats: Stats


class MCTS:
    def __init__(self, root: ShardingState, evaluator: Evaluator, axes: tuple[str, ...], kinds: frozenset[str], *,
                 seed: int = 0, c: float = 0.5, rollout_depth: int = 3, p_stop: float = 0.3, max_depth: int = 12,
                 simplicity: float = 0.005, progress: bool = False, prune: bool = True) -> None:
        self.simplicity, self.prune = simplicity, prune
        self.ev, self.axes, self.kinds = evaluator, axes, kinds
        self.rng = random.Random(seed)
        self.c, self.rollout_depth, self.p_stop, self.max_depth = c, rollout_depth, p_stop, max_depth
        self.progress = progress
        self.table: dict[frozenset, _Node] = {}
        self.by_print: dict[int, _Node] = {}
        p = root.program
        self._decided = [v.id for v in p.values if v.producer < 0]
        self.stats = Stats()
        self.root = self._node(frozenset(), root, 0, [])
        self.ref, _ = self.ev.score(root, frozenset())
        self.best: tuple[tuple, ShardingState, list[Action]] = (self.ref, root, [])

    def _fingerprint(self, state: ShardingState) -> int:
        """The decisions of a state: shardings and fences of its parameters, inputs and optimizer states."""
        sh, lk = state.shard, state.locked
        return hash(tuple((sh[v], lk[v]) for v in self._decided))

    def _node(self, key: frozenset, state: ShardingState, depth: int, acts: list[Action]) -> _Node:
        untried = self._candidates(state) if depth < self.max_depth else []
        if not self.prune:
            untried = [a for a in untried if a not in key]  # an action set: the same action twice is one
        self.rng.shuffle(untried)
        node = self.table[key] = _Node(key, state, untried, depth, acts)
        if self.prune:
            self.by_print[self._fingerprint(state)] = node
        self.stats.nodes += 1
        return node

    def _candidates(self, state: ShardingState) -> list[Action]:
        return candidates(state, self.axes, self.kinds, prune=self.prune)

    def _apply(self, state: ShardingState, action: Action) -> ShardingState | None:
        t0 = time.perf_counter()
        s = state.copy()
        ok = apply_action(s, action)
        self.stats.propagation_time_s += time.perf_counter() - t0
        return s if ok else None

    def _consider(self, key: tuple, state: ShardingState, actions: list[Action]) -> None:
        if key < self.best[0]:
            self.best = (key, state, actions)
            self.stats.best_at_episode = self.stats.episodes

    @staticmethod
    def _pruned(child: _Node, node: _Node, path: list[_Node]) -> bool:
        """The plan of `node` itself, of an ancestor (a transposition must not close a cycle, which selection
        would walk forever), or of a child it already has: no new decision."""
        return any(c is child for c in path) or any(c is child for _, c in node.children)

    def episode(self) -> None:
        node, path, acts = self.root, [self.root], []
        while not node.untried and node.children:  # select
            logn = math.log(node.n + 1)
            a, node = max(node.children, key=lambda ch: ch[1].q / max(ch[1].n, 1)
                          + self.c * math.sqrt(logn / max(ch[1].n, 1)))
            path.append(node)
            acts.append(a)
        child = None
        while node.untried and child is None:  # expand
            a = node.untried.pop()
            key = node.key | {a}
            child = self.table.get(key)
            if child is None and not self.prune:  # ablation: illegal is a no-op child, no transposition
                s = self._apply(node.state, a)
                legal = s is not None
                child = self._node(key, s if legal else node.state.copy(), node.depth + 1,
                                   [*node.acts, a] if legal else list(node.acts))
            elif child is None:
                s = self._apply(node.state, a)
                if s is None:
                    continue
                fp = self._fingerprint(s)
                child = self.by_print.get(fp)
                if child is None:
                    child = self._node(key, s, node.depth + 1, [*acts, a])
                elif not self._pruned(child, node, path):
                    self.table[key] = child
            if self._pruned(child, node, path):
                child = None  # no new decision: pruned
                continue
            node.children.append((a, child))
            acts.append(a)
        if child is not None:
            path.append(child)
            node = child
        if not self.prune:  # the path's actions may include illegal ones (no-ops): the node's own list
            acts = list(node.acts)
        k0, _ = self.ev.score(node.state, node.key)  # STOP here
        self._consider(k0, node.state, list(acts))
        r = self.ev.reward(k0, self.ref)
        s, ro_acts, key = node.state, list(acts), set(node.key)
        for _ in range(self.rollout_depth):  # roll out
            if self.rng.random() < self.p_stop:
                break
            cands = self._candidates(s)
            if not cands:
                break
            a = cands[self.rng.randrange(len(cands))]
            nxt = self._apply(s, a)
            if nxt is None:
                continue
            s = nxt
            ro_acts.append(a)
            key.add(a)
        if len(ro_acts) > len(acts):
            k1, _ = self.ev.score(s, frozenset(key))
            self._consider(k1, s, ro_acts)
            r = max(r, self.ev.reward(k1, self.ref))
        for n in path:  # back up
            n.n += 1
            n.q += r
        self.stats.episodes += 1

    def _replay(self, actions: list[Action]) -> ShardingState | None:
        s = self.root.state
        for a in actions:
            s = self._apply(s, a)
            if s is None:
                return None
        return s

    def refine(self, deadline: float | None, max_evals: int | None) -> None:
        """Prune incidental actions from the best plan, then hill-climb it (see the module docstring)."""
        used = 0

        def spent() -> bool:
            return (deadline is not None and time.perf_counter() >= deadline) or (max_evals is not None and used >= max_evals)

        base = key = self.best[0]
        _, state, acts = self.best
        i = len(acts) - 1
        while i >= 0 and not spent():  # prune, newest first
            trial = acts[:i] + acts[i + 1:]
            s = self._replay(trial)
            used += 1
            if s is not None:
                k, _ = self.ev.score(s, frozenset(trial))
                if k[0] == base[0] and k[1] <= base[1] and k[2] <= base[2] * (1 + self.simplicity):
                    key, state, acts = k, s, trial
            i -= 1
        self.best = (key, state, acts)  # within `simplicity` of the best found, with fewer decisions

        def better(k: tuple, than: tuple) -> bool:
            return k[0] < than[0] or (k[0] == than[0] and (k[1] < than[1] if k[0] else k[2] < than[2] * (1 - self.simplicity)))

        while not spent():  # hill-climb
            step = None
            for a in self._candidates(state):
                if spent():
                    break
                s = self._apply(state, a)
                used += 1
                if s is None:
                    continue
                k, _ = self.ev.score(s, frozenset([*acts, a]))
                if better(k, key) and (step is None or k < step[0]):
                    step = (k, s, a)
            if step is None:
                break
            key, state, acts = step[0], step[1], [*acts, step[2]]
            self.best = (key, state, acts)

    def run(self, budget: Budget, *, refine: float = 0.2) -> Result:
        t0 = time.perf_counter()
        main = Budget(None if budget.episodes is None else max(1, int(budget.episodes * (1 - refine))),
                      None if budget.seconds is None else budget.seconds * (1 - refine))
        ev0, ct0 = self.ev.evaluations, self.ev.cost_time_s
        bar = None
        if self.progress:
            from rich.progress import Progress

            bar = Progress(transient=True)
            bar.start()
            task = bar.add_task(f"MCTS on {', '.join(self.axes)}", total=budget.episodes or None)
        try:
            while True:
                if main.episodes is not None and self.stats.episodes >= main.episodes:
                    break
                if main.seconds is not None and time.perf_counter() - t0 >= main.seconds:
                    break
                if not self.root.untried and not self.root.children:
                    break  # nothing to do on these axes
                self.episode()
                if bar is not None:
                    bar.update(task, advance=1, description=f"MCTS on {', '.join(self.axes)}: best "
                               f"{'fits' if not self.best[0][0] else 'does not fit'}, {self.best[0][2] * 1e3:.2f} ms")
            if refine > 0:
                self.refine(None if budget.seconds is None else t0 + budget.seconds,
                            None if budget.episodes is None else max(8, int(budget.episodes * refine * 4)))
        finally:
            if bar is not None:
                bar.stop()
        self.stats.time_s = time.perf_counter() - t0
        self.stats.evaluations = self.ev.evaluations - ev0
        self.stats.cost_time_s = self.ev.cost_time_s - ct0
        key, state, actions = self.best
        return Result(state, actions, key, self.stats)
