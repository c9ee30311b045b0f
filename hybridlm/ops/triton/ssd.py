"""Mamba-2's SSD chunked scan in Triton: :func:`hybridlm.ops.ssd.ssd_chunk_scan_ref` on the kernels of
:mod:`.chunked_scan`.

Fused in the kernels: the whole chunked scan (forward and backward), the skip ``D x`` and the cast of the
output. Plain torch around them: ``dt x`` and ``dt A`` (elementwise, differentiated by autograd).
"""

from __future__ import annotations

import torch

from ..ssd import packed_sequences, ssd_through
from .chunked_scan import chunked_decay_scan


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`hybridlm.ops.ssd.ssd_chunk_scan_ref`, packed sequences included."""
    sequences = packed_sequences(x.shape[0], x.shape[1], seq_idx, cu_seqlens)
    return ssd_through(chunked_decay_scan, x, dt, A, B, C, chunk_size, D, initial_state, fused_skip=True,
                       sequences=sequences)
