"""Softmax attention with grouped key/value heads: PyTorch's SDPA on every device, except a few fp16 queries on
the CPU, or bf16 ones on a CPU without AMX-BF16, written out in fp32 (:func:`_fp32_grouped_attention`:
fp32 arithmetic rounded once, several times faster there; bf16 ones by our kernel,
:mod:`hybridlm.ops.cpu_attention`, which makes no fp32 copies of the keys and values)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hybridlm.ops.cpu_attention import kernel_attention
from hybridlm.ops.cpu_features import cpu_has_amx_bf16


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [batch, q_heads, q_len, dim]``, ``k, v [batch, kv_heads, k_len, dim]``; ``mask`` is boolean, True
    where a query may attend, broadcastable to ``[batch, q_heads, q_len, k_len]``. ``causal`` (only without a
    mask, and only for ``q_len == k_len``: query ``i`` sees keys ``0..i``) is SDPA's own causal path.
    ``seq_idx [batch, time]`` (queries and keys the same tokens) numbers the sequences packed in each row: a
    query sees only keys of its own sequence (a block-diagonal mask, combined with ``causal`` or ``mask``)."""
    if seq_idx is not None:
        mask, causal = _same_sequence(q, k, seq_idx, mask, causal), False
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {k.shape[1]} key/value heads do not divide {q.shape[1]} query heads")
    if causal and mask is not None:
        raise ValueError("attention: pass either causal=True or a mask that already holds causality")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"attention: causal=True needs as many queries as keys (got {q.shape[2]} and {k.shape[2]}); "
                         "pass a mask for queries that continue after cached keys")
    if not causal and _few_reduced_precision_queries_on_cpu(q, k):
        out = kernel_attention(q, k, v, mask, scale)  # bf16 keys and values, without fp32 copies of them
        return out if out is not None else _fp32_grouped_attention(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


#: rows of queries per key/value head (query heads of a group x queries) up to which a CPU bf16/fp16 attention
#: is written out in fp32 instead of calling SDPA
FEW_QUERY_ROWS = 16
#: AMX-BF16 tiles, which make SDPA's CPU kernel fast in bf16
CPU_HAS_AMX_BF16 = cpu_has_amx_bf16()


def _few_reduced_precision_queries_on_cpu(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Decode steps of a reduced-precision model on the CPU where torch's SDPA kernel (flash attention for the
    CPU) is several times slower than :func:`_fp32_grouped_attention` for a few queries over many keys, which
    then takes them. Measured for SmolLM2's 9 query heads over 3 key/value heads, 1 thread:

    - fp16 everywhere: 0.48 against 0.31 ms over 2,048 keys on a Sapphire Rapids, 3.14 against 0.28 ms on a
      Zen 4 EPYC;
    - bf16 without AMX-BF16: 1.93 against 0.29 ms over 2,048 keys on the Zen 4 (AVX-512 BF16), 0.49 against
      0.09 ms over 512 keys on an AVX2 EPYC (its compiled bf16 step went from 29.4 to 19.1 ms).

    With AMX-BF16, SDPA is the faster of the two in bf16 (0.14 against 0.55 ms over 2,048 keys on the Sapphire
    Rapids), so bf16 stays with it there."""
    rows = q.shape[1] // k.shape[1] * q.shape[2]
    if q.device.type != "cpu" or rows > FEW_QUERY_ROWS:
        return False
    return q.dtype == torch.float16 or (q.dtype == torch.bfloat16 and not CPU_HAS_AMX_BF16)


#: keys whose fp32 copies :func:`_fp32_grouped_attention` makes at a time, and the most such pieces it cuts the
#: keys into (longer pieces beyond that, so a compiled graph stays small). One fp32 copy of a whole long cache is
#: a fresh buffer of many megabytes on every call, written and read back through memory: at batch 16 over 8,192
#: bf16 keys, SmolLM2's heads took 159 ms a layer copied whole and 32 ms in pieces of 1,024, an fp32 cache 36 ms
#: (medians; AVX2 EPYC, compiled, 1 thread; benchmarks/cpu_attention.py, docs/performance.md).
FP32_KEY_CHUNK = 1024
MAX_KEY_CHUNKS = 16


def _fp32_grouped_attention(q, k, v, mask, scale) -> torch.Tensor:
    """:func:`attention_ref` on fp32 copies of ``q, k, v``, cast back once at the end (fp32 scores, softmax and
    sums), as products per key/value head. Query heads ``j * group .. (j + 1) * group - 1`` share key/value head
    ``j`` (SDPA's ``enable_gqa``), so the queries of a group are rows of one product and no key or value is
    repeated. The keys and values are copied to fp32 a piece at a time (:data:`FP32_KEY_CHUNK`)."""
    batch, q_heads, q_len, dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    rows = q_heads // kv_heads * q_len
    queries = q.float().reshape(batch, kv_heads, rows, dim)
    chunk = max(FP32_KEY_CHUNK, -(-k_len // MAX_KEY_CHUNKS))
    starts = range(0, k_len, chunk)
    pieces = [torch.matmul(queries, k[:, :, i:i + chunk].float().transpose(-1, -2)) for i in starts]
    scores = pieces[0] if len(pieces) == 1 else torch.cat(pieces, -1)  # [batch, kv_heads, rows, k_len]
    scores = scores * (scale if scale is not None else dim ** -0.5)
    if mask is not None:
        allowed = mask.expand(batch, q_heads, q_len, k_len).reshape(batch, kv_heads, rows, k_len)
        scores = scores.masked_fill(~allowed, -torch.inf)
    probs = scores.softmax(-1)
    out = functools.reduce(torch.add, (torch.matmul(probs[..., i:i + chunk], v[:, :, i:i + chunk].float())
                                       for i in starts))
    return out.reshape(batch, q_heads, q_len, v.shape[-1]).to(q.dtype)  # out: [batch, kv_heads, rows, dim]


def _same_sequence(q, k, seq_idx, mask, causal) -> torch.Tensor:
    """``mask`` (or causality) restricted to pairs of tokens in the same packed sequence: ``[batch, 1 or heads,
    time, time]``."""
    batch, _, time, _ = q.shape
    if k.shape[2] != time or seq_idx.shape != (batch, time) or seq_idx.is_floating_point():
        raise ValueError(f"attention: seq_idx must be integer [batch={batch}, time={time}] for {time} queries and "
                         f"as many keys, got seq_idx {tuple(seq_idx.shape)} and {k.shape[2]} keys")
    same = (seq_idx[:, :, None] == seq_idx[:, None, :]).unsqueeze(1)  # [b, 1, t, t]
    if causal:
        return same & torch.ones(time, time, dtype=torch.bool, device=q.device).tril()
    return same if mask is None else same & mask


def slot_mask(
    query_slots: torch.Tensor,
    key_slots: torch.Tensor,
    *,
    key_valid: torch.Tensor | None = None,
    key_pinned: torch.Tensor | None = None,
    window: int | None = None,
    q_heads: int = 1,
) -> torch.Tensor:
    """The boolean mask of queries continuing after cached keys, from the keys' absolute slots.

    ``query_slots [q_len]``; ``key_slots`` ``[k_len]`` or ``[batch, kv_heads, k_len]`` (in any order: a ring
    buffer's); ``key_valid`` (False: padding or an empty slot) and ``key_pinned`` (visible whatever the window:
    attention sinks) broadcastable to ``[batch, kv_heads, k_len]``. A query sees a valid key at or before its
    slot, within ``window`` slots unless pinned; a query always sees its own slot (a padded query then stays
    finite; its output is never read). Returns ``[batch or 1, 1 or q_heads, q_len, k_len]``."""
    keys = key_slots.view(1, 1, -1) if key_slots.dim() == 1 else key_slots  # [b, h, k]
    distance = query_slots[:, None] - keys[..., None, :]  # [b, h, q, k]
    allowed = distance >= 0
    if window is not None:
        inside = distance < window
        allowed = allowed & (inside if key_pinned is None else inside | key_pinned[..., None, :])
    if key_valid is not None:
        allowed = allowed & key_valid[..., None, :]
    allowed = allowed | (distance == 0)
    if allowed.shape[1] not in (1, q_heads):  # per key/value head: one copy per query head of its group
        allowed = allowed.repeat_interleave(q_heads // allowed.shape[1], dim=1)
    return allowed


def attention_with_probs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_ref` written out, also returning the probabilities ``[batch, q_heads, q_len, k_len]``
    (for caches that keep the keys with the most attention mass). Shapes as in :func:`attention_ref`."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [b, q_heads, k, d]
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    probs = scores.float().masked_fill(~mask, -torch.inf).softmax(-1)  # [b, q_heads, q, k]
    return torch.matmul(probs.to(v.dtype), v), probs
