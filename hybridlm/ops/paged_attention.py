"""Decode attention over a paged KV cache: one query token per row, keys and values read through a block table.

The reference gathers each row's pages into a dense ``[batch, kv_heads, n, head_dim]`` tensor and calls the
attention reference (SDPA); the Triton kernel (:mod:`hybridlm.ops.triton.paged_attention`) reads the pages in place.
"""

from __future__ import annotations

import torch

from hybridlm.ops.attention import attention_ref


def paged_attention_ref(
    q: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """``q [batch, q_heads, 1, dim]`` (the newest token of each row) over the first ``lengths[b]`` keys of row
    ``b``: key ``j`` of the row is slot ``j % page_size`` of page ``block_table[b, j // page_size]`` in
    ``key_pages, value_pages [pages, kv_heads, page_size, dim]``. ``block_table [batch, max_pages]`` (integer;
    entries past a row's pages are ignored), ``lengths [batch]`` (each at least 1). Returns ``[batch, q_heads, 1,
    dim]``."""
    batch, q_heads, time, _ = q.shape
    page_size = key_pages.shape[2]
    if time != 1:
        raise ValueError(f"paged_attention: one query token per row, got q of shape {tuple(q.shape)}")
    if block_table.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"paged_attention: block_table [batch={batch}, pages] and lengths [batch] expected, got "
                         f"{tuple(block_table.shape)} and {tuple(lengths.shape)}")
    keys_per_row = block_table.shape[1] * page_size
    index = torch.arange(keys_per_row, device=q.device)  # [n]
    pages = block_table.long()[:, index // page_size]  # [b, n]
    heads = torch.arange(key_pages.shape[1], device=q.device)[None, :, None]  # [1, h, 1]
    keys = key_pages[pages[:, None], heads, (index % page_size)[None, None]]  # [b, h, n, d]
    values = value_pages[pages[:, None], heads, (index % page_size)[None, None]]
    mask = (index[None, :] < lengths[:, None])[:, None, None, :]  # [b, 1, 1, n]
    return attention_ref(q, keys, values, mask=mask, scale=scale)
