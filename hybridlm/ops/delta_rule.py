"""The gated delta rule (Gated DeltaNet, Qwen3-Next; with a channel-wise gate, Kimi Delta Attention).

Per value head, with the state ``S [dim_k, dim_v]`` (the layout of fla and transformers: keys index the rows)::

    S[t] = (I - beta[t] k[t] k[t]^T) diag(alpha[t]) S[t-1] + beta[t] k[t] v[t]^T        o[t] = S[t]^T (scale q[t])

which is ``S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T`` written for the transposed state.
``alpha = exp(g)`` is one number per head (Gated DeltaNet) or one per key channel (KDA). Keys and queries may be
shared by groups of consecutive value heads (``value heads = groups * key heads``, as Qwen3-Next does).

The chunked form (the WY representation of DeltaNet's paper): inside a chunk that starts from ``S0``, the
corrections ``u[t] = beta[t] (v[t] - k[t]^T diag(alpha[t]) S[t-1])`` satisfy a unit lower-triangular system
``(I + tril(beta K K_decayed^T, -1)) U = beta V - beta (K * exp(G)) S0`` (``G`` the in-chunk cumulative log
gate), so ``U = Wv - Wk S0`` with ``Wv, Wk`` found for all chunks at once by one triangular solve. Then
``o = (Q * exp(G)) S0 + tril(Q K_decayed^T) U`` and the next chunk starts from ``exp(G_end) S0 + K_end^T U``.
Only that last step, a pair of small matrix products per chunk, runs in a loop over chunks: the delta rule's
state transition is a full matrix, not a decay, so chunks cannot be combined by a segment sum as in SSD.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from hybridlm.ops.ssd import exp_flushed, packed_sequences, scan_in_slices, scan_slice_tokens

# The channel-wise gate's decay tensor [..., L, L, dim_k] is dim_k times the scalar gate's (268 MB per layer at 2048
# tokens, 8 heads of 64 keys, chunk 64): it is formed a slice of chunks at a time, each at most this many elements.
_DECAY_ELEMENTS = 1 << 22

def _check(q, k, v, log_gate, beta, initial_state) -> None:
    batch, time, heads, dim_v = v.shape
    key_heads, dim_k = q.shape[-2:]
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if k.shape != q.shape or q.shape[:2] != (batch, time) or heads % key_heads:
        raise ValueError(f"gated_delta_rule: {shapes} disagree (need q, k [batch, time, key_heads, dim_k], "
                         "v [batch, time, heads, dim_v], heads a multiple of key_heads)")
    if beta.shape != (batch, time, heads):
        raise ValueError(f"gated_delta_rule: beta {tuple(beta.shape)} must be [batch, time, heads] for {shapes}")
    if log_gate is not None and log_gate.shape not in ((batch, time, heads), (batch, time, heads, dim_k)):
        raise ValueError(f"gated_delta_rule: log_gate {tuple(log_gate.shape)} must be [batch, time, heads] or "
                         f"[batch, time, heads, dim_k] for {shapes}")
    if initial_state is not None and initial_state.shape != (batch, heads, dim_k, dim_v):
        raise ValueError(f"gated_delta_rule: initial_state {tuple(initial_state.shape)} must be "
                         f"[batch, heads, dim_k, dim_v] = {(batch, heads, dim_k, dim_v)}")


def _decayed_products(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, diagonal: int) -> torch.Tensor:
    """``out[..., i, j] = sum_d a[i, d] b[j, d] exp(G[i(, d)] - G[j(, d)])`` for ``j <= i + diagonal``
    (``diagonal`` 0: lower triangle with the diagonal, -1: strictly lower), zero above; decays below
    :data:`~hybridlm.ops.ssd.FLUSHED` are zero, keeping ``exp`` off the CPU's slow path for tiny results (this
    matrix 1.3x faster for gates of -0.05 a token, 2.5x for -8; the whole op at 2,048 tokens 1.0-1.2x).

    ``a, b [..., L, dim_k]``; ``G [..., L]`` (one gate per head) or ``[..., L, dim_k]`` (per channel). The
    exponent is masked before ``exp``, so the entries that are dropped cannot overflow.
    """
    n = a.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(diagonal)
    if G.dim() == a.dim() - 1:  # scalar gate: [..., L, L]
        decay = exp_flushed((G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~keep, -torch.inf))
        return (a @ b.transpose(-1, -2)) * decay
    lead, dim_k = a.shape[:-2], a.shape[-1]
    a, b, G = (t.reshape(-1, n, dim_k) for t in (a, b, G))  # [z, L, dim_k]
    step = max(1, _DECAY_ELEMENTS // (n * n * dim_k))
    parts = []
    for start in range(0, a.shape[0], step):
        part = slice(start, start + step)
        diff = (G[part, :, None] - G[part, None]).masked_fill(~keep[..., None], -torch.inf)  # [z', L, L, dim_k]
        parts.append(torch.einsum("zid,zjd,zijd->zij", a[part], b[part], exp_flushed(diff)))
    return torch.cat(parts).view(*lead, n, n)


def _scale_rows(S: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``diag(gate) S`` for ``S [..., dim_k, dim_v]`` and ``gate [...]`` or ``[..., dim_k]``."""
    return S * (gate[..., None, None] if gate.dim() == S.dim() - 2 else gate[..., None])


