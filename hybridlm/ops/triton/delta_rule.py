"""The gated delta rule in Triton (forward and backward): :func:`hybridlm.ops.delta_rule.gated_delta_rule_ref`'s
contract, per-head or per-channel (KDA) gates, value heads sharing key heads, packed sequences.

A recurrent kernel: one program per (sequence, value head, block of value columns) keeps its ``[dim_k,
block_v]`` slice of the state in registers and steps through time (the delta rule's columns evolve
independently, so value blocks need no communication). Each step is elementwise products and reductions; no
tile product, so nothing depends on ``tl.dot``'s minimum tile sizes. The forward also writes the state at every
``CHUNK``-th token; the backward walks the chunks from the last, recomputes the states inside one chunk from its
checkpoint into a scratch buffer, then steps back through it. Offsets are int64.

Per step (``S [dim_k, dim_v]``, ``a = exp(g)``)::

    S' = diag(a) S;  w = v - S'^T k;  u = beta w;  S = S' + k u^T;  o = S^T (scale q)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.delta_rule import _check
from hybridlm.ops.ssd import packed_sequences
from hybridlm.ops.triton._common import block, check_device, launch, new_buffer, program_id64, total

CHUNK = 64  # tokens between state checkpoints (the backward's recomputation length)
STATE_TILE = 4096  # most state elements per program (a value block's tile; registers on the GPU)


@triton.jit
def _coordinates(cu_seqlens, T, H: tl.constexpr, GROUP: tl.constexpr, PACKED: tl.constexpr):
    """This program's value block, sequence, value head, key head, first token and length."""
    i_v, i_nh = program_id64(0), program_id64(1)
    i_n, i_h = i_nh // H, i_nh % H
    if PACKED:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos, length = i_n * T, T
    return i_v, i_nh, i_h, i_h // GROUP, bos, length


@triton.jit
def _inputs(q, k, v, g, beta, tok, i_h, i_hk, offs_k, offs_v, mask_k, mask_v, scale,
            H: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, CHANNEL_GATE: tl.constexpr):
    """Token ``tok``'s scaled query, key ``[BK]``, value ``[BV]``, decay factor and beta, in fp32."""
    b_q = tl.load(q + (tok * HK + i_hk) * DK + offs_k, mask=mask_k, other=0).to(tl.float32) * scale
    b_k = tl.load(k + (tok * HK + i_hk) * DK + offs_k, mask=mask_k, other=0).to(tl.float32)
    b_v = tl.load(v + (tok * H + i_h) * DV + offs_v, mask=mask_v, other=0).to(tl.float32)
    if CHANNEL_GATE:
        b_a = tl.exp(tl.load(g + (tok * H + i_h) * DK + offs_k, mask=mask_k, other=0).to(tl.float32))[:, None]
    else:
        b_a = tl.exp(tl.load(g + tok * H + i_h).to(tl.float32))
    b_beta = tl.load(beta + tok * H + i_h).to(tl.float32)
    return b_q, b_k, b_v, b_a, b_beta


