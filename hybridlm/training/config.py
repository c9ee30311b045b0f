"""Settings of a training run (no torch import: the command line reads the defaults from here)."""

from __future__ import annotations

import math
from dataclasses import dataclass

LAYOUTS = ("documents", "stream")
PRECISIONS = ("fp32", "bf16")


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16  # global: sequences per optimizer step
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    precision: str = "fp32"
    checkpointing: bool = False  # activation checkpointing
    layout: str = "documents"  # see hybridlm.training.packing
    eval_every: int = 200
    eval_rows: int = 32  # held-out rows evaluated every eval_every steps (all of them at the end)
    save_every: int = 200
    log_every: int = 10
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "save_every", "log_every", "eval_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"--batch-size {self.batch_size} is not divisible by --grad-accum {self.grad_accum}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"--layout must be one of {LAYOUTS}, got {self.layout!r}")

    def schedule(self, step: int) -> float:
        """Learning-rate multiplier at ``step``: linear warmup, then cosine down to ``min_lr_ratio``."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
