"""The chunk table of the chunked scan (:mod:`.chunked_scan`): which batch row and time range each chunk covers,
and which chunks each sequence owns. Chunks never cross a sequence, so fixed-length and packed batches are the
same kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridlm.ops.packing import packed_sequences


@dataclass(frozen=True)
class Chunks:
    """The chunk table: chunk ``c`` is ``time[start[c]:end[c]]`` of batch row ``row[c]``; sequence ``s`` owns the
    chunks ``first[s]:last[s]``. ``table`` packs ``row, start, end`` and ``seqs`` packs ``first, last``. A
    packed table may end in spare empty chunks (``start = end``) that no sequence owns."""

    table: torch.Tensor  # int32 [3, n_chunks]
    seqs: torch.Tensor  # int32 [2, n_seqs]
    size: int  # the longest chunk

    @property
    def count(self) -> int:
        return self.table.shape[1]

    @property
    def n_seqs(self) -> int:
        return self.seqs.shape[1]


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def scan_sequences(batch: int, time: int, device: torch.device, seq_idx, cu_seqlens) -> list[int] | torch.Tensor | None:
    """The ``sequences`` argument of :func:`.chunked_scan.chunked_decay_scan` for ``batch`` rows of ``time`` tokens
    on ``device``, packed as ``seq_idx`` / ``cu_seqlens`` say (None: not packed), checked as the references check
    them. A ``cu_seqlens`` tensor is passed on, on ``device``, for the chunk table to be built there. While a CUDA
    graph is being captured, ``cu_seqlens`` alone is checked only for its shape and dtype (reading its values
    would copy it to the host, which a capture cannot do): the eager calls before the capture check them."""
    if cu_seqlens is not None and seq_idx is None and _capturing(device):
        if batch != 1 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be an integer [n_seqs + 1] tensor for a batch of 1, got "
                             f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype} for batch {batch}")
        return cu_seqlens
    sequences = packed_sequences(batch, time, seq_idx, cu_seqlens)
    if cu_seqlens is not None and torch.is_tensor(cu_seqlens):
        return cu_seqlens.to(device)  # checked above; read on the device from here on
    return sequences


def packed_chunks(bounds: torch.Tensor, chunk_size: int, time: int) -> Chunks:
    """The chunks of the sequences packed along time with boundaries ``bounds [n_seqs + 1]`` (an integer tensor,
    0 to ``time``; batch row 0), each cut into chunks of ``chunk_size`` tokens (the last may be shorter).

    Built on ``bounds``' device without a copy to the host, so a packed call can be captured in a CUDA graph:
    the chunk count depends on the lengths, so the table has room for the most chunks ``n_seqs`` sequences of
    ``time`` tokens can need (``time // chunk_size + n_seqs``); the spare entries are empty (start = end), owned
    by no sequence, and the kernels skip them."""
    bounds = bounds.flatten().long()
    n_seqs = bounds.numel() - 1
    per_seq = (bounds[1:] - bounds[:-1] + chunk_size - 1) // chunk_size  # [n_seqs] chunks of each sequence
    last = per_seq.cumsum(0)
    first = last - per_seq
    c = torch.arange(time // chunk_size + n_seqs, device=bounds.device)  # [capacity]
    seq = torch.searchsorted(last, c, right=True)  # the sequence owning chunk c (n_seqs: a spare entry)
    owner = seq.clamp_max(n_seqs - 1)
    start = bounds[owner] + (c - first[owner]) * chunk_size
    end = torch.minimum(start + chunk_size, bounds[owner + 1])
    spare = seq == n_seqs
    start, end = start.masked_fill(spare, time), end.masked_fill(spare, time)
    table = torch.stack([torch.zeros_like(start), start, end]).int()
    return Chunks(table, torch.stack([first, last]).int(), chunk_size)


def uniform_chunks(batch: int, time: int, chunk_size: int, device) -> Chunks:
    """``batch`` rows of ``time`` tokens in chunks of ``chunk_size`` (the last of a row may be shorter), built on
    ``device`` (no host-to-device copy, so a fixed-length call can be captured in a CUDA graph)."""
    per_row = -(-time // chunk_size)
    c = torch.arange(batch * per_row, device=device, dtype=torch.int32)  # chunk c: row c // per_row
    start = c % per_row * chunk_size
    table = torch.stack([c // per_row, start, (start + chunk_size).clamp_max(time)])
    first = torch.arange(batch, device=device, dtype=torch.int32) * per_row
    return Chunks(table, torch.stack([first, first + per_row]), chunk_size)
