"""A plan's partition specs, in torch_xla's form: what a backend needs to apply a propagated sharding.

(The full `ShardingPlan` — cost report, search statistics, JSON round-trip, `explain` — grows here.)
"""

from __future__ import annotations

from dataclasses import dataclass

from partir_torch.propagate import ShardingState

Spec = list  # one entry per dim: None, an axis name, or a list of axis names (major to minor)


@dataclass(frozen=True)
class PlanSpecs:
    params: dict[str, Spec]
    inputs: list[Spec]
    optimizer_state: dict[str, dict[str, Spec]]  # per parameter, per per-parameter state


def specs(state: ShardingState) -> PlanSpecs:
    p = state.program
    return PlanSpecs(
        {n: state.shard[v].to_spec() for n, v in p.params.items()},
        [state.shard[v].to_spec() for v in p.inputs],
        {n: {s: state.shard[v].to_spec() for s, v in st.items() if s not in p.shared_states}
         for n, st in p.opt_states.items()},
    )
