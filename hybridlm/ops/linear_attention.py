"""Causal linear attention, optionally with a scalar decay per step (gated linear attention).

    S[t] = exp(g[t]) * S[t-1] + v[t] (outer) k[t]          out[t] = S[t] @ q[t]

``q, k [batch, heads, time, features]``, ``v [batch, heads, time, dim]``, ``log_decay [batch, heads, time]``,
state ``[batch, heads, dim, features]``. There is no normaliser here: a caller that wants one appends a column
of ones to ``v`` and divides by the last output column, so one state carries numerator and denominator.
It is the same chunked scan as Mamba-2's SSD, with one key/query group per head, and takes packed sequences
the same way (``seq_idx`` / ``cu_seqlens``, see :mod:`.packing`: one initial and final state per sequence).
"""

from __future__ import annotations

import torch

from hybridlm.ops.packing import check_initial_states, packed_sequences
from hybridlm.ops.ssd import chunked_decay_scan


def causal_linear_attention_ref(
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
    """Returns ``(out [batch, heads, time, dim], final_state [batch, heads, dim, features] fp32)``; packed
    (batch 1), ``initial_state`` and ``final_state`` are ``[n_seqs, heads, dim, features]``."""
    sequences = packed_sequences(q.shape[0], q.shape[2], seq_idx, cu_seqlens)
    check_initial_states("causal_linear_attention", sequences, initial_state)
    return linear_attention_through(chunked_decay_scan, q, k, v, log_decay, initial_state, chunk_size,
                                    sequences=sequences)


def linear_attention_through(scan, q, k, v, log_decay, initial_state, chunk_size, **scan_options):
    """Linear attention computed by a chunked decay ``scan`` in the ``[batch, time, heads, dim]`` layout.

    Shared by this reference and the faster backends, which differ only in ``scan``.
    """
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"causal_linear_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    y, final = scan(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        None if log_decay is None else log_decay.transpose(1, 2), chunk_size, initial_state, **scan_options,
    )
    return y.transpose(1, 2).to(v.dtype), final
