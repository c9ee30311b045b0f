"""Mamba-2's SSD chunked scan in Triton: :func:`hybridlm.ops.ssd.ssd_chunk_scan_ref` on the kernels of
:mod:`.chunked_scan`.

Fused in the kernels: the whole chunked scan (forward and backward), ``dt x`` (a per-token scale of ``x``),
``C . B^T`` once per chunk and group, the skip ``D x`` and the cast of the output. Plain torch around them:
``dt A`` (one product per token and head, formed by the shared :func:`hybridlm.ops.ssd.ssd_through` and
differentiated by autograd).

Packed sequences given by ``cu_seqlens`` reach the kernels as that tensor: the chunk table is built on the device
(:func:`.chunks.packed_chunks`). While a CUDA graph is being captured, ``cu_seqlens`` is not checked (that would
copy it to the host, which a capture cannot do): the eager calls before the capture check it.
"""

from __future__ import annotations

import torch

from ..ssd import packed_sequences, ssd_through
from .chunked_scan import chunked_decay_scan


def _capturing(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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
    if cu_seqlens is not None and seq_idx is None and _capturing(x):
        if x.shape[0] != 1 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be an integer [n_seqs + 1] tensor for a batch of 1, got "
                             f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype} for batch {x.shape[0]}")
        sequences = cu_seqlens
    else:
        sequences = packed_sequences(x.shape[0], x.shape[1], seq_idx, cu_seqlens)
        if cu_seqlens is not None and torch.is_tensor(cu_seqlens):
            sequences = cu_seqlens.to(x.device)  # checked above; read on the device from here on
    return ssd_through(chunked_decay_scan, x, dt, A, B, C, chunk_size, D, initial_state, fused_skip=True,
                       sequences=sequences)
