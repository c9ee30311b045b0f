"""Chunked scan with a scalar decay per head, in Triton: the kernels behind SSD and gated linear attention.

Computes what :func:`hybridlm.ops.ssd.chunked_decay_scan` computes::

    S[t] = exp(g[t]) * S[t-1] + v[t] (outer) k[t]        y[t] = S[t] @ q[t]

in five kernels (:mod:`.chunked_scan_kernels`): ``chunk_cumsum`` (log decay summed inside each chunk),
``chunk_state`` (the state each chunk adds), ``state_passing`` (chunk to chunk, sequentially), ``chunk_scores``
(``q . k`` inside each chunk, once per group, not per head and value block), ``chunk_scan`` (outputs: the
intra-chunk decay-masked product plus the entering state's contribution). An optional per-token scale of ``v``
(SSD's ``v = dt x``) is applied inside ``chunk_state`` and ``chunk_scan``, whichever role ``v`` plays.
Every kernel also runs in reversed time (``REVERSE``), and the backward pass is these same kernels with roles
swapped:

* ``dS`` entering each chunk from the right: ``chunk_state`` (reversed) of ``dy`` against ``q``, carried by
  ``state_passing`` (reversed), which also yields the initial state's gradient;
* ``dq = chunk_scan(dy, v, k, S^T)``, ``dk = chunk_scan_reversed(v, dy, q, dS^T)``,
  ``dv = chunk_scan_reversed(k, q, dy, dS)`` (``chunk_scores`` again, read transposed);
* ``dg``: the gradient of the cumulative decay, ``q.dq - k.dk`` (plus ``dS . S`` at each chunk's last token),
  summed in reverse by ``chunk_cumsum`` (reversed).

Fused into those kernels: the per-token dot products ``q.dq``, ``k.dk`` and the scale's gradient ``v.dv`` come
out of ``chunk_scan`` with its outputs (``dot_with``); the scale's product ``dv * scale`` is its row scale;
``dq, dk`` of keys and queries shared by a group of heads are summed over the group's heads by ``chunk_scan``
itself (relaxed atomic adds: their last bits may vary from run to run on the GPU); ``dS . S`` at each chunk's
end comes out of ``state_passing`` (reversed), per block of the state; when the skip's input is ``v`` (SSD's
``x``), its gradient ``dy * skip_weight`` is added in the ``dv`` pass. Plain torch between kernels: sums and
differences of ``[batch, time, heads]`` and ``[n_chunks, heads]`` tensors, and the skip weight's gradient.
Chunks never cross a sequence, so fixed-length batches and packed variable-length batches (one initial/final
state per sequence) are the same code: a table of chunks, each a batch row and a time range.
"""

from __future__ import annotations

import torch
import triton

from hybridlm.ops.triton._common import block, check_device, dot_dtype, launch, narrowest, new_buffer, state_dot_dtype
from hybridlm.ops.triton.chunked_scan_kernels import (
    _chunk_cumsum_kernel,
    _chunk_scan_kernel,
    _chunk_scores_kernel,
    _chunk_state_kernel,
    _state_passing_kernel,
)
from hybridlm.ops.triton.chunks import Chunks, packed_chunks, uniform_chunks

_MAX_BLOCK_K = 64  # the state dimension (dstate 128-256) in blocks: registers and shared memory stay bounded
_FP32_BLOCK_K = 32  # the same for fp32 inputs in the score and output kernels (see _score_blocks)


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


def chunk_state(k, v, g_cum, chunks: Chunks, reverse: bool = False, scale=None) -> torch.Tensor:
    """The state each chunk adds: ``[n_chunks, heads, dim_v, dim_k]`` fp32; ``scale [batch, time, heads]`` (fp32,
    contiguous, like ``g_cum``) multiplies each token's outer product."""
    heads, dv, dk = v.shape[2], v.shape[3], k.shape[3]
    out = new_buffer((chunks.count, heads, dv, dk), v, torch.float32)
    def grid(meta):  # BLOCK_V, BLOCK_K: tuned on the GPU, at most the sizes passed
        return chunks.count, heads * triton.cdiv(dv, meta["BLOCK_V"]), triton.cdiv(dk, meta["BLOCK_K"])

    launch(
        _chunk_state_kernel, grid,
        k, v, g_cum, g_cum if scale is None else scale, out, chunks.table, chunks.count, g_cum.shape[1],
        *_strides(k, heads), *_strides(v, heads), dk, dv, REVERSE=reverse, HAS_SCALE=scale is not None,
        BLOCK_N=block(chunks.size, maximum=64), BLOCK_K=block(dk, maximum=_MAX_BLOCK_K), BLOCK_V=block(dv, maximum=64),
        DOT_DTYPE=dot_dtype(k, v),
    )
    return out


