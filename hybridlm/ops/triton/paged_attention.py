"""Decode attention over a paged KV cache in Triton: one query token per row, pages read through the block table.

Same contract as :func:`hybridlm.ops.paged_attention.paged_attention_ref`. One program per (row, query head):
it walks the row's pages, scores a page of keys at a time (elementwise products and a sum: a page may be
smaller than the 16 rows ``tl.dot`` needs on the GPU) and keeps an online softmax in fp32 (running maximum,
normaliser and weighted sum of values). Grouped key/value heads are read in place (query head ``h`` reads key
head ``h // group``). Offsets into the pages are 64-bit. Forward only: decoding does not train.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.triton._common import cdiv, check_device, launch, new_buffer, total


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _paged_decode_kernel(
    Q, K, V, TABLE, LENGTHS, OUT, scale, page_size, dim, group,
    sq_b, sq_h, sq_d, sk_p, sk_h, sk_t, sk_d, sv_p, sv_h, sv_t, sv_d, st_b, st_p, so_b, so_h, so_d,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b, h = tl.program_id(0), tl.program_id(1)
    kv_head = (h // group).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    q = tl.load(Q + b.to(tl.int64) * sq_b + h * sq_h + offs_d * sq_d, mask=mask_d, other=0.0).to(tl.float32)
    length = tl.load(LENGTHS + b).to(tl.int32)
    running_max = tl.full((), float("-inf"), tl.float32)
    normaliser = tl.full((), 0.0, tl.float32)
    acc = tl.full((BLOCK_D,), 0.0, tl.float32)
    for i in range(0, cdiv(length, page_size)):
        page = tl.load(TABLE + b.to(tl.int64) * st_b + i * st_p).to(tl.int64)
        token = i * page_size + offs_t  # [BLOCK_T]: row-local index of each key of the page
        mask_t = (offs_t < page_size) & (token < length)
        tile = mask_t[:, None] & mask_d[None, :]
        k = tl.load(K + page * sk_p + kv_head * sk_h + offs_t[:, None] * sk_t + offs_d[None, :] * sk_d,
                    mask=tile, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_D]
        scores = tl.where(mask_t, total(k * q[None, :], 1) * scale, float("-inf"))  # [BLOCK_T]
        new_max = tl.maximum(running_max, tl.reduce(scores, 0, _larger))
        weights = tl.exp(scores - new_max)  # 0 for masked keys
        decay = tl.exp(running_max - new_max)  # 0 on the first page (running_max = -inf)
        v = tl.load(V + page * sv_p + kv_head * sv_h + offs_t[:, None] * sv_t + offs_d[None, :] * sv_d,
                    mask=tile, other=0.0).to(tl.float32)
        normaliser = normaliser * decay + total(weights, 0)
        acc = acc * decay + total(weights[:, None] * v, 0)
        running_max = new_max
    out = tl.where(normaliser > 0, acc / normaliser, 0.0)
    tl.store(OUT + b.to(tl.int64) * so_b + h * so_h + offs_d * so_d, out, mask=mask_d)


def paged_attention(
    q: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as :func:`hybridlm.ops.paged_attention.paged_attention_ref`: ``q [batch, q_heads, 1, dim]``,
    ``key_pages, value_pages [pages, kv_heads, page_size, dim]``, ``block_table [batch, max_pages]``, ``lengths
    [batch]``; returns ``[batch, q_heads, 1, dim]`` in ``q``'s dtype."""
    check_device("paged_attention", q, key_pages, value_pages, block_table, lengths)
    batch, q_heads, time, dim = q.shape
    _, kv_heads, page_size, _ = key_pages.shape
    if time != 1:
        raise ValueError(f"paged_attention: one query token per row, got q of shape {tuple(q.shape)}")
    if q_heads % kv_heads:
        raise ValueError(f"paged_attention: {kv_heads} key/value heads do not divide {q_heads} query heads")
    if value_pages.shape != key_pages.shape or key_pages.shape[3] != dim:
        raise ValueError(f"paged_attention: key_pages {tuple(key_pages.shape)} and value_pages "
                         f"{tuple(value_pages.shape)} must both be [pages, kv_heads, page_size, {dim}]")
    if block_table.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"paged_attention: block_table [batch={batch}, pages] and lengths [batch] expected, got "
                         f"{tuple(block_table.shape)} and {tuple(lengths.shape)}")
    out = new_buffer((batch, q_heads, dim), q, torch.float32)
    launch(
        _paged_decode_kernel, (batch, q_heads),
        q, key_pages, value_pages, block_table, lengths, out, scale if scale is not None else dim ** -0.5,
        page_size, dim, q_heads // kv_heads,
        q.stride(0), q.stride(1), q.stride(3), *key_pages.stride(), *value_pages.stride(), *block_table.stride(),
        *out.stride(),
        BLOCK_T=triton.next_power_of_2(page_size), BLOCK_D=triton.next_power_of_2(dim),
    )
    return out.to(q.dtype).unsqueeze(2)
