"""Depthwise causal conv1d in Triton (sequence form with backward, and the in-place decode step).

Same contracts as :mod:`hybridlm.ops.causal_conv1d`. The input is read as if it were preceded by the carried
window (``[initial_state, x]``, the "padded" sequence) without building that concatenation. Packed sequences
(``seq_idx`` / ``cu_seqlens``): each token's sequence and its first token are read in the kernels
(:func:`._common.sequence_span`), so a tap before the first token reads that sequence's own window. Fused: bias,
activation, and in the backward the activation's derivative. Plain torch: the final window (a slice of the
padded sequence) and the sum of per-block weight/bias gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hybridlm.ops.causal_conv1d import ACTIVATIONS
from hybridlm.ops.packing import check_initial_states, packed_sequences
from hybridlm.ops.triton._common import (
    Packing,
    block,
    check_device,
    launch,
    new_buffer,
    packing_of,
    program_id64,
    sequence_span,
    silu,
    silu_grad,
    total,
)

_BLOCK_T = 64


@triton.jit
def _padded(X, INIT, b, offs_c, s, seq, start, time, sx_b, sx_c, sx_t, si_b, si_c, si_t, mask_c,
            WIDTH: tl.constexpr, HAS_INIT: tl.constexpr):
    """Input ``s`` as read by a token of sequence ``seq`` starting at ``start``, fp32 ``[channels, time]``: ``x[s]``
    inside the sequence, before it the sequence's carried window (``s - start + WIDTH - 1``; zeros without one)."""
    inside = mask_c[:, None] & (s[None, :] >= start[None, :]) & (s[None, :] < time)
    value = tl.load(X + b * sx_b + offs_c[:, None] * sx_c + s[None, :] * sx_t, mask=inside, other=0.0)
    value = value.to(tl.float32)
    if HAS_INIT:
        before = mask_c[:, None] & (s[None, :] < start[None, :]) & (s[None, :] >= start[None, :] + 1 - WIDTH)
        window = INIT + seq[None, :] * si_b + offs_c[:, None] * si_c + (s - start + WIDTH - 1)[None, :] * si_t
        value += tl.load(window, mask=before, other=0.0).to(tl.float32)
    return value


@triton.jit
def _pre_activation(X, INIT, W, BIAS, b, offs_c, offs_t, seq, start, time, channels, sx_b, sx_c, sx_t,
                    si_b, si_c, si_t, WIDTH: tl.constexpr, HAS_INIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    """``bias + sum_k w[k] padded[t + k - (WIDTH - 1)]`` for a ``[channels, time]`` tile."""
    mask_c = offs_c < channels
    acc = tl.full((BLOCK_C, BLOCK_T), 0.0, tl.float32)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_c, mask=mask_c, other=0.0).to(tl.float32)[:, None]
    for k in tl.static_range(WIDTH):
        w = tl.load(W + offs_c * WIDTH + k, mask=mask_c, other=0.0).to(tl.float32)
        x = _padded(X, INIT, b, offs_c, offs_t + k - (WIDTH - 1), seq, start, time, sx_b, sx_c, sx_t,
                    si_b, si_c, si_t, mask_c, WIDTH, HAS_INIT)
        acc += w[:, None] * x
    return acc


@triton.jit
def _conv_fwd_kernel(
    X, INIT, W, BIAS, Y, SEQ, CU, time, channels, sx_b, sx_c, sx_t, si_b, si_c, si_t,
    WIDTH: tl.constexpr, HAS_INIT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    PACKED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):
    b, pc, pt = program_id64(0), program_id64(1), program_id64(2)
    offs_c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_t = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    seq, start, _ = sequence_span(SEQ, CU, b, offs_t, offs_t < time, time, PACKED)
    y = _pre_activation(X, INIT, W, BIAS, b, offs_c, offs_t, seq, start, time, channels, sx_b, sx_c, sx_t,
                        si_b, si_c, si_t, WIDTH, HAS_INIT, HAS_BIAS, BLOCK_C, BLOCK_T)
    if SILU:
        y = silu(y)
    mask = (offs_c[:, None] < channels) & (offs_t[None, :] < time)
    tl.store(Y + (b * channels + offs_c[:, None]) * time + offs_t[None, :], y, mask=mask)


