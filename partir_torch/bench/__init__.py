"""`partir-torch bench`: the search's plans against the plans a practitioner would write.

`scenarios`: S1-S7 at full size, every expert and the found plan priced by the cost model.
`engines`: the zoo at tiny size on 8-device meshes, every expert and the found plan run through both engines
(torch.distributed on gloo ranks, torch_xla SPMD), each priced from the bytes the engine really moved.
`report`: both written to `docs/benchmarks.md` with their charts.
"""

from partir_torch.bench.scenarios import ALL, LARGE, QUICK, SCENARIOS, SIMPLICITY, experts, run

__all__ = ["ALL", "LARGE", "QUICK", "SCENARIOS", "SIMPLICITY", "experts", "run"]
