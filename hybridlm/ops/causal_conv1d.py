"""Depthwise causal 1-D convolution with a carried window: the short convolution of Mamba and Mamba-2.

Layout follows the ``causal-conv1d`` package: ``x`` is ``[batch, channels, time]``, ``weight`` is
``[channels, width]``. The carried state is the last ``width - 1`` inputs, ``[batch, channels, width - 1]``:
exactly what the next token's output needs, nothing more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu")


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d activation={activation!r}; allowed: {ACTIVATIONS}")
    return F.silu(y) if activation == "silu" else y


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convolve ``x`` causally, continuing from ``initial_state`` (zeros when None).

    Returns ``(y [batch, channels, time], final_state [batch, channels, width - 1])``.
    """
    batch, channels, _ = x.shape
    width = weight.shape[-1]
    if weight.shape != (channels, width):
        raise ValueError(f"causal_conv1d weight must be [channels={channels}, width], got {tuple(weight.shape)}")
    if initial_state is None:
        initial_state = x.new_zeros(batch, channels, width - 1)
    padded = torch.cat([initial_state.to(x.dtype), x], dim=-1)
    y = F.conv1d(padded, weight.unsqueeze(1), bias, groups=channels)
    return _activate(y, activation), padded[..., padded.shape[-1] - (width - 1):]


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """One decode step: ``x [batch, channels]`` against the window ``conv_state``, which is updated in place."""
    window = torch.cat([conv_state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [batch, channels, width]
    y = torch.einsum("bcw,cw->bc", window, weight.to(x.dtype))
    if bias is not None:
        y = y + bias
    conv_state.copy_(window[..., 1:])
    return _activate(y, activation)