@triton.jit
def _conv_bwd_pre_kernel(
    X, INIT, W, BIAS, DY, DPRE, DW, DBIAS, SEQ, CU, time, channels, sx_b, sx_c, sx_t, si_b, si_c, si_t,
    sd_b, sd_c, sd_t,
    WIDTH: tl.constexpr, HAS_INIT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    PACKED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Gradient before the activation, and this tile's share of the weight and bias gradients."""
    b, pc, pt = program_id64(0), program_id64(1), program_id64(2)
    offs_c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_t = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_c = offs_c < channels
    mask = mask_c[:, None] & (offs_t[None, :] < time)
    seq, start, _ = sequence_span(SEQ, CU, b, offs_t, offs_t < time, time, PACKED)
    dpre = tl.load(DY + b * sd_b + offs_c[:, None] * sd_c + offs_t[None, :] * sd_t, mask=mask, other=0.0)
    dpre = dpre.to(tl.float32)
    if SILU:
        pre = _pre_activation(X, INIT, W, BIAS, b, offs_c, offs_t, seq, start, time, channels, sx_b, sx_c, sx_t,
                              si_b, si_c, si_t, WIDTH, HAS_INIT, HAS_BIAS, BLOCK_C, BLOCK_T)
        dpre *= silu_grad(pre)
    tl.store(DPRE + (b * channels + offs_c[:, None]) * time + offs_t[None, :], dpre, mask=mask)
    partial = (b * tl.num_programs(2) + pt) * channels + offs_c
    for k in tl.static_range(WIDTH):
        x = _padded(X, INIT, b, offs_c, offs_t + k - (WIDTH - 1), seq, start, time, sx_b, sx_c, sx_t,
                    si_b, si_c, si_t, mask_c, WIDTH, HAS_INIT)
        tl.store(DW + partial * WIDTH + k, total(dpre * x, 1), mask=mask_c)
    tl.store(DBIAS + partial, total(dpre, 1), mask=mask_c)


@triton.jit
def _conv_bwd_input_kernel(
    DPRE, W, DFINAL, DX, SEQ, CU, time, channels, sf_b, sf_c, sf_t,
    WIDTH: tl.constexpr, PACKED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Gradient of ``x``: ``sum_k w[k] dpre[s + WIDTH - 1 - k]`` over the outputs of its own sequence, plus the
    final window's gradient on the sequence's last ``WIDTH - 1`` inputs."""
    b, pc, pt = program_id64(0), program_id64(1), program_id64(2)
    offs_c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    s = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_c = offs_c < channels
    seq, _, end = sequence_span(SEQ, CU, b, s, s < time, time, PACKED)
    acc = tl.full((BLOCK_C, BLOCK_T), 0.0, tl.float32)
    for k in tl.static_range(WIDTH):
        w = tl.load(W + offs_c * WIDTH + k, mask=mask_c, other=0.0).to(tl.float32)
        t = s + (WIDTH - 1 - k)  # the output reading x[s] through tap k
        inside = mask_c[:, None] & (t[None, :] < end[None, :])
        acc += w[:, None] * tl.load(DPRE + (b * channels + offs_c[:, None]) * time + t[None, :], mask=inside, other=0.0)
    j = s - (end - (WIDTH - 1))  # position in the sequence's final window
    in_final = mask_c[:, None] & (j[None, :] >= 0) & (s[None, :] < time)
    acc += tl.load(DFINAL + seq[None, :] * sf_b + offs_c[:, None] * sf_c + j[None, :] * sf_t, mask=in_final,
                   other=0.0).to(tl.float32)
    tl.store(DX + (b * channels + offs_c[:, None]) * time + s[None, :], acc, mask=mask_c[:, None] & (s[None, :] < time))


@triton.jit
def _conv_bwd_window_kernel(
    DPRE, W, DFINAL, DINIT, CU, time, channels, sf_b, sf_c, sf_t,
    WIDTH: tl.constexpr, PACKED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Gradient of sequence ``n``'s carried window: element ``i`` is read by the output ``start + i - k`` through
    tap ``k`` while that is in the sequence; a sequence shorter than the window passes the rest to its final
    window."""
    n, pc = program_id64(0), program_id64(1)
    offs_c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    i = tl.arange(0, BLOCK_W)
    mask = (offs_c[:, None] < channels) & (i[None, :] < WIDTH - 1)
    if PACKED:
        row, start, end = n * 0, tl.load(CU + n).to(tl.int64), tl.load(CU + n + 1).to(tl.int64)
    else:
        row, start, end = n, n * 0, n * 0 + time
    acc = tl.full((BLOCK_C, BLOCK_W), 0.0, tl.float32)
    for k in tl.static_range(WIDTH):
        w = tl.load(W + offs_c * WIDTH + k, mask=offs_c < channels, other=0.0).to(tl.float32)
        t = start + i - k
        inside = mask & (i[None, :] >= k) & (t[None, :] < end)
        acc += w[:, None] * tl.load(DPRE + (row * channels + offs_c[:, None]) * time + t[None, :], mask=inside,
                                    other=0.0)
    j = i - (end - start)  # position in the final window
    acc += tl.load(DFINAL + n * sf_b + offs_c[:, None] * sf_c + j[None, :] * sf_t, mask=mask & (j[None, :] >= 0),
                   other=0.0).to(tl.float32)
    tl.store(DINIT + (n * channels + offs_c[:, None]) * (WIDTH - 1) + i[None, :], acc, mask=mask)


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


def _final_windows(x: torch.Tensor, initial_state: torch.Tensor | None, width: int, packing: Packing) -> torch.Tensor:
    """Packed ``x [1, channels, time]``: the last ``width - 1`` elements of each sequence's ``[its window, its
    tokens]``, ``[n_seqs, channels, width - 1]``."""
    cu = packing.cu
    position = (cu[1:] - cu[:-1])[:, None] + torch.arange(width - 1, device=x.device)  # [n, w - 1] in [window, x]
    token = cu[:-1, None] + position - (width - 1)
    from_x = F.pad(x[0], (0, 1))[:, token.clamp(0, x.shape[-1])].transpose(0, 1)  # [n, channels, w - 1]
    if initial_state is None:
        from_window = torch.zeros_like(from_x)
    else:
        index = position.clamp_max(max(width - 2, 0))[:, None].expand_as(from_x)
        from_window = initial_state.to(x.dtype).gather(2, index)
    return torch.where((position >= width - 1)[:, None], from_x, from_window)


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, activation, packing: Packing | None):
        batch, channels, time = x.shape
        width = weight.shape[1]
        block_c = block(channels, maximum=32)
        y = new_buffer(x.shape, x)
        init = initial_state if initial_state is not None else x
        ctx.options = dict(WIDTH=width, HAS_INIT=initial_state is not None, HAS_BIAS=bias is not None,
                           SILU=activation == "silu", PACKED=packing is not None, BLOCK_C=block_c, BLOCK_T=_BLOCK_T)
        seq, cu = packing if packing is not None else (x, x)  # (not read unpacked)
        launch(_conv_fwd_kernel, (batch, triton.cdiv(channels, block_c), triton.cdiv(time, _BLOCK_T)),
               x, init, weight.contiguous(), bias.contiguous() if bias is not None else weight, y, seq, cu, time,
               channels, *x.stride(), *init.stride(), **ctx.options)
        ctx.save_for_backward(x, weight, bias, initial_state)
        ctx.packing = packing
        if packing is None:
            return y, _final_window(x, initial_state, width)
        return y, _final_windows(x, initial_state, width, packing)

    @staticmethod
    def backward(ctx, dy, d_final):
        x, weight, bias, initial_state = ctx.saved_tensors
        batch, channels, time = x.shape
        width, block_c, packing = weight.shape[1], ctx.options["BLOCK_C"], ctx.packing
        seq, cu = packing if packing is not None else (x, x)
        n_tiles = triton.cdiv(time, _BLOCK_T)
        weight = weight.contiguous()
        init = initial_state if initial_state is not None else x
        dpre = new_buffer(x.shape, x, torch.float32)
        dw = new_buffer((batch, n_tiles, channels, width), x, torch.float32)
        db = new_buffer((batch, n_tiles, channels), x, torch.float32)
        launch(_conv_bwd_pre_kernel, (batch, triton.cdiv(channels, block_c), n_tiles),
               x, init, weight, bias.contiguous() if bias is not None else weight, dy, dpre, dw, db, seq, cu, time,
               channels, *x.stride(), *init.stride(), *dy.stride(), **ctx.options)
        dx = new_buffer(x.shape, x, torch.float32)
        packed = dict(PACKED=packing is not None, BLOCK_C=block_c)
        launch(_conv_bwd_input_kernel, (batch, triton.cdiv(channels, block_c), n_tiles),
               dpre, weight, d_final, dx, seq, cu, time, channels, *d_final.stride(),
               WIDTH=width, BLOCK_T=_BLOCK_T, **packed)
        d_init = None
        if initial_state is not None:
            d_init = new_buffer(initial_state.shape, x, torch.float32)
            launch(_conv_bwd_window_kernel, (initial_state.shape[0], triton.cdiv(channels, block_c)),
                   dpre, weight, d_final, d_init, cu, time, channels, *d_final.stride(),
                   WIDTH=width, BLOCK_W=block(width - 1, minimum=1), **packed)
        return (
            dx.to(x.dtype), dw.sum((0, 1)).to(weight.dtype),
            db.sum((0, 1)).to(bias.dtype) if bias is not None else None,
            d_init.to(initial_state.dtype) if initial_state is not None else None, None, None,
        )


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    activation: str | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`hybridlm.ops.causal_conv1d.causal_conv1d_ref`, packed sequences included (each
    token's sequence is read in the kernels: no tap crosses a boundary)."""
    _check("causal_conv1d", x, weight, activation)
    bounds = packed_sequences(x.shape[0], x.shape[2], seq_idx, cu_seqlens)
    check_initial_states("causal_conv1d", bounds, initial_state)
    width = weight.shape[1]
    n_states = x.shape[0] if bounds is None else len(bounds) - 1
    if initial_state is not None and tuple(initial_state.shape) != (n_states, x.shape[1], width - 1):
        raise ValueError(f"causal_conv1d initial_state must be {(n_states, x.shape[1], width - 1)}, "
                         f"got {tuple(initial_state.shape)}")
    check_device("causal_conv1d", x, weight, bias, initial_state)
    return _CausalConv1d.apply(x, weight, bias, initial_state, activation, packing_of(bounds, x.device))


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
