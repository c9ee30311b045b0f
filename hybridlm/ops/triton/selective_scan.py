"""Mamba-1 selective scan in Triton: :func:`hybridlm.ops.selective_scan.selective_scan_ref`, forward and backward.

One program owns a block of channels of one batch row, holds their ``[channels, dstate]`` state and walks the
sequence chunk by chunk (packed sequences, batch 1: that one row, each sequence restarting at its first token
from its own initial state, see :mod:`.selective_scan_steps`). Inside a chunk all steps are scanned at once
(``tl.associative_scan`` of the linear recurrence ``h = a h + b``), then the chunk's entering state is added
back weighted by the cumulative decay. The forward saves the state entering each chunk; the backward walks the
chunks in reverse, recomputes the chunk's states from it, and scans the adjoint ``dh[t] = C[t] dy[t] +
exp(dt[t+1] A) dh[t+1]`` the same way (a forward scan of the time-reversed chunk: no reversed
``associative_scan``). Offsets are 64-bit.

Fused in the kernels: ``delta_bias``, softplus, the skip ``D u``, the gate ``silu(z)`` and all their gradients.
Plain torch: summing the per-row partial gradients of ``A``, ``D`` and ``delta_bias`` over the batch. ``dB`` and
``dC`` (shared by the channels of a group) are accumulated with atomic adds, so their last bits may vary from
run to run on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.packing import check_initial_states, packed_sequences
from hybridlm.ops.triton._common import (
    Packing,
    block,
    cdiv,
    check_device,
    flip_rows,
    launch,
    new_buffer,
    packing_of,
    program_id64,
    sigmoid,
    silu,
    silu_grad,
    total,
    tuned,
)
from hybridlm.ops.triton.selective_scan_steps import _chunk_states, _linear_recurrence, _load_dt, _row, _sequence_edges

_CHUNK = 16
_TILE_ELEMENTS = 2048  # chunk x channels x dstate held by one program (untuned)


# BLOCK_D: fewer channels per program, more programs. Each choice is clamped to the launch's (a power of two
# dividing the group's channels), so a block still never spans two groups of B, C
@tuned((2, 1), (4, 1), (8, 1), key=["dim", "dstate"], blocks={"BLOCK_D": (2, 4, 8)})
@triton.jit
def _scan_fwd_kernel(
    U, DELTA, A, B, C, D, Z, BIAS, INIT, Y, FINAL, STATES, SEQ, CU,
    time, dim, per_group, dstate,
    su_b, su_d, su_t, sdt_b, sdt_d, sdt_t, sb_b, sb_g, sb_n, sb_t, sc_b, sc_g, sc_n, sc_t, sz_b, sz_d, sz_t,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_INIT: tl.constexpr, PACKED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Outputs and final states of one channel block of one batch row; packed (batch 1), the final state of each
    sequence is stored at its last token (an empty sequence's is left as the caller filled it)."""
    b, pd = program_id64(0), program_id64(1)
    offs_d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    mask_n = offs_n < dstate
    group = pd * BLOCK_D // per_group
    state_offs = (b * dim + offs_d[:, None]) * dstate + offs_n[None, :]
    A_tile = tl.load(A + offs_d[:, None] * dstate + offs_n[None, :], mask=mask_n[None, :], other=0.0).to(tl.float32)
    if HAS_INIT and not PACKED:
        h = tl.load(INIT + state_offs, mask=mask_n[None, :], other=0.0).to(tl.float32)
    else:  # (packed: the first token starts a sequence, from its own initial state)
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
        seq, first, last, restart = _sequence_edges(SEQ, CU, INIT, offs_t, mask_t, time, state_offs, mask_n,
                                                    dim * dstate, HAS_INIT, PACKED, BLOCK_T, BLOCK_D, BLOCK_N)
        hs, _, _, _ = _chunk_states(h, u, dt, A_tile, Bt, first, restart, PACKED)
        if PACKED:
            tl.store(FINAL + seq[:, None, None] * (dim * dstate) + state_offs[None, :, :], hs,
                     mask=last[:, None, None] & mask_n[None, None, :])
        y = total(hs * Ct[:, None, :], 2)
        if HAS_D:
            y += tl.load(D + offs_d).to(tl.float32)[None, :] * u
        if HAS_Z:
            z = tl.load(Z + b * sz_b + offs_t[:, None] * sz_t + offs_d[None, :] * sz_d, mask=mask, other=0.0)
            y *= silu(z.to(tl.float32))
        tl.store(Y + (b * dim + offs_d[None, :]) * time + offs_t[:, None], y, mask=mask)
        h = _row(hs, BLOCK_T - 1, BLOCK_T)  # padded steps leave the state unchanged
    if not PACKED:
        tl.store(FINAL + state_offs, h, mask=mask_n[None, :])


