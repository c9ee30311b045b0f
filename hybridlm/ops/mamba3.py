"""Mamba-3's scan (arXiv 2603.15569): trapezoidal, data-dependent rotary, optionally MIMO (pure PyTorch reference).

The recurrence, per head, with a ``[head_dim, d_state]`` state ``h``, rank ``R`` (1: SISO)::

    theta[t]   = theta[t-1] + pi * tanh(angles[t]) * dt[t]           (the angle accumulator, kept mod 2 pi)
    q~[t, r]   = rot(theta[t]) (q[t, r] + q_bias[r])                 (k~ alike: a rotary, "complex", state)
    v[t, r]    = x[t] * mimo_v[r]                                    (SISO: v[t] = x[t])
    lam        = sigmoid(trap[t]);  alpha = exp(log_decay[t])
    h[t]       = alpha h[t-1] + (1 - lam) dt[t] alpha sum_r v[t-1, r] k~[t-1, r]^T + lam dt[t] sum_r v[t, r] k~[t, r]^T
    o[t, r]    = h[t] q~[t, r] + D v[t, r]
    o[t, r]    = rms_norm(o[t, r]) * norm_weight (optional) * silu(z[t] * mimo_z[r]) (optional)
    y[t]       = sum_r mimo_o[r] * o[t, r]                           (SISO: y[t] = o[t])

``rot(theta)`` turns ``n_angles`` pairs of the ``d_state`` entries: ``"interleaved"`` pairs ``(2i, 2i+1)``
(mamba-ssm's SISO layer and step references), ``"halves"`` pairs ``(i, i + d_state/2)`` (its MIMO kernels), each by
``theta[i]``; the other entries are not turned. The decode state is four tensors, as mamba-ssm's
``Mamba3.allocate_inference_cache``: :class:`Mamba3Carry`.

The chunked form (no loop over time): token ``s``'s key enters every later state with weight ``lam[s] dt[s] +
(1 - lam[s+1]) dt[s+1]`` (its own term, and its share in the next token's trapezoid), so the scan is the
scalar-decay chunked scan of :mod:`.ssd` over keys scaled by that weight; the next token's share is then taken
out of each token's own readout, and the carried previous key and value enter the initial state with the first
token's share. MIMO lays the ``R`` inputs of each token along time (decay at the first), then corrects the
``R x R`` block of each token so that all its queries see all its keys.

Mapping to mamba-ssm's own references (state-spaces/mamba e9594ce; tests/ops/triton/test_mamba3_siso.py and
tests/ops/tilelang/test_mamba3_mimo.py), all in fp32, ``tr(x) = x.transpose(1, 2)``:

=========================  =================================================================================
ours                        theirs
=========================  =================================================================================
q, k [b, t, R, g, n]        SISO ``Q, K`` [b, t, g, n] = ``q[:, :, 0]``; MIMO ``Q, K`` / ``q, k`` = q, k
v [b, t, h, p]              ``V`` / ``v``
log_decay, dt, trap [b,t,h] ``ADT = tr(log_decay)``, ``DT = tr(dt)``, ``Trap = tr(trap)`` ([b, h, t]); MIMO chunk:
                            ``dt, trap`` likewise, ``dA_cs`` = ``tr(log_decay)`` cumulated inside each chunk of
                            ``chunk_size`` tokens (zero-padded to a whole chunk), ``dA_cs_rev = dA_cs[..., -1:] -
                            dA_cs`` (both reshaped back to [b, h, t])
angles [b, t, h, A]         ``Angles`` (raw: tanh and pi applied inside), except MIMO chunk: ``angles`` =
                            ``cumsum_t(pi * tanh(angles) * dt[..., None])`` (its ``apply_angle_dt_reference``)
q_bias, k_bias [h, R, n]    SISO ``Q_bias, K_bias`` [h, n] = ``q_bias[:, 0]``; MIMO the same tensors
D [h], z [b, t, h, p]       ``D``, ``Z`` / ``z``
mimo_v, mimo_z, mimo_o      ``MIMO_V, MIMO_Z, MIMO_O`` (step) / ``mimo_v, mimo_z, mimo_o`` (chunk) [h, R, p]
norm_weight [h*p] or [h,p]  ``fused_norm=True, outproj_norm_weight`` (MIMO); None: ``fused_norm=False``. SISO
                            references have no norm (mamba-ssm's layer applies RMSNormGated after them: the same)
rope_pairs                  SISO refs and ``mamba3_MIMO_step_ref``: "interleaved"; ``mamba3_MIMO_chunk_ref``:
                            ``rotate_pairwise=True`` (A = n/2) is "interleaved", ``rotate_pairwise=False`` is
                            "halves" with ``rotary_dim_divisor = n / A`` (2 or 4)
chunk_size                  ``chunk_size`` (only rounding changes)
initial_state (Mamba3Carry) ``Initial_States`` / ``Input_States`` = ``(angle, ssm, k_state, v_state)``: SISO
                            ``k_state = k[:, 0]`` [b, h, n], ``v_state = v``; MIMO step ``k_state = tr(k)``
                            [b, h, R, n], ``v_state = einsum("bhp,hrp->bhrp", v, mimo_v)``; MIMO chunk: none
cu_seqlens / seq_idx        ``cu_seqlens`` (batch 1, one initial and one final state per sequence)
y [b, t, h, p]              ``out_z`` / ``out`` (``contract_mimo_out=True``)
final Mamba3Carry           ``Final_States`` (same maps as the initial state); MIMO chunk
                            (``return_final_state=True``): ``final_state = ssm.transpose(-1, -2)`` [b, h, n, p],
                            ``final_k = k`` [b, R, h, n],
                            exact there only when ``t`` is a multiple of ``chunk_size``
=========================  =================================================================================

The final angle is reduced to ``[0, 2 pi)``, as the SISO references do; ``mamba3_MIMO_step_ref`` leaves its angle
state unreduced, so compare it modulo ``2 pi``. One-token decode (:func:`mamba3_step_ref`) maps like the step
references with a time axis of one.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hybridlm.ops.packing import check_initial_states, nonempty_spans, packed_sequences, token_sequences
from hybridlm.ops.ssd import chunked_decay_scan, decay_scan_states

ROPE_PAIRS = ("interleaved", "halves")
_TWO_PI = 2 * math.pi


class Mamba3Carry(NamedTuple):
    """Mamba-3's decode state (mamba-ssm's four ``allocate_inference_cache`` tensors): ``angle [b, h, A]`` fp32
    (the accumulated rotary angles), ``ssm [b, h, head_dim, d_state]`` fp32, ``k [b, R, h, d_state]`` (the last
    token's rotated, biased keys) and ``v [b, h, head_dim]`` (its ``x``, before the MIMO up-projection)."""

    angle: torch.Tensor
    ssm: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def rotary_angles(n_state: int, fraction: float) -> int:
    """How many angles a ``d_state`` of ``n_state`` turns with rotary fraction ``fraction`` (mamba-ssm's count:
    ``fraction * d_state`` rounded down to an even number of entries); 0 when it is too small for one."""
    return int(n_state * fraction) // 2


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: str) -> torch.Tensor:
    """Turn the first ``A = cos.shape[-1]`` pairs of ``x [..., n]`` (see the module docstring for ``pairs``)."""
    a = cos.shape[-1]
    if pairs == "interleaved":
        first, second = x[..., 0 : 2 * a : 2], x[..., 1 : 2 * a : 2]
        turned = torch.stack([first * cos - second * sin, first * sin + second * cos], dim=-1).flatten(-2)
        return torch.cat([turned, x[..., 2 * a :]], dim=-1)
    half = x.shape[-1] // 2
    first, second = x[..., :a], x[..., half : half + a]
    return torch.cat([first * cos - second * sin, x[..., a:half], first * sin + second * cos, x[..., half + a :]], -1)


