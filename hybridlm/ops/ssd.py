"""Chunked scan with a scalar decay per head: Mamba-2's SSD, and gated linear attention (pure PyTorch reference).

The core recurrence, per head ``h`` with a ``[dim_v, dim_k]`` state, keys/queries shared by the heads of a
group::

    S[t] = exp(g[t]) * S[t-1] + v[t] (outer) k[t]        y[t] = S[t] @ q[t]

Mamba-2's SSD is this with ``q = C``, ``k = B``, ``v = dt * x``, ``g = dt * A``. Inside a chunk the output is
a decay-masked matrix product (the "attention" form); the states entering the chunks are combined for all
chunks at once by the segment-sum matrix of chunk decays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = x[..., j+1] + ... + x[..., i]`` for ``j <= i`` and ``-inf`` above the diagonal.

    Built by a masked cumulative sum rather than a difference of cumsums, which loses precision when the
    cumulative decay is large.
    """
    n = x.shape[-1]
    x = x.unsqueeze(-1).expand(*x.shape, n)  # x[..., i, j] = x_i
    strictly_lower = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)
    sums = x.masked_fill(~strictly_lower, 0.0).cumsum(dim=-2)
    lower = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    return sums.masked_fill(~lower, -torch.inf)


def chunked_decay_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor | None,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q, k [batch, time, groups, dim_k]``, ``v [batch, time, heads, dim_v]``, ``log_decay [batch, time, heads]``
    (None: no decay). Returns ``(y [batch, time, heads, dim_v] fp32, final_state [batch, heads, dim_v, dim_k]
    fp32)``. The chunk size changes only the rounding."""
    batch, time, heads, dim_v = v.shape
    groups, dim_k = q.shape[-2:]
    if k.shape != q.shape or q.shape[:2] != v.shape[:2] or heads % groups:
        raise ValueError(
            f"chunked scan: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} disagree "
            "(need q, k [batch, time, groups, dim_k], v [batch, time, heads, dim_v], heads divisible by groups)"
        )
    chunk = max(1, min(chunk_size, time))
    pad = -time % chunk  # zero keys and values on padding: nothing enters the state
    if log_decay is None:
        log_decay = v.new_zeros(batch, time, heads, dtype=torch.float32)
    qf, kf, vf, gf = (F.pad(t.float(), (0, 0) * (t.dim() - 2) + (0, pad)) for t in (q, k, v, log_decay))
    qc = rearrange(qf, "b (c l) g n -> b c l g n", l=chunk)
    kc = rearrange(kf, "b (c l) g n -> b c l g n", l=chunk)
    vc = rearrange(vf, "b (c l) (g e) p -> b c l g e p", l=chunk, g=groups)
    decay = rearrange(gf, "b (c l) (g e) -> b g e c l", l=chunk, g=groups)
    within = decay.cumsum(dim=-1)  # log-decay from the chunk start, inclusive

    # 1. inside each chunk: y = (q k^T * L) v, L the causal decay matrix
    scores = torch.einsum("bclgn,bcsgn->bgcls", qc, kc).unsqueeze(2) * torch.exp(segment_sum(decay))
    y = torch.einsum("bgecls,bcsgep->bclgep", scores, vc)

    # 2. the state each chunk adds, as seen at its end
    to_end = torch.exp(within[..., -1:] - within)  # [b, g, e, c, l]
    added = torch.einsum("bcsgn,bgecs,bcsgep->bcgepn", kc, to_end, vc)

    # 3. pass states across chunks (entry 0 is the initial state)
    if initial_state is None:
        start = vf.new_zeros(batch, 1, groups, heads // groups, dim_v, dim_k)
    else:
        start = rearrange(initial_state.float(), "b (g e) p n -> b 1 g e p n", g=groups)
    states = torch.cat([start, added], dim=1)  # [b, c+1, g, e, p, n]
    across = torch.exp(segment_sum(F.pad(within[..., -1], (1, 0))))  # [b, g, e, c+1, c+1]
    states = torch.einsum("bgezc,bcgepn->bzgepn", across, states)
    entering, final = states[:, :-1], states[:, -1]

    # 4. what the entering state contributes to each position
    y = y + torch.einsum("bclgn,bcgepn,bgecl->bclgep", qc, entering, torch.exp(within))
    y = rearrange(y, "b c l g e p -> b (c l) (g e) p")[:, :time]
    return y, rearrange(final, "b g e p n -> b (g e) p n")


def packed_sequences(
    batch: int, time: int, seq_idx: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
) -> list[int] | None:
    """Boundaries ``[0, ..., time]`` of the sequences packed along time, or None for an ordinary batch.

    Packing is given by ``cu_seqlens [n_seqs + 1]`` (cumulative lengths, starting at 0 and ending at ``time``)
    or ``seq_idx [1, time]`` (each token's sequence number: 0, 0, 1, 1, 1, 2, ...), or both if they agree.
    Packed input has batch size 1.
    """
    if seq_idx is None and cu_seqlens is None:
        return None
    if batch != 1:
        raise ValueError(f"packed sequences (seq_idx / cu_seqlens) need batch size 1, got {batch}")
    bounds = None
    if cu_seqlens is not None:
        bounds = [int(b) for b in torch.as_tensor(cu_seqlens).flatten().tolist()]
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != time or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(
                f"cu_seqlens must rise from 0 to time={time} with at least one sequence, got {bounds}"
            )
    if seq_idx is not None:
        if tuple(seq_idx.shape) != (1, time) or seq_idx.is_floating_point() or time == 0:
            raise ValueError(f"seq_idx must be integer [1, time={time}] with time > 0, got {tuple(seq_idx.shape)}")
        ids = seq_idx[0].tolist()
        if ids[0] != 0 or any(b - a not in (0, 1) for a, b in zip(ids, ids[1:])):
            raise ValueError("seq_idx must number the packed sequences 0, 1, 2, ... in order, without gaps")
        from_ids = [0] + [t for t in range(1, time) if ids[t] != ids[t - 1]] + [time]
        if bounds is not None and [b for i, b in enumerate(bounds) if i == 0 or b != bounds[i - 1]] != from_ids:
            raise ValueError(f"seq_idx and cu_seqlens disagree: {from_ids} vs {bounds}")
        bounds = bounds or from_ids
    return bounds


def ssd_through(scan, x, dt, A, B, C, chunk_size, D=None, initial_state=None, **scan_options):
    """SSD computed by a chunked decay ``scan`` (q = C, k = B, v = dt x, log decay = dt A) plus the skip ``D x``.

    Shared by this reference and the faster backends, which differ only in ``scan``.
    """
    batch, time, heads, _ = x.shape
    if dt.shape != (batch, time, heads) or A.shape != (heads,):
        raise ValueError(f"ssd_chunk_scan: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)} disagree")
    dtf = dt.float()
    y, final = scan(C, B, x.float() * dtf.unsqueeze(-1), dtf * A.float(), chunk_size, initial_state, **scan_options)
    if D is not None:
        y = y + x.float() * (D.float().unsqueeze(-1) if D.dim() == 1 else D.float())
    return y.to(x.dtype), final


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
    (``[n_seqs, heads, head_dim, dstate]``). This reference simply runs each sequence alone.
    """
    bounds = packed_sequences(x.shape[0], x.shape[1], seq_idx, cu_seqlens)
    if bounds is None:
        return ssd_through(chunked_decay_scan, x, dt, A, B, C, chunk_size, D, initial_state)
    n_seqs = len(bounds) - 1
    if initial_state is not None and initial_state.shape[0] != n_seqs:
        raise ValueError(f"ssd_chunk_scan: {n_seqs} packed sequences but {initial_state.shape[0]} initial states")
    ys, finals = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        y, final = ssd_chunk_scan_ref(
            x[:, start:end], dt[:, start:end], A, B[:, start:end], C[:, start:end], chunk_size, D,
            initial_state=None if initial_state is None else initial_state[i : i + 1],
        )
        ys.append(y)
        finals.append(final)
    return torch.cat(ys, dim=1), torch.cat(finals)
