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

from dataclasses import dataclass, field
from typing import Any

from partir_torch.ir.mesh import Mesh
from partir_torch.ir.program import Program
from partir_torch.rules.base import OpRule, rule_for


@dataclass(eq=False)
class Analysis:
    """The per-(program, mesh) tables of every stage; fields after `layouts` are filled by the stage that
    owns them on first use (their types belong to later layers, so they are declared here untyped)."""

    program: Program
    mesh: Mesh
    fallback: bool = False  # ops without a rule run replicated (`rules.base.rule_for`)
    rules: list[OpRule] = field(init=False, repr=False)
    touch: list[list[int]] = field(init=False, repr=False)  # per value: the ops whose rule reads or writes it
    peers: dict[int, list[int]] = field(init=False, repr=False)  # value -> the same value of every repeat
    templates: dict[str, list[int]] = field(init=False, repr=False)  # group template name -> its values
    layouts: list[Any] = field(init=False, repr=False)  # per op, (tensors, factor carriers), built when read
    # propagate.py: (op, factor, axes) -> the first value carrying the factor whose dim the axes do not divide
    blockers: dict = field(default_factory=dict, repr=False)
    # lower.py: per-op rule signatures, the shardings an op needs by (signature, assignment, sums), reshards
    lower_sigs: list[int] | None = field(default=None, repr=False)
    lower_memo: dict = field(default_factory=dict, repr=False)
    reshard_memo: dict = field(default_factory=dict, repr=False)
    # cost/tables.py: the static tables and the memo of results by content
    cost_tables: Any = field(default=None, repr=False)
    cost_memo: Any = field(default=None, repr=False)
    # search/space.py: the action slots and each action's decided bytes
    search_slots: list | None = field(default=None, repr=False)
    decided_bytes: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        program = self.program
        self.rules = [rule_for(op, program, fallback=self.fallback) for op in program.ops]
        touch: list[list[int]] = [[] for _ in program.values]
        for i, r in enumerate(self.rules):
            for t in (*r.operands, *r.results):
                if not touch[t.value] or touch[t.value][-1] != i:
                    touch[t.value].append(i)
        self.touch = touch
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

    def clear_memos(self) -> None:
        """Forget the results memoized by content (lowering's and the cost model's), keeping the tables."""
        self.lower_memo.clear()
        self.reshard_memo.clear()
        self.cost_memo = None

    def layout(self, o: int) -> tuple[tuple[tuple[int, tuple], ...], dict[int, list[tuple[int, int]]]]:
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
