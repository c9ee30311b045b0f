"""Chunked scan with a scalar decay per head: Mamba-2's SSD, and gated linear attention (pure PyTorch reference).

The core recurrence, per head ``h`` with a ``[dim_v, dim_k]`` state, keys/queries shared by the heads of a
group::

    S[t] = exp(g[t]) * S[t-1] + v[t] (outer) k[t]        y[t] = S[t] @ q[t]

Mamba-2's SSD is this with ``q = C``, ``k = B``, ``v = dt * x``, ``g = dt * A``. Inside a chunk the output is
a decay-masked matrix product (the "attention" form); the states entering the chunks are combined for all
chunks at once by the segment-sum matrix of chunk decays.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange

from hybridlm.ops.packing import check_initial_states, nonempty_spans, packed_sequences

__all__ = ["chunked_decay_scan", "packed_sequences", "segment_sum", "ssd_chunk_scan_ref", "ssd_through"]


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = x[..., j+1] + ... + x[..., i]`` for ``j <= i`` and ``-inf`` above the diagonal.

    Built by a masked cumulative sum rather than a difference of cumsums, which loses precision when the
    cumulative decay is large.
    """
    return _lower_sums(x).masked_fill_(_on_or_above(x).triu(1), -torch.inf)


def _on_or_above(x: torch.Tensor) -> torch.Tensor:
    """``[l, l]`` bool, true on and above the diagonal, for ``x [..., l]``."""
    return torch.ones(x.shape[-1], x.shape[-1], dtype=torch.bool, device=x.device).triu()


def _lower_sums(x: torch.Tensor) -> torch.Tensor:
    """``[..., i, j] = x[j+1] + ... + x[i]`` below the diagonal, zero (of either sign) on and above it: a cumulative
    sum down the columns of ``x_i`` placed where ``i > j``. Placed by a multiply with a 0/1 mask, which on the CPU
    is 5-7x faster than ``where`` and 10x faster than a masked fill over the broadcast (measured at 8 heads x 4 chunks
    of 64); an ``x`` of ``-inf`` (a packed sequence's first token) is first made the most negative float, so that
    ``0 * x`` stays zero, and a sum reaching it is still ``-inf`` or next to it. In place after one ``[l, l]``
    allocation, row-major whatever ``x``'s strides (the backward of the multiply and ``cumsum`` keeps only the
    mask)."""
    below = torch.ones(x.shape[-1], x.shape[-1], dtype=x.dtype, device=x.device).tril(-1)
    finite = x.contiguous().clamp(min=torch.finfo(x.dtype).min)  # [..., l], row-major: so are the sums
    return (finite.unsqueeze(-1) * below).cumsum_(dim=-2)


#: Decays below ``exp(LOG_FLOOR)`` (1.8e-35) are computed as zero: ``exp`` is clamped there, and results at most
#: ``FLUSHED`` are then zeroed. Near float32's smallest normal number (1.2e-38) and below, ``exp`` is 12-35x slower
#: on the CPU than for a normal result (``exp(-inf)`` 3x slower); GPU kernels flush such results to zero too.
LOG_FLOOR = -80.0
FLUSHED = 2 * math.exp(LOG_FLOOR)


