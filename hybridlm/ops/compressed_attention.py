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

Packed sequences (``seq_idx`` / ``cu_seqlens``, see :mod:`.packing`; batch 1, no initial state) restart the sums
at each sequence: token pairs of different sequences are masked inside a chunk, and a chunk starts from the sums
of the earlier chunks of the sequence it continues. The final sums are then one pair per sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from hybridlm.ops.packing import packed_sequences, token_sequences


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
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``q, k, v [batch, heads, time, dim]``; returns ``(out, (K~, V~))`` with ``K~, V~ [batch, heads, rank, dim]``
    (sums, whether or not a ``normalizer [batch, time]`` divides what each query sees); packed, ``[n_seqs, ...]``."""
    batch, heads, time, dim = q.shape
    rank = e.shape[-1]
    if e.shape != (batch, time, rank) or f.shape != e.shape:
        raise ValueError(
            f"compressed_attention: e {tuple(e.shape)} and f {tuple(f.shape)} must be [{batch}, {time}, rank]"
        )
    if normalizer is not None and normalizer.shape != (batch, time):
        raise ValueError(f"compressed_attention: normalizer {tuple(normalizer.shape)} must be [{batch}, {time}]")
    bounds = packed_sequences(batch, time, seq_idx, cu_seqlens)
    if bounds is not None and initial_state is not None:
        raise ValueError("compressed_attention: packed sequences start from empty sums (no initial_state)")
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

    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    continues = 1.0  # or [c, l, 1]: whether a token reads the sums its chunk starts from (packed: same sequence)
    if bounds is None:
        keys_in, keys_out = entering(keys0, torch.einsum("bcsr,bhcsd->bhcrd", ec, kc))
        values_in, values_out = entering(values0, torch.einsum("bcsr,bhcsd->bhcrd", fc, vc))
    else:
        layout = _packed_layout(bounds, time + pad, chunk, q.device)
        causal, continues = causal & layout.same, layout.continues[..., None].float()  # [c, l, s], [c, l, 1]
        ec_end, fc_end = ec * layout.to_end[..., None], fc * layout.to_end[..., None]  # what a chunk carries on
        keys_in = torch.einsum("cj,bjsr,bhjsd->bhcrd", layout.carried, ec_end, kc)  # [b, h, c, r, d]
        values_in = torch.einsum("cj,bjsr,bhjsd->bhcrd", layout.carried, fc_end, vc)
        sequence = torch.nn.functional.one_hot(layout.sequence, len(bounds) - 1).float()  # [t, n]
        keys_out = torch.einsum("tn,tr,htd->nhrd", sequence, e[0].float(), k[0].float())
        values_out = torch.einsum("tn,tr,htd->nhrd", sequence, f[0].float(), v[0].float())

    inverse = 1.0  # or [b, 1, c, l, 1]: 1 / normalizer (1 past the end)
    if normalizer is not None:
        inverse = F.pad(1 / normalizer.float(), (0, pad), value=1.0).view(batch, 1, -1, chunk, 1)

    qk = torch.einsum("bhcld,bhcsd->bhcls", qc, kc).masked_fill(~causal, 0.0)  # [b, h, c, l, s]
    scores = torch.einsum("bhcld,bhcrd->bhclr", qc, keys_in) * continues + torch.einsum("bhcls,bcsr->bhclr", qk, ec)
    probs = torch.softmax(scores * inverse * scale, dim=-1)  # [b, h, c, l, r]
    mixed = torch.einsum("bhclr,bcsr->bhcls", probs, fc).masked_fill(~causal, 0.0)  # [b, h, c, l, s]
    out = torch.einsum("bhclr,bhcrd->bhcld", probs, values_in) * continues \
        + torch.einsum("bhcls,bhcsd->bhcld", mixed, vc)
    out = out * inverse  # [b, h, c, l, d]
    return out.flatten(2, 3)[:, :, :time].to(v.dtype), (keys_out, values_out)


class _PackedLayout(NamedTuple):
    """Where packed sequences lie in the chunks: ``sequence [time]`` of each token; ``same [c, l, s]`` pairs of a
    chunk's tokens in one sequence; ``to_end [c, s]`` tokens in the sequence the chunk ends in (what it carries
    on); ``continues [c, l]`` tokens in the sequence the previous chunk ended in; ``carried [c, j]`` earlier
    chunks whose carried sums chunk ``c`` starts from."""

    sequence: torch.Tensor
    same: torch.Tensor
    to_end: torch.Tensor
    continues: torch.Tensor
    carried: torch.Tensor


def _packed_layout(bounds: list[int], padded: int, chunk: int, device) -> _PackedLayout:
    sequence = token_sequences(bounds, device)  # [time]
    tokens = torch.cat([sequence, sequence[-1:].expand(padded - len(sequence))]).view(-1, chunk)  # [c, l]
    ends = tokens[:, -1]  # [c]: the sequence each chunk ends in
    previous = F.pad(ends[:-1], (1, 0), value=-1)  # [c]: the one the chunk before ended in (-1: none)
    earlier = torch.ones(len(ends), len(ends), dtype=torch.bool, device=device).tril(-1)  # [c, j]: j < c
    return _PackedLayout(
        sequence=sequence,
        same=tokens[:, :, None] == tokens[:, None, :],
        to_end=tokens == ends[:, None],
        continues=tokens == previous[:, None],
        carried=((ends[None, :] == previous[:, None]) & earlier).float(),
    )
