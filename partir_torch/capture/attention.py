"""`nn.MultiheadAttention` written out batch-major with its heads as a dim, while capturing and in the engines.

torch's `F.multi_head_attention_forward` projects q, k and v with one GEMM on the packed `in_proj_weight`
[3E, E], views the result as [L, B, 3, E] and its heads as [L, B*H, hd]. Tilings are blocks of a dim, so
neither split reaches that code: the heads are the minor half of a merged B*H dim (only the major half, the
batch, carries a tiling through a merge), q/k/v the major third of the projection (3 does not divide by a
mesh axis), and the linears run on [L*B, E], the batch again the minor half. Megatron over the heads, or even
the batch over a data axis without a gather, cannot be expressed.

`multi_head_attention_forward` here computes the same values with the same ops in a layout the rules read:
the packed weight (and bias) split into its three equal parts (`rules/view.split`: read in 3 chunks, so a
weight tiled by heads costs one all-to-all of its block), each projection on the batch-major [B, L, E],
heads as their own dim [B, H, L, hd], torch's masks canonicalized by torch's own helpers and merged in
[B, H, L, S], the same `scaled_dot_product_attention` call as torch's (same shapes: the same dropout draws),
or with `need_weights` the same softmax, dropout and average over heads. What torch's code handles and this
does not (`bias_k`/`bias_v`, `add_zero_attn`, `static_k`/`static_v`, unbatched input, a mask of the wrong
shape) runs torch's code unchanged.

`capture/rewrites.py` applies it while capturing; the torch_xla backend's `Lowerings` applies the same
function, so both run the op sequence the plan was made for.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch.nn.functional as F

_TORCH_MHA = F.multi_head_attention_forward


def _masks(query, attn_mask, key_padding_mask, is_causal, need_weights, B, H, L, S):
    """torch's canonical masks (its own helpers: its dtype rules and errors), or None where torch's code should
    run instead (what it rejects: it says so itself)."""
    kpm = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                            other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                            target_type=query.dtype)
    if is_causal and attn_mask is None:
        return None
    if is_causal and kpm is None and not need_weights:
        attn_mask = None  # (torch's SDPA call takes the causal hint instead)
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        if kpm is not None:
            is_causal = False
    if attn_mask is not None and tuple(attn_mask.shape) not in ((L, S), (B * H, L, S)):
        return None
    if kpm is not None and tuple(kpm.shape) != (B, S):
        return None
    return attn_mask, kpm, is_causal


def multi_head_attention_forward(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
                                 bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias,
                                 training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
                                 use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None,
                                 v_proj_weight=None, static_k=None, static_v=None, average_attn_weights=True,
                                 is_causal=False, *, attention: Callable = F.scaled_dot_product_attention):
    """`F.multi_head_attention_forward`'s values, batch-major with a heads dim (module docstring); `attention`
    is the SDPA to call (the torch_xla backend passes its own lowering)."""
    def torch_own():
        return _TORCH_MHA(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias, bias_k,
                          bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias, training=training,
                          key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
                          use_separate_proj_weight=use_separate_proj_weight, q_proj_weight=q_proj_weight,
                          k_proj_weight=k_proj_weight, v_proj_weight=v_proj_weight, static_k=static_k,
                          static_v=static_v, average_attn_weights=average_attn_weights, is_causal=is_causal)

    if (query.dim() != 3 or bias_k is not None or bias_v is not None or add_zero_attn or static_k is not None
            or static_v is not None or query.shape[2] != embed_dim_to_check or embed_dim_to_check % num_heads
            or key.shape[:2] != value.shape[:2] or key.shape[1] != query.shape[1]
            or (need_weights and is_causal and attn_mask is None)):
        return torch_own()
    L, B, E = query.shape
    S, H = key.shape[0], num_heads
    hd = E // H
    masks = _masks(query, attn_mask, key_padding_mask, is_causal, need_weights, B, H, L, S)
    if masks is None:
        return torch_own()
    attn_mask, kpm, is_causal = masks
    if use_separate_proj_weight:
        w_q, w_k, w_v = q_proj_weight, k_proj_weight, v_proj_weight
    else:
        w_q, w_k, w_v = in_proj_weight.chunk(3)
    b_q, b_k, b_v = (None, None, None) if in_proj_bias is None else in_proj_bias.chunk(3)

    def heads(x, w, b, n):  # [n, B, E_in] -> [B, H, n, hd]
        return F.linear(x.transpose(0, 1), w, b).view(B, n, H, hd).transpose(1, 2)

    q, k, v = heads(query, w_q, b_q, L), heads(key, w_k, b_k, S), heads(value, w_v, b_v, S)
    if attn_mask is not None:
        attn_mask = attn_mask.view(1, 1, L, S) if attn_mask.dim() == 2 else attn_mask.view(B, H, L, S)
    if kpm is not None:
        kpm = kpm.view(B, 1, 1, S).expand(-1, H, -1, -1)
        attn_mask = kpm if attn_mask is None else attn_mask + kpm
    if not training:
        dropout_p = 0.0
    weights = None
    if need_weights:
        scores = (q * math.sqrt(1.0 / float(hd))) @ k.transpose(-2, -1)
        if attn_mask is not None:
            scores = attn_mask + scores  # (torch: `baddbmm(attn_mask, q_scaled, k^T)`)
        weights = F.softmax(scores, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)  # (torch returns the weights after dropout too)
        out = weights @ v
        weights = weights.mean(dim=1) if average_attn_weights else weights
    else:
        out = attention(q, k, v, attn_mask, dropout_p, is_causal)
    out = F.linear(out.transpose(1, 2).reshape(B, L, E), out_proj_weight, out_proj_bias)
    # torch's result is a row-major [L, B, E]: laid out alike, a dropout after it draws the same mask (its
    # `empty_like` keeps the layout, `capture/draws.py`)
    return out.transpose(0, 1).contiguous(), weights
