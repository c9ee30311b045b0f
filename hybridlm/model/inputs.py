"""Checks of what a model's ``forward`` receives, so that bad input is an error naming the argument before any
mixer runs, not a failure deep inside one (or, worse, a silently wrong result: uint8 ids wrap at 256)."""

from __future__ import annotations

import torch

#: Token id types ``nn.Embedding`` takes without wrapping.
ID_DTYPES = (torch.long, torch.int32)


def check_token_ids(input_ids: torch.Tensor, vocab_size: int, device: torch.device) -> None:
    """``input_ids [batch, time]``: long or int32, on ``device``, non-empty, in ``[0, vocab_size)``."""
    _check_tensor("input_ids", input_ids)
    if input_ids.dtype not in ID_DTYPES:
        raise TypeError(f"input_ids must hold integer token ids as torch.long (or torch.int32), got {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}")
    _check_placement("input_ids", input_ids, device)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"input_ids must lie in [0, vocab_size={vocab_size}), got values in [{low}, {high}]")


def check_embeddings(inputs_embeds: torch.Tensor, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """``inputs_embeds [batch, time, hidden_size]`` of the model's ``dtype``, on ``device``, non-empty."""
    _check_tensor("inputs_embeds", inputs_embeds)
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size:
        raise ValueError(f"inputs_embeds must be [batch, time, {hidden_size}], got {tuple(inputs_embeds.shape)}")
    if inputs_embeds.dtype != dtype:
        raise TypeError(f"inputs_embeds is {inputs_embeds.dtype} but the model computes in {dtype}: convert it with "
                        f"inputs_embeds.to({dtype})")
    _check_placement("inputs_embeds", inputs_embeds, device)


def _check_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__} (a list of ids: "
                        f"torch.tensor([ids]))")


def check_position_ids(position_ids: torch.Tensor, batch: int, time: int) -> None:
    """``position_ids [batch or 1, time]`` of an integer type (they index rotary tables and projection columns)."""
    if position_ids.dim() != 2 or position_ids.shape[1] != time or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"position_ids must be [batch, {time}] or [1, {time}], got {tuple(position_ids.shape)}")
    if position_ids.dtype not in ID_DTYPES:
        raise TypeError(f"position_ids must be torch.long (or torch.int32), got {position_ids.dtype}")


def check_labels(labels: torch.Tensor, logits_shape: torch.Size) -> None:
    """``labels [batch, time]`` matching the logits ``[batch, time, vocab]``: integer ids in ``[0, vocab)``, or
    -100 where no token is predicted."""
    batch, time, vocab = logits_shape
    if labels.dtype not in ID_DTYPES:
        raise TypeError(f"labels must hold integer token ids as torch.long (or torch.int32), got {labels.dtype}")
    if tuple(labels.shape) != (batch, time):
        raise ValueError(f"labels must be [batch, time] = {(batch, time)} like the logits, got {tuple(labels.shape)}")
    targets = labels[labels != -100]
    if targets.numel():
        low, high = torch.stack([targets.min(), targets.max()]).tolist()  # one device sync
        if low < 0 or high >= vocab:
            raise ValueError(f"labels must lie in [0, vocab_size={vocab}) or be -100 (ignored), got values in "
                             f"[{low}, {high}]")


def check_logits_to_keep(logits_to_keep) -> None:
    """``logits_to_keep``: how many of the last positions get logits; 0 keeps all."""
    if not isinstance(logits_to_keep, int) or isinstance(logits_to_keep, bool) or logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be an int >= 0 (0: logits at every position), got {logits_to_keep!r}")


def check_cache_device(cache, device: torch.device) -> None:
    if cache.positions.device != device:
        raise ValueError(f"cache is on {cache.positions.device} but the model on {device}: move it with "
                         f"cache.to({str(device)!r})")


def _check_placement(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    """On the model's device, with at least one row and one token."""
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the model on {device}: move it with .to({str(device)!r})")
    if tensor.shape[0] == 0 or tensor.shape[1] == 0:
        raise ValueError(f"{name} must hold at least one row and one token, got shape {tuple(tensor.shape)} "
                         "[batch, time, ...]")