def _wy_terms(kc, vc, bc, G, G_at) -> tuple[torch.Tensor, torch.Tensor]:
    """``Wv, Wk`` of each chunk, solving ``(I + strictly_lower(beta K K_decayed^T)) [Wv, Wk] = beta [V, K e^G]``,
    so that a chunk entered with ``S0`` has the corrections ``U = Wv - Wk S0``. ``kc [..., l, dim_k]``, ``vc
    [..., l, dim_v]``, ``bc [..., l]``, ``G`` the in-chunk cumulative log gate, ``G_at`` it broadcast over keys."""
    eye = torch.eye(kc.shape[-2], dtype=kc.dtype, device=kc.device)
    system = eye + bc.unsqueeze(-1) * _decayed_products(kc, kc, G, -1)  # [..., l, l]
    rhs = bc.unsqueeze(-1) * torch.cat([vc, kc * G_at.exp()], dim=-1)  # [..., l, dim_v + dim_k]
    # solved transposed (X system^T = rhs^T): the same system, but LAPACK then reads the row-major rhs without the
    # transposing copy a left solve makes; about 3x faster on CPU at chunk 64, dim_v + dim_k = 128
    solved = torch.linalg.solve_triangular(system.mT, rhs.mT, upper=True, left=False, unitriangular=True).mT
    return solved.split([vc.shape[-1], kc.shape[-1]], -1)