def _check(q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, mimo_v, mimo_o, rope_pairs, one_token=False):
    name = "mamba3_step" if one_token else "mamba3_scan"
    lead = v.shape[:-2]  # [b, t] (or [b])
    rank, groups, n = q.shape[-3:]
    heads, p = v.shape[-2:]
    shapes = {"log_decay": (*lead, heads), "dt": (*lead, heads), "trap": (*lead, heads), "k": tuple(q.shape),
              "q": (*lead, rank, groups, n), "q_bias": (heads, rank, n), "k_bias": (heads, rank, n)}
    for field, tensor in (("q", q), ("k", k), ("log_decay", log_decay), ("dt", dt), ("trap", trap),
                          ("q_bias", q_bias), ("k_bias", k_bias)):
        if tuple(tensor.shape) != shapes[field]:
            raise ValueError(f"{name}: {field} is {tuple(tensor.shape)}, expected {shapes[field]} (from q "
                             f"{tuple(q.shape)} and v {tuple(v.shape)})")
    if heads % groups:
        raise ValueError(f"{name}: {groups} key groups do not divide {heads} heads")
    if rope_pairs not in ROPE_PAIRS:
        raise ValueError(f"{name}: rope_pairs must be one of {ROPE_PAIRS}, got {rope_pairs!r}")
    a = angles.shape[-1]
    if tuple(angles.shape) != (*lead, heads, a) or a < 1 or 2 * a > n or (rope_pairs == "halves" and n % 2):
        raise ValueError(f"{name}: angles {tuple(angles.shape)} must be {(*lead, heads)} + (A,) with 1 <= 2A <= "
                         f"d_state={n} (an even d_state for 'halves')")
    if (mimo_v is None) != (mimo_o is None) or (mimo_v is None and rank != 1):
        raise ValueError(f"{name}: rank {rank} needs mimo_v and mimo_o [heads, rank, head_dim] (both or neither; "
                         "neither only for rank 1)")
    for field, tensor in (("mimo_v", mimo_v), ("mimo_o", mimo_o)):
        if tensor is not None and tuple(tensor.shape) != (heads, rank, p):
            raise ValueError(f"{name}: {field} is {tuple(tensor.shape)}, expected {(heads, rank, p)}")


