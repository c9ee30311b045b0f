"""Causal compressed (Linformer-style) attention with a fixed-size state (pure PyTorch reference).

Linformer projects the ``time`` axis of keys and values to ``rank`` rows with matrices ``E, F [rank, n]``:
``softmax(q (E K)^T / sqrt(d)) (F V)``. Its causal form here restricts both projections to the prefix::

    K~[t] = K~[t-1] + e[t] (outer) k[t]       V~[t] = V~[t-1] + f[t] (outer) v[t]      (e[t] = E[:, pos t])
    out[t] = softmax(q[t] @ K~[t]^T * scale) @ V~[t]

so the state is two ``[rank, head_dim]`` matrices per head whatever the length. ``e, f [batch, time, rank]``
are the projection columns of each token (zero for padding, which then adds nothing).
With ``normalizer [batch, time]``, query ``t`` sees ``K~[t] / n[t]`` and ``V~[t] / n[t]`` instead (the mean
over its prefix when ``n[t]`` counts the tokens summed): its scores and its output are divided by ``n[t]``.
Inside a chunk the scores need ``(q k^T masked) e``; states entering each chunk are exclusive prefix sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_compressed_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor,
    f: torch.Tensor,
    *,
    scale: float,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunk_size: int = 64,
    normalizer: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``q, k, v [batch, heads, time, dim]``; returns ``(out, (K~, V~))`` with ``K~, V~ [batch, heads, rank, dim]``
    (sums, whether or not a ``normalizer [batch, time]`` divides what each query sees)."""
    batch, heads, time, dim = q.shape
    rank = e.shape[-1]
    if e.shape != (batch, time, rank) or f.shape != e.shape:
        raise ValueError(
            f"compressed_attention: e {tuple(e.shape)} and f {tuple(f.shape)} must be [{batch}, {time}, rank]"
        )
    if normalizer is not None and normalizer.shape != (batch, time):
        raise ValueError(f"compressed_attention: normalizer {tuple(normalizer.shape)} must be [{batch}, {time}]")
    chunk = max(1, min(chunk_size, time))
    pad = -time % chunk
    qc, kc, vc = (F.pad(t.float(), (0, 0, 0, pad)).unflatten(2, (-1, chunk)) for t in (q, k, v))
    ec, fc = (F.pad(t.float(), (0, 0, 0, pad)).unflatten(1, (-1, chunk)) for t in (e, f))  # [b, c, l, r]
    if initial_state is None:
        keys0 = q.new_zeros(batch, heads, rank, dim, dtype=torch.float32)
        values0 = torch.zeros_like(keys0)
    else:
        keys0, values0 = (s.float() for s in initial_state)

    def entering(start, added):  # state at each chunk start, and after the last chunk
        running = torch.cumsum(added, dim=2)
        before = torch.cat([torch.zeros_like(added[:, :, :1]), running[:, :, :-1]], dim=2)
        return start.unsqueeze(2) + before, start + running[:, :, -1]

    keys_in, keys_out = entering(keys0, torch.einsum("bcsr,bhcsd->bhcrd", ec, kc))
    values_in, values_out = entering(values0, torch.einsum("bcsr,bhcsd->bhcrd", fc, vc))
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()

    inverse = 1.0  # or [b, 1, c, l, 1]: 1 / normalizer (1 past the end)
    if normalizer is not None:
        inverse = F.pad(1 / normalizer.float(), (0, pad), value=1.0).view(batch, 1, -1, chunk, 1)

    qk = torch.einsum("bhcld,bhcsd->bhcls", qc, kc).masked_fill(~causal, 0.0)  # [b, h, c, l, s]
    scores = torch.einsum("bhcld,bhcrd->bhclr", qc, keys_in) + torch.einsum("bhcls,bcsr->bhclr", qk, ec)
    probs = torch.softmax(scores * inverse * scale, dim=-1)  # [b, h, c, l, r]
    mixed = torch.einsum("bhclr,bcsr->bhcls", probs, fc).masked_fill(~causal, 0.0)  # [b, h, c, l, s]
    out = torch.einsum("bhclr,bhcrd->bhcld", probs, values_in) + torch.einsum("bhcls,bhcsd->bhcld", mixed, vc)
    out = out * inverse  # [b, h, c, l, d]
    return out.flatten(2, 3)[:, :, :time].to(v.dtype), (keys_out, values_out)
