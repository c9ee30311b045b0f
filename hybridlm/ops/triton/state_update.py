"""One decode step of the Mamba-1 / Mamba-2 recurrence in Triton, updating the cached state in place.

Same contract as :func:`hybridlm.ops.selective_scan.selective_state_update_ref`. Everything is fused: ``dt_bias``,
softplus, the state update, the read-out by ``C``, the skip ``D x`` and the gate ``silu(z)``. Inputs are read
through their strides, so the broadcast (expanded) ``dt``, ``A`` and ``D`` of Mamba-2 are never materialised.
Forward only: decoding does not train.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.triton._common import (
    block,
    check_device,
    launch,
    new_buffer,
    program_id64,
    silu,
    softplus,
    total,
    tuned,
)


# BLOCK_P: fewer channels per program, more programs at small batches (bounded by the launch's, the widest that fits)
@tuned((2, 1), (4, 1), (8, 1), key=["dim", "dstate"], blocks={"BLOCK_P": (8, 16, 32)},
       restore_value=["S"])  # 1 warp spills at dstate 128
@triton.jit
def _state_update_kernel(
    S, X, DT, A, B, C, D, Z, BIAS, Y, dim, dstate, heads_per_group,
    ss_b, ss_h, ss_p, ss_n, sx_b, sx_h, sx_p, sdt_b, sdt_h, sdt_p, sa_h, sa_p, sa_n,
    sb_b, sb_g, sb_n, sc_b, sc_g, sc_n, sd_h, sd_p, sz_b, sz_h, sz_p, sbias_h, sbias_p,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b, h, pb = program_id64(0), program_id64(1), program_id64(2)
    group = h // heads_per_group
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = offs_p < dim, offs_n < dstate
    mask = mask_p[:, None] & mask_n[None, :]
    state_ptr = S + b * ss_b + h * ss_h + offs_p[:, None] * ss_p + offs_n[None, :] * ss_n
    state = tl.load(state_ptr, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + b * sx_b + h * sx_h + offs_p * sx_p, mask=mask_p, other=0.0).to(tl.float32)
    dt = tl.load(DT + b * sdt_b + h * sdt_h + offs_p * sdt_p, mask=mask_p, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(BIAS + h * sbias_h + offs_p * sbias_p, mask=mask_p, other=0.0).to(tl.float32)
    if SOFTPLUS:
        dt = softplus(dt)
    A_tile = tl.load(A + h * sa_h + offs_p[:, None] * sa_p + offs_n[None, :] * sa_n, mask=mask, other=0.0)
    Bv = tl.load(B + b * sb_b + group * sb_g + offs_n * sb_n, mask=mask_n, other=0.0).to(tl.float32)
    Cv = tl.load(C + b * sc_b + group * sc_g + offs_n * sc_n, mask=mask_n, other=0.0).to(tl.float32)
    state = state * tl.exp(dt[:, None] * A_tile.to(tl.float32)) + (dt * x)[:, None] * Bv[None, :]
    tl.store(state_ptr, state, mask=mask)
    y = total(state * Cv[None, :], 1)
    if HAS_D:
        y += x * tl.load(D + h * sd_h + offs_p * sd_p, mask=mask_p, other=0.0).to(tl.float32)
    if HAS_Z:
        y *= silu(tl.load(Z + b * sz_b + h * sz_h + offs_p * sz_p, mask=mask_p, other=0.0).to(tl.float32))
    tl.store(Y + (b * tl.num_programs(1) + h) * dim + offs_p, y, mask=mask_p)


def _strides(x: torch.Tensor | None, count: int) -> tuple[int, ...]:
    return tuple(x.stride()) if x is not None else (0,) * count


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
) -> torch.Tensor:
    """Same contract as :func:`hybridlm.ops.selective_scan.selective_state_update_ref`: ``state [batch, dim,
    dstate]`` (Mamba-1) or ``[batch, heads, head_dim, dstate]`` (Mamba-2), updated in place; returns ``y`` like
    ``x``."""
    check_device("selective_state_update", state, x, dt, A, B, C, D, z, dt_bias)
    if state.dim() not in (3, 4):
        raise ValueError(f"selective_state_update: state must be 3-D or 4-D, got {tuple(state.shape)}")
    if B.dim() == 2:
        B, C = B.unsqueeze(1), C.unsqueeze(1)
    batch, groups, dstate = B.shape
    channels = tuple(state.shape[1:-1])  # (dim,) or (heads, head_dim)
    expected = {"state": (state, (batch, *channels, dstate)), "x": (x, (batch, *channels)), "dt": (dt, x.shape),
                "z": (z, x.shape), "A": (A, (*channels, dstate)), "C": (C, B.shape), "D": (D, channels),
                "dt_bias": (dt_bias, channels)}
    for name, (t, shape) in expected.items():
        if t is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"selective_state_update: {name} must be {tuple(shape)}, got {tuple(t.shape)}")
    if channels[0] % groups:
        raise ValueError(f"selective_state_update: {groups} groups do not divide {channels[0]} channels or heads")
    headless = len(channels) == 1
    if headless:  # Mamba-1: the channels of a group act as one head
        split = (groups, channels[0] // groups)
        state, A = state.unflatten(-2, split), A.unflatten(-2, split)
        x, dt, D, z, dt_bias = (t.unflatten(-1, split) if t is not None else None for t in (x, dt, D, z, dt_bias))
    heads, dim = state.shape[1], state.shape[2]
    y = new_buffer(x.shape, x)
    block_p = block(dim, minimum=1, maximum=max(1, 4096 // block(dstate, minimum=1)))
    launch(
        _state_update_kernel, lambda meta: (batch, heads, triton.cdiv(dim, meta["BLOCK_P"])),  # BLOCK_P: tuned
        state, x, dt, A, B, C, D if D is not None else x, z if z is not None else x,
        dt_bias if dt_bias is not None else x, y, dim, dstate, heads // groups,
        *state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(), *_strides(D, 2),
        *_strides(z, 3), *_strides(dt_bias, 2),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
        BLOCK_P=block_p, BLOCK_N=block(dstate, minimum=1),
    )
    return y.flatten(1, 2) if headless else y
