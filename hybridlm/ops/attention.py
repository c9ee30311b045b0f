"""Softmax attention with grouped key/value heads (the reference is PyTorch's SDPA, on every device)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [batch, q_heads, q_len, dim]``, ``k, v [batch, kv_heads, k_len, dim]``; ``mask`` is boolean, True
    where a query may attend, broadcastable to ``[batch, q_heads, q_len, k_len]``. ``causal`` (only without a
    mask, and only for ``q_len == k_len``: query ``i`` sees keys ``0..i``) is SDPA's own causal path.
    ``seq_idx [batch, time]`` (queries and keys the same tokens) numbers the sequences packed in each row: a
    query sees only keys of its own sequence (a block-diagonal mask, combined with ``causal`` or ``mask``)."""
    if seq_idx is not None:
        mask, causal = _same_sequence(q, k, seq_idx, mask, causal), False
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {k.shape[1]} key/value heads do not divide {q.shape[1]} query heads")
    if causal and mask is not None:
        raise ValueError("attention: pass either causal=True or a mask that already holds causality")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"attention: causal=True needs as many queries as keys (got {q.shape[2]} and {k.shape[2]}); "
                         "pass a mask for queries that continue after cached keys")
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def _same_sequence(q, k, seq_idx, mask, causal) -> torch.Tensor:
    """``mask`` (or causality) restricted to pairs of tokens in the same packed sequence: ``[batch, 1 or heads,
    time, time]``."""
    batch, _, time, _ = q.shape
    if k.shape[2] != time or seq_idx.shape != (batch, time) or seq_idx.is_floating_point():
        raise ValueError(f"attention: seq_idx must be integer [batch={batch}, time={time}] for {time} queries and "
                         f"as many keys, got seq_idx {tuple(seq_idx.shape)} and {k.shape[2]} keys")
    same = (seq_idx[:, :, None] == seq_idx[:, None, :]).unsqueeze(1)  # [b, 1, t, t]
    if causal:
        return same & torch.ones(time, time, dtype=torch.bool, device=q.device).tril()
    return same if mask is None else same & mask
