"""The chunk table of the chunked scan (:mod:`.chunked_scan`): which batch row and time range each chunk covers,
and which chunks each sequence owns. Chunks never cross a sequence, so fixed-length and packed batches are the
same kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Chunks:
    """The chunk table: chunk ``c`` is ``time[start[c]:end[c]]`` of batch row ``row[c]``; sequence ``s`` owns the
    chunks ``first[s]:last[s]``. ``table`` packs ``row, start, end`` and ``seqs`` packs ``first, last``."""

    table: torch.Tensor  # int32 [3, n_chunks]
    seqs: torch.Tensor  # int32 [2, n_seqs]
    size: int  # the longest chunk

    @property
    def count(self) -> int:
        return self.table.shape[1]

    @property
    def n_seqs(self) -> int:
        return self.seqs.shape[1]


def split_chunks(sequences: list[tuple[int, int, int]], chunk_size: int, device) -> Chunks:
    """Cut each sequence ``(row, start, end)`` into chunks of ``chunk_size`` tokens (the last may be shorter)."""
    rows, starts, ends, first, last = [], [], [], [], []
    for row, start, end in sequences:
        first.append(len(starts))
        for s in range(start, end, chunk_size):
            rows.append(row)
            starts.append(s)
            ends.append(min(s + chunk_size, end))
        last.append(len(starts))
    table = torch.tensor([rows, starts, ends], dtype=torch.int32).view(3, -1)
    seqs = torch.tensor([first, last], dtype=torch.int32).view(2, -1)
    return Chunks(table.to(device), seqs.to(device), chunk_size)


def uniform_chunks(batch: int, time: int, chunk_size: int, device) -> Chunks:
    """:func:`split_chunks` of ``batch`` rows of ``time`` tokens, built on ``device`` (no host-to-device copy, so
    a fixed-length call can be captured in a CUDA graph)."""
    per_row = -(-time // chunk_size)
    c = torch.arange(batch * per_row, device=device, dtype=torch.int32)  # chunk c: row c // per_row
    start = c % per_row * chunk_size
    table = torch.stack([c // per_row, start, (start + chunk_size).clamp_max(time)])
    first = torch.arange(batch, device=device, dtype=torch.int32) * per_row
    return Chunks(table, torch.stack([first, first + per_row]), chunk_size)
