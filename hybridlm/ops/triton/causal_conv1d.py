"""Depthwise causal conv1d in Triton (sequence form with backward, and the in-place decode step).

Same contracts as :mod:`hybridlm.ops.causal_conv1d`. The input is read as if it were preceded by the carried
window (``[initial_state, x]``, the "padded" sequence) without building that concatenation. Fused: bias,
activation, and in the backward the activation's derivative. Plain torch: the final window (a slice of the
padded sequence) and the sum of per-block weight/bias gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..causal_conv1d import ACTIVATIONS
from ._common import block, check_device, launch, new_buffer, program_id64, silu, silu_grad, total

_BLOCK_T = 64


@triton.jit
def _padded(X, INIT, b, offs_c, t, time, sx_b, sx_c, sx_t, si_b, si_c, si_t, mask_c,
            WIDTH: tl.constexpr, HAS_INIT: tl.constexpr):
    """Element ``t`` of the padded sequence (``t < 0``: the carried window) as fp32 ``[channels, time]``."""
    inside = mask_c[:, None] & (t[None, :] >= 0) & (t[None, :] < time)
    value = tl.load(X + b * sx_b + offs_c[:, None] * sx_c + t[None, :] * sx_t, mask=inside, other=0.0)
    value = value.to(tl.float32)
    if HAS_INIT:
        before = mask_c[:, None] & (t[None, :] < 0) & (t[None, :] >= 1 - WIDTH)
        window = INIT + b * si_b + offs_c[:, None] * si_c + (t[None, :] + WIDTH - 1) * si_t
        value += tl.load(window, mask=before, other=0.0).to(tl.float32)
    return value


@triton.jit
def _pre_activation(X, INIT, W, BIAS, b, offs_c, offs_t, time, channels, sx_b, sx_c, sx_t, si_b, si_c, si_t,
                    WIDTH: tl.constexpr, HAS_INIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    """``bias + sum_k w[k] padded[t + k - (WIDTH - 1)]`` for a ``[channels, time]`` tile."""
    mask_c = offs_c < channels
    acc = tl.full((BLOCK_C, BLOCK_T), 0.0, tl.float32)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_c, mask=mask_c, other=0.0).to(tl.float32)[:, None]
    for k in tl.static_range(WIDTH):
        w = tl.load(W + offs_c * WIDTH + k, mask=mask_c, other=0.0).to(tl.float32)
        x = _padded(X, INIT, b, offs_c, offs_t + k - (WIDTH - 1), time, sx_b, sx_c, sx_t, si_b, si_c, si_t, mask_c,
                    WIDTH, HAS_INIT)
        acc += w[:, None] * x
    return acc


@triton.jit
def _conv_fwd_kernel(
    X, INIT, W, BIAS, Y, time, channels, sx_b, sx_c, sx_t, si_b, si_c, si_t,
    WIDTH: tl.constexpr, HAS_INIT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):
    b, pc, pt = program_id64(0), program_id64(1), program_id64(2)
    offs_c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_t = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    y = _pre_activation(X, INIT, W, BIAS, b, offs_c, offs_t, time, channels, sx_b, sx_c, sx_t, si_b, si_c, si_t,
                        WIDTH, HAS_INIT, HAS_BIAS, BLOCK_C, BLOCK_T)
    if SILU:
        y = silu(y)
    mask = (offs_c[:, None] < channels) & (offs_t[None, :] < time)
    tl.store(Y + (b * channels + offs_c[:, None]) * time + offs_t[None, :], y, mask=mask)


@triton.jit
def _conv_bwd_pre_kernel(
    X, INIT, W, BIAS, DY, DPRE, DW, DBIAS, time, channels, sx_b, sx_c, sx_t, si_b, si_c, si_t, sd_b, sd_c, sd_t,
    WIDTH: tl.constexpr, HAS_INIT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Gradient before the activation, and this tile's share of the weight and bias gradients."""
    b, pc, pt = program_id64(0), program_id64(1), program_id64(2)
    offs_c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_t = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_c = offs_c < channels
    mask = mask_c[:, None] & (offs_t[None, :] < time)
    dpre = tl.load(DY + b * sd_b + offs_c[:, None] * sd_c + offs_t[None, :] * sd_t, mask=mask, other=0.0)
    dpre = dpre.to(tl.float32)
    if SILU:
        pre = _pre_activation(X, INIT, W, BIAS, b, offs_c, offs_t, time, channels, sx_b, sx_c, sx_t,
                              si_b, si_c, si_t, WIDTH, HAS_INIT, HAS_BIAS, BLOCK_C, BLOCK_T)
        dpre *= silu_grad(pre)
    tl.store(DPRE + (b * channels + offs_c[:, None]) * time + offs_t[None, :], dpre, mask=mask)
    partial = (b * tl.num_programs(2) + pt) * channels + offs_c
    for k in tl.static_range(WIDTH):
        x = _padded(X, INIT, b, offs_c, offs_t + k - (WIDTH - 1), time, sx_b, sx_c, sx_t, si_b, si_c, si_t, mask_c,
                    WIDTH, HAS_INIT)
        tl.store(DW + partial * WIDTH + k, total(dpre * x, 1), mask=mask_c)
    tl.store(DBIAS + partial, total(dpre, 1), mask=mask_c)