def state_passing(added, g_cum, initial, chunks: Chunks, reverse: bool = False, forward_states=None):
    """States entering each chunk ``[n_chunks, heads, dim_v, dim_k]`` and after each sequence ``[n_seqs, ...]``.

    ``forward_states``: the forward pass's ``(entering, added)`` when this (reversed) pass carries their gradient;
    then also returns ``[n_chunks, heads]``, the carried gradient at each chunk's end dotted with the forward
    state there (0 for a spare chunk)."""
    heads, size = added.shape[1], added.shape[2] * added.shape[3]
    entering = new_buffer(added.shape, added)
    final = new_buffer((chunks.n_seqs, *added.shape[1:]), added)
    block_size = block(size, maximum=1024)
    n_blocks = triton.cdiv(size, block_size)
    end_dots = None if forward_states is None else torch.zeros(n_blocks, chunks.count, heads, device=added.device)
    launch(
        _state_passing_kernel, (chunks.n_seqs, heads, n_blocks),
        added, g_cum, initial.contiguous() if initial is not None else added, entering, final,
        chunks.table, chunks.seqs, *(forward_states or (added, added)), added if end_dots is None else end_dots,
        chunks.count, chunks.n_seqs, g_cum.shape[1], size,
        HAS_INIT=initial is not None, REVERSE=reverse, HAS_END_DOTS=end_dots is not None, BLOCK=block_size,
    )
    return (entering, final) if end_dots is None else (entering, final, end_dots.sum(0))


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
               dtype=torch.float32, scores=None, scale=None, scale_rows=False, dot_with=None, out_groups=None):
    """Outputs ``[batch, time, heads, dim_v]`` in ``dtype``; ``states`` is ``[n_chunks, heads, dim_v, dim_k]``
    (any strides). ``skip [batch, time, heads, dim_v]`` times ``skip_weight [heads, dim_v]`` is added (fused).
    ``scores``: :func:`chunk_scores` of ``q, k`` (any strides: its transpose for ``k, q``), else computed here
    per head. ``scale [batch, time, heads]`` (fp32, contiguous) scales the rows of ``k, v`` (or with
    ``scale_rows``, of ``q``). With ``dot_with [batch, time, heads or groups, dim_v]`` returns ``(outputs,
    dots)``: ``dots [batch, time, heads]`` fp32, each output row before the row scale and the skip dotted with
    ``dot_with``'s row (of the head's group). With ``out_groups`` below the head count, the outputs of the heads
    of each group are summed (fp32, atomically): ``[batch, time, out_groups, dim_v]``."""
    batch, time, heads, dv = g_cum.shape[0], g_cum.shape[1], g_cum.shape[2], v.shape[3]
    dk = q.shape[3]
    out_groups = out_groups or heads
    if out_groups < heads:  # (zeros whether poisoned or not: added to)
        out = torch.zeros((batch, time, out_groups, dv), device=v.device, dtype=torch.float32)
    else:
        out = new_buffer((batch, time, heads, dv), v, dtype)
    skip_args = (skip, skip_weight, *skip.stride(), *skip_weight.stride()) if skip is not None else (v, v, *(0,) * 6)
    score_args = (scores, *scores.stride()) if scores is not None else (v, *(0,) * 4)
    block_m, block_v = block(chunks.size, maximum=64), block(dv, maximum=64)
    block_n, block_k = _score_blocks(chunks.size, dk, q, k, v)
    n_dots = triton.cdiv(dv, narrowest(_chunk_scan_kernel, "BLOCK_V", block_v))  # a slot per value block
    if dot_with is None:
        dots = None
    elif n_dots > triton.cdiv(dv, block_v):  # (BLOCK_V tuned: the slots of blocks not there must add nothing)
        dots = torch.zeros((batch, time, heads, n_dots), device=v.device, dtype=torch.float32)
    else:
        dots = new_buffer((batch, time, heads, n_dots), v, torch.float32)
    dot_args = (dot_with, dots, *_strides(dot_with, heads)) if dot_with is not None else (v, out, *(0,) * 4, 1)

    def grid(meta):  # BLOCK_V, BLOCK_K: tuned on the GPU, at most the sizes passed
        return chunks.count, triton.cdiv(chunks.size, block_m), heads * triton.cdiv(dv, meta["BLOCK_V"])

    launch(
        _chunk_scan_kernel, grid,
        q, k, v, states, g_cum, skip_args[0], skip_args[1], score_args[0], g_cum if scale is None else scale,
        dot_args[0], out, dot_args[1], chunks.table, chunks.count, time,
        *_strides(q, heads), *_strides(k, heads), *_strides(v, heads), *states.stride(), *skip_args[2:],
        *score_args[1:], *dot_args[2:], heads // out_groups, n_dots, dk, dv, REVERSE=reverse, HAS_SKIP=skip is not None,
        HAS_SCORES=scores is not None, SCALE_ROWS=scale is not None and scale_rows,
        SCALE_COLS=scale is not None and not scale_rows, HAS_DOTS=dot_with is not None,
        SUM_HEADS=out_groups < heads,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_V=block_v,
        DOT_DTYPE=dot_dtype(q, k, v), STATE_DOT_DTYPE=state_dot_dtype(q, k, v),
    )
    return out if dots is None else (out, dots.sum(-1) if n_dots > 1 else dots.squeeze(-1))


