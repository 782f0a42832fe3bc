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
                  same plan) are one node (transposition table). A wide node (more than `widen_above`,
                  128, candidates: the U-Net's 245 first actions, where a 10 s budget buys ~150 episodes)
                  is widened progressively: at most `widen` * sqrt(n + 1) children (3, n its visits),
                  expanded largest decision first (`space.decided_bytes`: the bytes the action tiles, an
                  input's tile counting the activations propagation carries it to; ties in random
                  order), so the tree goes deep instead of spending the whole budget one level down
      3. simulate score the new node as it stands (STOP here), then roll out: up to `rollout_depth`
                  of the node's candidate actions (one per slot and axis), stopping with probability
                  `p_stop` before each, put at their places in one replay (one illegal there is left
                  out: a rollout is a sampling policy; what is scored is the plan replayed); each is, with
                  probability `greedy_rollout` (0.5), the candidate whose episodes so far have the best mean
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

Refinement (the last `refine` share of the budget): rollouts leave incidental actions in the best plan, and
the tree rarely reaches the last small improvements. So a local search runs from each of the `elite` (4)
best distinct plans seen, best first, and from `starts` (plans of other searches, see `Auto` "both"):
  (1) prune: each action whose removal keeps the plan within `simplicity` (0.5 %) of the best step time found
      (or no worse than the plan itself) is dropped, newest first (`simplify`);
  (2) hill-climb: the best of the neighbours one move away is taken while it improves the plan by more than
      `simplicity` (or makes it fit). The moves, by groups, a group tried only when none before improves:
      (a) add one candidate action at its place (on a wide plan, more than `widen_above` candidates, they are tried
      in the order of their mean reward in the episodes, MAST, and the first that improves is taken: a
      U-Net append scan costs ~250 propagations); (b) replace one action by another on the same slot
      (another dim, ZeRO stage, or ZeRO instead of a tile); (c) insert one action before an action that
      made it illegal (a ZeRO move fences the parameters on its axis, a tile propagates its axis; the
      orders of the tree are not commutative), first before the ZeRO moves, the candidates ordered by the tree's scores of the shorter
      plan with them; the first insertion that improves is taken (the costly group);
  (3) at a local optimum, walk the plateau: each plan as good as it with one parameter tile replaced by
      another slot's (the same decision reached from another layer: S5's edge MLP and decoder weights, both
      on the latent dim) is hill-climbed in turn (`_twins`): other moves are legal after the other tile;
and the best result (with the `simplicity` margin, the first start winning ties) is the answer. The
refinement's budget is counted in applied actions (each replay applies the plan's actions again). Under a
time budget, a refinement that reaches its local optimum early hands the time left back to the tree (then
refines again), so the budget is spent searching.
Sharding more than a plan needs costs what the cost model does not see (more collectives to launch, more to
debug) and the model is not accurate to 0.5 %: a decision must earn its place.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field

from partir_torch.propagate import ShardingState
from partir_torch.search.goals import Evaluator
from partir_torch.search.space import Action, Plans, ShardOptimizer, decided_bytes, place, rank


def simplify(replay, ev: Evaluator, plan: tuple, ref: tuple, simplicity: float, spent=lambda: False,
             seen=None) -> tuple:
    """Drop each action of `plan` = (key, state, actions), newest first, whose removal keeps it as good or
    within `simplicity` of the step time of `ref` (the best found), in passes until one drops nothing: a
    decision must earn its place.
    `replay(actions)` makes a plan's state (None: illegal); `seen(key, state, actions)` sees each trial."""
    key, state, acts = plan
    dropped = True
    while dropped:  # again while a pass drops something (an action may earn its place only beside another)
        dropped, i = False, len(acts) - 1
        while i >= 0 and not spent():
            trial = acts[:i] + acts[i + 1:]
            s = replay(trial)
            if s is not None:
                k, _ = ev.score(s, frozenset(trial))
                if seen is not None:
                    seen(k, s, trial)
                if k[0] == key[0] and k[1] <= key[1] and k[2] <= max(key[2], ref[2] * (1 + simplicity)):
                    key, state, acts, dropped = k, s, trial, True
            i -= 1
    return key, state, acts


DEFAULT_EPISODES = 200  # the budget when none is given (`Budget()`, `Budget.parse(None)`, `SearchConfig()`)


INTERRUPTED = threading.Event()  # set by Ctrl-C during a search: every search phase then ends with its best


