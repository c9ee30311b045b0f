"""Mamba-3 in Triton: the chunked scan on the kernels of :mod:`.chunked_scan`, and one fused decode step.

``mamba3_scan``: :func:`hybridlm.ops.mamba3.mamba3_scan_ref` through the shared
:func:`hybridlm.ops.mamba3.mamba3_through` with the Triton chunked scan (forward and backward: its five kernels and
their reversed forms). Plain torch around them, differentiated by autograd: the angles' cumulative sum, the rotation
of the biased keys and queries, the trapezoid's weights, the per-token correction and the output gate (elementwise
work and ``R x R`` products per token).

``mamba3_step``: one kernel per decode step, a program per (row, head) holding the whole ``[head_dim, d_state]``
state: the angle update, the rotation of q and k (each entry reads its pair partner's value), the trapezoidal
update with the previous token's key and x, the read-out, the D skip, the optional RMSNorm and SiLU gate, MIMO's
up and down projections; the four state tensors are written in place. Forward only: decoding does not train.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.declined import Declined
from hybridlm.ops.mamba3 import _check, mamba3_through
from hybridlm.ops.triton._common import block, check_device, launch, new_buffer, program_id64, sigmoid, silu, total
from hybridlm.ops.triton.chunked_scan import chunked_decay_scan
from hybridlm.ops.triton.chunks import scan_sequences

_MAX_TILE = 16384  # state elements one step program holds (head_dim 64 x d_state 256, 128 x 128)


def mamba3_scan(q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, *, D=None, z=None, mimo_v=None, mimo_z=None,
                mimo_o=None, norm_weight=None, norm_eps=1e-5, rope_pairs="interleaved", initial_state=None,
                chunk_size=64, seq_idx=None, cu_seqlens=None):
    """Same contract as :func:`hybridlm.ops.mamba3.mamba3_scan_ref`, packed sequences included."""
    check_device("mamba3_scan", q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, D, z, mimo_v, mimo_z, mimo_o,
                 norm_weight, *(initial_state or ()))
    scan_sequences(*v.shape[:2], v.device, seq_idx, cu_seqlens)  # checked as the reference checks them
    return mamba3_through(chunked_decay_scan, q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, D=D, z=z,
                          mimo_v=mimo_v, mimo_z=mimo_z, mimo_o=mimo_o, norm_weight=norm_weight, norm_eps=norm_eps,
                          rope_pairs=rope_pairs, initial_state=initial_state, chunk_size=chunk_size, seq_idx=seq_idx,
                          cu_seqlens=cu_seqlens)


@triton.jit
def _turned(X, BIAS, offs, partner, mask, turned, c, s, sign):
    """Entries ``offs`` of ``X + BIAS`` turned: each is ``x * cos + sign * partner * sin`` (cos 1, sin 0 for an
    entry outside the rotary part, whose partner is not read)."""
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + tl.load(BIAS + offs, mask=mask, other=0.0)
    other = tl.load(X + partner, mask=turned, other=0.0).to(tl.float32) \
        + tl.load(BIAS + partner, mask=turned, other=0.0)
    return x * c + sign * other * s


@triton.jit
def _angle(AS, ANG, index, mask, dt):
    """The accumulated angle after this token: ``theta + pi tanh(angle) dt``, reduced to [0, 2 pi)."""
    theta = tl.load(AS + index, mask=mask, other=0.0) + 3.141592653589793 * (
        2.0 * sigmoid(2.0 * tl.load(ANG + index, mask=mask, other=0.0).to(tl.float32)) - 1.0) * dt
    return theta - 6.283185307179586 * tl.floor(theta / 6.283185307179586)


@triton.jit
def _mamba3_step_kernel(
    Q, K, X, ADT, DT, TRAP, ANG, QB, KB, D, Z, MV, MZ, MO, NW, AS, S, KS, VS, Y,
    heads, dim, dstate, n_angles, heads_per_group, eps,
    RANK: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_MIMO: tl.constexpr, HAS_MZ: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr,
):
    # every tensor contiguous: q, k [b, R, g, n]; x, z, y, v state [b, h, p]; adt, dt, trap [b, h];
    # angles, angle state [b, h, A]; biases [h, R, n]; MIMO weights [h, R, p]; state [b, h, p, n]; k state [b, R, h, n]
    b, h = program_id64(0), program_id64(1)
    groups = heads // heads_per_group
    offs_p, offs_n = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    mask_p, mask_n = offs_p < dim, offs_n < dstate
    if INTERLEAVED:  # pairs (2i, 2i + 1)
        turned = offs_n < 2 * n_angles
        pair, partner = offs_n // 2, offs_n + 1 - 2 * (offs_n % 2)
        sign = tl.where(offs_n % 2 == 0, -1.0, 1.0)
    else:  # pairs (i, i + d_state / 2)
        half = dstate // 2
        second = (offs_n >= half) & (offs_n < half + n_angles)
        turned = (offs_n < n_angles) | second
        pair = tl.where(second, offs_n - half, offs_n)
        partner = tl.where(second, offs_n - half, offs_n + half)
        sign = tl.where(second, 1.0, -1.0)
    turned = turned & mask_n
    row = b * heads + h
    dt = tl.load(DT + row).to(tl.float32)
    theta = _angle(AS + row * n_angles, ANG + row * n_angles, pair, turned, dt)
    c, s = tl.where(turned, tl.cos(theta), 1.0), tl.where(turned, tl.sin(theta), 0.0)
    lam = sigmoid(tl.load(TRAP + row).to(tl.float32))
    alpha = tl.exp(tl.load(ADT + row).to(tl.float32))
    x = tl.load(X + row * dim + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    x_prev = tl.load(VS + row * dim + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    g = h // heads_per_group
    previous = tl.full((BLOCK_P, BLOCK_N), 0.0, tl.float32)
    own = tl.full((BLOCK_P, BLOCK_N), 0.0, tl.float32)
    for r in tl.static_range(RANK):
        k_turned = _turned(K + ((b * RANK + r) * groups + g) * dstate, KB + (h * RANK + r) * dstate, offs_n, partner,
                           mask_n, turned, c, s, sign)
        ks_ptr = KS + ((b * RANK + r) * heads + h) * dstate + offs_n
        k_prev = tl.load(ks_ptr, mask=mask_n, other=0.0).to(tl.float32)
        v_r, v_prev = x, x_prev
        if HAS_MIMO:
            up = tl.load(MV + (h * RANK + r) * dim + offs_p, mask=mask_p, other=0.0)
            v_r, v_prev = x * up, x_prev * up
        previous += v_prev[:, None] * k_prev[None, :]
        own += v_r[:, None] * k_turned[None, :]
        tl.store(ks_ptr, k_turned, mask=mask_n)  # (this program alone reads and writes this row and head)
    mask = mask_p[:, None] & mask_n[None, :]
    s_ptr = S + row * dim * dstate + offs_p[:, None] * dstate + offs_n[None, :]
    state = tl.load(s_ptr, mask=mask, other=0.0)
    state = alpha * (state + ((1.0 - lam) * dt) * previous) + (lam * dt) * own
    tl.store(s_ptr, state, mask=mask)
    y = tl.full((BLOCK_P,), 0.0, tl.float32)
    if HAS_Z:
        zv = tl.load(Z + row * dim + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    for r in tl.static_range(RANK):
        q_turned = _turned(Q + ((b * RANK + r) * groups + g) * dstate, QB + (h * RANK + r) * dstate, offs_n, partner,
                           mask_n, turned, c, s, sign)
        o = total(state * q_turned[None, :], 1)
        v_r = x
        if HAS_MIMO:
            v_r = x * tl.load(MV + (h * RANK + r) * dim + offs_p, mask=mask_p, other=0.0)
        if HAS_D:
            o += tl.load(D + h).to(tl.float32) * v_r
        if HAS_NORM:
            o = o / tl.sqrt(total(o * o, 0) / dim + eps) * tl.load(NW + h * dim + offs_p, mask=mask_p, other=0.0)
        if HAS_Z:
            gate = zv
            if HAS_MZ:
                gate = zv * tl.load(MZ + (h * RANK + r) * dim + offs_p, mask=mask_p, other=0.0)
            o *= silu(gate)
        if HAS_MIMO:
            o *= tl.load(MO + (h * RANK + r) * dim + offs_p, mask=mask_p, other=0.0)
        y += o
    tl.store(Y + row * dim + offs_p, y, mask=mask_p)
    tl.store(VS + row * dim + offs_p, x, mask=mask_p)
    offs_a = tl.arange(0, BLOCK_A)
    tl.store(AS + row * n_angles + offs_a, _angle(AS + row * n_angles, ANG + row * n_angles, offs_a,
                                                  offs_a < n_angles, dt), mask=offs_a < n_angles)


def mamba3_step(q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, angle_state, ssm_state, k_state, v_state, *,
                D=None, z=None, mimo_v=None, mimo_z=None, mimo_o=None, norm_weight=None, norm_eps=1e-5,
                rope_pairs="interleaved"):
    """Same contract as :func:`hybridlm.ops.mamba3.mamba3_step_ref`: the four state tensors updated in place;
    returns ``y`` like ``v``. Declines a state too large for one program, or state tensors that are not
    contiguous fp32 angle / SSM states."""
    _check(q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, mimo_v, mimo_o, rope_pairs, one_token=True)
    check_device("mamba3_step", q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, angle_state, ssm_state,
                 k_state, v_state, D, z, mimo_v, mimo_z, mimo_o, norm_weight)
    batch, heads, dim = v.shape
    rank, groups, dstate = q.shape[1:]
    block_p, block_n = block(dim, minimum=1), block(dstate, minimum=1)
    if block_p * block_n > _MAX_TILE:
        raise Declined(f"mamba3_step: a [{dim}, {dstate}] state per head is more than one program holds")
    states = (angle_state, ssm_state, k_state, v_state)
    if not all(t.is_contiguous() for t in states) or angle_state.dtype != torch.float32 \
            or ssm_state.dtype != torch.float32:
        raise Declined("mamba3_step: the state tensors must be contiguous, the angle and SSM states fp32")
    y = new_buffer(v.shape, v)
    inputs = [t.contiguous() if t is not None else None for t in (q, k, v, log_decay, dt, trap, angles)]
    weights = [t.float().contiguous() if t is not None else None
               for t in (q_bias, k_bias, D, z, mimo_v, mimo_z, mimo_o, norm_weight)]
    qb, kb, d, zz, mv, mz, mo, nw = weights
    launch(_mamba3_step_kernel, (batch, heads), *inputs, qb, kb, *(t if t is not None else qb for t in
                                                                   (d, zz, mv, mz, mo, nw)),
           *states, y, heads, dim, dstate, angles.shape[-1], heads // groups, float(norm_eps),
           RANK=rank, INTERLEAVED=rope_pairs == "interleaved", HAS_D=D is not None, HAS_Z=z is not None,
           HAS_MIMO=mimo_v is not None, HAS_MZ=mimo_z is not None and z is not None, HAS_NORM=norm_weight is not None,
           BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_A=block(angles.shape[-1], minimum=1))
    return y