# --- autograd ---------------------------------------------------------------------------------------------


def _at_chunk_ends(per_chunk: torch.Tensor, g_cum: torch.Tensor, chunks: Chunks) -> torch.Tensor:
    """``per_chunk [n_chunks, heads]`` placed at each chunk's last token of a ``g_cum``-shaped zero tensor (a spare,
    empty chunk adds its zero at the last token)."""
    row, end = chunks.table[0].long(), chunks.table[2].long()
    return torch.zeros_like(g_cum).index_put_((row, (end - 1).clamp_min(0)), per_chunk, accumulate=True)


class _ChunkedScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, v_scale, log_decay, initial_state, chunks: Chunks, skip, skip_weight, dtype):
        g_cum = chunk_cumsum(log_decay, chunks)
        scale = None if v_scale is None else v_scale.float().contiguous()  # [batch, time, heads]
        added = chunk_state(k, v, g_cum, chunks, scale=scale)
        entering, final = state_passing(added, g_cum, initial_state, chunks)
        weight = None if skip_weight is None else skip_weight.expand(v.shape[2], v.shape[3])  # [heads, dim_v]
        y = chunk_scan(q, k, v, entering, g_cum, chunks, skip=skip, skip_weight=weight, dtype=dtype,
                       scores=chunk_scores(q, k, chunks), scale=scale)
        ctx.save_for_backward(q, k, v, v_scale, g_cum, initial_state, skip, skip_weight)
        ctx.chunks, ctx.decay_dtype, ctx.skip_is_v = chunks, log_decay.dtype, skip is v
        return y, final

    @staticmethod
    def backward(ctx, dy, d_final):
        q, k, v, v_scale, g_cum, initial_state, skip, skip_weight = ctx.saved_tensors
        chunks = ctx.chunks
        dy = dy.float()
        groups = q.shape[2]
        scale = None if v_scale is None else v_scale.float().contiguous()
        added = chunk_state(k, v, g_cum, chunks, scale=scale)
        entering, _ = state_passing(added, g_cum, initial_state, chunks)
        direct = chunk_state(q, dy, g_cum, chunks, reverse=True)
        # with dS . S at each chunk's end (the gradient of the chunk's total log decay)
        d_after, d_initial, end_dots = state_passing(direct, g_cum, d_final, chunks, reverse=True,
                                                     forward_states=(entering, added))
        # dq, dk summed over the heads of each group in the kernels, with q . dq and k . dk per token and head (the
        # decay's gradient)
        dq, q_dq = chunk_scan(dy, v, k, entering.transpose(2, 3), g_cum, chunks, scale=scale, dtype=q.dtype,
                              dot_with=q, out_groups=groups)
        dk, k_dk = chunk_scan(v, dy, q, d_after.transpose(2, 3), g_cum, chunks, reverse=True, scale=scale,
                              scale_rows=True, dtype=k.dtype, dot_with=k, out_groups=groups)
        # dv is the gradient of v * scale: dv * scale for v (the row scale), v . dv for the scale (the dots); when
        # the skip's input is v itself (SSD's x), its gradient dy * weight is added in the same kernel
        fused_skip = skip is not None and ctx.skip_is_v
        weight = skip_weight.expand(v.shape[2], v.shape[3]) if fused_skip else None  # [heads, dim_v]
        dv = chunk_scan(k, q, dy, d_after, g_cum, chunks, reverse=True, dtype=v.dtype, scale=scale, scale_rows=True,
                        scores=chunk_scores(q, k, chunks).transpose(2, 3), dot_with=v if scale is not None else None,
                        skip=dy if fused_skip else None, skip_weight=weight)
        dv, d_scale = dv if scale is not None else (dv, None)
        d_cum = q_dq - (k_dk if scale is None else k_dk * scale)  # k_dk was taken before dk's row scale
        d_cum += _at_chunk_ends(end_dots, g_cum, chunks)
        d_log_decay = chunk_cumsum(d_cum, chunks, reverse=True)
        return (
            dq.to(q.dtype), dk.to(k.dtype), dv,
            d_scale.to(v_scale.dtype) if d_scale is not None else None,
            d_log_decay.to(ctx.decay_dtype), d_initial.to(initial_state.dtype) if initial_state is not None else None,
            None, *_skip_gradients(dy, skip, skip_weight, in_dv=fused_skip), None,
        )


