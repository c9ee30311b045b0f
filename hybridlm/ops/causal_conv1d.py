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


def check_activation(activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d activation={activation!r}; allowed: {ACTIVATIONS}")


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    check_activation(activation)
    return F.silu(y) if activation == "silu" else y


def conv_shapes(x: torch.Tensor, weight: torch.Tensor, activation: str | None,
                initial_state: torch.Tensor | None = None) -> tuple[int, int, int, int]:
    """``(batch, channels, time, width)`` of ``x [batch, channels, time]`` convolved by ``weight [channels,
    width]`` from ``initial_state [batch, channels, width - 1]`` (when given); raises naming what disagrees."""
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d x must be [batch, channels, time], got {tuple(x.shape)}")
    batch, channels, time = x.shape
    width = weight.shape[-1]
    if weight.shape != (channels, width):
        raise ValueError(f"causal_conv1d weight must be [channels={channels}, width], got {tuple(weight.shape)}")
    check_activation(activation)
    if initial_state is not None and initial_state.shape != (batch, channels, width - 1):
        raise ValueError(f"causal_conv1d initial_state must be [batch={batch}, channels={channels}, width - 1="
                         f"{width - 1}], got {tuple(initial_state.shape)}")
    return batch, channels, time, width


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
    packed = seq_idx is not None or cu_seqlens is not None  # then initial_state holds one window per sequence
    batch, channels, time, width = conv_shapes(x, weight, activation, None if packed else initial_state)
    bounds = packed_sequences(batch, time, seq_idx, cu_seqlens)
    if bounds is not None:
        check_initial_states("causal_conv1d", bounds, initial_state)
        return _packed_conv(x[0], weight, bias, initial_state, activation, bounds)
    dtype = torch.promote_types(x.dtype, torch.float32)  # taps summed in fp32 at least, rounded once
    history = (x.new_zeros(batch, width - 1, channels) if initial_state is None
               else initial_state.to(x.dtype).transpose(1, 2))
    padded = torch.cat([history, x.transpose(1, 2)], dim=1).to(dtype)  # [batch, width - 1 + time, channels]
    y = _TimeMajorConv.apply(padded, weight.to(dtype), None if bias is None else bias.to(dtype)).to(x.dtype)
    final = padded[:, padded.shape[1] - (width - 1):].transpose(1, 2).to(x.dtype).contiguous()
    return _activate(y, activation).transpose(1, 2), final


class _TimeMajorConv(torch.autograd.Function):
    """``y[:, t] = bias + sum_k weight[:, k] * padded[:, t + k]`` for ``padded [batch, width - 1 + time,
    channels]``: ``y [batch, time, channels]``. Time-major, the layout the mixers' projections produce: one
    multiply-add over contiguous channels per tap, forward and backward. ``F.conv1d`` wants ``[batch, channels,
    time]``, which costs a transposing copy each way and a slower depthwise backward."""

    @staticmethod
    def forward(ctx, padded: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        width, time = weight.shape[-1], padded.shape[1] - weight.shape[-1] + 1
        # [width, channels]: each tap's weights contiguous, so that the multiply-adds vectorise (a column of
        # weight [channels, width] is strided: 4.1x slower at 256 tokens x 320 channels, 1 thread)
        taps = weight.t().contiguous()
        first = padded[:, :time]
        y = first * taps[0] if bias is None else torch.addcmul(bias, first, taps[0])
        for k in range(1, width):
            y.addcmul_(padded[:, k : k + time], taps[k])
        ctx.save_for_backward(padded, taps)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        padded, taps = ctx.saved_tensors
        width, time = taps.shape[0], grad.shape[1]
        grad_padded = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_padded = padded.new_zeros(padded.shape)
            for k in range(width):
                grad_padded[:, k : k + time].addcmul_(grad, taps[k])
        if ctx.needs_input_grad[1]:
            grad_weight = torch.stack([(grad * padded[:, k : k + time]).sum((0, 1)) for k in range(width)], -1)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum((0, 1))
        return grad_padded, grad_weight, grad_bias


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
