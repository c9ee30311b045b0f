"""A verification block read as the one-token decode steps it stands for.

Speculative decoding scores ``k + 1`` tokens in one forward and must get, for each of them, the logits that
decoding it alone would give (greedy speculative output is then exactly greedy output). For most layouts a
multi-token forward already does. Two kinds of layout change what a token sees as the cache moves on:

* quantized KV (KIVI) quantizes a group once it ages past ``kv_residual``: a decode step at slot ``s`` reads
  the tokens quantized by then as codes and the rest in full precision, whereas a multi-token forward reads
  all its own tokens in full precision;
* attention sinks give the sinks fixed positions while the window slides: a decode step past the window sees
  the sinks at a distance that stops growing, a multi-token forward at the distance of its first token.

So a forward of 2 to :data:`~hybridlm.cache.rollback.AUTO_CHECKPOINT_TOKENS` tokens on a warm cache (what
verification sends, the same rule as the rollback checkpoints) attends through :func:`stepwise_view`: each key
carries the query slots that see it, ``[visible_from, visible_until)`` (a token both in full precision, until
it is quantized, and as its dequantized copy, from then), and the sinks are scored with each query rotated to
the position its own decode step gives it. Longer forwards (a prefill) keep KIVI's reading: their own tokens in
full precision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from hybridlm import ops
from hybridlm.cache import rollback
from hybridlm.cache.kv.base import KVView
from hybridlm.ops.attention import slot_mask

#: ``visible_until`` of a key that no later query slot stops seeing
NEVER = torch.iinfo(torch.long).max


def is_verification_block(first: int, time: int) -> bool:
    """A forward of ``time`` tokens after ``first`` slots: read as decode steps (see the module docstring)."""
    return first > 0 and 1 < time <= rollback.AUTO_CHECKPOINT_TOKENS


def stepwise_view(view: KVView, visible_from: torch.Tensor | None = None, visible_until: torch.Tensor | None = None,
                  sink_query: Callable[[torch.Tensor], torch.Tensor] | None = None) -> KVView:
    """``view`` (keys already rotated) with an ``attend`` that adds, to the slot mask, that query slot ``s`` sees
    key ``j`` only if ``visible_from[j] <= s < visible_until[j]`` (``[n]`` each; None: no such bound).
    ``sink_query``: None, or a function turning the queries ``[batch, q_heads, time, head_dim]`` (rotated at
    the view's query positions) into the queries rotated at their decode step's positions, which score the
    pinned keys (the sinks)."""
    query_slots = view.query_slots[:, None]  # [time, 1]
    own_step = torch.ones(view.query_slots.shape[0], view.slots.shape[-1], dtype=torch.bool,
                          device=view.slots.device)  # [time, n]
    if visible_from is not None:
        own_step = own_step & (visible_from <= query_slots) & (query_slots < visible_until)

    def attend(q: torch.Tensor, scale: float | None) -> torch.Tensor:
        """``q [batch, q_heads, time, head_dim]`` -> ``[batch, q_heads, time, head_dim]``."""
        allowed = slot_mask(view.query_slots, view.slots, key_valid=view.valid, key_pinned=view.pinned,
                            window=view.window, q_heads=q.shape[1]) & own_step  # [b or 1, h or 1, time, n]
        if sink_query is None:
            return ops.attention(q, view.keys, view.values, mask=allowed, scale=scale)
        heads = q.shape[1] // view.keys.shape[1]
        keys = view.keys.repeat_interleave(heads, 1).transpose(-1, -2)  # [b, q_heads, d, n]
        scores = torch.where(view.pinned.view(-1), sink_query(q) @ keys, q @ keys)  # [b, q_heads, time, n]
        return _softmax_values(scores, view.values.repeat_interleave(heads, 1), allowed, scale, q.shape[-1])

    return dataclasses.replace(view, in_order=False, attend=attend)  # the keys stay, for inspection


def _softmax_values(scores, values, allowed, scale, dim) -> torch.Tensor:
    """softmax(``scores [b, h, time, n]`` * scale, masked by ``allowed``) @ ``values [b, h, n, d]``, in at least
    fp32 (as SDPA's math path)."""
    dtype = torch.promote_types(scores.dtype, torch.float32)
    scores = scores.to(dtype) * (scale if scale is not None else dim**-0.5)
    probs = scores.masked_fill(~allowed, -torch.inf).softmax(-1)
    return (probs @ values.to(dtype)).to(values.dtype)