@dataclass
class Budget:
    """Stop after `episodes`, or after `seconds`, whichever comes first (None: no limit on that). With
    neither given, the search is bounded by `DEFAULT_EPISODES` episodes: it never runs unbounded."""

    episodes: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if self.episodes is None and self.seconds is None:
            self.episodes = DEFAULT_EPISODES

    @classmethod
    def parse(cls, text: str | int | float | Budget | None) -> Budget:
        """`"30s"`, `"2m"`, `"500"` / `"500ep"` (episodes), a number of episodes, or None (the default)."""
        from partir_torch.errors import PartirError

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
    width: int = 0  # candidates when created
    cands: list[Action] = field(default_factory=list)  # the candidates when created (the rollouts draw from them)
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
                 simplicity: float = 0.005, progress: bool = False, prune: bool = True, elite: int = 4,
                 greedy_rollout: float = 0.5, widen: float | None = 3.0, widen_above: int = 128) -> None:
        self.simplicity, self.prune, self.widen = simplicity, prune, widen
        self.widen_above = widen_above
        self.ev, self.axes, self.kinds = evaluator, axes, kinds
        self.rng = random.Random(seed)
        self.c, self.rollout_depth, self.p_stop, self.max_depth = c, rollout_depth, p_stop, max_depth
        self.progress = progress
        self.table: dict[frozenset, _Node] = {}
        self.by_print: dict[int, _Node] = {}
        p = root.program
        self._decided = [v.id for v in p.values if v.producer < 0]
        self.stats = Stats()
        self.plans = Plans(root)  # plans in canonical order (space.rank); counts the actions applied (propagated)
        self.root = self._node(frozenset(), root, 0, [])
        self.ref, _ = self.ev.score(root, frozenset())
        self.best: tuple[tuple, ShardingState, list[Action]] = (self.ref, root, [])
        self.elite_size = elite
        self.greedy_rollout = greedy_rollout
        self.mast: dict[Action, list[float]] = {}  # action -> [sum of rewards, episodes] of episodes that took it
        self.elite: dict[int, tuple[tuple, ShardingState, list[Action]]] = {}  # the best distinct plans seen

    def _fingerprint(self, state: ShardingState) -> int:
        """The decisions of a state: shardings and fences of its parameters, inputs and optimizer states."""
        sh, lk = state.shard, state.locked
        return hash(tuple((sh[v], lk[v]) for v in self._decided))

    def _plan_print(self, state: ShardingState, acts: list[Action]) -> int:
        """The decisions of a plan and its parameter tiles (`space.rank` 0): plans that propagate to the same
        shardings differ in what may follow when their parameter tiles differ, since an action added later
        is placed after those (S5: the edge MLP's or the decoder's weight tiled on the latent dim give the same
        shardings; only the decoder's leaves the edge MLP's ZeRO-3 move legal before it). The refinement tells
        plans apart so (`_twins`); the tree merges them (transpositions by shardings alone: on the U-Net, whose
        layer tiles often propagate alike, telling them apart there measured 0.763-0.790 x the expert on S4a
        over 5 seeds of 10 s against 0.773-0.786)."""
        p = state.program
        return hash((frozenset(a for a in acts if rank(p, a) == 0), self._fingerprint(state)))

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

    def _wide_list(self, cands: list[Action]) -> bool:
        return self.widen is not None and len(cands) > self.widen_above

    def _candidates(self, state: ShardingState, acts: list[Action]) -> list[Action]:
        """The candidates of the plan `acts` (state `state`), each judged at its place (`Plans.candidates`)."""
        return self.plans.candidates(state, acts, self.axes, self.kinds, prune=self.prune)


    def _consider(self, key: tuple, state: ShardingState, actions: list[Action]) -> None:
        if key < self.best[0]:
            self.best = (key, state, actions)
            self.stats.best_at_episode = self.stats.episodes
        el = self.elite
        if len(el) >= self.elite_size and key >= max(e[0] for e in el.values()):
            return
        fp = self._plan_print(state, actions)
        if fp in el:
            if key < el[fp][0] or (key == el[fp][0] and len(actions) < len(el[fp][2])):
                el[fp] = (key, state, actions)
            return
        el[fp] = (key, state, actions)
        if len(el) > self.elite_size:
            del el[max(el, key=lambda f: el[f][0])]

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
            a, node = max(options, key=lambda ch: ch[1].q / max(ch[1].n, 1) + self.c * math.sqrt(logn / max(ch[1].n, 1)))
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
        self._consider(k0, node.state, list(acts))
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
            self._consider(k1, s, ro_acts)
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

    def better(self, k: tuple, than: tuple) -> bool:
        """`k` beats `than` by more than `simplicity` (or fits where `than` does not, or uses less memory)."""
        return k[0] < than[0] or (k[0] == than[0] and (k[1] < than[1] if k[0] else k[2] < than[2] * (1 - self.simplicity)))

    def refine(self, deadline: float | None, max_evals: int | None, starts: list[list[Action]] | None = None) -> None:
        """Local search from the best plans found (see the module docstring): each is pruned, then hill-climbed;
        the best result, in the goal's order with the `simplicity` margin, becomes the answer.

        `starts`: action lists (from the root) to refine as well, e.g. the plans of other searches."""
        applied0 = self.plans.applied  # the refinement's budget unit: actions applied (and propagated)

        def spent() -> bool:
            return ((deadline is not None and time.perf_counter() >= deadline) or INTERRUPTED.is_set()
                    or (max_evals is not None and self.plans.applied - applied0 >= max_evals))

        pool = sorted(self.elite.values(), key=lambda e: e[0])
        plans: list[tuple[tuple, ShardingState, list[Action]]] = []
        for acts in starts or []:
            s = self.plans.replay(acts)
            if s is not None:
                k, _ = self.ev.score(s, frozenset(acts))
                self._consider(k, s, list(acts))
                plans.append((k, s, list(acts)))
        plans = sorted(plans + pool, key=lambda e: e[0])
        seen: set[int] = set()  # starts, and plans already hill-climbed
        ref = self.best[0]  # prune towards the best step time found
        answer = None
        for key, state, acts in plans:
            fp = self._plan_print(state, acts)
            if fp in seen or spent():
                continue
            got = self._local_search(key, state, acts, ref, spent, seen)
            if got is None:
                continue
            if answer is None or self.better(got[0], answer[0]):
                answer = got
        if answer is not None:
            self.best = answer

    def _local_search(self, key: tuple, state: ShardingState, acts: list[Action], ref: tuple, spent,
                      seen: set[int]) -> tuple | None:
        key, state, acts = simplify(self.plans.replay, self.ev, (key, state, acts), ref, self.simplicity, spent,
                                    self._consider)
        # within `simplicity` of the best found, with fewer decisions; now hill-climb (unless done from here)
        fp = self._plan_print(state, acts)
        if fp in seen:
            return None
        seen.add(fp)
        best, todo = (key, state, acts), [(key, state, acts)]
        while todo and not spent():  # each local optimum, then its twins (a plateau walk, `_twins`)
            got = self._climb(*todo.pop(0), spent)
            if self.better(got[0], best[0]):
                best = got
            for k, s, trial in self._twins(*got, spent):
                fp = self._plan_print(s, trial)
                if fp not in seen:
                    seen.add(fp)
                    todo.append((k, s, trial))
        return best

    def _climb(self, key: tuple, state: ShardingState, acts: list[Action], spent) -> tuple:
        """Hill-climb: the best neighbour (`_neighbours`) while one improves."""
        while not spent():
            step = None
            cands = self._candidates(state, acts)
            wide = self._wide_list(cands)
            for group, trial, s in self._neighbours(state, acts, cands, spent):
                if step is not None and group > step[3]:
                    break  # an append improves: the costlier moves are not needed
                k, _ = self.ev.score(s, frozenset(trial))
                self._consider(k, s, trial)
                if self.better(k, key) and (step is None or k < step[0]):
                    step = (k, s, trial, group)
                    if group == 2 or (group == 0 and wide):
                        break  # the costly moves, or appends on a wide node: take the first that improves
            if step is None:
                break
            key, state, acts = step[:3]
        return key, state, acts

    def _twins(self, key: tuple, state: ShardingState, acts: list[Action], spent):
        """Plans as good as a local optimum with one parameter tile replaced by another slot's: the same
        decision reached from another layer (S5: the edge MLP's or the decoder's weight tiled on the latent
        dim propagates to the same plan) leaves other moves legal (there, the edge MLP's ZeRO-3 move inserted
        before the decoder's tile: 0.873 -> 0.834 x the expert). Not on a wide plan (the U-Net's ~250
        candidates a position)."""
        p = state.program
        for i, a in enumerate(acts):
            if rank(p, a) != 0:
                continue
            pre = self.plans.prefix(tuple(acts[:i]))
            if pre is None:
                return
            cands = self._candidates(pre, acts[:i])
            if self._wide_list(cands):
                return
            for c in cands:
                if rank(p, c) != 0 or c.target == a.target or c in acts:
                    continue
                if spent():
                    return
                trial = [*acts[:i], c, *acts[i + 1:]]
                s = self.plans.replay(trial[i:], pre)
                if s is None:
                    continue
                k, _ = self.ev.score(s, frozenset(trial))
                self._consider(k, s, trial)
                if k <= key:
                    yield k, s, trial

    def _neighbours(self, state: ShardingState, acts: list[Action], cands: list[Action], spent):
        """Plans one move from `acts`, by groups, each tried only if no move of the groups before improves:
        (0) one candidate action added at its place; (1) one action replaced by another on the same slot (another dim,
        ZeRO stage, or ZeRO instead of a tile); (2) one action inserted before an action that makes it illegal
        (a ZeRO move fences the parameters on its axis, a tile propagates its axis): first before the ZeRO
        moves, then before each other action, last to first, each position's actions in the order of the
        tree's scores of the shorter plan with that action; the first that improves is taken.
        `cands`: the candidates of `acts` (`_candidates`)."""
        have, after = set(acts), set(cands)
        if self._wide_list(cands):  # too many to try all: the actions the episodes rewarded most first
            mast = self.mast
            cands = sorted(cands, key=lambda a: -mast[a][0] / mast[a][1] if a in mast else 0.0)
        for a in cands:
            if spent():
                return
            got = self.plans.extend(state, acts, a)
            if got is not None:
                yield 0, got[1], got[0]
        prefixes = [self.plans.prefix(tuple(acts[:i])) for i in range(len(acts))]  # the plan of acts[:i]
        if any(s is None for s in prefixes):
            return
        for i, a in enumerate(acts):  # another decision for the same slot (a dim, a ZeRO stage, tile or ZeRO)
            for c in self._candidates(prefixes[i], acts[:i]):
                if c.target != a.target or c == a or c in have:
                    continue
                if spent():
                    return
                rest = [*acts[:i], *acts[i + 1:]]
                j = place(state.program, rest, c)
                trial = [*rest[:j], c, *rest[j:]]  # at its place in the canonical order
                k = min(i, j)
                s = self.plans.replay(trial[k:], prefixes[k])
                if s is not None:
                    yield 1, trial, s
        fences = [i for i, a in enumerate(acts) if isinstance(a, ShardOptimizer)]
        for i in fences + [i for i in reversed(range(len(acts))) if i not in fences]:
            # the tree's scores of `acts[:i] + [c]`, where it has them, order the trials (best first)
            cache, worst = self.ev.cache, (2, 0.0, 0.0)
            cands = [c for c in self._candidates(prefixes[i], acts[:i]) if c not in after and c not in have]
            cands.sort(key=lambda c: cache.get(frozenset([*acts[:i], c]), worst))
            for c in cands:
                if spent():
                    return
                trial = [*acts[:i], c, *acts[i:]]
                s = self.plans.replay(trial[i:], prefixes[i])
                if s is not None:
                    yield 2, trial, s

    def run(self, budget: Budget, *, refine: float = 0.2, starts: list[list[Action]] | None = None) -> Result:
        """Search for `1 - refine` of the budget, then refine (from `starts` too); `refine=1`: refine only.
        Under a time budget, a refinement that ends early (a local optimum) hands the time left back to the
        tree, in the same shares, until less than 5 % of the budget is left."""
        t0 = time.perf_counter()
        main = Budget(None if budget.episodes is None else int(budget.episodes * (1 - refine)) or int(refine < 1),
                      None if budget.seconds is None else budget.seconds * (1 - refine))
        ev0, ct0 = self.ev.evaluations, self.ev.cost_time_s
        bar = None
        if self.progress:
            from rich.progress import Progress

            bar = Progress(transient=True)
            bar.start()
            task = bar.add_task(f"MCTS on {', '.join(self.axes)}", total=budget.episodes or None)
        end = None if main.seconds is None else t0 + main.seconds
        try:
            while not INTERRUPTED.is_set():
                while True:
                    if INTERRUPTED.is_set():
                        break
                    if main.episodes is not None and self.stats.episodes >= main.episodes:
                        break
                    if end is not None and time.perf_counter() >= end:
                        break
                    if not self.root.untried and not self.root.children:
                        break  # nothing to do on these axes
                    self.episode()
                    if bar is not None:
                        bar.update(task, advance=1, description=f"MCTS on {', '.join(self.axes)}: best "
                                   f"{'fits' if not self.best[0][0] else 'does not fit'}, {self.best[0][2] * 1e3:.2f} ms")
                if refine > 0:
                    self.refine(None if budget.seconds is None else t0 + budget.seconds,
                                None if budget.episodes is None else max(8, int(budget.episodes * refine * 4)), starts)
                if end is None or (not self.root.untried and not self.root.children):
                    break
                left = t0 + budget.seconds - time.perf_counter()
                if left < 0.05 * budget.seconds:
                    break
                # the refinement ended early: search on (a refinement-only run too: its tree starts then)
                end = time.perf_counter() + left * (1 - refine if refine < 1 else 0.8)
        except KeyboardInterrupt:  # Ctrl-C: the best plan so far is the answer (of this and every later phase)
            INTERRUPTED.set()
        finally:
            if bar is not None:
                bar.stop()
        self.stats.time_s = time.perf_counter() - t0
        self.stats.evaluations = self.ev.evaluations - ev0
        self.stats.cost_time_s = self.ev.cost_time_s - ct0
        self.stats.propagation_time_s = self.plans.time_s
        key, state, actions = self.best
        return Result(state, actions, key, self.stats)
