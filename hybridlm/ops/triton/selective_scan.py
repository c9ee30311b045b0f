"""Mamba-1 selective scan in Triton: :func:`hybridlm.ops.selective_scan.selective_scan_ref`, forward and backward.

One program owns a block of channels of one batch row, holds their ``[channels, dstate]`` state and walks the
sequence chunk by chunk. Inside a chunk all steps are scanned at once (``tl.associative_scan`` of the linear
recurrence ``h = a h + b``), then the chunk's entering state is added back weighted by the cumulative decay.
The forward saves the state entering each chunk; the backward walks the chunks in reverse, recomputes the
chunk's states from it, and scans the adjoint ``dh[t] = C[t] dy[t] + exp(dt[t+1] A) dh[t+1]`` the same way
(a forward scan of the time-reversed chunk: no reversed ``associative_scan``). Offsets are 64-bit.

Fused in the kernels: ``delta_bias``, softplus, the skip ``D u``, the gate ``silu(z)`` and all their gradients.
Plain torch: summing the per-row partial gradients of ``A``, ``D`` and ``delta_bias`` over the batch. ``dB`` and
``dC`` (shared by the channels of a group) are accumulated with atomic adds, so their last bits may vary from
run to run on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    block,
    cdiv,
    check_device,
    flip_rows,
    launch,
    new_buffer,
    program_id64,
    sigmoid,
    silu,
    silu_grad,
    softplus,
    total,
    tuned,
)

_CHUNK = 16
_TILE_ELEMENTS = 2048  # chunk x channels x dstate held by one program (untuned)


@triton.jit
def _linear_recurrence(a1, b1, a2, b2):
    """Compose ``h -> a1 h + b1`` then ``h -> a2 h + b2``."""
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _load_dt(DELTA, BIAS, offs_t, offs_d, mask, sdt_d, sdt_t, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """The step sizes ``[chunk, channels]`` (0 where masked, so a padded step leaves the state as it is) and the
    raw values before softplus."""
    raw = tl.load(DELTA + offs_t[:, None] * sdt_t + offs_d[None, :] * sdt_d, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw += tl.load(BIAS + offs_d).to(tl.float32)[None, :]
    dt = raw
    if SOFTPLUS:
        dt = softplus(raw)
    return tl.where(mask, dt, 0.0), raw


@triton.jit
def _chunk_states(h0, u, dt, A, Bt):
    """States ``[chunk, channels, dstate]`` of one chunk entered with ``h0``, and the input terms ``dt u B``."""
    a = tl.exp(dt[:, :, None] * A[None, :, :])
    drive = (dt * u)[:, :, None] * Bt[:, None, :]
    decay, local = tl.associative_scan((a, drive), 0, _linear_recurrence)
    return local + decay * h0[None, :, :], drive, a


@triton.jit
def _row(x, index, BLOCK_T: tl.constexpr):
    """``x[index]`` of a ``[chunk, channels, dstate]`` tile."""
    rows = tl.arange(0, BLOCK_T)[:, None, None]
    return total(tl.where(rows == index, x, 0.0), 0)


# BLOCK_D: fewer channels per program, more programs. Each choice is clamped to the launch's (a power of two
# dividing the group's channels), so a block still never spans two groups of B, C
@tuned((2, 1), (4, 1), (8, 1), key=["dim", "dstate"], blocks={"BLOCK_D": (2, 4, 8)})
@triton.jit
def _scan_fwd_kernel(
    U, DELTA, A, B, C, D, Z, BIAS, INIT, Y, FINAL, STATES,
    time, dim, per_group, dstate,
    su_b, su_d, su_t, sdt_b, sdt_d, sdt_t, sb_b, sb_g, sb_n, sb_t, sc_b, sc_g, sc_n, sc_t, sz_b, sz_d, sz_t,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_INIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b, pd = program_id64(0), program_id64(1)
    offs_d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    mask_n = offs_n < dstate
    group = pd * BLOCK_D // per_group
    state_offs = (b * dim + offs_d[:, None]) * dstate + offs_n[None, :]
    A_tile = tl.load(A + offs_d[:, None] * dstate + offs_n[None, :], mask=mask_n[None, :], other=0.0).to(tl.float32)
    if HAS_INIT:
        h = tl.load(INIT + state_offs, mask=mask_n[None, :], other=0.0).to(tl.float32)
    else:
        h = tl.full((BLOCK_D, BLOCK_N), 0.0, tl.float32)
    U += b * su_b
    DELTA += b * sdt_b
    B += b * sb_b + group * sb_g
    C += b * sc_b + group * sc_g
    n_chunks = cdiv(time, BLOCK_T)
    for ci in range(0, n_chunks):
        tl.store(STATES + ((b * n_chunks + ci) * dim + offs_d[:, None]) * dstate + offs_n[None, :], h,
                 mask=mask_n[None, :])
        offs_t = (ci * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask_t = offs_t < time
        mask = mask_t[:, None] & (offs_d[None, :] < dim)
        u = tl.load(U + offs_t[:, None] * su_t + offs_d[None, :] * su_d, mask=mask, other=0.0).to(tl.float32)
        dt, _ = _load_dt(DELTA, BIAS, offs_t, offs_d, mask, sdt_d, sdt_t, HAS_BIAS, SOFTPLUS)
        mask_tn = mask_t[:, None] & mask_n[None, :]
        Bt = tl.load(B + offs_t[:, None] * sb_t + offs_n[None, :] * sb_n, mask=mask_tn, other=0.0).to(tl.float32)
        Ct = tl.load(C + offs_t[:, None] * sc_t + offs_n[None, :] * sc_n, mask=mask_tn, other=0.0).to(tl.float32)
        hs, _, _ = _chunk_states(h, u, dt, A_tile, Bt)
        y = total(hs * Ct[:, None, :], 2)
        if HAS_D:
            y += tl.load(D + offs_d).to(tl.float32)[None, :] * u
        if HAS_Z:
            z = tl.load(Z + b * sz_b + offs_t[:, None] * sz_t + offs_d[None, :] * sz_d, mask=mask, other=0.0)
            y *= silu(z.to(tl.float32))
        tl.store(Y + (b * dim + offs_d[None, :]) * time + offs_t[:, None], y, mask=mask)
        h = _row(hs, BLOCK_T - 1, BLOCK_T)  # padded steps leave the state unchanged
    tl.store(FINAL + state_offs, h, mask=mask_n[None, :])


@tuned((4, 1), (8, 1), key=["dim", "dstate"], blocks={"BLOCK_D": (2, 4, 8)},
       reset_to_zero=["DB", "DC"])  # 2 warps spill
@triton.jit
def _scan_bwd_kernel(
    U, DELTA, A, B, C, D, Z, BIAS, STATES, DOUT, DFINAL,
    DU, DDELTA, DZ, DB, DC, DA, DD, DBIAS, DINIT,
    time, dim, per_group, dstate, n_groups,
    su_b, su_d, su_t, sdt_b, sdt_d, sdt_t, sb_b, sb_g, sb_n, sb_t, sc_b, sc_g, sc_n, sc_t, sz_b, sz_d, sz_t,
    so_b, so_d, so_t,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_T: tl.constexpr,
):
    """Gradients of one channel block of one batch row; ``dB, dC`` are added atomically, ``dA, dD, dbias``
    written per batch row."""
    b, pd = program_id64(0), program_id64(1)
    offs_d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    mask_n = offs_n < dstate
    group = pd * BLOCK_D // per_group
    state_offs = (b * dim + offs_d[:, None]) * dstate + offs_n[None, :]
    A_tile = tl.load(A + offs_d[:, None] * dstate + offs_n[None, :], mask=mask_n[None, :], other=0.0).to(tl.float32)
    D_vec = tl.full((BLOCK_D,), 0.0, tl.float32)
    if HAS_D:
        D_vec = tl.load(D + offs_d).to(tl.float32)
    carry = tl.load(DFINAL + state_offs, mask=mask_n[None, :], other=0.0).to(tl.float32)  # d(loss)/d(state) so far
    dA = tl.full((BLOCK_D, BLOCK_N), 0.0, tl.float32)
    dD = tl.full((BLOCK_D,), 0.0, tl.float32)
    dbias = tl.full((BLOCK_D,), 0.0, tl.float32)
    U += b * su_b
    DELTA += b * sdt_b
    B += b * sb_b + group * sb_g
    C += b * sc_b + group * sc_g
    rows = tl.arange(0, BLOCK_T)
    n_chunks = cdiv(time, BLOCK_T)
    for i in range(0, n_chunks):
        ci = n_chunks - 1 - i
        offs_t = (ci * BLOCK_T + rows).to(tl.int64)
        mask_t = offs_t < time
        mask = mask_t[:, None] & (offs_d[None, :] < dim)
        mask_tn = mask_t[:, None] & mask_n[None, :]
        u = tl.load(U + offs_t[:, None] * su_t + offs_d[None, :] * su_d, mask=mask, other=0.0).to(tl.float32)
        dt, raw = _load_dt(DELTA, BIAS, offs_t, offs_d, mask, sdt_d, sdt_t, HAS_BIAS, SOFTPLUS)
        Bt = tl.load(B + offs_t[:, None] * sb_t + offs_n[None, :] * sb_n, mask=mask_tn, other=0.0).to(tl.float32)
        Ct = tl.load(C + offs_t[:, None] * sc_t + offs_n[None, :] * sc_n, mask=mask_tn, other=0.0).to(tl.float32)
        h0 = tl.load(STATES + ((b * n_chunks + ci) * dim + offs_d[:, None]) * dstate + offs_n[None, :],
                     mask=mask_n[None, :], other=0.0)
        hs, drive, a = _chunk_states(h0, u, dt, A_tile, Bt)

        dy = tl.load(DOUT + b * so_b + offs_t[:, None] * so_t + offs_d[None, :] * so_d, mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        out_offs = (b * dim + offs_d[None, :]) * time + offs_t[:, None]
        if HAS_Z:
            z = tl.load(Z + b * sz_b + offs_t[:, None] * sz_t + offs_d[None, :] * sz_d, mask=mask, other=0.0)
            z = z.to(tl.float32)
            y = total(hs * Ct[:, None, :], 2) + D_vec[None, :] * u
            tl.store(DZ + out_offs, dy * y * silu_grad(z), mask=mask)
            dy = dy * silu(z)

        # adjoint: dh[t] = C[t] dy[t] + exp(dt[t+1] A) dh[t+1], the carry entering from the next chunk
        next_mask = mask & (offs_t[:, None] + 1 < time) & (rows[:, None] < BLOCK_T - 1)
        dt_next, _ = _load_dt(DELTA, BIAS, offs_t + 1, offs_d, next_mask, sdt_d, sdt_t, HAS_BIAS, SOFTPLUS)
        a_next = tl.exp(dt_next[:, :, None] * A_tile[None, :, :])
        # scanned backwards in time as a forward scan between flips (see flip_rows); dh: [chunk, channels, dstate]
        decay, local = tl.associative_scan(
            (flip_rows(a_next, BLOCK_T, LOG2_T, BLOCK_D, BLOCK_N),
             flip_rows(Ct[:, None, :] * dy[:, :, None], BLOCK_T, LOG2_T, BLOCK_D, BLOCK_N)), 0, _linear_recurrence)
        dh = flip_rows(local + decay * carry[None, :, :], BLOCK_T, LOG2_T, BLOCK_D, BLOCK_N)

        before = hs - drive  # exp(dt A) h[t-1]
        ddt = tl.where(mask, total(dh * (A_tile[None, :, :] * before + Bt[:, None, :] * u[:, :, None]), 2), 0.0)
        dA += total(dh * before * dt[:, :, None], 0)
        du = dt * total(dh * Bt[:, None, :], 2) + D_vec[None, :] * dy
        dD += total(dy * u, 0)
        if SOFTPLUS:
            ddt = ddt * sigmoid(raw)
        dbias += total(ddt, 0)
        tl.store(DU + out_offs, du, mask=mask)
        tl.store(DDELTA + out_offs, ddt, mask=mask)
        group_offs = ((b * n_groups + group) * dstate + offs_n[None, :]) * time + offs_t[:, None]
        # summed over the block's channels first; relaxed: only the sums matter, not the order of the adds
        tl.atomic_add(DB + group_offs, total(dh * (dt * u)[:, :, None], 1), mask=mask_tn, sem="relaxed")
        tl.atomic_add(DC + group_offs, total(hs * dy[:, :, None], 1), mask=mask_tn, sem="relaxed")
        carry = _row(a * dh, 0, BLOCK_T)
    tl.store(DINIT + state_offs, carry, mask=mask_n[None, :])
    tl.store(DA + state_offs, dA, mask=mask_n[None, :])
    tl.store(DD + b * dim + offs_d, dD)
    tl.store(DBIAS + b * dim + offs_d, dbias)


def _channel_block(per_group: int, block_t: int, block_n: int) -> int:
    """The widest power-of-two channel block inside one group (so it shares B and C) that fits the tile."""
    width = per_group & -per_group  # largest power of two dividing per_group
    return max(1, min(width, 16, _TILE_ELEMENTS // (block_t * block_n)))


def _shape_options(u, B, dstate, block_t):
    per_group = u.shape[1] // B.shape[1]
    block_n = block(dstate, minimum=1)
    return per_group, dict(BLOCK_T=block_t, BLOCK_D=_channel_block(per_group, block_t, block_n), BLOCK_N=block_n)


def _dummy(x, fallback):
    """A stand-in pointer for an absent optional input (the kernel never reads it)."""
    return x if x is not None else fallback


def _packed(x):
    """Small per-channel tensors are read as contiguous arrays."""
    return x.contiguous() if x is not None else None


class _SelectiveScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, initial_state, softplus: bool, block_t: int):
        batch, dim, time = u.shape
        dstate = A.shape[1]
        per_group, blocks = _shape_options(u, B, dstate, block_t)
        flags = dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=softplus)
        y = new_buffer((batch, dim, time), u)
        final = new_buffer((batch, dim, dstate), u, torch.float32)
        states = new_buffer((batch, triton.cdiv(time, block_t), dim, dstate), u, torch.float32)
        launch(
            _scan_fwd_kernel, lambda meta: (batch, dim // meta["BLOCK_D"]),  # BLOCK_D: tuned on the GPU
            u, delta, A.contiguous(), B, C, _dummy(_packed(D), u), _dummy(z, u), _dummy(_packed(delta_bias), u),
            _dummy(_packed(initial_state), u), y, final, states, time, dim, per_group, dstate,
            *u.stride(), *delta.stride(), *B.stride(), *C.stride(), *_dummy(z, u).stride(),
            HAS_INIT=initial_state is not None, **flags, **blocks,
        )
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, states)
        ctx.flags, ctx.blocks = flags, blocks
        return y, final

    @staticmethod
    def backward(ctx, dy, d_final):
        u, delta, A, B, C, D, z, delta_bias, initial_state, states = ctx.saved_tensors
        batch, dim, time = u.shape
        n_groups, dstate = B.shape[1], A.shape[1]
        per_group = dim // n_groups
        du, d_delta = new_buffer(u.shape, u, torch.float32), new_buffer(u.shape, u, torch.float32)
        dz = new_buffer(u.shape, u, torch.float32) if z is not None else None
        dB = torch.zeros(batch, n_groups, dstate, time, device=u.device, dtype=torch.float32)
        dC = torch.zeros_like(dB)
        dA = new_buffer((batch, dim, dstate), u, torch.float32)
        dD, d_bias = new_buffer((batch, dim), u, torch.float32), new_buffer((batch, dim), u, torch.float32)
        d_init = new_buffer((batch, dim, dstate), u, torch.float32)
        launch(
            _scan_bwd_kernel, lambda meta: (batch, dim // meta["BLOCK_D"]),
            u, delta, A.contiguous(), B, C, _dummy(_packed(D), u), _dummy(z, u), _dummy(_packed(delta_bias), u),
            states, dy,
            d_final.contiguous(), du, d_delta, _dummy(dz, du), dB, dC, dA, dD, d_bias, d_init,
            time, dim, per_group, dstate, n_groups,
            *u.stride(), *delta.stride(), *B.stride(), *C.stride(), *_dummy(z, u).stride(), *dy.stride(),
            **ctx.flags, **ctx.blocks, LOG2_T=ctx.blocks["BLOCK_T"].bit_length() - 1,
        )
        return (
            du.to(u.dtype), d_delta.to(delta.dtype), dA.sum(0).to(A.dtype), dB.to(B.dtype), dC.to(C.dtype),
            dD.sum(0).to(D.dtype) if D is not None else None, dz.to(z.dtype) if z is not None else None,
            d_bias.sum(0).to(delta_bias.dtype) if delta_bias is not None else None,
            d_init.to(initial_state.dtype) if initial_state is not None else None, None, None,
        )


def _check(u, delta, A, B, C, D, z, delta_bias, initial_state):
    batch, dim, time = u.shape
    dstate = A.shape[-1]
    expected = {
        "delta": (delta, (batch, dim, time)), "A": (A, (dim, dstate)), "B": (B, (batch, B.shape[1], dstate, time)),
        "C": (C, (batch, B.shape[1], dstate, time)), "D": (D, (dim,)), "z": (z, (batch, dim, time)),
        "delta_bias": (delta_bias, (dim,)), "initial_state": (initial_state, (batch, dim, dstate)),
    }
    for name, (x, shape) in expected.items():
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"selective_scan: {name} must be {shape} for u {tuple(u.shape)}, got {tuple(x.shape)}")
    if dim % B.shape[1]:
        raise ValueError(f"selective_scan: {B.shape[1]} groups do not divide dim={dim}")
    check_device("selective_scan", u, delta, A, B, C, D, z, delta_bias, initial_state)


def _with_groups(x: torch.Tensor, name: str) -> torch.Tensor:
    """``[batch, dstate, time]`` -> ``[batch, 1, dstate, time]`` (a view); 4-D passes through."""
    if x.dim() not in (3, 4):
        raise ValueError(f"selective_scan: {name} must be [batch, dstate, time] or [batch, groups, dstate, time]")
    return x.unsqueeze(1) if x.dim() == 3 else x


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    *,
    initial_state: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`hybridlm.ops.selective_scan.selective_scan_ref`.

    ``chunk_size`` (default 16) is rounded up to a power of two; it changes only the rounding.
    """
    grouped_B, grouped_C = _with_groups(B, "B"), _with_groups(C, "C")
    _check(u, delta, A, grouped_B, grouped_C, D, z, delta_bias, initial_state)
    y, final = _SelectiveScan.apply(
        u, delta, A, grouped_B, grouped_C, D, z, delta_bias, initial_state, delta_softplus,
        block(chunk_size or _CHUNK, minimum=1),
    )
    return y, final