@triton.jit
def _conv_bwd_input_kernel(
    DPRE, W, DFINAL, DX, DINIT, time, channels, sf_b, sf_c, sf_t,
    WIDTH: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Gradient of the padded sequence: ``sum_k w[k] dpre[p - k]``, plus the final window's gradient on its last
    ``WIDTH - 1`` elements; the first ``WIDTH - 1`` go to the initial window, the rest to ``x``."""
    b, pc, pt = program_id64(0), program_id64(1), program_id64(2)
    offs_c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    p = pt * BLOCK_T + tl.arange(0, BLOCK_T)  # index into the padded sequence
    mask_c = offs_c < channels
    acc = tl.full((BLOCK_C, BLOCK_T), 0.0, tl.float32)
    for k in tl.static_range(WIDTH):
        w = tl.load(W + offs_c * WIDTH + k, mask=mask_c, other=0.0).to(tl.float32)
        t = p - k
        inside = mask_c[:, None] & (t[None, :] >= 0) & (t[None, :] < time)
        acc += w[:, None] * tl.load(DPRE + (b * channels + offs_c[:, None]) * time + t[None, :], mask=inside, other=0.0)
    j = p - time  # position in the final window
    in_final = mask_c[:, None] & (j[None, :] >= 0) & (j[None, :] < WIDTH - 1)
    final = DFINAL + b * sf_b + offs_c[:, None] * sf_c + j[None, :] * sf_t
    acc += tl.load(final, mask=in_final, other=0.0).to(tl.float32)
    t = p - (WIDTH - 1)
    tl.store(DX + (b * channels + offs_c[:, None]) * time + t[None, :], acc,
             mask=mask_c[:, None] & (t[None, :] >= 0) & (t[None, :] < time))
    tl.store(DINIT + (b * channels + offs_c[:, None]) * (WIDTH - 1) + p[None, :], acc,
             mask=mask_c[:, None] & (p[None, :] < WIDTH - 1))


@triton.jit
def _conv_update_kernel(
    X, STATE, W, BIAS, Y, channels, sx_b, sx_c, ss_b, ss_c, ss_t,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One step: ``y = bias + w . [window, x]``; the window shifts left by one and takes ``x``."""
    b, pc = program_id64(0), program_id64(1)
    offs_c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < channels
    x = tl.load(X + b * sx_b + offs_c * sx_c, mask=mask_c, other=0.0).to(tl.float32)
    y = tl.load(W + offs_c * WIDTH + WIDTH - 1, mask=mask_c, other=0.0).to(tl.float32) * x
    if HAS_BIAS:
        y += tl.load(BIAS + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    window = STATE + b * ss_b + offs_c * ss_c
    for k in tl.static_range(WIDTH - 1):
        value = tl.load(window + k * ss_t, mask=mask_c, other=0.0)
        y += tl.load(W + offs_c * WIDTH + k, mask=mask_c, other=0.0).to(tl.float32) * value.to(tl.float32)
        if k > 0:
            tl.store(window + (k - 1) * ss_t, value, mask=mask_c)
    if WIDTH > 1:
        tl.store(window + (WIDTH - 2) * ss_t, x, mask=mask_c)
    if SILU:
        y = silu(y)
    tl.store(Y + b * channels + offs_c, y, mask=mask_c)


def _check(op: str, x: torch.Tensor, weight: torch.Tensor, activation: str | None) -> None:
    channels = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"{op} weight must be [channels={channels}, width], got {tuple(weight.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op} activation={activation!r}; allowed: {ACTIVATIONS}")


def _final_window(x: torch.Tensor, initial_state: torch.Tensor | None, width: int) -> torch.Tensor:
    """The last ``width - 1`` elements of ``[initial_state, x]``."""
    batch, channels, time = x.shape
    if time >= width - 1:
        return x[..., time - (width - 1):].clone()
    history = initial_state if initial_state is not None else x.new_zeros(batch, channels, width - 1)
    return torch.cat([history[..., time:].to(x.dtype), x], dim=-1)


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, activation):
        batch, channels, time = x.shape
        width = weight.shape[1]
        block_c = block(channels, maximum=32)
        y = new_buffer(x.shape, x)
        init = initial_state if initial_state is not None else x
        ctx.options = dict(WIDTH=width, HAS_INIT=initial_state is not None, HAS_BIAS=bias is not None,
                           SILU=activation == "silu", BLOCK_C=block_c, BLOCK_T=_BLOCK_T)
        launch(_conv_fwd_kernel, (batch, triton.cdiv(channels, block_c), triton.cdiv(time, _BLOCK_T)),
               x, init, weight.contiguous(), bias.contiguous() if bias is not None else weight, y, time, channels,
               *x.stride(), *init.stride(), **ctx.options)
        ctx.save_for_backward(x, weight, bias, initial_state)
        return y, _final_window(x, initial_state, width)

    @staticmethod
    def backward(ctx, dy, d_final):
        x, weight, bias, initial_state = ctx.saved_tensors
        batch, channels, time = x.shape
        width, block_c = weight.shape[1], ctx.options["BLOCK_C"]
        n_tiles = triton.cdiv(time, _BLOCK_T)
        weight = weight.contiguous()
        init = initial_state if initial_state is not None else x
        dpre = new_buffer(x.shape, x, torch.float32)
        dw = new_buffer((batch, n_tiles, channels, width), x, torch.float32)
        db = new_buffer((batch, n_tiles, channels), x, torch.float32)
        launch(_conv_bwd_pre_kernel, (batch, triton.cdiv(channels, block_c), n_tiles),
               x, init, weight, bias.contiguous() if bias is not None else weight, dy, dpre, dw, db, time, channels,
               *x.stride(), *init.stride(), *dy.stride(), **ctx.options)
        dx = new_buffer(x.shape, x, torch.float32)
        d_init = new_buffer((batch, channels, width - 1), x, torch.float32)
        launch(_conv_bwd_input_kernel, (batch, triton.cdiv(channels, block_c), triton.cdiv(time + width - 1, _BLOCK_T)),
               dpre, weight, d_final, dx, d_init, time, channels, *d_final.stride(),
               WIDTH=width, BLOCK_C=block_c, BLOCK_T=_BLOCK_T)
        return (
            dx.to(x.dtype), dw.sum((0, 1)).to(weight.dtype),
            db.sum((0, 1)).to(bias.dtype) if bias is not None else None,
            d_init.to(initial_state.dtype) if initial_state is not None else None, None,
        )


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`hybridlm.ops.causal_conv1d.causal_conv1d_ref`."""
    _check("causal_conv1d", x, weight, activation)
    width = weight.shape[1]
    if initial_state is not None and tuple(initial_state.shape) != (x.shape[0], x.shape[1], width - 1):
        raise ValueError(f"causal_conv1d initial_state must be {(x.shape[0], x.shape[1], width - 1)}, "
                         f"got {tuple(initial_state.shape)}")
    check_device("causal_conv1d", x, weight, bias, initial_state)
    return _CausalConv1d.apply(x, weight, bias, initial_state, activation)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """Same contract as :func:`hybridlm.ops.causal_conv1d.causal_conv1d_update_ref`: ``x [batch, channels]``,
    ``conv_state [batch, channels, width - 1]`` updated in place."""
    _check("causal_conv1d_update", x, weight, activation)
    batch, channels = x.shape
    width = weight.shape[1]
    if tuple(conv_state.shape) != (batch, channels, width - 1):
        raise ValueError(f"causal_conv1d_update conv_state must be {(batch, channels, width - 1)}, "
                         f"got {tuple(conv_state.shape)}")
    check_device("causal_conv1d_update", x, conv_state, weight, bias)
    y = new_buffer(x.shape, x)
    block_c = block(channels, maximum=256)
    launch(_conv_update_kernel, (batch, triton.cdiv(channels, block_c)),
           x, conv_state, weight.contiguous(), bias.contiguous() if bias is not None else weight, y, channels,
           *x.stride(), *conv_state.stride(),
           WIDTH=width, HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_C=block_c)
    return y
