"""Causal (gated) linear attention in Triton: :func:`hybridlm.ops.linear_attention.causal_linear_attention_ref`
on the kernels of :mod:`.chunked_scan` (one key/query group per head). The kernels read the ``[batch, heads,
time, dim]`` tensors through their strides, so the layout change copies nothing."""

from __future__ import annotations

import torch

from ..linear_attention import linear_attention_through
from .chunked_scan import chunked_decay_scan


def causal_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`hybridlm.ops.linear_attention.causal_linear_attention_ref`."""
    return linear_attention_through(chunked_decay_scan, q, k, v, log_decay, initial_state, chunk_size)
