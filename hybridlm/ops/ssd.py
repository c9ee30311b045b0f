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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's SSD: ``S[t] = exp(dt[t] A) S[t-1] + dt[t] x[t] (outer) B[t]``, ``y[t] = S[t] C[t] + D x[t]``.

    Layout follows mamba-ssm's ``mamba_chunk_scan_combined``: ``x [batch, time, heads, head_dim]``, ``dt
    [batch, time, heads]`` (already biased, soft-plussed and clamped), ``A [heads]``, ``B, C [batch, time,
    groups, dstate]``, ``D [heads]`` or ``[heads, head_dim]``. Returns ``(y like x, final_state [batch, heads,
    head_dim, dstate] fp32)``.
    """
    batch, time, heads, _ = x.shape
    if dt.shape != (batch, time, heads) or A.shape != (heads,):
        raise ValueError(f"ssd_chunk_scan: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)} disagree")
    dtf = dt.float()
    y, final = chunked_decay_scan(C, B, x.float() * dtf.unsqueeze(-1), dtf * A.float(), chunk_size, initial_state)
    if D is not None:
        y = y + x.float() * (D.float().unsqueeze(-1) if D.dim() == 1 else D.float())
    return y.to(x.dtype), final