@tuned((4, 1), (8, 1), key=["dim", "dstate"], blocks={"BLOCK_D": (2, 4, 8)},
       reset_to_zero=["DB", "DC"])  # 2 warps spill
@triton.jit
def _scan_bwd_kernel(
    U, DELTA, A, B, C, D, Z, BIAS, STATES, DOUT, DFINAL, INIT, SEQ, CU,
    DU, DDELTA, DZ, DB, DC, DA, DD, DBIAS, DINIT,
    time, dim, per_group, dstate, n_groups,
    su_b, su_d, su_t, sdt_b, sdt_d, sdt_t, sb_b, sb_g, sb_n, sb_t, sc_b, sc_g, sc_n, sc_t, sz_b, sz_d, sz_t,
    so_b, so_d, so_t,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_INIT: tl.constexpr, PACKED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_T: tl.constexpr,
):
    """Gradients of one channel block of one batch row; ``dB, dC`` are added atomically, ``dA, dD, dbias``
    written per batch row. Packed (batch 1): each sequence's final-state gradient enters at its last token, and
    its initial state's gradient is stored at its first (with ``HAS_INIT``; an empty sequence's is left as the
    caller filled it)."""
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
    carry = tl.full((BLOCK_D, BLOCK_N), 0.0, tl.float32)  # d(loss)/d(state) so far
    if not PACKED:
        carry = tl.load(DFINAL + state_offs, mask=mask_n[None, :], other=0.0).to(tl.float32)
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
        seq, first, last, restart = _sequence_edges(SEQ, CU, INIT, offs_t, mask_t, time, state_offs, mask_n,
                                                    dim * dstate, HAS_INIT, PACKED, BLOCK_T, BLOCK_D, BLOCK_N)
        hs, drive, a, applied = _chunk_states(h0, u, dt, A_tile, Bt, first, restart, PACKED)

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
        direct = Ct[:, None, :] * dy[:, :, None]
        if PACKED:  # nothing flows back across a boundary; a sequence's final state is its last token's
            a_next = tl.where(last[:, None, None], 0.0, a_next)
            at = DFINAL + seq[:, None, None] * (dim * dstate) + state_offs[None, :, :]
            direct += tl.load(at, mask=last[:, None, None] & mask_n[None, None, :], other=0.0).to(tl.float32)
        # scanned backwards in time as a forward scan between flips (see flip_rows); dh: [chunk, channels, dstate]
        decay, local = tl.associative_scan(
            (flip_rows(a_next, BLOCK_T, LOG2_T, BLOCK_D, BLOCK_N),
             flip_rows(direct, BLOCK_T, LOG2_T, BLOCK_D, BLOCK_N)), 0, _linear_recurrence)
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
        if PACKED and HAS_INIT:  # a sequence's initial state entered as exp(dt A) h0 at its first token
            tl.store(DINIT + seq[:, None, None] * (dim * dstate) + state_offs[None, :, :], a * dh,
                     mask=first[:, None, None] & mask_n[None, None, :])
        carry = _row(applied * dh, 0, BLOCK_T)
    if not PACKED:
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
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, initial_state, softplus: bool, block_t: int,
                packing: Packing | None):
        batch, dim, time = u.shape
        dstate = A.shape[1]
        per_group, blocks = _shape_options(u, B, dstate, block_t)
        flags = dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=softplus,
                     PACKED=packing is not None)
        y = new_buffer((batch, dim, time), u)
        final = new_buffer((batch, dim, dstate), u, torch.float32)
        if packing is not None:  # the kernel writes the non-empty sequences'; an empty one keeps its initial state
            final = u.new_zeros(packing.n_seqs, dim, dstate, dtype=torch.float32) if initial_state is None \
                else initial_state.float().clone()
        seq, cu = packing if packing is not None else (u, u)  # (not read unpacked)
        states = new_buffer((batch, triton.cdiv(time, block_t), dim, dstate), u, torch.float32)
        launch(
            _scan_fwd_kernel, lambda meta: (batch, dim // meta["BLOCK_D"]),  # BLOCK_D: tuned on the GPU
            u, delta, A.contiguous(), B, C, _dummy(_packed(D), u), _dummy(z, u), _dummy(_packed(delta_bias), u),
            _dummy(_packed(initial_state), u), y, final, states, seq, cu, time, dim, per_group, dstate,
            *u.stride(), *delta.stride(), *B.stride(), *C.stride(), *_dummy(z, u).stride(),
            HAS_INIT=initial_state is not None, **flags, **blocks,
        )
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, states)
        ctx.flags, ctx.blocks, ctx.packing = flags, blocks, packing
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
        packing = ctx.packing
        seq, cu = packing if packing is not None else (u, u)
        # packed, the kernel writes the non-empty sequences'; an empty one's final state is its initial state
        d_init = new_buffer((batch, dim, dstate), u, torch.float32) if packing is None else d_final.float().clone()
        launch(
            _scan_bwd_kernel, lambda meta: (batch, dim // meta["BLOCK_D"]),
            u, delta, A.contiguous(), B, C, _dummy(_packed(D), u), _dummy(z, u), _dummy(_packed(delta_bias), u),
            states, dy, d_final.contiguous(), _dummy(_packed(initial_state), u), seq, cu,
            du, d_delta, _dummy(dz, du), dB, dC, dA, dD, d_bias, d_init,
            time, dim, per_group, dstate, n_groups,
            *u.stride(), *delta.stride(), *B.stride(), *C.stride(), *_dummy(z, u).stride(), *dy.stride(),
            **ctx.flags, **ctx.blocks, HAS_INIT=packing is not None and initial_state is not None,
            LOG2_T=ctx.blocks["BLOCK_T"].bit_length() - 1,
        )
        return (
            du.to(u.dtype), d_delta.to(delta.dtype), dA.sum(0).to(A.dtype), dB.to(B.dtype), dC.to(C.dtype),
            dD.sum(0).to(D.dtype) if D is not None else None, dz.to(z.dtype) if z is not None else None,
            d_bias.sum(0).to(delta_bias.dtype) if delta_bias is not None else None,
            d_init.to(initial_state.dtype) if initial_state is not None else None, None, None, None,
        )


def _check(u, delta, A, B, C, D, z, delta_bias, initial_state, n_states):
    batch, dim, time = u.shape
    dstate = A.shape[-1]
    expected = {
        "delta": (delta, (batch, dim, time)), "A": (A, (dim, dstate)), "B": (B, (batch, B.shape[1], dstate, time)),
        "C": (C, (batch, B.shape[1], dstate, time)), "D": (D, (dim,)), "z": (z, (batch, dim, time)),
        "delta_bias": (delta_bias, (dim,)), "initial_state": (initial_state, (n_states, dim, dstate)),
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
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`hybridlm.ops.selective_scan.selective_scan_ref`, packed sequences included.

    ``chunk_size`` (default 16) is rounded up to a power of two; it changes only the rounding.
    """
    bounds = packed_sequences(u.shape[0], u.shape[2], seq_idx, cu_seqlens)
    check_initial_states("selective_scan", bounds, initial_state)
    grouped_B, grouped_C = _with_groups(B, "B"), _with_groups(C, "C")
    _check(u, delta, A, grouped_B, grouped_C, D, z, delta_bias, initial_state,
           u.shape[0] if bounds is None else len(bounds) - 1)
    y, final = _SelectiveScan.apply(
        u, delta, A, grouped_B, grouped_C, D, z, delta_bias, initial_state, delta_softplus,
        block(chunk_size or _CHUNK, minimum=1), packing_of(bounds, u.device),
    )
    return y, final