def _skip_gradients(dy, skip, weight, in_dv: bool):
    """Gradients of ``skip [batch, time, heads, dim_v]`` and ``weight [heads, 1 or dim_v]`` of ``skip * weight``
    (``in_dv``: the skip's input is ``v``, whose gradient already holds the skip's: None for it)."""
    if skip is None:
        return None, None
    d_weight = (dy * skip.float()).sum((0, 1))
    d_weight = d_weight.sum(-1, keepdim=True) if weight.shape[-1] == 1 else d_weight
    return None if in_dv else (dy * weight.float()).to(skip.dtype), d_weight.to(weight.dtype)


def chunked_decay_scan(q, k, v, log_decay, chunk_size: int, initial_state=None, sequences=None, skip=None,
                       skip_weight=None, dtype=torch.float32, v_scale=None):
    """Triton version of :func:`hybridlm.ops.ssd.chunked_decay_scan`, differentiable in every tensor input.

    ``sequences``: ``None`` for a fixed-length batch (one state per row), or the boundaries ``[0, ..., time]``
    of sequences packed along time (batch 1, one initial/final state per sequence; a list, or an integer tensor
    on ``v``'s device, which is read on the device only: see :func:`.chunks.packed_chunks`). Fused into the
    output (SSD's skip and cast): ``+ skip * skip_weight`` (``skip`` like ``v``, ``skip_weight [heads, 1 or
    dim_v]``), stored as ``dtype``. Fused into the kernels' loads (SSD's ``dt x``): ``v * v_scale[..., None]``,
    ``v_scale [batch, time, heads]``.
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
    check_device("chunked scan", q, k, v, log_decay, initial_state, skip, skip_weight, v_scale)
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
    if v_scale is not None and v_scale.shape != v.shape[:3]:
        raise ValueError(f"chunked scan: v_scale must be [batch, time, heads] {tuple(v.shape[:3])}, got "
                         f"{tuple(v_scale.shape)}")
    return _ChunkedScan.apply(q, k, v, v_scale, log_decay, initial_state, chunks, skip, skip_weight, dtype)
