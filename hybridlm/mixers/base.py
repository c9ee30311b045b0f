"""The mixer contract and the registry of mixer kinds.

Every mixer mixes information along the sequence and owns one state type:

* ``init_state(batch_size, max_length=None, device=None, dtype=None)`` returns an empty state;
* ``forward(x [batch, time, hidden], state=None, *, mask=None, positions=None)`` returns ``[batch, time,
  hidden]``. Without a state it is the parallel (training) form; with one it continues from the state over
  ``time >= 1`` new tokens and updates it in place, so prefill, chunked prefill and decode are one call.
  ``mask [batch, time]`` (bool, True = real token) marks padding; a padded token leaves the state exactly as
  it was. With a state, padding may only precede a row's first real token (left padding).
  ``positions [batch, time]`` are the tokens' position ids (for RoPE and position-indexed projections).

A new kind is one module that subclasses :class:`Mixer` and is decorated with :func:`register`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..cache import LayerState

MIXERS: dict[str, type[Mixer]] = {}


def register(name: str):
    """Class decorator adding a mixer kind under ``name`` (the name used in ``HybridConfig.layer_types``)."""

    def add(cls: type[Mixer]) -> type[Mixer]:
        cls.kind = name
        MIXERS[name] = cls
        return cls

    return add


class Mixer(nn.Module):
    """Base class of all sequence mixers; see the module docstring for the contract."""

    kind: ClassVar[str]

    def init_state(self, batch_size: int, max_length: int | None = None, device=None, dtype=None) -> LayerState:
        raise NotImplementedError

    def forward(
        self,
        x: torch.Tensor,
        state: LayerState | None = None,
        *,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError


def zero_padding(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Zero the padded tokens of ``x [batch, time, ...]``."""
    if mask is None:
        return x
    return x * mask.view(*mask.shape, *([1] * (x.dim() - 2))).to(x.dtype)
