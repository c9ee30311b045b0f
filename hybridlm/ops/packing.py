"""Sequences packed along time (padding-free batches): how the ops are told where each one starts.

Two equivalent descriptions, as in mamba-ssm, flash-attn and fla: ``cu_seqlens [n_seqs + 1]`` (cumulative
lengths from 0 to ``time``) or ``seq_idx [1, time]`` (each token's sequence number, 0, 0, 1, 1, 1, 2, ...).
Packed input has batch size 1; an op given either treats each sequence as if it ran alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch

PACKING_ARGUMENTS = ("seq_idx", "cu_seqlens")  # the keyword arguments that describe packed sequences


def packed_sequences(
    batch: int, time: int, seq_idx: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
) -> list[int] | None:
    """Boundaries ``[0, ..., time]`` of the sequences packed along time, or None for an ordinary batch.

    Packing is given by ``cu_seqlens [n_seqs + 1]`` (cumulative lengths, starting at 0 and ending at ``time``)
    or ``seq_idx [1, time]`` (each token's sequence number: 0, 0, 1, 1, 1, 2, ...), or both if they agree.
    Packed input has batch size 1.
    """
    if seq_idx is None and cu_seqlens is None:
        return None
    if batch != 1:
        raise ValueError(f"packed sequences (seq_idx / cu_seqlens) need batch size 1, got {batch}")
    bounds = None
    if cu_seqlens is not None:
        bounds = [int(b) for b in torch.as_tensor(cu_seqlens).flatten().tolist()]
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != time or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(
                f"cu_seqlens must rise from 0 to time={time} with at least one sequence, got {bounds}"
            )
    if seq_idx is not None:
        if tuple(seq_idx.shape) != (1, time) or seq_idx.is_floating_point() or time == 0:
            raise ValueError(f"seq_idx must be integer [1, time={time}] with time > 0, got {tuple(seq_idx.shape)}")
        ids = seq_idx[0].tolist()
        if ids[0] != 0 or any(b - a not in (0, 1) for a, b in zip(ids, ids[1:])):
            raise ValueError("seq_idx must number the packed sequences 0, 1, 2, ... in order, without gaps")
        from_ids = [0] + [t for t in range(1, time) if ids[t] != ids[t - 1]] + [time]
        if bounds is not None and [b for i, b in enumerate(bounds) if i == 0 or b != bounds[i - 1]] != from_ids:
            raise ValueError(f"seq_idx and cu_seqlens disagree: {from_ids} vs {bounds}")
        bounds = bounds or from_ids
    return bounds


def check_initial_states(op: str, bounds: list[int] | None, initial_state) -> None:
    """Packed, an op takes one initial state per sequence: say so when the count differs."""
    if bounds is not None and initial_state is not None and initial_state.shape[0] != len(bounds) - 1:
        raise ValueError(f"{op}: {len(bounds) - 1} packed sequences but {initial_state.shape[0]} initial states")


class Spans(NamedTuple):
    """The non-empty packed sequences: their numbers ``index``, first tokens ``starts`` and last tokens ``lasts``
    (each ``[m]`` long)."""

    index: torch.Tensor
    starts: torch.Tensor
    lasts: torch.Tensor


def nonempty_spans(bounds: list[int], device) -> Spans:
    """:class:`Spans` of the sequences with boundaries ``bounds`` that hold at least one token."""
    kept = [(i, a, b - 1) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a]
    index, starts, lasts = zip(*kept) if kept else ((), (), ())
    return Spans(*(torch.tensor(x, device=device, dtype=torch.long) for x in (index, starts, lasts)))


def token_sequences(bounds: list[int], device) -> torch.Tensor:
    """``[time]``: the sequence number of each token (``seq_idx`` without its batch axis)."""
    lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)


def takes_packing(function: Callable) -> bool:
    """Whether ``function`` (an op's backend) accepts packed sequences; one that does not is never given them."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in PACKING_ARGUMENTS)
