"""Mamba-1 selective scan and its single-token state update (pure PyTorch reference).

Recurrence, per channel ``d`` and state index ``n``::

    h[t] = exp(dt[t] * A[d, n]) * h[t-1] + dt[t] * B[t, n] * u[t]
    y[t] = sum_n C[t, n] * h[t, n] + D[d] * u[t]          (then y *= silu(z[t]) when z is given)

Layout follows mamba-ssm's ``selective_scan_fn``: ``u, delta, z: [batch, dim, time]``, ``A: [dim, dstate]``,
``B, C: [batch, dstate, time]`` or grouped ``[batch, groups, dstate, time]``.

The scan is chunked in two levels, so ``T`` tokens cost about ``L + T / L`` vectorised steps instead of ``T``
(``L = 16``): every chunk of ``L`` tokens is scanned from a zero state (all chunks at once, ``L`` steps), then the
chunk-boundary states are carried across chunks (``T / L`` steps) and added back weighted by the cumulative
decay inside each chunk. Only products of decays ``<= 1`` are formed, never their inverses, so it is as stable
as the sequential loop. Long inputs are processed in blocks of time that keep the working tensors small.

Packed sequences (``seq_idx`` / ``cu_seqlens``, see :mod:`.packing`) set the decay to zero at each sequence's
first token, where the sequence's own initial state (decayed by that token's step) is added instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from hybridlm.ops.packing import check_initial_states, nonempty_spans, packed_sequences

# Working tensors are [block, batch, dim, dstate]; about 4 MiB of fp32 each keeps them in the allocator's
# reuse pool (fresh multi-MiB allocations page-fault on every call and cost more than the arithmetic).
_BLOCK_ELEMENTS = 1 << 20
_CHUNK = 16


class Restarts(NamedTuple):
    """Packed sequences inside one block of time: first tokens ``starts [m]`` with their initial states
    ``initial [m, 1, dim, dstate]`` (None: zeros), and last tokens ``lasts [k]`` whose states are wanted."""

    starts: torch.Tensor
    initial: torch.Tensor | None
    lasts: torch.Tensor


def _block_restarts(bounds, initial_state, block_start, block_stop, device) -> Restarts:
    spans = nonempty_spans(bounds, device)
    starting = (spans.starts >= block_start) & (spans.starts < block_stop)
    ending = (spans.lasts >= block_start) & (spans.lasts < block_stop)
    initial = None if initial_state is None else initial_state.float()[spans.index[starting]].unsqueeze(1)
    return Restarts(spans.starts[starting] - block_start, initial, spans.lasts[ending] - block_start)


def _grouped(x: torch.Tensor, name: str) -> torch.Tensor:
    """``[batch, dstate, time]`` or ``[batch, groups, dstate, time]`` -> ``[time, batch, groups, dstate]``."""
    if x.dim() == 3:
        x = x.unsqueeze(1)
    if x.dim() != 4:
        raise ValueError(f"selective_scan {name} must be [batch, dstate, time] or [batch, groups, dstate, time]")
    return x.permute(3, 0, 1, 2).contiguous()


def _scan_block(u, dt, A, B, C, state, chunk, inplace, restarts=None):
    """Two-level scan of one time-major block.

    u, dt: [T, b, d]; B, C: [T, b, g, n]; state: [b, d, n] (fp32). Returns y [T, b, d], the final state and the
    states after the tokens ``restarts.lasts`` (packed sequences, else None).
    """
    t, b, d = u.shape
    g, n = B.shape[2], A.shape[-1]
    nc = -(-t // chunk)
    pad = nc * chunk - t
    if pad:  # dt = 0 on padding: decay 1 and no input, so the carried state is untouched
        u, dt = F.pad(u, (0, 0, 0, 0, 0, pad)), F.pad(dt, (0, 0, 0, 0, 0, pad))
        B, C = F.pad(B, (0, 0, 0, 0, 0, 0, 0, pad)), F.pad(C, (0, 0, 0, 0, 0, 0, 0, pad))
    decay = torch.exp(dt.unsqueeze(-1) * A)  # [T, b, d, n]
    drive = ((dt * u).view(-1, b, g, d // g, 1) * B.unsqueeze(3)).view(-1, b, d, n)
    if restarts is not None:  # a sequence's first token forgets the state before it and takes its own
        if restarts.initial is not None:
            drive = drive.index_add(0, restarts.starts, decay[restarts.starts] * restarts.initial)
        decay = decay.index_fill(0, restarts.starts, 0.0)
    decay, drive = decay.view(nc, chunk, b, d, n), drive.view(nc, chunk, b, d, n)

    # 1. every chunk from a zero state, all chunks at once
    if inplace:  # running products by slices: torch.cumprod along dim 1 is several times slower on CPU
        for i in range(1, chunk):
            drive[:, i].addcmul_(decay[:, i], drive[:, i - 1])
            decay[:, i].mul_(decay[:, i - 1])
        local, within = drive, decay
    else:
        steps = [drive[:, 0]]
        for i in range(1, chunk):
            steps.append(torch.addcmul(drive[:, i], decay[:, i], steps[-1]))
        local, within = torch.stack(steps, dim=1), torch.cumprod(decay, dim=1)

    # 2. the state entering each chunk, carried chunk to chunk
    entering = []
    for c in range(nc):
        entering.append(state)
        state = torch.addcmul(local[c, -1], within[c, -1], state)
    entering = torch.stack(entering).unsqueeze(1)  # [nc, 1, b, d, n]

    # 3. full states, read out by C
    h = local.addcmul_(within, entering) if inplace else torch.addcmul(local, within, entering)
    ended = h.view(nc * chunk, b, d, n)[restarts.lasts] if restarts is not None else None
    h = h.view(nc * chunk * b * g, d // g, n)
    y = torch.bmm(h, C.reshape(nc * chunk * b * g, n, 1)).view(nc * chunk, b, d)
    return y[:t], state, ended


def selective_scan_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    *,
    initial_state: torch.Tensor | None = None,
    chunk_size: int | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan over ``time``; returns ``(y [batch, dim, time], final_state [batch, dim, dstate] fp32)``.

    ``chunk_size`` (default 16) changes only the rounding, not the result. Packed (batch 1, ``seq_idx`` or
    ``cu_seqlens``), ``initial_state`` and ``final_state`` are ``[n_seqs, dim, dstate]``.
    """
    batch, dim, time, dstate = scan_shapes(u, delta, A)
    bounds = packed_sequences(batch, time, seq_idx, cu_seqlens)
    check_initial_states("selective_scan", bounds, initial_state)
    Bt, Ct = _grouped(B, "B").float(), _grouped(C, "C").float()
    if dim % Bt.shape[2]:
        raise ValueError(f"selective_scan: {Bt.shape[2]} groups do not divide dim={dim}")
    dt = delta.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float().unsqueeze(-1)
    if delta_softplus:
        dt = F.softplus(dt)
    state = (
        u.new_zeros(batch, dim, dstate, dtype=torch.float32)
        if initial_state is None or bounds is not None else initial_state.float()
    )
    uf, Af = u.float(), A.float()
    ut, dtt = uf.permute(2, 0, 1).contiguous(), dt.permute(2, 0, 1).contiguous()
    chunk = chunk_size or _CHUNK
    block = chunk * max(1, _BLOCK_ELEMENTS // (batch * dim * dstate * chunk))
    inplace = not (torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (u, delta, A, B, C, delta_bias, initial_state)
    ))
    outputs, ended = [], []
    for start in range(0, time, block):
        stop = min(time, start + block)
        restarts = None if bounds is None else _block_restarts(bounds, initial_state, start, stop, u.device)
        y, state, block_ended = _scan_block(
            ut[start:stop], dtt[start:stop], Af, Bt[start:stop], Ct[start:stop], state, min(chunk, stop - start),
            inplace, restarts,
        )
        outputs.append(y)
        ended.append(block_ended)
    y = torch.cat(outputs).permute(1, 2, 0) if outputs else uf.new_zeros(batch, dim, 0)
    if bounds is not None:  # the state after each sequence's last token; an empty one keeps its initial state
        final = state.new_zeros(len(bounds) - 1, dim, dstate) if initial_state is None else initial_state.float()
        ended = torch.cat(ended)[:, 0] if ended else state.new_zeros(0, dim, dstate)
        state = final.index_put((nonempty_spans(bounds, u.device).index,), ended)
    return skip_and_gate(y, u, D, z), state


