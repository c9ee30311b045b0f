"""How a run is spread over processes. The loop talks to one small interface; the single-process case is
the plain implementation below."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from .checkpoint import load_checkpoint, save_checkpoint


class SingleProcess:
    """One process: the whole global batch here, no communication."""

    rank, world_size, is_main = 0, 1, True

    def wrap(self, model):
        return model

    def check_batch(self, micro_batch: int) -> None:
        """Each rank must get an equal share of every micro-batch."""
        if micro_batch % self.world_size:
            raise ValueError(f"the micro-batch (--batch-size / --grad-accum = {micro_batch}) is not divisible by "
                             f"the world size {self.world_size}")

    def shard(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's share of a micro-batch's row indices."""
        return rows.chunk(self.world_size)[self.rank] if self.world_size > 1 else rows

    def no_sync(self, wrapped, last_micro: bool):
        """Skip gradient synchronisation on all but the last micro-batch of a step."""
        return nullcontext()

    def sum(self, value: float) -> float:
        return value

    def save(self, out: Path, model, optimizer, scheduler, state: dict) -> None:
        save_checkpoint(out, model, optimizer, scheduler, state)

    def load(self, out: Path, model, optimizer, scheduler) -> dict:
        return load_checkpoint(out, model, optimizer, scheduler)
