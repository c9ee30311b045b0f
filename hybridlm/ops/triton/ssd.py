"""Mamba-2's SSD chunked scan in Triton: :func:`hybridlm.ops.ssd.ssd_chunk_scan_ref` on the kernels of
:mod:`.chunked_scan`.

Fused in the kernels: the whole chunked scan (forward and backward), ``dt x`` (a per-token scale of ``x``),
``C . B^T`` once per chunk and group, the skip ``D x`` and the cast of the output. Plain torch around them:
``dt A`` (one product per token and head, formed by the shared :func:`hybridlm.ops.ssd.ssd_through` and
differentiated by autograd).

Packed sequences given by ``cu_seqlens`` reach the kernels as that tensor: the chunk table is built on the device
(:func:`.chunks.packed_chunks`; see :func:`.chunks.scan_sequences` for what is checked during a CUDA graph
capture).
"""

from __future__ import annotations

import torch

from hybridlm.ops.ssd import ssd_through
from hybridlm.ops.triton.chunked_scan import chunked_decay_scan
from hybridlm.ops.triton.chunks import scan_sequences


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
    return ssd_through(chunked_decay_scan, x, dt, A, B, C, chunk_size, D, initial_state, fused_skip=True,
                       sequences=scan_sequences(*x.shape[:2], x.device, seq_idx, cu_seqlens))
