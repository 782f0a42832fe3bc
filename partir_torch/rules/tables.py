"""Sets of aten ops that later stages single out, kept beside the rules that give those ops their meaning.

The tile-mapping rules say how an op maps shardings; these tables say what kind of op it is where a stage
needs more than its rule: the Megatron tactic finds linears and stops at normalizations, the cost model
lets views alias their base and counts attention's saved state.
"""

from __future__ import annotations

# a linear layer's matmul: target -> (input operand, weight operand) positions (rules/matrix.py)
LINEAR: dict[str, tuple[int, int]] = {"aten.mm.default": (0, 1), "aten.addmm.default": (1, 2)}

# transposes of a weight in front of a linear (nn.Linear reads W.T) (rules/view.py)
TRANSPOSES = frozenset({"aten.t.default", "aten.transpose.int", "aten.permute.default"})

# dtype casts, which autocast puts between a weight and its linear (rules/pointwise.py)
CASTS = frozenset({"aten._to_copy.default", "prims.convert_element_type.default"})

# ops between a column and a row linear that end a Megatron pair: normalizations, reductions, lookups
PAIR_STOPS = frozenset({"aten.native_layer_norm.default", "aten.native_group_norm.default", "aten.mean.dim",
                        "aten.sum.dim_IntList", "aten.embedding.default"})

# ops whose result aliases their first operand's buffer (no memory of their own) (rules/view.py)
VIEWS = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.t.default", "aten.transpose.int",
                   "aten.permute.default", "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dim",
                   "aten.alias.default", "aten.select.int", "aten.slice.Tensor",
                   "aten.detach.default"})  # (what autograd saves for a backward: HF Gemma-2 has 127)

# fused attention forwards, whose second result is what the backward reads (rules/attention.py)
ATTENTION = frozenset({"aten._scaled_dot_product_flash_attention_for_cpu.default",
                       "aten._scaled_dot_product_flash_attention.default",
                       "aten._scaled_dot_product_efficient_attention.default"})
