"""The Triton kernels of the chunked scan with a scalar decay per head (:mod:`.chunked_scan` launches them and
describes how the backward pass reuses them): ``chunk_cumsum``, ``chunk_state``, ``state_passing``,
``chunk_scores`` (``q . k`` once per chunk and group) and ``chunk_scan``."""

from __future__ import annotations

import triton
import triton.language as tl

from hybridlm.ops.triton._common import cdiv, mm, program_id64, running_total, total, tuned


@triton.jit
def chunk_bounds(TABLE, n_chunks, c):
    """``(row, start, end)`` of chunk ``c`` in the packed chunk table ``[3, n_chunks]`` (int64 offsets)."""
    row = tl.load(TABLE + c).to(tl.int64)
    start = tl.load(TABLE + n_chunks + c).to(tl.int64)
    end = tl.load(TABLE + 2 * n_chunks + c).to(tl.int64)
    return row, start, end


@triton.jit
def _chunk_cumsum_kernel(
    X, OUT, TABLE, n_chunks, time, sx_b, sx_t, sx_h, REVERSE: tl.constexpr, BLOCK_L: tl.constexpr
):
    """OUT[b, t, h] = sum of X over the chunk up to t (inclusive; from t to the chunk end when REVERSE)."""
    c, h = program_id64(0), program_id64(1)
    n_heads = tl.num_programs(1)
    row, start, end = chunk_bounds(TABLE, n_chunks, c)
    t = start + tl.arange(0, BLOCK_L)
    mask = t < end
    x = tl.load(X + row * sx_b + t * sx_t + h * sx_h, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + (row * time + t) * n_heads + h, running_total(x, 0, REVERSE), mask=mask)


# blocks: the launch's sizes (the largest that fit) bound these choices; spill-free on sm_90 at model shapes
# (docs/kernels-and-backends.md): a value block of 32 spills in fp32 with 4 warps
@tuned((4, 2), (4, 3), (8, 3, {"BLOCK_V": (32, 64)}), key=["DK", "DV", "REVERSE"],
       blocks={"BLOCK_V": (64,), "BLOCK_K": (32, 64)})
