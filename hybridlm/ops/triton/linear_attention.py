"""Causal (gated) linear attention in Triton: :func:`hybridlm.ops.linear_attention.causal_linear_attention_ref`
on the kernels of :mod:`.chunked_scan` (one key/query group per head). The kernels read the ``[batch, heads,
time, dim]`` tensors through their strides, so the layout change copies nothing. Packed sequences reach the
kernels as the SSD's do (:func:`.chunks.scan_sequences`): chunks never cross a sequence, and each sequence has
its own initial and final state."""

from __future__ import annotations

import torch

from hybridlm.ops.linear_attention import linear_attention_through
from hybridlm.ops.packing import check_initial_states
from hybridlm.ops.triton.chunked_scan import chunked_decay_scan
from hybridlm.ops.triton.chunks import scan_sequences


def causal_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`hybridlm.ops.linear_attention.causal_linear_attention_ref`, packed sequences
    included."""
    sequences = scan_sequences(q.shape[0], q.shape[2], q.device, seq_idx, cu_seqlens)
    check_initial_states("causal_linear_attention", sequences, initial_state)  # (a list, or cu_seqlens: [n + 1])
    return linear_attention_through(chunked_decay_scan, q, k, v, log_decay, initial_state, chunk_size,
                                    sequences=sequences)
