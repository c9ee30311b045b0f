"""Documents packed along time (padding-free training): where each starts, as every mixer receives it.

A packed row holds several documents end to end; each mixer must treat each document as if it ran alone. The
model derives one :class:`Segments` per forward (from ``position_ids`` restarting at each document, or from
explicit boundaries) and passes it to every mixer as ``segments=`` (None for ordinary rows, whose path is
unchanged). A mixer whose ``forward`` takes ``segments`` handles it itself (attention with a block-diagonal
mask, scans resetting their state); :func:`mix` runs any other kind once per document.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from hybridlm.cache import rollback


@dataclass(frozen=True, eq=False)
class Segments:
    """``seq_idx [batch, time]``: each token's document number within its row (0, 0, 1, 1, 1, 2, ...; every
    row starts a document); ``cu_seqlens [n_docs + 1]``: the document boundaries with the rows laid end to end
    (what the scan ops take, on the input flattened to one row by :meth:`one_row`)."""

    seq_idx: torch.Tensor
    cu_seqlens: torch.Tensor

    @classmethod
    def from_seq_idx(cls, seq_idx: torch.Tensor) -> Segments | None:
        """From per-row document numbers (rising by 0 or 1 from 0 in each row); None if every row holds one."""
        if seq_idx.dim() != 2 or seq_idx.is_floating_point() or seq_idx.shape[1] == 0:
            raise ValueError(f"seq_idx must be integer [batch, time], got {seq_idx.dtype} {tuple(seq_idx.shape)}")
        seq_idx = seq_idx.long()
        steps = seq_idx.diff(dim=-1)
        if bool((seq_idx[:, 0] != 0).any() | (steps < 0).any() | (steps > 1).any()):
            raise ValueError("seq_idx must number the documents of each row 0, 1, 2, ... in order, without gaps")
        if not bool(steps.any()):
            return None
        batch, time = seq_idx.shape
        starts = torch.nn.functional.pad(steps, (1, 0), value=1).flatten().nonzero().flatten()  # row starts too
        return cls(seq_idx, torch.cat([starts, starts.new_tensor([batch * time])]))

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> Segments | None:
        """transformers' padding-free convention: a document starts wherever a position does not follow the
        previous one by 1 (``DataCollatorWithFlattening`` restarts positions at 0 for each)."""
        restarts = position_ids.diff(dim=-1) != 1  # [batch, time - 1]
        return cls.from_seq_idx(torch.nn.functional.pad(restarts.long().cumsum(-1), (1, 0)))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, batch: int, time: int) -> Segments | None:
        """From boundaries over one row (``batch`` must be 1): ``[0, ..., time]``, as flash-attn's varlen."""
        bounds = cu_seqlens.flatten().long()
        if batch != 1 or bounds.numel() < 2 or int(bounds[0]) != 0 or int(bounds[-1]) != time \
                or bool((bounds.diff() <= 0).any()):
            raise ValueError(f"cu_seqlens must rise strictly from 0 to time={time} in a batch of one (batch "
                             f"{batch}), got {bounds.tolist()}")
        lengths = bounds.diff()
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths), device=bounds.device), lengths)
        return cls.from_seq_idx(seq_idx[None])

    def documents(self) -> torch.Tensor:
        """``[batch * time]``: each token's document number with the rows laid end to end."""
        flat = torch.arange(self.seq_idx.numel(), device=self.seq_idx.device)
        return torch.searchsorted(self.cu_seqlens[:-1], flat, right=True) - 1

    def positions(self) -> torch.Tensor:
        """``[batch, time]``: each token's position in its own document."""
        flat = torch.arange(self.seq_idx.numel(), device=self.seq_idx.device)
        return (flat - self.cu_seqlens[self.documents()]).view(self.seq_idx.shape)

    def running_max(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., batch * time]`` laid out by :meth:`one_row`: the maximum so far within each document. Each
        of the log2(time) steps looks twice as far back, within the document (documents are contiguous)."""
        document, result, step = self.documents(), x, 1
        while step < x.shape[-1]:
            same = document[step:] == document[:-step]  # [n - step]
            ahead = torch.where(same, torch.maximum(result[..., step:], result[..., :-step]), result[..., step:])
            result = torch.cat([result[..., :step], ahead], dim=-1)
            step *= 2
        return result

    def one_row(self, x: torch.Tensor) -> torch.Tensor:
        """``x [batch, time, ...]`` as one row ``[1, batch * time, ...]`` (no copy); documents stay apart by
        ``cu_seqlens``."""
        return x.reshape(1, -1, *x.shape[2:])

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`one_row`."""
        return x.reshape(*self.seq_idx.shape, *x.shape[2:])

    def scan_kwargs(self) -> dict[str, torch.Tensor]:
        """What the scan ops take for input laid out by :meth:`one_row`."""
        return {"cu_seqlens": self.cu_seqlens}


def check_stateless(kind: str, state, mask) -> None:
    """Packed documents are for the parallel (training) form: no state to continue, no padding mask."""
    if state is not None:
        raise ValueError(f"{kind}: packed documents (segments) cannot continue a state; decode each sequence "
                         "in its own row")
    if mask is not None:
        raise ValueError(f"{kind}: packed documents (segments) take no padding mask")


@functools.cache
def takes_segments(mixer_class: type) -> bool:
    """Whether a mixer kind handles packed documents itself (its ``forward`` takes ``segments``)."""
    return "segments" in inspect.signature(mixer_class.forward).parameters


def _part(t: torch.Tensor | None, start: int, stop: int | None) -> torch.Tensor | None:
    return None if t is None else t[:, start:stop]


def mix(mixer, x: torch.Tensor, state=None, *, mask=None, positions=None, segments: Segments | None = None):
    """``mixer(x, state, mask=..., positions=...)``; with packed ``segments``, each document as if alone: passed
    on to a mixer that takes them, else one call per document. A state that asks for it
    (``one_token_at_a_time``) gets one call per token, each keeping its checkpoint."""
    if segments is None:
        time = x.shape[1]
        if state is not None and state.one_token_at_a_time(time):
            with rollback.kept_per_token(state, time):
                outputs = [mixer(x[:, t:t + 1], state, mask=_part(mask, t, t + 1), positions=_part(positions, t, t + 1))
                           for t in range(time)]
            return torch.cat(outputs, dim=1)
        head = rollback.unkept_head(state, time)
        if head:  # rollback keeps the states of the last tokens only: run the others without computing theirs
            with rollback.paused(state):
                first = mixer(x[:, :head], state, mask=_part(mask, 0, head), positions=_part(positions, 0, head))
            rest = mixer(x[:, head:], state, mask=_part(mask, head, None), positions=_part(positions, head, None))
            return torch.cat([first, rest], dim=1)
        return mixer(x, state, mask=mask, positions=positions)
    if takes_segments(type(mixer)):
        return mixer(x, state, mask=mask, positions=positions, segments=segments)
    check_stateless(type(mixer).__name__, state, mask)
    flat_x, flat_positions = segments.one_row(x), segments.one_row(positions)
    bounds = segments.cu_seqlens.tolist()
    outputs = [mixer(flat_x[:, a:b], None, positions=flat_positions[:, a:b]) for a, b in zip(bounds, bounds[1:])]
    return segments.rows(torch.cat(outputs, dim=1))
