"""What is known of one program on one mesh before any sharding decision: the analysis object.

Propagation, lowering, the cost model and the search each need tables computed once per program and mesh
(each op's rule, which ops touch a value, the repeated-layer peers of a value, memoized reshards, the cost
model's static tables, the search's slots). They are the declared fields of one `Analysis`; every
`ShardingState` of the program on that mesh holds the same one (the program keeps its analyses in its one
declared `analyses` field, so they live as long as it does). Dropping the analysis is how its caches
are cleared: `Analysis.forget(program)`, or build a new one (`Analysis(program, mesh)`) and start states
from it.

>>> # an = Analysis.of(program, Mesh.parse("batch=2,model=4")); an.rules[0].name
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar, cast

from partir_torch.ir.mesh import Mesh
from partir_torch.ir.program import Program
from partir_torch.rules.base import OpRule, rule_for

T = TypeVar("T")
# per op: (tensors as (value, factor per dim), {factor: [(value, dim), ...]})
Layout = tuple[tuple[tuple[int, tuple], ...], dict[int, list[tuple[int, int]]]]


@dataclass(eq=False)
class Analysis:
    """The per-(program, mesh) tables of every stage. Propagation's and lowering's are declared fields; a later
    stage keeps its own (the cost model's tables, the search's slots) through `stage(kind, build)`, keyed by
    its type: the stage owns the type and builds it, the analysis only holds it for as long as it lives."""

    program: Program
    mesh: Mesh
    fallback: bool = False  # ops without a rule run replicated (`rules.base.rule_for`)
    rules: list[OpRule] = field(init=False, repr=False)
    ops_of: list[list[int]] = field(init=False, repr=False)  # per value: the ops whose rule reads or writes it
    peers: dict[int, list[int]] = field(init=False, repr=False)  # value -> the same value of every repeat
    templates: dict[str, list[int]] = field(init=False, repr=False)  # group template name -> its values
    layouts: list[Layout | None] = field(init=False, repr=False)  # per op, built when read (`layout`)
    # propagate.py: (op, factor, axes) -> the first value carrying the factor whose dim the axes do not divide
    blockers: dict = field(default_factory=dict, repr=False)
    # lower.py: per-op rule signatures, the shardings an op needs by (signature, assignment, sums), reshards
    lower_sigs: list[int] | None = field(default=None, repr=False)
    lower_memo: dict = field(default_factory=dict, repr=False)
    reshard_memo: dict = field(default_factory=dict, repr=False)
    # later stages' tables by their type (`stage`): the cost model's static tables and memo, the search's slots
    stages: dict[type, object] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        program = self.program
        self.rules = [rule_for(op, program, fallback=self.fallback) for op in program.ops]
        touch: list[list[int]] = [[] for _ in program.values]
        for i, r in enumerate(self.rules):
            for t in (*r.operands, *r.results):
                if not touch[t.value] or touch[t.value][-1] != i:
                    touch[t.value].append(i)
        self.ops_of = touch
        by_key: dict[str, list[int]] = {}
        keys = _peer_keys(program)
        for v, k in keys.items():
            by_key.setdefault(k, []).append(v)
        self.peers = {v: by_key[k] for v, k in keys.items()}
        self.templates = by_key
        self.layouts = [None] * len(program.ops)

    @classmethod
    def of(cls, program: Program, mesh: Mesh, *, fallback: bool = False) -> Analysis:
        """The analysis every state of `program` on `mesh` shares, built on first use. The first one built
        decides `fallback`: a program whose ops all have rules gets the same rules either way."""
        an = program.analyses.get(mesh)
        if an is None:
            an = program.analyses[mesh] = cls(program, mesh, fallback=fallback)
        return an

    @staticmethod
    def forget(program: Program) -> None:
        """Drop the analyses of `program`: later states build them again (benchmarks, tests)."""
        program.analyses.clear()

    def stage(self, kind: type[T], build: Callable[[], T]) -> T:
        """The table of type `kind` a later stage keeps for this analysis, `build()` on first use."""
        got = self.stages.get(kind)
        if got is None:
            got = self.stages[kind] = build()
        return cast(T, got)

    def clear_memos(self) -> None:
        """Forget the results memoized by content (lowering's, and every stage table that is a memo: one with
        a `memo = True` class attribute, the cost model's), keeping the other tables."""
        self.lower_memo.clear()
        self.reshard_memo.clear()
        for kind in [k for k in self.stages if getattr(k, "memo", False)]:
            del self.stages[kind]

    def layout(self, o: int) -> Layout:
        """(tensors as (value, factor per dim), {factor: [(value, dim), ...]}) of op `o`."""
        entry = self.layouts[o]
        if entry is None:
            rule = self.rules[o]
            tensors = tuple((t.value, t.dims) for t in (*rule.operands, *rule.results))
            carriers: dict[int, list[tuple[int, int]]] = {}
            for v, dims in tensors:
                for d, f in enumerate(dims):
                    if f is not None:
                        carriers.setdefault(f, []).append((v, d))
            entry = self.layouts[o] = (tensors, carriers)
        return entry


def _peer_keys(program: Program) -> dict[int, str]:
    """Value id -> its name with the parameter replaced by the group key (equal for repeated-layer peers)."""
    keys: dict[int, str] = {}
    for g in program.groups:
        for m in g.members:
            name = program.values[m].name
            for p in g.params:
                if name == p or name.endswith(f"[{p}]"):
                    closing = "]" if name.endswith("]") else ""
                    keys[m] = name[: len(name) - len(p) - len(closing)] + g.key + closing
                    break
    return keys
