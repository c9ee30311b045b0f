"""Padding-free batches as transformers makes them (``DataCollatorWithFlattening``), read into the
:class:`~hybridlm.mixers.segments.Segments` that every mixer receives.

A batch packs several documents per row. The model finds where they start from, in order of precedence:

* explicit boundaries among the forward's keyword arguments: ``seq_idx [batch, time]`` (document number per
  token; the collator's ``return_seq_idx=True``), ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (its
  ``return_flash_attn_kwargs=True``; ``max_length_q`` / ``max_length_k`` are accepted and not needed) or
  ``cu_seqlens`` (batch 1: ``[0, ..., time]``);
* else ``position_ids`` that do not rise by 1 from one token to the next (the collator restarts them at each
  document), read only when no padding mask is given, as transformers does.

Explicit boundaries and restarting ``position_ids`` must agree. Without ``position_ids`` each document's
positions count from 0.
"""

from __future__ import annotations

import torch

from hybridlm.mixers.segments import Segments

#: Keyword arguments of ``forward`` that describe packed documents (transformers 5.x names, and ``cu_seqlens``).
PACKING_KWARGS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cu_seqlens")


def packed_documents(kwargs: dict, position_ids, mask, cache, batch: int, time: int) -> Segments | None:
    """The documents packed in the batch (None: one per row), removing :data:`PACKING_KWARGS` from ``kwargs``.
    ``mask`` is the padding mask of the new tokens (None without padding)."""
    given = {name: kwargs.pop(name) for name in PACKING_KWARGS if kwargs.get(name) is not None}
    if "cu_seq_lens_q" in given and "cu_seq_lens_k" in given \
            and not torch.equal(given["cu_seq_lens_q"].cpu(), given["cu_seq_lens_k"].cpu()):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ: packed documents attend within themselves only")
    readings = {}
    if "seq_idx" in given:
        readings["seq_idx"] = Segments.from_seq_idx(_batched(given["seq_idx"], batch, time, "seq_idx"))
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens"):
        if name in given:
            readings[name] = Segments.from_cu_seqlens(given[name], batch, time)
    if position_ids is not None and mask is None:
        readings["position_ids"] = Segments.from_position_ids(_batched(position_ids, batch, time, "position_ids"))
    if not readings:
        return None
    (first_name, segments), *others = readings.items()
    for name, other in others:
        if (segments is None) != (other is None) or (segments is not None and not torch.equal(
                segments.cu_seqlens, other.cu_seqlens)):
            raise ValueError(f"{first_name} and {name} describe different packed documents")
    if segments is not None and cache is not None:
        raise ValueError("packed documents (restarting position_ids, seq_idx or cu_seqlens) cannot use a cache: "
                         "decode each sequence in its own row")
    if segments is not None and mask is not None:
        raise ValueError(f"{first_name} packs documents: pass no padding attention_mask with it")
    return segments


def _batched(ids: torch.Tensor, batch: int, time: int, name: str) -> torch.Tensor:
    if ids.dim() != 2 or ids.shape[1] != time or ids.shape[0] not in (1, batch):
        raise ValueError(f"{name} must be [batch={batch}, {time}] or [1, {time}], got {tuple(ids.shape)}")
    return ids.expand(batch, time)