def scan_shapes(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor) -> tuple[int, int, int, int]:
    """``(batch, dim, time, dstate)`` of a selective scan's ``u, delta [batch, dim, time]`` and ``A [dim, dstate]``;
    raises when they disagree."""
    batch, dim, time = u.shape
    dstate = A.shape[-1]
    if A.shape != (dim, dstate) or delta.shape != u.shape:
        raise ValueError(
            f"selective_scan: u {tuple(u.shape)}, delta {tuple(delta.shape)} and A {tuple(A.shape)} disagree"
        )
    return batch, dim, time, dstate


def skip_and_gate(y: torch.Tensor, u: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """``(y + D u) * silu(z)`` in fp32, cast to ``u``'s dtype (``y`` fp32, ``u, z [batch, dim, time]``, ``D [dim]``)."""
    if D is not None:
        y = y + u.float() * D.float().unsqueeze(-1)
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(u.dtype)


def selective_state_update_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
) -> torch.Tensor:
    """One decode step of the Mamba-1 or Mamba-2 recurrence, updating ``state`` in place.

    Shapes follow mamba-ssm's ``selective_state_update``: ``state [batch, dim, dstate]`` with ``x, dt, z
    [batch, dim]``, ``A [dim, dstate]``, ``B, C [batch, dstate]``; or with heads: ``state [batch, heads, dim,
    dstate]``, ``x, dt, z [batch, heads, dim]``, ``A [heads, dim, dstate]``, ``B, C [batch, groups, dstate]``,
    ``D, dt_bias [heads, dim]``. Returns ``y`` shaped like ``x``.
    """
    if B.dim() == 2:
        B, C = B.unsqueeze(1), C.unsqueeze(1)
    headless = state.dim() == 3
    if headless:  # Mamba-1: each group of channels is one "head" sharing B and C
        batch, dim, dstate = state.shape
        g = B.shape[1]
        if dim % g:
            raise ValueError(f"selective_state_update: {g} groups do not divide dim={dim}")
        state, x, dt = state.view(batch, g, dim // g, dstate), x.view(batch, g, -1), dt.view(batch, g, -1)
        A = A.view(g, dim // g, dstate)
        z = z.view(batch, g, -1) if z is not None else None
        D = D.view(g, -1) if D is not None else None
        dt_bias = dt_bias.view(g, -1) if dt_bias is not None else None
    heads, groups = state.shape[1], B.shape[1]
    if heads % groups:
        raise ValueError(f"selective_state_update: {groups} groups do not divide {heads} heads")
    B = B.float().repeat_interleave(heads // groups, dim=1).unsqueeze(2)  # [b, h, 1, n]
    C = C.float().repeat_interleave(heads // groups, dim=1).unsqueeze(2)
    step = dt.float()
    if dt_bias is not None:
        step = step + dt_bias.float()
    if dt_softplus:
        step = F.softplus(step)
    xf = x.float()
    if _one_decay_per_head(dt, A, dt_bias):
        # [b, h, 1, 1]: one exp per head, where the expanded form takes one per state element (a Mamba-2
        # layer holds heads x head_dim x d_state of them; the same values either way)
        decay = torch.exp(step[..., :1, None] * A[:, :1, :1].float())
    else:
        decay = torch.exp(step.unsqueeze(-1) * A.float())  # [b, h, dim, n]
    new_state = state.float() * decay + (step * xf).unsqueeze(-1) * B
    state.copy_(new_state)
    y = (new_state * C).sum(-1)
    if D is not None:
        y = y + xf * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return y.flatten(1, 2) if headless else y


def _one_decay_per_head(dt: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor | None) -> bool:
    """Whether ``dt`` (and ``dt_bias``) are expanded over the head's channels and ``A`` over its channels and
    state (stride 0, as Mamba-2 passes them; mamba-ssm's kernel ties them the same way), so that the decay is one
    value per head."""
    return (dt.dim() == 3 and dt.stride(-1) == 0 and A.stride(-1) == 0 and A.stride(-2) == 0
            and (dt_bias is None or dt_bias.stride(-1) == 0))


def selective_scan_with_states(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                               C: torch.Tensor, initial_state: torch.Tensor, D: torch.Tensor | None = None,
                               z: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`selective_scan_ref`'s output and the state after each token, from one pass of the same two-level
    chunked scan (``delta`` already biased and soft-plussed): a forward that keeps the states (for rollback)
    need not scan twice. ``u, delta, z [batch, dim, time]``, ``B, C [batch, (groups,) dstate, time]``. Returns
    ``(y like u, states [batch, time, dim, dstate] fp32)``."""
    time = u.shape[-1]
    Bt, Ct = _grouped(B, "B").float(), _grouped(C, "C").float()
    ut, dtt = (t.float().permute(2, 0, 1).contiguous() for t in (u, delta))  # [time, batch, dim]
    every = Restarts(torch.zeros(0, dtype=torch.long, device=u.device), None, torch.arange(time, device=u.device))
    y, _, states = _scan_block(ut, dtt, A.float(), Bt, Ct, initial_state.float(), min(_CHUNK, time),
                               not torch.is_grad_enabled(), every)
    return skip_and_gate(y.permute(1, 2, 0), u, D, z), states.transpose(0, 1)


def selective_scan_states(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                          initial_state: torch.Tensor) -> torch.Tensor:
    """The state after each token of :func:`selective_scan_ref` (what rolling the state back to any token
    needs): ``[batch, time, dim, dstate]`` fp32; see :func:`selective_scan_with_states`."""
    return selective_scan_with_states(u, delta, A, B, B, initial_state)[1]
