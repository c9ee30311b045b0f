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
) -> torch.Tensor:
    """``q [batch, q_heads, q_len, dim]``, ``k, v [batch, kv_heads, k_len, dim]``; ``mask`` is boolean, True
    where a query may attend, broadcastable to ``[batch, q_heads, q_len, k_len]``. ``causal`` (only without a
    mask, and only for ``q_len == k_len``: query ``i`` sees keys ``0..i``) is SDPA's own causal path."""
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