@triton.jit
def _fwd_kernel(q, k, v, g, beta, h0, o, ht, checkpoints, cu_seqlens, scale, T, NC,
                H: tl.constexpr, HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, CHUNK_LEN: tl.constexpr, CHANNEL_GATE: tl.constexpr,
                PACKED: tl.constexpr):
    i_v, i_nh, i_h, i_hk, bos, length = _coordinates(cu_seqlens, T, H, GROUP, PACKED)
    offs_k, offs_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    state_offs = offs_k[:, None] * DV + offs_v[None, :]
    state_mask = mask_k[:, None] & mask_v[None, :]
    b_S = tl.load(h0 + i_nh * DK * DV + state_offs, mask=state_mask, other=0).to(tl.float32)  # [BK, BV]
    for t in range(0, length):
        if t % CHUNK_LEN == 0:  # the state entering each chunk, for the backward
            tl.store(checkpoints + (i_nh * NC + t // CHUNK_LEN) * DK * DV + state_offs, b_S, mask=state_mask)
        tok = bos + t
        b_q, b_k, b_v, b_a, b_beta = _inputs(q, k, v, g, beta, tok, i_h, i_hk, offs_k, offs_v, mask_k, mask_v,
                                            scale, H, HK, DK, DV, CHANNEL_GATE)
        b_S = b_S * b_a
        b_u = b_beta * (b_v - total(b_k[:, None] * b_S, 0))  # [BV]
        b_S = b_S + b_k[:, None] * b_u[None, :]
        tl.store(o + (tok * H + i_h) * DV + offs_v, total(b_q[:, None] * b_S, 0), mask=mask_v)
    tl.store(ht + i_nh * DK * DV + state_offs, b_S, mask=state_mask)


@triton.jit
def _bwd_kernel(q, k, v, g, beta, checkpoints, do, dht, scratch, dq, dk, dv, dg, dbeta, dh0, cu_seqlens, scale, T,
                TOKENS, NC, NSH, H: tl.constexpr, HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr,
                DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHUNK_LEN: tl.constexpr,
                CHANNEL_GATE: tl.constexpr, PACKED: tl.constexpr):
    """Gradients per value head and value block (``dq, dk, dg, dbeta``: partial sums over the value blocks,
    ``[n_value_blocks, tokens, heads, ...]``; ``dv`` and ``dh0`` complete)."""
    i_v, i_nh, i_h, i_hk, bos, length = _coordinates(cu_seqlens, T, H, GROUP, PACKED)
    offs_k, offs_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    state_offs = offs_k[:, None] * DV + offs_v[None, :]
    state_mask = mask_k[:, None] & mask_v[None, :]
    tile = tl.arange(0, BK)[:, None] * BV + tl.arange(0, BV)[None, :]
    mine = scratch + (i_v * NSH + i_nh) * CHUNK_LEN * BK * BV  # this program's scratch: CHUNK_LEN states
    part = i_v * TOKENS  # the first row of this value block's partial sums (rows: all tokens laid end to end)
    b_dS = tl.load(dht + i_nh * DK * DV + state_offs, mask=state_mask, other=0).to(tl.float32)
    n_chunks = (length + CHUNK_LEN - 1) // CHUNK_LEN
    for back in range(0, n_chunks):
        c = n_chunks - 1 - back
        start = c * CHUNK_LEN
        n = tl.minimum(CHUNK_LEN, length - start)
        b_S = tl.load(checkpoints + (i_nh * NC + c) * DK * DV + state_offs, mask=state_mask, other=0)
        for j in range(0, n):  # recompute the states entering each token of the chunk
            tl.store(mine + j * BK * BV + tile, b_S)
            b_q, b_k, b_v, b_a, b_beta = _inputs(q, k, v, g, beta, bos + start + j, i_h, i_hk, offs_k, offs_v,
                                                mask_k, mask_v, scale, H, HK, DK, DV, CHANNEL_GATE)
            b_S = b_S * b_a
            b_S = b_S + b_k[:, None] * (b_beta * (b_v - total(b_k[:, None] * b_S, 0)))[None, :]
        tl.debug_barrier()
        for jj in range(0, n):
            j = n - 1 - jj
            tok = bos + start + j
            b_q, b_k, b_v, b_a, b_beta = _inputs(q, k, v, g, beta, tok, i_h, i_hk, offs_k, offs_v, mask_k, mask_v,
                                                scale, H, HK, DK, DV, CHANNEL_GATE)
            b_Sp = tl.load(mine + j * BK * BV + tile) * b_a  # S' = diag(a) S_prev
            b_w = b_v - total(b_k[:, None] * b_Sp, 0)  # [BV]
            b_u = b_beta * b_w
            b_do = tl.load(do + (tok * H + i_h) * DV + offs_v, mask=mask_v, other=0).to(tl.float32)
            b_dS += b_q[:, None] * b_do[None, :]
            b_dq = scale * total((b_Sp + b_k[:, None] * b_u[None, :]) * b_do[None, :], 1)  # [BK]
            b_du = total(b_dS * b_k[:, None], 0)  # [BV]
            b_dk = total(b_dS * b_u[None, :], 1) - b_beta * total(b_Sp * b_du[None, :], 1)
            b_dSp = b_dS - b_beta * b_k[:, None] * b_du[None, :]
            row = ((part + tok) * H + i_h)
            tl.store(dq + row * DK + offs_k, b_dq, mask=mask_k)
            tl.store(dk + row * DK + offs_k, b_dk, mask=mask_k)
            tl.store(dv + (tok * H + i_h) * DV + offs_v, b_beta * b_du, mask=mask_v)
            tl.store(dbeta + row, total(b_du * b_w, 0))
            if CHANNEL_GATE:
                tl.store(dg + row * DK + offs_k, total(b_Sp * b_dSp, 1), mask=mask_k)
            else:
                tl.store(dg + row, total(total(b_Sp * b_dSp, 1), 0))
            b_dS = b_dSp * b_a
        tl.debug_barrier()
    tl.store(dh0 + i_nh * DK * DV + state_offs, b_dS, mask=state_mask)


def _layout(q, k, v, log_gate, beta, initial_state, cu_seqlens):
    """Contiguous inputs, fp32 initial states ``[sequences, heads, dim_k, dim_v]`` and the launch settings."""
    batch, time, heads, dim_v = v.shape
    key_heads, dim_k = q.shape[-2:]
    bounds = packed_sequences(batch, time, None, cu_seqlens)
    n_seqs = batch if bounds is None else len(bounds) - 1
    if log_gate is None:
        log_gate = beta.new_zeros(batch, time, heads)
    if initial_state is None:
        initial_state = v.new_zeros(n_seqs, heads, dim_k, dim_v, dtype=torch.float32)
    elif initial_state.shape != (n_seqs, heads, dim_k, dim_v):
        raise ValueError(f"gated_delta_rule: initial_state {tuple(initial_state.shape)} must be "
                         f"{(n_seqs, heads, dim_k, dim_v)} ({n_seqs} sequences)")
    longest = time if bounds is None else max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    width_k = block(dim_k, 1)
    settings = dict(H=heads, HK=key_heads, GROUP=heads // key_heads, DK=dim_k, DV=dim_v, BK=width_k,
                    BV=block(dim_v, 1, max(1, STATE_TILE // width_k)), CHUNK_LEN=CHUNK,
                    CHANNEL_GATE=log_gate.dim() == 4, PACKED=bounds is not None)
    seqlens = cu_seqlens.to(device=v.device, dtype=torch.int64).contiguous() if bounds is not None else v.new_zeros(1)
    tensors = [t.contiguous() for t in (q, k, v, log_gate, beta)]
    return tensors, initial_state.float().contiguous(), seqlens, n_seqs, triton.cdiv(max(longest, 1), CHUNK), settings


class _DeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_gate, beta, initial_state, scale, cu_seqlens, gate_given, state_given):
        (q, k, v, g, beta), h0, seqlens, n_seqs, n_chunks, settings = _layout(q, k, v, log_gate, beta,
                                                                           initial_state, cu_seqlens)
        batch, time, heads, dim_v = v.shape
        o = new_buffer((batch, time, heads, dim_v), v, torch.float32)
        final = new_buffer(h0.shape, h0)
        checkpoints = new_buffer((n_seqs, heads, n_chunks, *h0.shape[2:]), h0)
        grid = (triton.cdiv(dim_v, settings["BV"]), n_seqs * heads)
        launch(_fwd_kernel, grid, q, k, v, g, beta, h0, o, final, checkpoints, seqlens, scale, time, n_chunks,
               **settings)
        ctx.save_for_backward(q, k, v, g, beta, checkpoints, seqlens)
        ctx.scale, ctx.settings, ctx.grid = scale, settings, grid
        ctx.dtypes = (q.dtype, v.dtype, g.dtype, beta.dtype, initial_state.dtype if state_given else None)
        ctx.given = (gate_given, state_given)
        out_dtype = torch.promote_types(v.dtype, torch.float32)
        return o.to(v.dtype), final.to(out_dtype)

    @staticmethod
    def backward(ctx, do, d_final):
        q, k, v, g, beta, checkpoints, seqlens = ctx.saved_tensors
        settings, (n_blocks, n_seq_heads) = ctx.settings, ctx.grid
        batch, time, heads, dim_v = v.shape
        dim_k = q.shape[-1]
        dht = (d_final if d_final is not None else checkpoints.new_zeros(1).expand(
            n_seq_heads // heads, heads, dim_k, dim_v)).float().contiguous()
        do = (do if do is not None else torch.zeros_like(v)).float().contiguous()
        scratch = new_buffer((n_blocks * n_seq_heads, CHUNK, settings["BK"], settings["BV"]), checkpoints)
        dq, dk = (new_buffer((n_blocks, batch, time, heads, dim_k), checkpoints) for _ in range(2))
        dv = new_buffer(v.shape, checkpoints)
        dg = new_buffer((n_blocks, *g.shape), checkpoints)
        dbeta = new_buffer((n_blocks, *beta.shape), checkpoints)
        dh0 = new_buffer(dht.shape, checkpoints)
        launch(_bwd_kernel, ctx.grid, q, k, v, g, beta, checkpoints, do, dht, scratch, dq, dk, dv, dg, dbeta, dh0,
               seqlens, ctx.scale, time, batch * time, checkpoints.shape[2], n_seq_heads,
               **settings)
        groups = (batch, time, settings["HK"], settings["GROUP"], dim_k)
        dq, dk = (d.sum(0).view(groups).sum(3) for d in (dq, dk))  # over value blocks, then each key head's group
        q_dtype, v_dtype, g_dtype, beta_dtype, state_dtype = ctx.dtypes
        gate_given, state_given = ctx.given
        return (dq.to(q_dtype), dk.to(q_dtype), dv.to(v_dtype), dg.sum(0).to(g_dtype) if gate_given else None,
                dbeta.sum(0).to(beta_dtype), dh0.to(state_dtype) if state_given else None, None, None, None, None)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gate: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`hybridlm.ops.delta_rule.gated_delta_rule_ref` (``chunk_size`` changes nothing
    here: the kernel is recurrent). Differentiable in every tensor argument."""
    check_device("gated_delta_rule", q, k, v, log_gate, beta, initial_state)
    _check(q, k, v, log_gate, beta, initial_state if cu_seqlens is None else None)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _DeltaRule.apply(q, k, v, log_gate, beta, initial_state, scale, cu_seqlens, log_gate is not None,
                            initial_state is not None)
