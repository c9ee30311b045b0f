"""Chunked scan with a scalar decay per head, in Triton: the kernels behind SSD and gated linear attention.

Computes what :func:`hybridlm.ops.ssd.chunked_decay_scan` computes::

    S[t] = exp(g[t]) * S[t-1] + v[t] (outer) k[t]        y[t] = S[t] @ q[t]

in four kernels: ``chunk_cumsum`` (log decay summed inside each chunk), ``chunk_state`` (the state each chunk
adds), ``state_passing`` (chunk to chunk, sequentially), ``chunk_scan`` (outputs: the intra-chunk decay-masked
product plus the entering state's contribution). Every kernel also runs in reversed time (``REVERSE``), and
the backward pass is these same kernels with roles swapped:

* ``dS`` entering each chunk from the right: ``chunk_state`` (reversed) of ``dy`` against ``q``, carried by
  ``state_passing`` (reversed), which also yields the initial state's gradient;
* ``dq = chunk_scan(dy, v, k, S^T)``, ``dk = chunk_scan_reversed(v, dy, q, dS^T)``,
  ``dv = chunk_scan_reversed(k, q, dy, dS)``;
* ``dg``: the gradient of the cumulative decay, ``q.dq - k.dk`` (plus ``dS . S`` at each chunk's last token),
  summed in reverse by ``chunk_cumsum`` (reversed).

Plain torch between kernels: those dot products per token, the sum of per-head ``dq, dk`` over the heads of a
group, and the chunk-end states ``dS . S`` (all elementwise). Chunks never cross a sequence, so fixed-length
batches and packed variable-length batches (one initial/final state per sequence) are the same code: a table of
chunks, each a batch row and a time range.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    block,
    cdiv,
    check_device,
    dot_dtype,
    launch,
    mm,
    new_buffer,
    program_id64,
    running_total,
    state_dot_dtype,
    tuned,
)
from .chunks import Chunks, packed_chunks, uniform_chunks

_MAX_BLOCK_K = 64  # the state dimension (dstate 128-256) in blocks: registers and shared memory stay bounded
_FP32_BLOCK_K = 32  # the same for fp32 inputs in the score and output kernels (see _score_blocks)


# --- kernels ----------------------------------------------------------------------------------------------


@triton.jit
def _chunk_cumsum_kernel(
    X, OUT, TABLE, n_chunks, time, sx_b, sx_t, sx_h, REVERSE: tl.constexpr, BLOCK_L: tl.constexpr
):
    """OUT[b, t, h] = sum of X over the chunk up to t (inclusive; from t to the chunk end when REVERSE)."""
    c, h = program_id64(0), program_id64(1)
    n_heads = tl.num_programs(1)
    row = tl.load(TABLE + c).to(tl.int64)
    start = tl.load(TABLE + n_chunks + c).to(tl.int64)
    end = tl.load(TABLE + 2 * n_chunks + c).to(tl.int64)
    t = start + tl.arange(0, BLOCK_L)
    mask = t < end
    x = tl.load(X + row * sx_b + t * sx_t + h * sx_h, mask=mask, other=0.0).to(tl.float32)
    total = running_total(x, 0, REVERSE)
    tl.store(OUT + (row * time + t) * n_heads + h, total, mask=mask)


@tuned((4, 2), (4, 3), (8, 3), key=["DK", "DV"])
@triton.jit
def _chunk_state_kernel(
    K, V, G, OUT, TABLE, n_chunks, time,
    sk_b, sk_t, sk_h, sk_d, k_ratio, sv_b, sv_t, sv_h, sv_d, v_ratio, DK, DV,
    REVERSE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """OUT[c, h] = sum_s w[s] v[s] (outer) k[s] over chunk c: w = the decay from s to the chunk end, or, when
    REVERSE, from the chunk start to s."""
    c, pid, kb = program_id64(0), tl.program_id(1), tl.program_id(2)
    n_vb = cdiv(DV, BLOCK_V)
    h, vb = pid // n_vb, pid % n_vb
    n_heads = tl.num_programs(1) // n_vb
    row = tl.load(TABLE + c).to(tl.int64)
    start = tl.load(TABLE + n_chunks + c).to(tl.int64)
    end = tl.load(TABLE + 2 * n_chunks + c).to(tl.int64)
    g_row = G + row * time * n_heads + h
    g_end = tl.load(g_row + (end - 1) * n_heads, mask=end > start, other=0.0)  # (a spare chunk: empty)
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_base = K + row * sk_b + (h // k_ratio) * sk_h + offs_k[None, :] * sk_d
    v_base = V + row * sv_b + (h // v_ratio) * sv_h + offs_v[None, :] * sv_d
    acc = tl.full((BLOCK_V, BLOCK_K), 0.0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        g = tl.load(g_row + offs_n * n_heads, mask=mask_n, other=0.0)
        if REVERSE:
            w = tl.exp(g)
        else:
            w = tl.exp(g_end - g)
        w = tl.where(mask_n, w, 0.0)
        k = tl.load(k_base + offs_n[:, None] * sk_t, mask=mask_n[:, None] & (offs_k[None, :] < DK), other=0.0)
        v = tl.load(v_base + offs_n[:, None] * sv_t, mask=mask_n[:, None] & (offs_v[None, :] < DV), other=0.0)
        acc += mm(tl.trans(v.to(tl.float32) * w[:, None]), k, DOT_DTYPE)
    out = OUT + ((c * n_heads + h) * DV + offs_v[:, None]) * DK + offs_k[None, :]
    tl.store(out, acc, mask=(offs_v[:, None] < DV) & (offs_k[None, :] < DK))


@triton.jit
def _state_passing_kernel(
    ADDED, G, INIT, OUT, FINAL, TABLE, SEQS, n_chunks, n_seqs, time, SIZE,
    HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Carry the state through the chunks of sequence s: OUT[c] is the state entering chunk c (in scan order),
    then state = exp(total decay of c) * state + ADDED[c]; FINAL[s] is the state after the last chunk."""
    s, h, pb = program_id64(0), program_id64(1), tl.program_id(2)
    n_heads = tl.num_programs(1)
    offs = pb * BLOCK + tl.arange(0, BLOCK)
    mask = offs < SIZE
    if HAS_INIT:
        state = tl.load(INIT + (s * n_heads + h) * SIZE + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        state = tl.full((BLOCK,), 0.0, tl.float32)
    first = tl.load(SEQS + s).to(tl.int64)
    last = tl.load(SEQS + n_seqs + s)
    for i in range(0, last - first):
        if REVERSE:
            c = last - 1 - i
        else:
            c = first + i
        tl.store(OUT + (c * n_heads + h) * SIZE + offs, state, mask=mask)
        row = tl.load(TABLE + c).to(tl.int64)
        end = tl.load(TABLE + 2 * n_chunks + c).to(tl.int64)
        decay = tl.exp(tl.load(G + (row * time + end - 1) * n_heads + h))
        state = decay * state + tl.load(ADDED + (c * n_heads + h) * SIZE + offs, mask=mask, other=0.0)
    tl.store(FINAL + (s * n_heads + h) * SIZE + offs, state, mask=mask)


@tuned((4, 2), (4, 3), (8, 3), key=["DK"])
@triton.jit
def _chunk_scores_kernel(
    Q, K, OUT, TABLE, n_chunks, sq_b, sq_t, sq_h, sq_d, sk_b, sk_t, sk_h, sk_d, DK, L,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """OUT[c, g, i, j] = q[start + i] . k[start + j] for j <= i (the causal half; tiles above it are not
    written) over chunk c and group g: once per group, read by every head of the group and every value block.
    OUT is [n_chunks, groups, L, L] fp32, L the longest chunk."""
    c, mb, pid = program_id64(0), tl.program_id(1), tl.program_id(2)
    n_nb = cdiv(L, BLOCK_N)
    grp, nb = pid // n_nb, pid % n_nb
    n_groups = tl.num_programs(2) // n_nb
    if nb * BLOCK_N > mb * BLOCK_M + BLOCK_M - 1:  # entirely above the diagonal
        return
    row = tl.load(TABLE + c).to(tl.int64)
    start = tl.load(TABLE + n_chunks + c).to(tl.int64)
    end = tl.load(TABLE + 2 * n_chunks + c).to(tl.int64)
    offs_i = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = start + offs_i < end, start + offs_j < end
    q_base = Q + row * sq_b + (start + offs_i[:, None]) * sq_t + grp * sq_h
    k_base = K + row * sk_b + (start + offs_j[:, None]) * sk_t + grp * sk_h
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, DK, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < DK
        q = tl.load(q_base + offs_k[None, :] * sq_d, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        k = tl.load(k_base + offs_k[None, :] * sk_d, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += mm(q, tl.trans(k), DOT_DTYPE)
    out = OUT + ((c * n_groups + grp) * L + offs_i[:, None]) * L + offs_j[None, :]
    tl.store(out, acc, mask=(offs_i[:, None] < L) & (offs_j[None, :] < L))


@tuned((4, 2), (8, 2), (8, 3), key=["DK", "DV"])
@triton.jit
def _chunk_scan_kernel(
    Q, K, V, S, G, X, W, P, OUT, TABLE, n_chunks, time,
    sq_b, sq_t, sq_h, sq_d, q_ratio, sk_b, sk_t, sk_h, sk_d, k_ratio, sv_b, sv_t, sv_h, sv_d, v_ratio,
    ss_c, ss_h, ss_v, ss_k, sx_b, sx_t, sx_h, sx_d, sw_h, sw_d, sp_c, sp_g, sp_m, sp_n, DK, DV,
    REVERSE: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_SCORES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_DTYPE: tl.constexpr, STATE_DOT_DTYPE: tl.constexpr,
):
    """OUT[t] = sum_{s <= t in the chunk} (q[t].k[s]) decay(s -> t) v[t] + decay(start -> t) S[c] q[t].

    When REVERSE, time runs backwards: s >= t, decay(t -> s), and S[c] arrives from the chunk's end. Tensors
    are [batch, time, heads or groups, dim] (strides given; head h reads group h // ratio); S is [chunk, head,
    DV, DK] through its strides, so a transposed state is a stride swap. OUT is [batch, time, head, DV], stored
    in its own dtype; with HAS_SKIP it also gets the skip term X[t] * W (X like OUT, W [head, DV] by strides).
    With HAS_SCORES the products q[t].k[s] are read from P (:func:`chunk_scores`, [chunk, group, t - start,
    s - start] by strides; its causal half) instead of computed per head and value block.
    """
    c, mb, pid = program_id64(0), tl.program_id(1), tl.program_id(2)
    n_vb = cdiv(DV, BLOCK_V)
    h, vb = pid // n_vb, pid % n_vb
    n_heads = tl.num_programs(2) // n_vb
    row = tl.load(TABLE + c).to(tl.int64)
    start = tl.load(TABLE + n_chunks + c).to(tl.int64)
    end = tl.load(TABLE + 2 * n_chunks + c).to(tl.int64)
    m0 = start + mb * BLOCK_M
    if m0 >= end:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_m = offs_m < end
    mask_v = offs_v < DV
    g_row = G + row * time * n_heads + h
    g_m = tl.load(g_row + offs_m * n_heads, mask=mask_m, other=0.0)
    q_base = Q + row * sq_b + offs_m[:, None] * sq_t + (h // q_ratio) * sq_h  # + k index * sq_d: [BLOCK_M, K]
    s_base = S + c * ss_c + h * ss_h + offs_v[None, :] * ss_v  # + k index * ss_k: [K, BLOCK_V], S^T

    acc = tl.full((BLOCK_M, BLOCK_V), 0.0, tl.float32)
    for k0 in range(0, DK, BLOCK_K):  # the state dimension in blocks of at most BLOCK_K (registers, shared memory)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < DK
        q = tl.load(q_base + offs_k[None, :] * sq_d, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        state = tl.load(s_base + offs_k[:, None] * ss_k, mask=mask_k[:, None] & mask_v[None, :], other=0.0)
        acc += mm(q, state, STATE_DOT_DTYPE)
    if REVERSE:
        w_state = tl.exp(tl.load(g_row + (end - 1) * n_heads) - g_m)
    else:
        w_state = tl.exp(g_m)
    acc = acc * w_state[:, None]

    if REVERSE:
        lo, hi = m0, end
    else:
        lo, hi = start, tl.minimum(m0 + BLOCK_M, end)
    k_base = K + row * sk_b + (h // k_ratio) * sk_h
    v_base = V + row * sv_b + (h // v_ratio) * sv_h + offs_v[None, :] * sv_d
    p_base = P + c * sp_c + (h // q_ratio) * sp_g
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        g_n = tl.load(g_row + offs_n * n_heads, mask=mask_n, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * sv_t, mask=mask_n[:, None] & mask_v[None, :], other=0.0)
        if REVERSE:
            keep = offs_n[None, :] >= offs_m[:, None]
            decay = tl.exp(g_n[None, :] - g_m[:, None])
        else:
            keep = offs_n[None, :] <= offs_m[:, None]
            decay = tl.exp(g_m[:, None] - g_n[None, :])
        keep = keep & mask_m[:, None] & mask_n[None, :]
        if HAS_SCORES:
            scores = tl.load(p_base + (offs_m[:, None] - start) * sp_m + (offs_n[None, :] - start) * sp_n,
                             mask=keep, other=0.0)
        else:
            scores = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for k0 in range(0, DK, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < DK
                q = tl.load(q_base + offs_k[None, :] * sq_d, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                k = tl.load(k_base + offs_n[:, None] * sk_t + offs_k[None, :] * sk_d,
                            mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                scores += mm(q, tl.trans(k), DOT_DTYPE)
        p = tl.where(keep, scores * decay, 0.0)
        acc += mm(p, v, DOT_DTYPE)
    mask = mask_m[:, None] & mask_v[None, :]
    if HAS_SKIP:
        x = tl.load(X + row * sx_b + offs_m[:, None] * sx_t + h * sx_h + offs_v[None, :] * sx_d, mask=mask, other=0.0)
        acc += x.to(tl.float32) * tl.load(W + h * sw_h + offs_v * sw_d, mask=mask_v, other=0.0).to(tl.float32)[None, :]
    out = OUT + ((row * time + offs_m[:, None]) * n_heads + h) * DV + offs_v[None, :]
    tl.store(out, acc, mask=mask)


# --- launchers --------------------------------------------------------------------------------------------


def _strides(x: torch.Tensor, heads: int) -> tuple[int, ...]:
    """Strides of a [batch, time, heads-or-groups, dim] tensor and the heads that share one of its slices."""
    return (*x.stride(), heads // x.shape[2])


def chunk_cumsum(x: torch.Tensor, chunks: Chunks, reverse: bool = False) -> torch.Tensor:
    """``x [batch, time, heads]`` summed inside each chunk (fp32, contiguous)."""
    batch, time, heads = x.shape
    out = new_buffer((batch, time, heads), x, torch.float32)
    launch(_chunk_cumsum_kernel, (chunks.count, heads), x, out, chunks.table, chunks.count, time, *x.stride(),
           REVERSE=reverse, BLOCK_L=block(chunks.size, minimum=1))
    return out


def chunk_state(k, v, g_cum, chunks: Chunks, reverse: bool = False) -> torch.Tensor:
    """The state each chunk adds: ``[n_chunks, heads, dim_v, dim_k]`` fp32."""
    heads, dv, dk = v.shape[2], v.shape[3], k.shape[3]
    out = new_buffer((chunks.count, heads, dv, dk), v, torch.float32)
    block_v, block_k = block(dv, maximum=64), block(dk, maximum=_MAX_BLOCK_K)
    launch(
        _chunk_state_kernel, (chunks.count, heads * triton.cdiv(dv, block_v), triton.cdiv(dk, block_k)),
        k, v, g_cum, out, chunks.table, chunks.count, g_cum.shape[1], *_strides(k, heads), *_strides(v, heads),
        dk, dv, REVERSE=reverse, BLOCK_N=block(chunks.size, maximum=64), BLOCK_K=block_k, BLOCK_V=block_v,
        DOT_DTYPE=dot_dtype(k, v),
    )
    return out


def state_passing(added, g_cum, initial, chunks: Chunks, reverse: bool = False):
    """States entering each chunk ``[n_chunks, heads, dim_v, dim_k]`` and after each sequence ``[n_seqs, ...]``."""
    heads, size = added.shape[1], added.shape[2] * added.shape[3]
    entering = new_buffer(added.shape, added)
    final = new_buffer((chunks.n_seqs, *added.shape[1:]), added)
    block_size = block(size, maximum=1024)
    launch(
        _state_passing_kernel, (chunks.n_seqs, heads, triton.cdiv(size, block_size)),
        added, g_cum, initial.contiguous() if initial is not None else added, entering, final,
        chunks.table, chunks.seqs, chunks.count, chunks.n_seqs, g_cum.shape[1], size,
        HAS_INIT=initial is not None, REVERSE=reverse, BLOCK=block_size,
    )
    return entering, final


def _score_blocks(size: int, dk: int, *tensors: torch.Tensor) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_K)`` of the score and output kernels. fp32 tile products are tf32x3 on the GPU (each
    operand split in two): at 64-wide tiles they spill on sm_90 (255 registers and a stack), so fp32 inputs walk
    the chunk and the state dimension in blocks of 32."""
    fp32 = all(t.dtype == torch.float32 for t in tensors)
    return block(size, maximum=32 if fp32 else 64), block(dk, maximum=_FP32_BLOCK_K if fp32 else _MAX_BLOCK_K)


def chunk_scores(q, k, chunks: Chunks) -> torch.Tensor:
    """``q . k`` inside each chunk, once per group: ``[n_chunks, groups, L, L]`` fp32 (L the longest chunk),
    ``[c, g, i, j]`` the product of the chunk's tokens ``i`` and ``j``; only ``j <= i`` is written."""
    groups, dk, size = q.shape[2], q.shape[3], chunks.size
    out = new_buffer((chunks.count, groups, size, size), q, torch.float32)
    block_m, (block_n, block_k) = block(size, maximum=64), _score_blocks(size, dk, q, k)
    launch(
        _chunk_scores_kernel, (chunks.count, triton.cdiv(size, block_m), groups * triton.cdiv(size, block_n)),
        q, k, out, chunks.table, chunks.count, *q.stride(), *k.stride(), dk, size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_DTYPE=dot_dtype(q, k),
    )
    return out


def chunk_scan(q, k, v, states, g_cum, chunks: Chunks, reverse: bool = False, skip=None, skip_weight=None,
               dtype=torch.float32, scores=None) -> torch.Tensor:
    """Outputs ``[batch, time, heads, dim_v]`` in ``dtype``; ``states`` is ``[n_chunks, heads, dim_v, dim_k]``
    (any strides). ``skip [batch, time, heads, dim_v]`` times ``skip_weight [heads, dim_v]`` is added (fused).
    ``scores``: :func:`chunk_scores` of ``q, k`` (any strides: its transpose for ``k, q``), else computed here
    per head."""
    batch, time, heads, dv = g_cum.shape[0], g_cum.shape[1], g_cum.shape[2], v.shape[3]
    dk = q.shape[3]
    out = new_buffer((batch, time, heads, dv), v, dtype)
    skip_args = (skip, skip_weight, *skip.stride(), *skip_weight.stride()) if skip is not None else (v, v, *(0,) * 6)
    score_args = (scores, *scores.stride()) if scores is not None else (v, *(0,) * 4)
    block_m, block_v = block(chunks.size, maximum=64), block(dv, maximum=64)
    block_n, block_k = _score_blocks(chunks.size, dk, q, k, v)
    launch(
        _chunk_scan_kernel, (chunks.count, triton.cdiv(chunks.size, block_m), heads * triton.cdiv(dv, block_v)),
        q, k, v, states, g_cum, skip_args[0], skip_args[1], score_args[0], out, chunks.table, chunks.count, time,
        *_strides(q, heads), *_strides(k, heads), *_strides(v, heads), *states.stride(), *skip_args[2:],
        *score_args[1:], dk, dv, REVERSE=reverse, HAS_SKIP=skip is not None, HAS_SCORES=scores is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_V=block_v,
        DOT_DTYPE=dot_dtype(q, k, v), STATE_DOT_DTYPE=state_dot_dtype(q, k, v),
    )
    return out


# --- autograd ---------------------------------------------------------------------------------------------


def _chunk_end_gradient(d_after, entering, added, g_cum, chunks: Chunks) -> torch.Tensor:
    """``dS . S`` at each chunk's end (the gradient of the chunk's total log decay), scattered to its last token.
    Spare (empty) chunks, whose states no kernel wrote, add zero."""
    row, start, end = chunks.table[0].long(), chunks.table[1].long(), chunks.table[2].long()
    last = (end - 1).clamp_min(0)
    total = g_cum[row, last]  # [n_chunks, heads]
    after = entering * torch.exp(total)[..., None, None] + added
    gradient = torch.where((end > start)[:, None], (d_after * after).sum((-2, -1)), 0.0)
    return torch.zeros_like(g_cum).index_put_((row, last), gradient, accumulate=True)


def _per_group(x_heads: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum per-head gradients ``[batch, time, heads, dim]`` over the heads that share a group's slice."""
    batch, time, heads, dim = x_heads.shape
    return x_heads.view(batch, time, groups, heads // groups, dim).sum(3)


def _dot_per_head(x_heads: torch.Tensor, x_groups: torch.Tensor) -> torch.Tensor:
    """``sum_d x_heads[b, t, h, d] * x_groups[b, t, h // ratio, d]`` -> ``[batch, time, heads]``."""
    batch, time, heads, dim = x_heads.shape
    groups = x_groups.shape[2]
    return (x_heads.view(batch, time, groups, heads // groups, dim) * x_groups.float().unsqueeze(3)).sum(-1).flatten(2)


class _ChunkedScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_decay, initial_state, chunks: Chunks, skip, skip_weight, dtype):
        g_cum = chunk_cumsum(log_decay, chunks)
        added = chunk_state(k, v, g_cum, chunks)
        entering, final = state_passing(added, g_cum, initial_state, chunks)
        weight = None if skip_weight is None else skip_weight.expand(v.shape[2], v.shape[3])  # [heads, dim_v]
        y = chunk_scan(q, k, v, entering, g_cum, chunks, skip=skip, skip_weight=weight, dtype=dtype,
                       scores=chunk_scores(q, k, chunks))
        ctx.save_for_backward(q, k, v, g_cum, initial_state, skip, skip_weight)
        ctx.chunks, ctx.decay_dtype = chunks, log_decay.dtype
        return y, final

    @staticmethod
    def backward(ctx, dy, d_final):
        q, k, v, g_cum, initial_state, skip, skip_weight = ctx.saved_tensors
        chunks = ctx.chunks
        dy = dy.float()
        groups = q.shape[2]
        added = chunk_state(k, v, g_cum, chunks)
        entering, _ = state_passing(added, g_cum, initial_state, chunks)
        direct = chunk_state(q, dy, g_cum, chunks, reverse=True)
        d_after, d_initial = state_passing(direct, g_cum, d_final, chunks, reverse=True)
        dq = chunk_scan(dy, v, k, entering.transpose(2, 3), g_cum, chunks)
        dk = chunk_scan(v, dy, q, d_after.transpose(2, 3), g_cum, chunks, reverse=True)
        dv = chunk_scan(k, q, dy, d_after, g_cum, chunks, reverse=True,
                        scores=chunk_scores(q, k, chunks).transpose(2, 3))
        d_cum = _dot_per_head(dq, q) - _dot_per_head(dk, k)
        d_cum += _chunk_end_gradient(d_after, entering, added, g_cum, chunks)
        d_log_decay = chunk_cumsum(d_cum, chunks, reverse=True)
        return (
            _per_group(dq, groups).to(q.dtype), _per_group(dk, groups).to(k.dtype), dv.to(v.dtype),
            d_log_decay.to(ctx.decay_dtype), d_initial.to(initial_state.dtype) if initial_state is not None else None,
            None, *_skip_gradients(dy, skip, skip_weight), None,
        )


def _skip_gradients(dy, skip, weight):
    """Gradients of ``skip [batch, time, heads, dim_v]`` and ``weight [heads, 1 or dim_v]`` of ``skip * weight``."""
    if skip is None:
        return None, None
    d_weight = (dy * skip.float()).sum((0, 1))
    d_weight = d_weight.sum(-1, keepdim=True) if weight.shape[-1] == 1 else d_weight
    return (dy * weight.float()).to(skip.dtype), d_weight.to(weight.dtype)


def chunked_decay_scan(q, k, v, log_decay, chunk_size: int, initial_state=None, sequences=None, skip=None,
                       skip_weight=None, dtype=torch.float32):
    """Triton version of :func:`hybridlm.ops.ssd.chunked_decay_scan`, differentiable in every tensor input.

    ``sequences``: ``None`` for a fixed-length batch (one state per row), or the boundaries ``[0, ..., time]``
    of sequences packed along time (batch 1, one initial/final state per sequence; a list, or an integer tensor
    on ``v``'s device, which is read on the device only: see :func:`.chunks.packed_chunks`). Fused into the
    output (SSD's skip and cast): ``+ skip * skip_weight`` (``skip`` like ``v``, ``skip_weight [heads, 1 or
    dim_v]``), stored as ``dtype``.
    """
    batch, time, heads, dim_v = v.shape
    groups = q.shape[2]
    if k.shape != q.shape or q.shape[:2] != v.shape[:2] or heads % groups:
        raise ValueError(
            f"chunked scan: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} disagree "
            "(need q, k [batch, time, groups, dim_k], v [batch, time, heads, dim_v], heads divisible by groups)"
        )
    if chunk_size < 1:
        raise ValueError(f"chunked scan: chunk_size must be >= 1, got {chunk_size}")
    check_device("chunked scan", q, k, v, log_decay, initial_state, skip, skip_weight)
    if skip is not None and (skip.shape != v.shape or skip_weight.dim() != 2 or skip_weight.shape[0] != heads):
        raise ValueError(f"chunked scan: skip must be like v {tuple(v.shape)} and skip_weight [heads={heads}, 1 or "
                         f"{dim_v}], got {tuple(skip.shape)} and {tuple(skip_weight.shape)}")
    n_states = batch if sequences is None else len(sequences) - 1
    expected_state = (n_states, heads, dim_v, q.shape[3])
    if initial_state is not None and initial_state.shape != expected_state:
        raise ValueError(f"chunked scan: initial_state must be {expected_state}, got {tuple(initial_state.shape)}")
    if log_decay is None:
        log_decay = v.new_zeros(batch, time, heads, dtype=torch.float32)
    size = max(1, min(chunk_size, time))
    if sequences is None:
        chunks = uniform_chunks(batch, time, size, v.device)
    else:
        chunks = packed_chunks(torch.as_tensor(sequences, device=v.device), size, time)
    return _ChunkedScan.apply(q, k, v, log_decay, initial_state, chunks, skip, skip_weight, dtype)