def _per_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., R, g, n]`` -> ``[..., R, h, n]`` fp32 (each group's keys repeated for its heads)."""
    return x.float().repeat_interleave(heads // x.shape[-2], dim=-2)


def _up(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """``x [..., h, p]`` -> ``[..., R, h, p]`` fp32: ``x * weight[:, r]`` (``weight [h, R, p]``; None: R = 1)."""
    x = x.float().unsqueeze(-3)
    return x if weight is None else x * weight.float().transpose(0, 1)


def _readout(o, v_up, z, D, mimo_z, mimo_o, norm_weight, norm_eps, dtype):
    """``o [..., R, h, p]`` fp32 (the state read by the queries) -> ``y [..., h, p]``: skip, norm, gate, down."""
    if D is not None:
        o = o + D.float()[:, None] * v_up
    if norm_weight is not None:
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + norm_eps) * norm_weight.float().view(o.shape[-2:])
    if z is not None:
        o = o * F.silu(_up(z, mimo_z))
    if mimo_o is None:
        return o.squeeze(-3).to(dtype)
    return torch.einsum("...rhp,hrp->...hp", o, mimo_o.float()).to(dtype)


class _Prepared(NamedTuple):
    q: torch.Tensor  # [b, t, R, h, n] rotated, biased queries (fp32)
    k: torch.Tensor  # [b, t, R, h, n] rotated, biased keys (fp32)
    v: torch.Tensor  # [b, t, R, h, p] up-projected values (fp32)
    theta: torch.Tensor  # [b, t, h, A] accumulated angles (fp32, in [0, 2 pi))
    own: torch.Tensor  # [b, t, h] lam dt: a token's weight on its own input
    share: torch.Tensor  # [b, t, h] (1 - lam) dt: its weight on the previous token's input (before the decay)
    next_share: torch.Tensor  # [b, t, h] the next token's share in this token's input (0 at sequence ends)


def _prepare(q, k, v, dt, trap, angles, q_bias, k_bias, mimo_v, rope_pairs, theta0, bounds) -> _Prepared:
    heads = v.shape[-2]
    # the angles accumulate in float64, then are reduced mod 2 pi: fp32 loses their fraction over long sequences
    steps = torch.tanh(angles.double()) * math.pi * dt.double().unsqueeze(-1)  # [b, t, h, A]
    theta = steps.cumsum(1)
    if bounds is not None:  # restart at each packed sequence
        seq = token_sequences(bounds, v.device)
        before = F.pad(theta, (0, 0, 0, 0, 1, 0))[:, torch.tensor(bounds[:-1], device=v.device)]  # [1, s, h, A]
        theta = theta - before[:, seq]
        if theta0 is not None:
            theta = theta + theta0.double()[seq].unsqueeze(0)
    elif theta0 is not None:
        theta = theta + theta0.double().unsqueeze(1)
    theta = torch.remainder(theta, _TWO_PI).float()
    cos, sin = torch.cos(theta).unsqueeze(2), torch.sin(theta).unsqueeze(2)  # [b, t, 1, h, A]
    qr = rotate(_per_head(q, heads) + q_bias.float().transpose(0, 1), cos, sin, rope_pairs)
    kr = rotate(_per_head(k, heads) + k_bias.float().transpose(0, 1), cos, sin, rope_pairs)
    lam, dtf = torch.sigmoid(trap.float()), dt.float()
    share = (1 - lam) * dtf
    next_share = F.pad(share[:, 1:], (0, 0, 0, 1))
    if bounds is not None:
        next_share = next_share.index_fill(1, nonempty_spans(bounds, v.device).lasts, 0.0)
    return _Prepared(qr, kr, _up(v, mimo_v), theta, lam * dtf, share, next_share)


def fold_previous(initial_state: Mamba3Carry | None, share0: torch.Tensor, mimo_v=None) -> torch.Tensor | None:
    """The initial SSM state with the carried previous token's input added at the first token's share
    (``share0 [b, h]``, ``(1 - sigmoid(trap)) dt``): what the chunked scan starts from. A caller that starts a row
    later (after padding, whose dt is 0) folds it in at its first real token and carries zero ``k, v`` instead."""
    if initial_state is None:
        return None
    prev_v = _up(initial_state.v, mimo_v)  # [b, R, h, p]
    prev = torch.einsum("brhp,brhn->bhpn", prev_v, initial_state.k.float())
    return initial_state.ssm.float() + share0[..., None, None] * prev


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[b, t, R, ...]`` -> ``[b, t * R, ...]``: a token's R inputs one after the other along time."""
    return x.flatten(1, 2)


def mamba3_scan_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    dt: torch.Tensor,
    trap: torch.Tensor,
    angles: torch.Tensor,
    q_bias: torch.Tensor,
    k_bias: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    mimo_v: torch.Tensor | None = None,
    mimo_z: torch.Tensor | None = None,
    mimo_o: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-5,
    rope_pairs: str = "interleaved",
    initial_state: Mamba3Carry | None = None,
    chunk_size: int = 64,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Mamba3Carry]:
    """Mamba-3 over a sequence (see the module docstring for the recurrence and the mapping to mamba-ssm).

    ``q, k [batch, time, rank, groups, d_state]`` (C and B after their RMSNorm, before the biases), ``v [batch,
    time, heads, head_dim]`` (x), ``log_decay, dt, trap [batch, time, heads]`` (dt A, dt after softplus, the
    trapezoid's logits), ``angles [batch, time, heads, A]`` (raw angle projections), ``q_bias, k_bias [heads,
    rank, d_state]``; ``D [heads]``, ``z [batch, time, heads, head_dim]``, ``mimo_* [heads, rank, head_dim]``,
    ``norm_weight [heads * head_dim]`` optional. Returns ``(y like v, final Mamba3Carry)``.

    With ``seq_idx`` / ``cu_seqlens`` (batch 1, see :mod:`.packing`) each packed sequence starts from its own
    ``initial_state`` row and ends in its own final row, all in one chunked scan.
    """
    return mamba3_through(chunked_decay_scan, q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, D=D, z=z,
                          mimo_v=mimo_v, mimo_z=mimo_z, mimo_o=mimo_o, norm_weight=norm_weight, norm_eps=norm_eps,
                          rope_pairs=rope_pairs, initial_state=initial_state, chunk_size=chunk_size, seq_idx=seq_idx,
                          cu_seqlens=cu_seqlens)


def mamba3_through(scan, q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, *, D=None, z=None, mimo_v=None,
                   mimo_z=None, mimo_o=None, norm_weight=None, norm_eps=1e-5, rope_pairs="interleaved",
                   initial_state=None, chunk_size=64, seq_idx=None, cu_seqlens=None):
    """:func:`mamba3_scan_ref` computed by a scalar-decay chunked ``scan`` (:func:`.ssd.chunked_decay_scan`'s
    signature): shared by the reference and the Triton backend, which differ only in ``scan``."""
    _check(q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, mimo_v, mimo_o, rope_pairs)
    batch, time, heads, p = v.shape
    rank = q.shape[2]
    bounds = packed_sequences(batch, time, seq_idx, cu_seqlens)
    check_initial_states("mamba3_scan", bounds, initial_state.ssm if initial_state is not None else None)
    theta0 = initial_state.angle if initial_state is not None else None
    pre = _prepare(q, k, v, dt, trap, angles, q_bias, k_bias, mimo_v, rope_pairs, theta0, bounds)
    if bounds is None:
        start = fold_previous(initial_state, pre.share[:, 0], mimo_v) if time else None
    else:
        start = None if initial_state is None else initial_state.ssm.float().clone()
        if initial_state is not None:
            spans = nonempty_spans(bounds, v.device)
            picked = Mamba3Carry(*(t[spans.index] for t in initial_state))
            start[spans.index] = fold_previous(picked, pre.share[0, spans.starts], mimo_v)
    weighted = pre.k * (pre.own + pre.next_share).unsqueeze(2).unsqueeze(-1)
    decay = F.pad(log_decay.float().unsqueeze(2), (0, 0, 0, rank - 1))  # [b, t, R, h]: the decay at r = 0
    sequences = None if bounds is None else [rank * b for b in bounds]
    o, ssm = scan(_flat(pre.q), _flat(weighted), _flat(pre.v), _flat(decay), chunk_size * rank, start, sequences)
    o = o.view(batch, time, rank, heads, p)
    # inside a token: every query sees every key of its token with weight lam dt; the flattened scan gave the
    # keys up to its own with the next token's share added, and none after it
    qk = torch.einsum("btrhn,btshn->bthrs", pre.q, pre.k)
    causal = torch.ones(rank, rank, dtype=torch.bool, device=v.device).tril()
    weight = torch.where(causal, -pre.next_share[..., None, None], pre.own[..., None, None])
    o = o + torch.einsum("bthrs,btshp->btrhp", qk * weight, pre.v)
    y = _readout(o, pre.v, z, D, mimo_z, mimo_o, norm_weight, norm_eps, v.dtype)
    return y, _final(initial_state, pre, v, ssm, bounds, q.dtype)


def _final(initial_state, pre: _Prepared, v, ssm, bounds, k_dtype) -> Mamba3Carry:
    batch, time, heads, p = v.shape
    rank, n, a = pre.k.shape[2], pre.k.shape[-1], pre.theta.shape[-1]
    if bounds is None:
        if time == 0:
            return initial_state if initial_state is not None else _zeros(batch, heads, a, p, n, rank, v, k_dtype)
        return Mamba3Carry(pre.theta[:, -1], ssm, pre.k[:, -1].to(k_dtype), v[:, -1])
    count = len(bounds) - 1
    final = (Mamba3Carry(*(t.clone() for t in initial_state)) if initial_state is not None
             else _zeros(count, heads, a, p, n, rank, v, k_dtype))
    spans = nonempty_spans(bounds, v.device)
    final.angle[spans.index] = pre.theta[0, spans.lasts]
    final.k[spans.index] = pre.k[0, spans.lasts].to(final.k.dtype)
    final.v[spans.index] = v[0, spans.lasts].to(final.v.dtype)
    return Mamba3Carry(final.angle, ssm, final.k, final.v)


def _zeros(batch, heads, a, p, n, rank, v, k_dtype) -> Mamba3Carry:
    return Mamba3Carry(v.new_zeros(batch, heads, a, dtype=torch.float32),
                       v.new_zeros(batch, heads, p, n, dtype=torch.float32),
                       v.new_zeros(batch, rank, heads, n, dtype=k_dtype), v.new_zeros(batch, heads, p))


def mamba3_scan_states(q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, *, initial_state: Mamba3Carry,
                       D=None, z=None, mimo_v=None, mimo_z=None, mimo_o=None, norm_weight=None, norm_eps=1e-5,
                       rope_pairs="interleaved", chunk_size=64) -> tuple[torch.Tensor, Mamba3Carry]:
    """:func:`mamba3_scan_ref` (no packing) returning the state after every token: each field of the carry with a
    time axis after the batch (``ssm [b, t, h, p, n]`` ...), what rolling a cache back needs. The output is read
    out of those states."""
    _check(q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, mimo_v, mimo_o, rope_pairs)
    batch, time, heads, p = v.shape
    rank = q.shape[2]
    pre = _prepare(q, k, v, dt, trap, angles, q_bias, k_bias, mimo_v, rope_pairs, initial_state.angle, None)
    start = fold_previous(initial_state, pre.share[:, 0], mimo_v)
    weighted = pre.k * (pre.own + pre.next_share).unsqueeze(2).unsqueeze(-1)
    decay = F.pad(log_decay.float().unsqueeze(2), (0, 0, 0, rank - 1))
    states = decay_scan_states(_flat(weighted), _flat(pre.v), _flat(decay), start, chunk_size * rank)
    states = states[:, rank - 1 :: rank]  # [b, t, h, p, n] after each token's last input
    # the scaled keys carried the next token's share of each token's input: not in the state yet
    states = states - torch.einsum("bth,btrhp,btrhn->bthpn", pre.next_share, pre.v, pre.k)
    o = torch.einsum("bthpn,btrhn->btrhp", states, pre.q)
    y = _readout(o, pre.v, z, D, mimo_z, mimo_o, norm_weight, norm_eps, v.dtype)
    return y, Mamba3Carry(pre.theta, states, pre.k.to(initial_state.k.dtype), v.to(initial_state.v.dtype))


def mamba3_step_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    dt: torch.Tensor,
    trap: torch.Tensor,
    angles: torch.Tensor,
    q_bias: torch.Tensor,
    k_bias: torch.Tensor,
    angle_state: torch.Tensor,
    ssm_state: torch.Tensor,
    k_state: torch.Tensor,
    v_state: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    mimo_v: torch.Tensor | None = None,
    mimo_z: torch.Tensor | None = None,
    mimo_o: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-5,
    rope_pairs: str = "interleaved",
) -> torch.Tensor:
    """One decode step, updating the four state tensors (the fields of :class:`Mamba3Carry`, as mamba-ssm's
    ``Mamba3.step`` takes them) in place. The other arguments are those of :func:`mamba3_scan_ref` without the
    time axis (``q, k [batch, rank, groups, d_state]``, ``v [batch, heads, head_dim]``, ``log_decay, dt, trap
    [batch, heads]``, ``angles [batch, heads, A]``). Returns ``y`` like ``v``."""
    _check(q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, mimo_v, mimo_o, rope_pairs, one_token=True)
    state = Mamba3Carry(angle_state, ssm_state, k_state, v_state)
    heads = v.shape[-2]
    steps = torch.tanh(angles.double()) * math.pi * dt.double().unsqueeze(-1)
    theta = torch.remainder(state.angle.double() + steps, _TWO_PI).float()  # [b, h, A]
    cos, sin = torch.cos(theta).unsqueeze(1), torch.sin(theta).unsqueeze(1)
    qr = rotate(_per_head(q, heads) + q_bias.float().transpose(0, 1), cos, sin, rope_pairs)  # [b, R, h, n]
    kr = rotate(_per_head(k, heads) + k_bias.float().transpose(0, 1), cos, sin, rope_pairs)
    lam, dtf, alpha = torch.sigmoid(trap.float()), dt.float(), torch.exp(log_decay.float())
    v_up, prev_v = _up(v, mimo_v), _up(state.v, mimo_v)  # [b, R, h, p]
    prev = torch.einsum("brhp,brhn->bhpn", prev_v, state.k.float())
    own = torch.einsum("brhp,brhn->bhpn", v_up, kr)
    ssm = alpha[..., None, None] * (state.ssm + ((1 - lam) * dtf)[..., None, None] * prev) \
        + (lam * dtf)[..., None, None] * own
    o = torch.einsum("bhpn,brhn->brhp", ssm, qr)
    state.ssm.copy_(ssm)
    state.angle.copy_(theta)
    state.k.copy_(kr)
    state.v.copy_(v)
    return _readout(o, v_up, z, D, mimo_z, mimo_o, norm_weight, norm_eps, v.dtype)
