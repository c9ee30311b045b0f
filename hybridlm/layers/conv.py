"""The short causal convolution of Mamba and Mamba-2 (depthwise, then SiLU; LFM2's without), with its window."""

from __future__ import annotations

import torch
from torch import nn

from hybridlm import ops


class ShortConv(nn.Conv1d):
    """A depthwise ``nn.Conv1d`` (so checkpoints keep their ``conv1d.weight [C, 1, K]`` layout) run causally.

    ``forward(x [batch, channels, time], window=None)``: without a window it is the parallel form from a
    zero history; with one (``[batch, channels, width - 1]``) it continues from it and updates it in place.
    """

    def __init__(self, channels: int, width: int, bias: bool = True, activation: str | None = "silu"):
        super().__init__(channels, channels, width, groups=channels, padding=width - 1, bias=bias)
        self.activation = activation

    def init_window(self, batch_size: int, device=None, dtype=None) -> torch.Tensor:
        return torch.zeros(batch_size, self.in_channels, self.kernel_size[0] - 1, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, window: torch.Tensor | None = None, **packed) -> torch.Tensor:
        """``packed``: ``cu_seqlens`` or ``seq_idx`` of documents packed along time (see
        :mod:`hybridlm.ops.packing`), each convolved from a zero window; only without ``window``."""
        weight = self.weight.squeeze(1)
        if window is not None and x.shape[-1] == 1:
            return ops.causal_conv1d_update(x[..., 0], window, weight, self.bias,
                                            activation=self.activation).unsqueeze(-1)
        y, final = ops.causal_conv1d(x, weight, self.bias, initial_state=window, activation=self.activation, **packed)
        if window is not None:
            window.copy_(final)
        return y
