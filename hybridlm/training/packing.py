"""Packing documents into fixed-length rows, and a deterministic, resumable order of rows.

Two layouts, both padding-free:

* ``documents`` (default): documents separated by the end-of-text token and cut into rows of ``seq_len``;
  ``position_ids`` restart at 0 at each document start (transformers' ``DataCollatorWithFlattening``
  convention), so every mixer treats each document as if it ran alone.
* ``stream``: the same rows with positions 0..seq_len-1 (GPT-style: a document may read its predecessor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def tokenize_documents(tokenizer, texts: list[str], batch: int = 256) -> torch.Tensor:
    """One stream of ids: each document's tokens followed by the end-of-text id. Documents longer than the
    tokenizer's ``model_max_length`` (the training length) are expected: they are cut into rows later, so
    transformers' warning about them is silenced."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for start in range(0, len(texts), batch):
        for encoded in tokenizer(texts[start:start + batch], add_special_tokens=False, verbose=False)["input_ids"]:
            ids += encoded
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class PackedRows:
    """``ids [rows, seq_len]`` and ``positions [rows, seq_len]`` (restart at document starts, each row
    starting at 0: a document cut at a row boundary continues as a new document in the next row).
    ``trained [rows, seq_len]`` (optional, bool): the tokens that are targets (fine-tuning: response tokens
    only); without it every token but a document's first is."""

    ids: torch.Tensor
    positions: torch.Tensor
    trained: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.ids.shape[0]

    def batch(self, rows: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
        """Model inputs for the given row indices: ``input_ids``, ``labels`` and, packed, ``position_ids``.
        Labels of the first token of each document are -100 (nothing predicts them across a boundary)."""
        ids = self.ids[rows]
        labels = ids.clone()
        if self.trained is not None:
            labels[~self.trained[rows]] = -100
        if layout == "stream":
            return {"input_ids": ids, "labels": labels}
        positions = self.positions[rows]
        labels[positions == 0] = -100
        return {"input_ids": ids, "labels": labels, "position_ids": positions}


def pack_documents(stream: torch.Tensor, seq_len: int, eos_id: int, what: str = "the training text") -> PackedRows:
    """Cut ``stream`` into ``len(stream) // seq_len`` rows (the tail is dropped); ``what`` names it in errors."""
    rows = len(stream) // seq_len
    if rows < 1:
        raise ValueError(f"{what} has {len(stream)} tokens, fewer than one row of --seq-len {seq_len}")
    ids = stream[: rows * seq_len].view(rows, seq_len)
    starts = torch.zeros_like(ids, dtype=torch.bool)  # [rows, seq_len]: a document starts here
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == eos_id
    index = torch.arange(seq_len).expand(rows, seq_len)
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return PackedRows(ids, index - last_start)


def rows_for_step(step: int, batch_size: int, num_rows: int, seed: int) -> torch.Tensor:
    """The ``batch_size`` row indices of optimizer step ``step``: epochs of seeded permutations, so the order
    is a function of (step, seed) alone — resuming at step k continues the same sequence."""
    if batch_size > num_rows:
        raise ValueError(f"--batch-size {batch_size} is larger than the {num_rows} rows of the corpus")
    steps_per_epoch = num_rows // batch_size
    epoch, offset = divmod(step, steps_per_epoch)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[offset * batch_size:(offset + 1) * batch_size]
