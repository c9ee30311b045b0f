"""How the next token is chosen from the logits: greedy, or sampled after temperature, top-k and top-p; shared by
the incremental decoder and speculative decoding (whose acceptance test needs the same distribution)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingSettings:
    """Greedy when ``do_sample`` is False (or temperature is 0); otherwise temperature, then top-k, then
    top-p (nucleus) filtering. ``stop_tokens`` end a row; its later slots hold ``pad_token_id``."""

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop_tokens: Sequence[int] = field(default_factory=tuple)
    pad_token_id: int = 0
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be None or >= 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be None or in (0, 1]")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


def choose_next(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from ``logits [batch, vocab]``."""
    if settings.greedy:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits, settings), 1, generator=generator).squeeze(-1)


def sampling_probs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """The distribution sampling draws from: ``logits [..., vocab]`` after temperature, top-k and top-p (fp32)."""
    logits = logits.float() / settings.temperature
    if settings.top_k is not None:
        kth = logits.topk(min(settings.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if settings.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the top token always stays)
        drop = probs.cumsum(-1) - probs >= settings.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -torch.inf))
    return logits.softmax(-1)
