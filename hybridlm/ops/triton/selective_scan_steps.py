"""The steps of :mod:`.selective_scan`'s kernels inside one chunk, shared by the forward and the backward: the
step sizes, the chunk's states by one associative scan, and where packed sequences start and end."""

from __future__ import annotations

import triton
import triton.language as tl

from hybridlm.ops.triton._common import sequence_span, softplus, total


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
def _chunk_states(h0, u, dt, A, Bt, first, restart, PACKED: tl.constexpr):
    """States ``[chunk, channels, dstate]`` of one chunk entered with ``h0``, the input terms ``dt u B``, the decays
    ``exp(dt A)`` and the decays the scan applied: packed, zero at a sequence's ``first`` token, where
    ``exp(dt A) restart`` (its sequence's initial state, ``[chunk, channels, dstate]``) enters instead."""
    a = tl.exp(dt[:, :, None] * A[None, :, :])
    drive = (dt * u)[:, :, None] * Bt[:, None, :]
    if PACKED:
        applied = tl.where(first[:, None, None], 0.0, a)
        decay, local = tl.associative_scan((applied, drive + a * restart), 0, _linear_recurrence)
    else:
        applied = a
        decay, local = tl.associative_scan((a, drive), 0, _linear_recurrence)
    return local + decay * h0[None, :, :], drive, a, applied


@triton.jit
def _sequence_edges(SEQ, CU, INIT, offs_t, mask_t, time, state_offs, mask_n, per_state, HAS_INIT: tl.constexpr,
                    PACKED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Packed (batch 1): each token's sequence, whether it is its sequence's first and last token, and the
    initial state entering at each first token (``[chunk, channels, dstate]``, zeros elsewhere and without
    initial states); ``state_offs [channels, dstate]`` locate the channels in one sequence's state. Unpacked:
    placeholders, never read."""
    if not PACKED:
        return offs_t, mask_t, mask_t, tl.full((BLOCK_T, BLOCK_D, BLOCK_N), 0.0, tl.float32)
    seq, start, end = sequence_span(SEQ, CU, 0, offs_t, mask_t, time, True)
    first, last = mask_t & (offs_t == start), mask_t & (offs_t == end - 1)
    restart = tl.full((BLOCK_T, BLOCK_D, BLOCK_N), 0.0, tl.float32)
    if HAS_INIT:
        at = INIT + seq[:, None, None] * per_state + state_offs[None, :, :]
        restart = tl.load(at, mask=first[:, None, None] & mask_n[None, None, :], other=0.0).to(tl.float32)
    return seq, first, last, restart


@triton.jit
def _row(x, index, BLOCK_T: tl.constexpr):
    """``x[index]`` of a ``[chunk, channels, dstate]`` tile."""
    rows = tl.arange(0, BLOCK_T)[:, None, None]
    return total(tl.where(rows == index, x, 0.0), 0)
