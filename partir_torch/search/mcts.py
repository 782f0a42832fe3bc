"""Monte Carlo Tree Search over sharding actions, with propagation and the cost model in the loop (PartIR §6).

    root: the state left by the schedule's earlier tactics; a node is the set of actions applied so far
    until the budget (episodes or seconds) is spent:
      1. select   from the root, while a node has children and no untried action (or is wide, below), go
                  to the child maximizing  Q/n + c * sqrt(ln N / n)   (UCT; rewards: see goals.py)
      2. expand   pop one untried action of the node, in random order (the candidates are pruned by
                  propagation: only legal actions not already implied are offered, each judged at its
                  place in the plan's canonical order, `space.rank`: parameter tiles, input tiles, then
                  ZeRO moves and late tiles), put it at its place and propagate (replaying the actions
                  after it, from a cached state of the prefix); an action that leaves every decision as it was is
                  dropped, and states with the same shardings of parameters, inputs and optimizer states
                  (the same set of actions in another order, or different actions that propagate to the
                  same plan) are one node (transposition table). A wide node (more than `widen_above`
                  candidates, where a short budget buys fewer episodes than there are children)
                  is widened progressively: at most `widen` * sqrt(n + 1) children (n its visits),
                  expanded largest decision first (`space.decided_bytes`: the bytes the action tiles, an
                  input's tile counting the activations propagation carries it to; ties in random
                  order), so the tree goes deep instead of spending the whole budget one level down
      3. simulate score the new node as it stands (STOP here), then roll out: up to `rollout_depth`
                  of the node's candidate actions (one per slot and axis), stopping with probability
                  `p_stop` before each, put at their places in one replay (one illegal there is left
                  out: a rollout is a sampling policy; what is scored is the plan replayed); each is, with
                  probability `greedy_rollout`, the candidate whose episodes so far have the best mean
                  reward (move-average sampling, MAST: an action that pays off anywhere in the tree, such as
                  the batch split of an input, is tried in the rollouts of the others), else a random one
                  (or random while no candidate has been tried); score that
      4. back up  the better of the two rewards along the selected path, and into the per-action means
    the answer is the best state ever scored, in the goal's order (anytime: the budget can end it at any
    episode). Deterministic for a seed under an episode budget; a time budget varies the episode count.

`prune=False` is the ablation of `benchmarks/search.py` (what the propagation analysis buys): every
syntactically possible action is offered (`candidates(..., prune=False)`), an illegal one expands to a
child with its parent's plan (a no-op, scored like any node), and there is no transposition by shardings
and no dropping of actions that change nothing: only action sets are merged (an action is not offered
twice on one path).

Refinement (the last `refine` share of the budget) is the local search of `local.py`, from the best plans
the tree found. Under a time budget, a refinement that reaches its local optimum early hands the time left
back to the tree (then refines again), so the budget is spent searching.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field

from partir_torch.propagate import ShardingState
from partir_torch.search.budget import DEFAULT_EPISODES, Budget, Result, Stats, ctrl_c_ends_search
from partir_torch.search.goals import Evaluator
from partir_torch.search.local import Fingerprint, LocalSearch, Plan, simplify
from partir_torch.search.progress import Reporter, mode_of
from partir_torch.search.space import Action, Plans, decided_bytes

__all__ = ["DEFAULT_EPISODES", "MCTS", "Budget", "Result", "Stats", "simplify"]


@dataclass
class _Node:
    key: frozenset
    state: ShardingState
    untried: list[Action]
    depth: int
    acts: list[Action]  # the legal actions that made `state` from the root, in order
    width: int = 0  # candidates when created
    cands: list[Action] = field(default_factory=list)  # the candidates when created (the rollouts draw from them)
    children: list[tuple[Action, _Node]] = field(default_factory=list)
    n: int = 0
    q: float = 0.0


class MCTS:
    """The tree search of the module docstring; the best plans and the refinement are `self.local`'s."""

    def __init__(self, root: ShardingState, evaluator: Evaluator, axes: tuple[str, ...], kinds: frozenset[str], *,
                 seed: int = 0, c: float = 0.5, rollout_depth: int = 3, p_stop: float = 0.3, max_depth: int = 12,
                 simplicity: float = 0.005, progress: bool | str | None = False, prune: bool = True, elite: int = 4,
                 greedy_rollout: float = 0.5, widen: float | None = 3.0, widen_above: int = 128,
                 cancel: threading.Event | None = None) -> None:
        self.cancel = cancel if cancel is not None else threading.Event()  # set: end with the best plan so far
        self.simplicity, self.prune, self.widen = simplicity, prune, widen
        self.widen_above = widen_above
        self.ev, self.axes, self.kinds = evaluator, axes, kinds
        self.rng = random.Random(seed)
        self.c, self.rollout_depth, self.p_stop, self.max_depth = c, rollout_depth, p_stop, max_depth
        self.progress = progress
        self.table: dict[frozenset, _Node] = {}
        self.by_print: dict[Fingerprint, _Node] = {}
        self.stats = Stats()
        self.plans = Plans(root)  # plans in canonical order (space.rank); counts the actions applied (propagated)
        self.mast: dict[Action, list[float]] = {}  # action -> [sum of rewards, episodes] of episodes that took it
        self.local = LocalSearch(self.plans, evaluator, axes, kinds, prune=prune, simplicity=simplicity,
                                 elite=elite, widen=widen, widen_above=widen_above, stats=self.stats, mast=self.mast,
                                 cancel=self.cancel)
        self.root = self._node(frozenset(), root, 0, [])
        self.ref = self.local.best[0]
        self.greedy_rollout = greedy_rollout


    def _node(self, key: frozenset, state: ShardingState, depth: int, acts: list[Action]) -> _Node:
        cands = self._candidates(state, acts)
        if not self.prune:
            cands = [a for a in cands if a not in key]  # an action set: the same action twice is one
        untried = list(cands) if depth < self.max_depth else []
        self.rng.shuffle(untried)
        if self.widen is not None and len(untried) > self.widen_above:  # prior: largest decision first (popped last)
            untried.sort(key=lambda a: decided_bytes(state, a))
        node = self.table[key] = _Node(key, state, untried, depth, acts, len(untried), cands)
        if self.prune:
            self.by_print[self._fingerprint(state)] = node
        self.stats.nodes += 1
        return node

    def _wide(self, node: _Node) -> bool:
        """Progressive widening: a node of n visits has at most `widen` * sqrt(n + 1) children, so a node with
        hundreds of candidates is searched in depth before it is fully expanded."""
        return (self.widen is not None and node.width > self.widen_above
                and len(node.children) >= self.widen * math.sqrt(node.n + 1))

    def _candidates(self, state: ShardingState, acts: list[Action]) -> list[Action]:
        return self.local._candidates(state, acts)

    @property
    def best(self) -> Plan:
        return self.local.best

    def _fingerprint(self, state: ShardingState) -> Fingerprint:
        return self.local._fingerprint(state)

    def _plan_print(self, state: ShardingState, acts: list[Action]) -> Fingerprint:
        return self.local._plan_print(state, acts)



    @staticmethod
    def _pruned(child: _Node, node: _Node, path: list[_Node]) -> bool:
        """The plan of `node` itself, of an ancestor (a transposition must not close a cycle, which selection
        would walk forever), or of a child it already has: no new decision."""
        return any(c is child for c in path) or any(c is child for _, c in node.children)

    def episode(self) -> None:
        node, path = self.root, [self.root]
        on_path = {id(self.root)}
        while node.children and (not node.untried or self._wide(node)):  # select
            # a transposition can close a cycle through another route than this path (adding a layer's tile
            # before the batch split can decide less than before): a node is visited once per episode
            options = [ch for ch in node.children if id(ch[1]) not in on_path]
            if not options:
                break
            logn = math.log(node.n + 1)
            a, node = max(options,
                          key=lambda ch: ch[1].q / max(ch[1].n, 1) + self.c * math.sqrt(logn / max(ch[1].n, 1)))
            path.append(node)
            on_path.add(id(node))
        child = None
        while node.untried and child is None:  # expand
            a = node.untried.pop()
            key = node.key | {a}
            child = self.table.get(key)
            if child is None and not self.prune:  # ablation: illegal is a no-op child, no transposition
                got = self.plans.extend(node.state, node.acts, a)
                child = (self._node(key, node.state.copy(), node.depth + 1, list(node.acts)) if got is None
                         else self._node(key, got[0], node.depth + 1, got[1]))
            elif child is None:
                got = self.plans.extend(node.state, node.acts, a)
                if got is None:
                    continue
                s, new = got
                fp = self._fingerprint(s)
                child = self.by_print.get(fp)
                if child is None:
                    child = self._node(key, s, node.depth + 1, new)
                elif not self._pruned(child, node, path):
                    self.table[key] = child
            if self._pruned(child, node, path):
                child = None  # no new decision: pruned
                continue
            node.children.append((a, child))
        if child is not None:
            path.append(child)
            node = child
        acts = list(node.acts)  # the plan of the node, in canonical order (space.rank)
        k0, _ = self.ev.score(node.state, node.key)  # STOP here
        self.local.consider(k0, node.state, list(acts))
        r = self.ev.reward(k0, self.ref)
        s, ro_acts, picked, taken = node.state, list(acts), [], set()
        for _ in range(self.rollout_depth):  # roll out: drawn from the node's candidates, one slot per axis once
            if self.rng.random() < self.p_stop:
                break
            pool = [c for c in node.cands if (c.target, c.axis) not in taken]
            if not pool:
                break
            a = self._rollout_action(pool)
            picked.append(a)
            taken.add((a.target, a.axis))
        got = self.plans.extend_many(s, ro_acts, picked) if picked else None  # each at its place, one replay
        if got is not None and len(got[1]) > len(acts):
            s, ro_acts = got
            k1, _ = self.ev.score(s, frozenset(ro_acts))
            self.local.consider(k1, s, ro_acts)
            r = max(r, self.ev.reward(k1, self.ref))
        for n in path:  # back up
            n.n += 1
            n.q += r
        for a in ro_acts:  # and per action, for the rollouts
            m = self.mast.setdefault(a, [0.0, 0])
            m[0] += r
            m[1] += 1
        self.stats.episodes += 1

    def _rollout_action(self, cands: list[Action]) -> Action:
        """With probability `greedy_rollout`, the candidate whose episodes have had the best mean reward so far
        (move-average sampling); else, or while none has been tried, a uniformly random one."""
        if self.greedy_rollout and self.rng.random() < self.greedy_rollout:
            mast = self.mast
            best, mean = None, -1.0
            for a in cands:
                m = mast.get(a)
                if m is not None and m[0] / m[1] > mean:
                    best, mean = a, m[0] / m[1]
            if best is not None:
                return best
        return cands[self.rng.randrange(len(cands))]


    def run(self, budget: Budget, *, refine: float = 0.2, starts: list[list[Action]] | None = None) -> Result:
        """Search for `1 - refine` of the budget, then refine (from `starts` too); `refine=1`: refine only.
        Under a time budget, a refinement that ends early (a local optimum) hands the time left back to the
        tree, in the same shares, until less than 5 % of the budget is left."""
        t0 = time.perf_counter()
        main = Budget(None if budget.episodes is None else int(budget.episodes * (1 - refine)) or int(refine < 1),
                      None if budget.seconds is None else budget.seconds * (1 - refine))
        ev0, ct0 = self.ev.evaluations, self.ev.cost_time_s
        end = None if main.seconds is None else t0 + main.seconds
        report = Reporter(mode_of(self.progress), f"MCTS on {', '.join(self.axes)}", budget)
        try:
            with ctrl_c_ends_search(self.cancel), report:  # (Ctrl-C sets the token: the loops below end)
                while not self.cancel.is_set():
                    while True:
                        if self.cancel.is_set():
                            break
                        if main.episodes is not None and self.stats.episodes >= main.episodes:
                            break
                        if end is not None and time.perf_counter() >= end:
                            break
                        if not self.root.untried and not self.root.children:
                            break  # nothing to do on these axes
                        self.episode()
                        report.update(self.stats.episodes, self.best[0].objective, not self.best[0].infeasible)
                    if refine > 0:
                        # 4 applied actions per episode of the refinement's share, and as many again up to
                        # 320: the climbs from the expert composites need a few hundred whatever the budget
                        # (docs/search.md, "Axes")
                        n = None if budget.episodes is None else \
                            max(8, int(4 * budget.episodes * refine + min(4 * budget.episodes * refine, 320)))
                        self.local.refine(None if budget.seconds is None else t0 + budget.seconds, n, starts)
                    if end is None or (not self.root.untried and not self.root.children):
                        break
                    left = t0 + budget.seconds - time.perf_counter()
                    if left < 0.05 * budget.seconds:
                        break
                    # the refinement ended early: search on (a refinement-only run too: its tree starts then)
                    end = time.perf_counter() + left * (1 - refine if refine < 1 else 0.8)
        except KeyboardInterrupt:  # Ctrl-C: the best plan so far is the answer (of this and every later phase)
            self.cancel.set()
        self.stats.time_s = time.perf_counter() - t0
        self.stats.evaluations = self.ev.evaluations - ev0
        self.stats.cost_time_s = self.ev.cost_time_s - ct0
        self.stats.propagation_time_s = self.plans.time_s
        key, state, actions = self.best
        return Result(state, actions, key, self.stats)