def exp_flushed(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` on the fast path, results at most :data:`FLUSHED` flushed to zero."""
    return F.threshold(x.clamp(min=LOG_FLOOR).exp_(), FLUSHED, 0.0)  # (exp_'s backward needs its output kept)


def decay_matrix(x: torch.Tensor) -> torch.Tensor:
    """``exp(segment_sum(x))`` flushed as :func:`exp_flushed` does: ``[..., l, l]``, the decay from token ``j``
    to token ``i`` (zero above the diagonal). Differentiable through :class:`_DecayMatrix`."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _DecayMatrix.apply(x)
    return _flushed_decays(x)


def _flushed_decays(x: torch.Tensor) -> torch.Tensor:
    """:func:`decay_matrix`'s values, in place on one allocation: :func:`segment_sum`'s sums, with the upper
    triangle zeroed after ``exp`` by a multiply rather than filled with ``-inf`` before it (a masked fill over a
    broadcast mask is several times slower on the CPU). The values are the same bit for bit; 2.4x faster than
    masked fills at 16 heads x 32 chunks of 64."""
    sums = _lower_sums(x)
    on_or_below = torch.ones(x.shape[-1], x.shape[-1], dtype=x.dtype, device=x.device).tril()
    return F.threshold_(sums.clamp_(min=LOG_FLOOR).exp_().mul_(on_or_below), FLUSHED, 0.0)


class _DecayMatrix(torch.autograd.Function):
    """:func:`decay_matrix` with a backward that needs only its output. ``out[i, j]`` depends on ``x[j+1..i]``
    with derivative ``out[i, j]`` (zero where flushed or masked), so ``dx[k]`` is the sum of ``grad * out`` over
    ``j < k <= i``: one cumulative sum along each row and a sum down each column. Autograd's own backward of
    the masked ``cumsum`` down the columns flips the ``[l, l]`` sums twice, and keeps the masks and the clamp's
    input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = _flushed_decays(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        row_sums = (grad * out).cumsum_(dim=-1)  # [..., i, m]: the sum over j <= m of row i
        below = torch.where(_on_or_above(out), 0.0, row_sums).sum(dim=-2)  # [..., m]: over i > m, for k = m + 1
        return F.pad(below[..., :-1], (1, 0))  # x[0] never enters a segment sum


#: On CPU tensors the scan's chunks hold at most this many tokens, whatever larger chunk the model names: that one
#: is a GPU kernel's tile (256 in the public Mamba-2 and Bamba checkpoints). Per token, the work inside a chunk grows
#: with its length. Measured on one Mamba-2 layer (8 heads of 64, state 64, 1 thread), chunk 64 against 256: prefill
#: 2.3x faster at 512 and 8,192 tokens; training (4 x 512, forward and backward) 2.1x.
CPU_CHUNK = 64

#: On CPU tensors a long chunked scan without packed sequences (this one, and the gated delta rule's) runs in slices
#: of consecutive chunks, each slice's final state the next one's initial state. A slice holds at least
#: ``CPU_SLICE_CHUNKS`` chunks, more while its decay matrices (batch x heads x chunk x chunk per chunk) stay within
#: ``CPU_SLICE_ELEMENTS`` (1 MiB of fp32, this CPU's L2 cache per core). The whole sequence at once streams every
#: elementwise pass over the ``[chunks, chunk, chunk]`` decays through memory, and passes states across all chunks
#: by a matrix quadratic in their number. Measured on the peer Mamba-2 layer (16 heads of 32, state 64, 1 thread),
#: the scan alone at the min (median): 1.1x (1.5x) faster at 2,048 tokens, 1.6x (1.8x) at 8,192, 2.6x at 32K
#: against chunks of 128 there; the peer Mamba-2 model's prefill 1.06-1.09x at 2,048 tokens, 1.15-1.19x at 8,192;
#: training at 4 x 512 unchanged.
CPU_SLICE_CHUNKS, CPU_SLICE_ELEMENTS = 4, 1 << 18


def scan_chunk_size(chunk_size: int, device: torch.device) -> int:
    """The chunk :func:`chunked_decay_scan` uses when the caller names ``chunk_size``."""
    return chunk_size if device.type != "cpu" else min(chunk_size, CPU_CHUNK)


def scan_slice_tokens(batch: int, heads: int, chunk: int, device: torch.device) -> int | None:
    """How many tokens each slice of a CPU scan holds (a whole number of ``chunk``s); None off the CPU."""
    if device.type != "cpu":
        return None
    return chunk * max(CPU_SLICE_CHUNKS, CPU_SLICE_ELEMENTS // (batch * heads * chunk * chunk))


def chunked_decay_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor | None,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
    sequences: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q, k [batch, time, groups, dim_k]``, ``v [batch, time, heads, dim_v]``, ``log_decay [batch, time, heads]``
    (None: no decay). Returns ``(y [batch, time, heads, dim_v] fp32, final_state [batch, heads, dim_v, dim_k]
    fp32)``. The chunk size changes only the rounding; on the CPU it is at most :func:`scan_chunk_size`'s, and a
    long scan without ``sequences`` runs in slices of :func:`scan_slice_tokens` tokens (the rounding again).

    ``sequences``: the boundaries ``[0, ..., time]`` of sequences packed in a batch of one (see
    :func:`packed_sequences`); then ``initial_state`` and the final state have one row per sequence. Packing is
    a decay of zero (log decay ``-inf``) at each sequence's first token, so no term crosses a boundary, and each
    initial state enters at its sequence's first token as that token's own outer product would.

    The chunked tensors are head-major (``[batch, groups, heads per group, chunk, ...]``): the products take the
    large ``[.., chunk, chunk]`` decay-masked scores as they are, and only token-sized tensors are permuted.
    """
    batch, time, heads, dim_v = v.shape
    groups, dim_k = q.shape[-2:]
    if k.shape != q.shape or q.shape[:2] != v.shape[:2] or heads % groups:
        raise ValueError(
            f"chunked scan: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} disagree "
            "(need q, k [batch, time, groups, dim_k], v [batch, time, heads, dim_v], heads divisible by groups)"
        )
    chunk = max(1, min(scan_chunk_size(chunk_size, v.device), time))
    slice_tokens = scan_slice_tokens(batch, heads, chunk, v.device)
    if sequences is None and slice_tokens is not None and time > slice_tokens:
        return scan_in_slices(chunked_decay_scan, (q, k, v, log_decay), initial_state, slice_tokens, chunk_size=chunk)
    pad = -time % chunk  # zero keys and values on padding: nothing enters the state
    if log_decay is None:
        log_decay = v.new_zeros(batch, time, heads, dtype=torch.float32)
    qf, kf, vf, gf = (F.pad(t.float(), (0, 0) * (t.dim() - 2) + (0, pad)) if pad else t.float()
                      for t in (q, k, v, log_decay))  # (F.pad copies even when it pads nothing)
    if sequences is not None:
        starts = nonempty_spans(sequences, v.device).starts
        start_decay = gf[0, starts]  # [n_nonempty, heads]: the decay each initial state gets at its first token
        gf = gf.index_fill(1, starts, -torch.inf)  # nothing before a sequence start reaches it
    # each used by two products: laid out head-major once rather than copied by both
    qc = rearrange(qf, "b (c l) g n -> b g c l n", l=chunk).contiguous()
    kc = rearrange(kf, "b (c l) g n -> b g c l n", l=chunk).contiguous()
    vc = rearrange(vf, "b (c l) (g e) p -> b g e c l p", l=chunk, g=groups).contiguous()
    decay = rearrange(gf, "b (c l) (g e) -> b g e c l", l=chunk, g=groups)
    within = decay.cumsum(dim=-1)  # log-decay from the chunk start, inclusive
    inside = decay_matrix(decay)  # [b, g, e, c, l, s]: decay from token s to token l of a chunk
    to_end = inside[..., -1, :]  # [b, g, e, c, s]: from token s to the chunk's end

    # 1. inside each chunk: y = (q k^T * L) v, L the causal decay matrix
    scores = (qc @ kc.transpose(-1, -2)).unsqueeze(2) * inside  # [b, g, e, c, l, s]
    y = scores @ vc  # [b, g, e, c, l, p]

    # 2. the state each chunk adds, as seen at its end
    added = torch.einsum("bgcsn,bgecsp->bgecpn", kc, vc * to_end.unsqueeze(-1))

    # 3. pass states across chunks (entry 0 is the initial state)
    if initial_state is None or sequences is not None:
        start = vf.new_zeros(batch, groups, heads // groups, 1, dim_v, dim_k)
    else:
        start = rearrange(initial_state.float(), "b (g e) p n -> b g e 1 p n", g=groups)
    injected = None
    if sequences is not None and initial_state is not None:
        injected = _inject_initial_states(initial_state, sequences, starts, start_decay, inside, qc, groups, chunk)
        y = y.index_add(3, injected.chunks, injected.outputs)
        added = added.index_add(3, injected.chunks, injected.at_chunk_end)
    states = torch.cat([start, added], dim=3)  # [b, g, e, c+1, p, n]
    across = decay_matrix(F.pad(within[..., -1], (1, 0)))  # [b, g, e, c+1, c+1]
    states = across @ states.flatten(-2)  # [b, g, e, c+1, p n]
    entering = states[..., :-1, :].unflatten(-1, (dim_v, dim_k))  # [b, g, e, c, p, n]
    final = states[..., -1, :].unflatten(-1, (dim_v, dim_k))  # [b, g, e, p, n]

    # 4. what the entering state contributes to each position
    y = y + torch.einsum("bgcln,bgecpn->bgeclp", qc, entering) * exp_flushed(within).unsqueeze(-1)
    y = rearrange(y, "b g e c l p -> b (c l) (g e) p")[:, :time]
    if sequences is not None:
        final = _sequence_final_states(sequences, initial_state, injected, entering, within, inside, kc, vc, chunk)
        return y, final
    return y, rearrange(final, "b g e p n -> b (g e) p n")


def scan_in_slices(scan, inputs, initial_state, slice_tokens: int, **options):
    """``scan(*inputs, initial_state=..., **options) -> (y [batch, time, ...], final_state)`` run on ``slice_tokens``
    tokens of ``inputs`` (each ``[batch, time, ...]``, or None) at a time, each slice starting from the state the
    one before ended in (see :data:`CPU_SLICE_ELEMENTS`)."""
    outputs, state = [], initial_state
    for start in range(0, inputs[0].shape[1], slice_tokens):
        part = slice(start, start + slice_tokens)
        y, state = scan(*(None if t is None else t[:, part] for t in inputs), initial_state=state, **options)
        outputs.append(y)
    return torch.cat(outputs, dim=1), state


class _Injected(NamedTuple):
    """Initial states of packed sequences entering at their first tokens (``m`` non-empty sequences)."""

    chunks: torch.Tensor  # [m] chunk of each first token
    offsets: torch.Tensor  # [m] its place in the chunk
    states: torch.Tensor  # [m, g, e, p, n] the initial state after the first token's decay
    outputs: torch.Tensor  # [1, g, e, m, l, p] what it adds to the outputs of its chunk
    at_chunk_end: torch.Tensor  # [1, g, e, m, p, n] what it adds to its chunk's end state


def _inject_initial_states(initial_state, sequences, starts, start_decay, inside, qc, groups, chunk) -> _Injected:
    """An initial state acts like one more outer product at its sequence's first token: it reaches later
    tokens of the chunk (and the chunk's end) through the same decay matrix ``inside``."""
    chunks, offsets = starts // chunk, starts % chunk
    nonempty = nonempty_spans(sequences, starts.device).index
    s0 = rearrange(initial_state.float()[nonempty], "m (g e) p n -> m g e p n", g=groups)
    s0 = s0 * rearrange(torch.exp(start_decay), "m (g e) -> m g e 1 1", g=groups)
    by_chunk = rearrange(inside[0], "g e c l s -> c l s g e")
    column = by_chunk[chunks, :, offsets]  # [m, l, g, e]: decay from each first token to the tokens of its chunk
    outputs = torch.einsum("gmln,mgepn,mlge->gemlp", qc[0][:, chunks], s0, column)
    at_chunk_end = s0 * rearrange(column[:, -1], "m g e -> m g e 1 1")
    return _Injected(chunks, offsets, s0, outputs.unsqueeze(0),
                     rearrange(at_chunk_end, "m g e p n -> 1 g e m p n"))


def _sequence_final_states(sequences, initial_state, injected, entering, within, inside, kc, vc, chunk):
    """``[n_seqs, heads, dim_v, dim_k]``: the state after each packed sequence's last token (its initial state,
    or zeros, for an empty sequence). The state after token ``l`` of chunk ``c`` is the entering state decayed
    to ``l``, plus the chunk's outer products up to ``l`` decayed to ``l``, plus an initial state injected there."""
    n_seqs, spans = len(sequences) - 1, nonempty_spans(sequences, entering.device)
    chunks, offsets = spans.lasts // chunk, spans.lasts % chunk
    by_chunk = rearrange(inside[0], "g e c l s -> c l s g e")
    upto = by_chunk[chunks, offsets]  # [m, s, g, e]: decay from each token of the end chunk to the end
    state = torch.einsum("gmsn,msge,gemsp->mgepn", kc[0][:, chunks], upto, vc[0][:, :, chunks])
    from_entering = torch.exp(rearrange(within[0], "g e c l -> c l g e")[chunks, offsets])  # [m, g, e]
    state = state + rearrange(entering[0][:, :, chunks], "g e m p n -> m g e p n") * from_entering[..., None, None]
    if injected is not None:  # an initial state that entered in the end chunk itself
        reach = by_chunk[chunks, offsets, injected.offsets] * (injected.chunks == chunks)[:, None, None]
        state = state + injected.states * reach[..., None, None]
    state = rearrange(state, "m g e p n -> m (g e) p n")
    if initial_state is None:
        final = state.new_zeros(n_seqs, *state.shape[1:])
    else:
        final = initial_state.float()
    return final.index_put((spans.index,), state)


def ssd_through(scan, x, dt, A, B, C, chunk_size, D=None, initial_state=None, fused_skip=False, **scan_options):
    """SSD computed by a chunked decay ``scan`` (q = C, k = B, v = dt x, log decay = dt A) plus the skip ``D x``.

    Shared by this reference and the faster backends, which differ only in ``scan``. With ``fused_skip`` the scan
    adds ``D x`` and casts to ``x``'s dtype itself (``skip=x, skip_weight=D [heads, 1 or head_dim], dtype=``), and
    scales ``v = x`` by ``dt`` itself (``v_scale=dt``).
    """
    batch, time, heads, _ = x.shape
    if dt.shape != (batch, time, heads) or A.shape != (heads,):
        raise ValueError(f"ssd_chunk_scan: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)} disagree")
    dtf = dt.float()
    if fused_skip:
        weight = None if D is None else D.unsqueeze(-1) if D.dim() == 1 else D
        return scan(C, B, x, dtf * A.float(), chunk_size, initial_state, skip=None if D is None else x,
                    skip_weight=weight, dtype=x.dtype, v_scale=dt, **scan_options)
    y, final = scan(C, B, x.float() * dtf.unsqueeze(-1), dtf * A.float(), chunk_size, initial_state, **scan_options)
    return with_skip(y, x, D), final


def with_skip(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor:
    """``y + D x`` in fp32, cast to ``x``'s dtype: ``y`` fp32 and ``x [..., heads, head_dim]``, ``D [heads]`` or
    ``[heads, head_dim]`` (None: no skip)."""
    if D is not None:
        y = y + x.float() * (D.float().unsqueeze(-1) if D.dim() == 1 else D.float())
    return y.to(x.dtype)


def ssd_chunk_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's SSD: ``S[t] = exp(dt[t] A) S[t-1] + dt[t] x[t] (outer) B[t]``, ``y[t] = S[t] C[t] + D x[t]``.

    Layout follows mamba-ssm's ``mamba_chunk_scan_combined``: ``x [batch, time, heads, head_dim]``, ``dt
    [batch, time, heads]`` (already biased, soft-plussed and clamped), ``A [heads]``, ``B, C [batch, time,
    groups, dstate]``, ``D [heads]`` or ``[heads, head_dim]``. Returns ``(y like x, final_state [batch, heads,
    head_dim, dstate] fp32)``.

    With ``seq_idx`` or ``cu_seqlens`` (see :func:`packed_sequences`) the batch of one holds several sequences
    packed along time; each starts from its own ``initial_state`` row and ends in its own ``final_state`` row
    (``[n_seqs, heads, head_dim, dstate]``), all in one chunked scan (see :func:`chunked_decay_scan`).
    """
    bounds = packed_sequences(x.shape[0], x.shape[1], seq_idx, cu_seqlens)
    check_initial_states("ssd_chunk_scan", bounds, initial_state)
    return ssd_through(chunked_decay_scan, x, dt, A, B, C, chunk_size, D, initial_state, sequences=bounds)


def decay_scan_states(k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, initial_state: torch.Tensor,
                      chunk_size: int = 64) -> torch.Tensor:
    """The state after each token of :func:`chunked_decay_scan` (what rolling it back to any token needs):
    ``[batch, time, heads, dim_v, dim_k]`` fp32 (a transposed view of ``[batch, heads, time, ...]`` storage).
    ``k [batch, time, groups, dim_k]``, ``v [batch, time, heads, dim_v]``, ``log_decay [batch, time, heads]``,
    ``initial_state [batch, heads, dim_v, dim_k]``. Inside a chunk ``S[t] = exp(G[t]) S_in + sum_{s<=t}
    exp(G[t] - G[s]) v[s] (outer) k[s]`` (the segment-sum matrix, as in the scan): one matrix product whose first
    source is the entering state, so each chunk allocates its states once; only the chunk-to-chunk carry is a
    loop."""
    batch, time, heads, dim_v = v.shape
    kf = k.float().repeat_interleave(heads // k.shape[2], dim=2).transpose(1, 2)  # [b, h, t, n]
    vf, gf, state = v.float().transpose(1, 2), log_decay.float().transpose(1, 2), initial_state.float()
    states = []
    for start in range(0, time, chunk_size):
        g = gf[..., start : start + chunk_size]  # [b, h, l]
        length = g.shape[-1]
        # [b, h, l, 1 + l]: the decay of the entering state, and of each token's outer product, to token l
        weights = torch.cat([exp_flushed(g.cumsum(-1)).unsqueeze(-1), decay_matrix(g)], dim=-1)
        v_part, k_part = vf[:, :, start : start + length, :, None], kf[:, :, start : start + length, None, :]
        if torch.is_grad_enabled():  # (out= cannot record a graph)
            sources = torch.cat([state.unsqueeze(2), v_part * k_part], dim=2)  # [b, h, 1 + s, p, n]
        else:  # the outer products written in place: one allocation of the chunk's size fewer
            sources = vf.new_empty(batch, heads, 1 + length, dim_v, kf.shape[-1])
            sources[:, :, 0] = state
            torch.mul(v_part, k_part, out=sources[:, :, 1:])
        chunk = (weights @ sources.flatten(3)).view(batch, heads, length, dim_v, -1)  # [b, h, l, p, n]
        states.append(chunk)
        state = chunk[:, :, -1]
    return (states[0] if len(states) == 1 else torch.cat(states, dim=2)).transpose(1, 2)


def ssd_states(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               initial_state: torch.Tensor) -> torch.Tensor:
    """The state after each token of :func:`ssd_chunk_scan_ref` (same arguments): ``[batch, time, heads,
    head_dim, dstate]`` fp32."""
    dtf = dt.float()
    return decay_scan_states(B, x.float() * dtf.unsqueeze(-1), dtf * A.float(), initial_state)


#: A short forward whose per-token states hold at most this many elements (batch x time x heads x head_dim x
#: dstate) computes them and reads its output out of them on CPU: faster there than the chunked scan's many small
#: ops (mamba2-small's shapes, 1 thread: 0.19 against 0.37 ms for 2 tokens, 0.32 against 0.39 for 8; past about
#: 256K elements, e.g. 4 rows of 8 tokens, the scan is faster).
PER_TOKEN_ELEMENTS = 1 << 17


def per_token_is_faster(x: torch.Tensor, dstate: int) -> bool:
    """Whether the SSD of ``x [batch, time, heads, head_dim]`` is cheaper through :func:`ssd_states` and
    :func:`ssd_readout` than through the chunked scan (CPU reference only; GPU kernels keep their path)."""
    return x.device.type == "cpu" and x.numel() * dstate <= PER_TOKEN_ELEMENTS


def ssd_readout(states: torch.Tensor, C: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`ssd_chunk_scan_ref`'s output from its per-token states (:func:`ssd_states`): ``y[t] = S[t] C[t] +
    D x[t]``, like ``x``. A forward that keeps the states reads its output out of them instead of running the
    scan a second time. ``states [batch, time, heads, head_dim, dstate]`` fp32, ``C [batch, time, groups,
    dstate]``, ``x [batch, time, heads, head_dim]``, ``D [heads]`` or ``[heads, head_dim]``."""
    heads, groups = states.shape[2], C.shape[2]
    by_head = C.float().repeat_interleave(heads // groups, dim=2).transpose(1, 2)  # [b, h, t, n]
    # in ssd_states' [b, h, t, p, n] storage, where an einsum is ~5x faster than batched matrix-vector products
    y = torch.einsum("bhtpn,bhtn->bhtp", states.transpose(1, 2), by_head).transpose(1, 2)  # [b, t, h, p] fp32
    return with_skip(y, x, D)