@triton.jit
def _chunk_state_kernel(
    K, V, G, T, OUT, TABLE, n_chunks, time,
    sk_b, sk_t, sk_h, sk_d, k_ratio, sv_b, sv_t, sv_h, sv_d, v_ratio, DK, DV,
    REVERSE: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """OUT[c, h] = sum_s w[s] v[s] (outer) k[s] over chunk c: w = the decay from s to the chunk end, or, when
    REVERSE, from the chunk start to s."""
    c, pid, kb = program_id64(0), tl.program_id(1), tl.program_id(2)
    n_vb = cdiv(DV, BLOCK_V)
    h, vb = pid // n_vb, pid % n_vb
    n_heads = tl.num_programs(1) // n_vb
    row, start, end = chunk_bounds(TABLE, n_chunks, c)
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
        if HAS_SCALE:  # v[s] scaled by T[s] (SSD's dt x; T [batch, time, heads] like G)
            w = w * tl.load(T + row * time * n_heads + h + offs_n * n_heads, mask=mask_n, other=0.0)
        w = tl.where(mask_n, w, 0.0)
        k = tl.load(k_base + offs_n[:, None] * sk_t, mask=mask_n[:, None] & (offs_k[None, :] < DK), other=0.0)
        v = tl.load(v_base + offs_n[:, None] * sv_t, mask=mask_n[:, None] & (offs_v[None, :] < DV), other=0.0)
        acc += mm(tl.trans(v.to(tl.float32) * w[:, None]), k, DOT_DTYPE)
    out = OUT + ((c * n_heads + h) * DV + offs_v[:, None]) * DK + offs_k[None, :]
    tl.store(out, acc, mask=(offs_v[:, None] < DV) & (offs_k[None, :] < DK))


@triton.jit
def _state_passing_kernel(
    ADDED, G, INIT, OUT, FINAL, TABLE, SEQS, FWD_ENTERING, FWD_ADDED, END_DOTS, n_chunks, n_seqs, time, SIZE,
    HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, HAS_END_DOTS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Carry the state through the chunks of sequence s: OUT[c] is the state entering chunk c (in scan order),
    then state = exp(total decay of c) * state + ADDED[c]; FINAL[s] is the state after the last chunk.

    With HAS_END_DOTS (the backward's reversed pass, carrying dS): END_DOTS[block, c, h] = OUT[c] . (the forward
    state after chunk c, FWD_ENTERING[c] * exp(total decay of c) + FWD_ADDED[c]) over this program's block of the
    state, the gradient of chunk c's total log decay."""
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
        row, _, end = chunk_bounds(TABLE, n_chunks, c)
        decay = tl.exp(tl.load(G + (row * time + end - 1) * n_heads + h))
        if HAS_END_DOTS:
            after = tl.load(FWD_ENTERING + (c * n_heads + h) * SIZE + offs, mask=mask, other=0.0) * decay
            after += tl.load(FWD_ADDED + (c * n_heads + h) * SIZE + offs, mask=mask, other=0.0)
            tl.store(END_DOTS + (pb * n_chunks + c) * n_heads + h, total(state * after, 0))
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
    row, start, end = chunk_bounds(TABLE, n_chunks, c)
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


# 4 warps spill in bf16 (the dq, dk pass at 64-wide blocks, the forward at 32-wide ones)
@tuned((8, 2), (8, 3), key=["DK", "DV", "REVERSE", "HAS_DOTS", "SUM_HEADS"],  # each pass tuned on its own
       blocks={"BLOCK_V": (32, 64), "BLOCK_K": (32, 64)},
       reset_to_zero=["OUT", "DOTS"])  # OUT accumulated with SUM_HEADS; DOTS: slots of blocks not there add 0
@triton.jit
def _chunk_scan_kernel(
    Q, K, V, S, G, X, W, P, T, R, OUT, DOTS, TABLE, n_chunks, time,
    sq_b, sq_t, sq_h, sq_d, q_ratio, sk_b, sk_t, sk_h, sk_d, k_ratio, sv_b, sv_t, sv_h, sv_d, v_ratio,
    ss_c, ss_h, ss_v, ss_k, sx_b, sx_t, sx_h, sx_d, sw_h, sw_d, sp_c, sp_g, sp_m, sp_n,
    sr_b, sr_t, sr_h, sr_d, r_ratio, out_ratio, n_dots, DK, DV,
    REVERSE: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_SCORES: tl.constexpr, SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr, HAS_DOTS: tl.constexpr, SUM_HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_DTYPE: tl.constexpr, STATE_DOT_DTYPE: tl.constexpr,
):
    """OUT[t] = sum_{s <= t in the chunk} (q[t].k[s]) decay(s -> t) v[t] + decay(start -> t) S[c] q[t].

    When REVERSE, time runs backwards: s >= t, decay(t -> s), and S[c] arrives from the chunk's end. Tensors
    are [batch, time, heads or groups, dim] (strides given; head h reads group h // ratio); S is [chunk, head,
    DV, DK] through its strides, so a transposed state is a stride swap. OUT is [batch, time, head, DV], stored
    in its own dtype; with HAS_SKIP it also gets the skip term X[t] * W (X like OUT, W [head, DV] by strides).
    With HAS_SCORES the products q[t].k[s] are read from P (:func:`chunk_scores`, [chunk, group, t - start,
    s - start] by strides; its causal half) instead of computed per head and value block. T [batch, time,
    head] (like G) scales the rows of q (SCALE_ROWS: OUT[t] before the skip times T[t]) or those of k and v
    (SCALE_COLS: the term of s times T[s]), which is SSD's v = dt x in whichever role v plays. With HAS_DOTS
    the row products OUT[t] . R[t] before the row scale and the skip (R like OUT, head h reading R's slice
    h // r_ratio) are stored, summed over this value block, in DOTS [batch, time, head, n_dots] fp32 (n_dots at
    least the value blocks; the rest left as they are): the
    backward's per-token sums (q . dq, k . dk, x . dv) without another pass over its fp32 gradients. With
    SUM_HEADS, OUT is [batch, time, head // out_ratio, DV] fp32, zeroed, and the heads sharing a slice add their
    outputs to it atomically (the backward's dq, dk of keys and queries shared by a group of heads).
    """
    c, mb, pid = program_id64(0), tl.program_id(1), tl.program_id(2)
    n_vb = cdiv(DV, BLOCK_V)
    h, vb = pid // n_vb, pid % n_vb
    n_heads = tl.num_programs(2) // n_vb
    row, start, end = chunk_bounds(TABLE, n_chunks, c)
    m0 = start + mb * BLOCK_M
    if m0 >= end:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_m = offs_m < end
    mask_v = offs_v < DV
    g_row = G + row * time * n_heads + h
    t_row = T + row * time * n_heads + h
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
        if SCALE_COLS:
            decay = decay * tl.load(t_row + offs_n * n_heads, mask=mask_n, other=0.0)[None, :]
        p = tl.where(keep, scores * decay, 0.0)
        acc += mm(p, v, DOT_DTYPE)
    mask = mask_m[:, None] & mask_v[None, :]
    if HAS_DOTS:
        r = tl.load(R + row * sr_b + offs_m[:, None] * sr_t + (h // r_ratio) * sr_h + offs_v[None, :] * sr_d,
                    mask=mask, other=0.0)  # [BLOCK_M, BLOCK_V]
        tl.store(DOTS + ((row * time + offs_m) * n_heads + h) * n_dots + vb, total(acc * r.to(tl.float32), 1),
                 mask=mask_m)
    if SCALE_ROWS:
        acc = acc * tl.load(t_row + offs_m * n_heads, mask=mask_m, other=0.0)[:, None]
    if HAS_SKIP:
        x = tl.load(X + row * sx_b + offs_m[:, None] * sx_t + h * sx_h + offs_v[None, :] * sx_d, mask=mask, other=0.0)
        acc += x.to(tl.float32) * tl.load(W + h * sw_h + offs_v * sw_d, mask=mask_v, other=0.0).to(tl.float32)[None, :]
    n_out = n_heads // out_ratio
    out = OUT + ((row * time + offs_m[:, None]) * n_out + h // out_ratio) * DV + offs_v[None, :]
    if SUM_HEADS:  # relaxed: only the sum matters, not the order of the adds
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out, acc, mask=mask)
