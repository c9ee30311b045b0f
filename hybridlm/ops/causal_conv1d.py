"""Depthwise causal 1-D convolution with a carried window: the short convolution of Mamba and Mamba-2.

Layout follows the ``causal-conv1d`` package: ``x`` is ``[batch, channels, time]``, ``weight`` is
``[channels, width]``. The carried state is the last ``width - 1`` inputs, ``[batch, channels, width - 1]``:
exactly what the next token's output needs, nothing more.

Packed sequences (``seq_idx`` / ``cu_seqlens``, see :mod:`.packing`): a tap that would reach before its
sequence's first token reads that sequence's own window (``initial_state [n_seqs, channels, width - 1]``, zeros
when None) instead of the previous sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridlm.ops.packing import check_initial_states, packed_sequences, token_sequences

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
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convolve ``x`` causally, continuing from ``initial_state`` (zeros when None).

    Returns ``(y [batch, channels, time], final_state [batch, channels, width - 1])``; packed (batch 1), the
    states are ``[n_seqs, channels, width - 1]``.
    """
    batch, channels, time = x.shape
    width = weight.shape[-1]
    if weight.shape != (channels, width):
        raise ValueError(f"causal_conv1d weight must be [channels={channels}, width], got {tuple(weight.shape)}")
    bounds = packed_sequences(batch, time, seq_idx, cu_seqlens)
    if bounds is not None:
        check_initial_states("causal_conv1d", bounds, initial_state)
        return _packed_conv(x[0], weight, bias, initial_state, activation, bounds)
    if initial_state is None:
        initial_state = x.new_zeros(batch, channels, width - 1)
    padded = torch.cat([initial_state.to(x.dtype), x], dim=-1)
    y = F.conv1d(padded, weight.unsqueeze(1), bias, groups=channels)
    return _activate(y, activation), padded[..., padded.shape[-1] - (width - 1):]


def _packed_conv(x, weight, bias, initial_state, activation, bounds):
    """``x [channels, time]`` holding the packed sequences ``bounds``. Every sequence's inputs are read from
    ``[its window, its tokens]``: an index per (tap, token) into the windows and tokens laid side by side."""
    channels, time = x.shape
    width, n_seqs = weight.shape[-1], len(bounds) - 1
    if initial_state is None:
        initial_state = x.new_zeros(n_seqs, channels, width - 1)
    windows = initial_state.to(x.dtype).permute(1, 0, 2).reshape(channels, n_seqs * (width - 1))
    source = torch.cat([windows, x], dim=-1)  # [channels, n_seqs * (width - 1) + time]
    starts = torch.tensor(bounds, device=x.device)

    def index(sequence: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """Where ``source`` holds input ``at`` (>= start - width + 1) of ``sequence``."""
        before = at - starts[sequence]  # < 0: in the sequence's window
        return torch.where(before >= 0, n_seqs * (width - 1) + at, (sequence + 1) * (width - 1) + before)

    sequence = token_sequences(bounds, x.device)  # [time]
    taps = torch.arange(1 - width, 1, device=x.device)  # [width]: offsets of the taps
    inputs = source[:, index(sequence, torch.arange(time, device=x.device) + taps[:, None])]  # [c, width, time]
    y = torch.einsum("cwt,cw->ct", inputs, weight.to(x.dtype))
    if bias is not None:
        y = y + bias.to(x.dtype)[:, None]
    every = torch.arange(n_seqs, device=x.device)
    last_inputs = starts[1:, None] + taps[:-1]  # [n_seqs, width - 1]: the last width - 1 inputs of each
    final = source[:, index(every[:, None], last_inputs)].permute(1, 0, 2)  # [n_seqs, channels, width - 1]
    return _activate(y, activation).unsqueeze(0), final


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


def causal_conv1d_windows(x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """The carried window after each token of ``x [batch, channels, time]`` continuing from ``window [batch,
    channels, width - 1]``: ``[batch, time, channels, width - 1]``, slices of ``[window, x]`` (what rolling the
    window back to any token needs; the last one is the window :func:`causal_conv1d_ref` returns)."""
    joined = torch.cat([window.to(x.dtype), x], dim=-1)  # [batch, channels, width - 1 + time]
    return joined.unfold(-1, window.shape[-1], 1)[:, :, 1:].transpose(1, 2)