def gated_delta_rule_ref(
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
    """The gated delta rule over a sequence, continuing from ``initial_state`` (zeros when None).

    ``q, k [batch, time, key_heads, dim_k]`` (normalised by the caller if wanted), ``v [batch, time, heads,
    dim_v]``, ``log_gate [batch, time, heads]`` or ``[batch, time, heads, dim_k]`` (``log alpha <= 0``; None: no
    decay), ``beta [batch, time, heads]``, ``scale`` multiplies the queries (None: ``dim_k ** -0.5``).
    Returns ``(o like v, final_state [batch, heads, dim_k, dim_v])``, computed and returned in fp32 (fp64 for
    fp64 inputs). The chunk size changes only the rounding. With ``cu_seqlens`` (see
    :func:`~hybridlm.ops.ssd.packed_sequences`) the batch of one holds several sequences packed along time,
    each with its own initial and final state row.
    """
    _check(q, k, v, log_gate, beta, initial_state if cu_seqlens is None else None)
    bounds = packed_sequences(v.shape[0], v.shape[1], None, cu_seqlens)
    if bounds is not None:
        return _packed(q, k, v, log_gate, beta, scale, initial_state, chunk_size, bounds)
    batch, time, heads, dim_v = v.shape
    key_heads, dim_k = q.shape[-2:]
    dtype = torch.promote_types(v.dtype, torch.float32)
    scale = dim_k**-0.5 if scale is None else scale
    chunk = max(1, min(chunk_size, time))
    slice_tokens = scan_slice_tokens(batch, heads, chunk, v.device)
    # in slices on the CPU (ssd.CPU_SLICE_ELEMENTS), bit-identical: 8 heads of 64 at 2,048 and 8,192 tokens, 1 thread,
    # 0.96-1.19x at the min over four noisy runs (1.16x on the quietest), 0.9-1.4x at the median
    if slice_tokens is not None and time > slice_tokens:
        return scan_in_slices(gated_delta_rule_ref, (q, k, v, log_gate, beta), initial_state, slice_tokens,
                              scale=scale, chunk_size=chunk)
    pad = -time % chunk  # zero keys, values, beta and gate on padding: the state passes unchanged

    def chunked(t: torch.Tensor, pattern: str) -> torch.Tensor:
        t = F.pad(t.to(dtype), (0, 0) * (t.dim() - 2) + (0, pad))
        return rearrange(t, pattern, l=chunk).contiguous()  # one copy here, not one per matrix product below

    group = heads // key_heads  # value heads per key head
    qc = chunked(q.repeat_interleave(group, dim=2) * scale, "b (c l) h d -> b h c l d")
    kc = chunked(k.repeat_interleave(group, dim=2), "b (c l) h d -> b h c l d")
    vc = chunked(v, "b (c l) h d -> b h c l d")
    bc = chunked(beta, "b (c l) h -> b h c l")
    if log_gate is None:
        log_gate = beta.new_zeros(batch, time, heads)
    if log_gate.dim() == 3:
        G = chunked(log_gate, "b (c l) h -> b h c l").cumsum(-1)  # [b, h, c, l]
        G_at = G.unsqueeze(-1)  # broadcast over dim_k
    else:
        G = chunked(log_gate, "b (c l) h d -> b h c l d").cumsum(-2)  # [b, h, c, l, dim_k]
        G_at = G
    G_end = G_at[:, :, :, -1:]  # [b, h, c, 1, 1 or dim_k]: the log gate over the whole chunk

    # 1. all chunks at once: U = Wv - Wk S0, (I + strictly_lower(beta K K_decayed^T)) [Wv, Wk] = beta [V, K e^G]
    Wv, Wk = _wy_terms(kc, vc, bc, G, G_at)  # [b, h, c, l, dim_v], [b, h, c, l, dim_k]
    attend = _decayed_products(qc, kc, G, 0)  # [b, h, c, l, l]
    q_decayed = qc * G_at.exp()  # what the entering state gives each query
    k_to_end = kc * (G_end - G_at).exp()  # each key decayed to the chunk end

    # 2. carry the state across chunks (the only loop: the transition is a full matrix)
    state = (torch.zeros(batch, heads, dim_k, dim_v, dtype=dtype, device=v.device) if initial_state is None
             else initial_state.to(dtype))
    entering, corrections = [], []
    for c in range(qc.shape[2]):
        u = Wv[:, :, c] - Wk[:, :, c] @ state  # [b, h, l, dim_v]
        entering.append(state)
        corrections.append(u)
        state = state * G_end[:, :, c].exp().transpose(-1, -2) + k_to_end[:, :, c].transpose(-1, -2) @ u
    S0 = torch.stack(entering, dim=2)  # [b, h, c, dim_k, dim_v]
    U = torch.stack(corrections, dim=2)  # [b, h, c, l, dim_v]

    # 3. outputs: the entering state read by the decayed queries, plus the in-chunk corrections
    o = q_decayed @ S0 + attend @ U  # [b, h, c, l, dim_v]
    o = rearrange(o, "b h c l d -> b (c l) h d")[:, :time]
    return o.to(v.dtype), state


def _packed(q, k, v, log_gate, beta, scale, initial_state, chunk_size, bounds):
    """Each packed sequence run alone (this reference's way of honouring ``cu_seqlens``)."""
    n_seqs = len(bounds) - 1
    if initial_state is not None and initial_state.shape[0] != n_seqs:
        raise ValueError(f"gated_delta_rule: {n_seqs} packed sequences but {initial_state.shape[0]} initial states")
    outs, finals = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        part = slice(start, end)
        o, final = gated_delta_rule_ref(
            q[:, part], k[:, part], v[:, part], None if log_gate is None else log_gate[:, part], beta[:, part],
            scale=scale, initial_state=None if initial_state is None else initial_state[i : i + 1],
            chunk_size=chunk_size,
        )
        outs.append(o)
        finals.append(final)
    return torch.cat(outs, dim=1), torch.cat(finals)


def gated_delta_rule_step_ref(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gate: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step: ``q, k [batch, key_heads, dim_k]``, ``v [batch, heads, dim_v]``, ``log_gate [batch,
    heads(, dim_k)]``, ``beta [batch, heads]``. Updates ``state [batch, heads, dim_k, dim_v]`` in place and
    returns ``o [batch, heads, dim_v]`` (dtype of ``v``)."""
    batch, heads, dim_v = v.shape
    dim_k = q.shape[-1]
    if state.shape != (batch, heads, dim_k, dim_v) or k.shape != q.shape or heads % q.shape[1]:
        raise ValueError(f"gated_delta_rule_step: state {tuple(state.shape)}, q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    dtype = state.dtype
    group = heads // q.shape[1]
    scale = dim_k**-0.5 if scale is None else scale
    qh, kh = (t.repeat_interleave(group, dim=1).to(dtype) for t in (q, k))  # [b, h, dim_k]
    S = state if log_gate is None else _scale_rows(state, log_gate.to(dtype).exp())
    u = beta.to(dtype)[..., None] * (v.to(dtype) - torch.einsum("bhk,bhkv->bhv", kh, S))  # [b, h, dim_v]
    S = S + kh[..., None] * u[..., None, :]
    state.copy_(S)
    return torch.einsum("bhk,bhkv->bhv", qh * scale, S).to(v.dtype)


def gated_delta_rule_states(k: torch.Tensor, v: torch.Tensor, log_gate: torch.Tensor | None, beta: torch.Tensor,
                            initial_state: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """The state after each token of :func:`gated_delta_rule_ref` (same arguments): ``[batch, time, heads, dim_k,
    dim_v]`` (what rolling it back to any token needs). The chunked WY form: inside a chunk entered with
    ``S0``, ``S[t] = diag(exp(G[t])) S0 + sum_{i<=t} diag(exp(G[t] - G[i])) k[i] u[i]^T``."""
    heads = v.shape[2]
    dtype = torch.promote_types(v.dtype, torch.float32)
    kh = k.repeat_interleave(heads // k.shape[2], dim=2).to(dtype).transpose(1, 2)  # [b, h, t, dim_k]
    vh, bh = v.to(dtype).transpose(1, 2), beta.to(dtype).transpose(1, 2)  # [b, h, t, dim_v], [b, h, t]
    gh = torch.zeros_like(bh) if log_gate is None else log_gate.to(dtype).transpose(1, 2)  # [b, h, t(, dim_k)]
    state, states = initial_state.to(dtype), []
    for start in range(0, v.shape[1], chunk_size):
        part = slice(start, start + chunk_size)
        kc, vc, bc = kh[:, :, part], vh[:, :, part], bh[:, :, part]
        G = gh[:, :, part].cumsum(2)  # [b, h, l(, dim_k)]
        G_at = G if G.dim() == 4 else G.unsqueeze(-1)  # [b, h, l, dim_k or 1]
        Wv, Wk = _wy_terms(kc, vc, bc, G, G_at)
        U = Wv - Wk @ state  # [b, h, l, dim_v]
        keep = torch.ones(kc.shape[2], kc.shape[2], dtype=torch.bool, device=kc.device).tril()  # [t, i]: i <= t
        diff = G_at.unsqueeze(3) - G_at.unsqueeze(2)  # [b, h, t, i, dim_k or 1]
        reach = exp_flushed(diff.masked_fill(~keep[..., None], -torch.inf))
        chunk = torch.einsum("bhtid,bhie->bhtde", reach * kc.unsqueeze(2), U)  # k[i] decayed to t, times u[i]
        chunk = chunk + G_at.exp().unsqueeze(-1) * state.unsqueeze(2)  # [b, h, l, dim_k, dim_v]
        states.append(chunk)
        state = chunk[:, :, -1]
    return torch.cat(states, dim=2).transpose(1, 2)
