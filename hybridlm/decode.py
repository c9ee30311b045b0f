"""One decode step that reads nothing back to the host, run eagerly or compiled.

:func:`decode_logits` is what ``forward`` does for one token, minus everything that needs a tensor value in
Python: the ids are the model's own choices (checked at prefill: the prompt; the vocabulary bounds the rest), so
they are not range-checked; there is no padding mask (padding only precedes a row's first token, all seen at
prefill); positions come from the cache as a tensor; the position limit was checked for the whole generation
before prefill. The cache's Python counters advance outside the step (:meth:`DecodeStep.__call__`), so the step
itself is a pure tensor program: with a static cache (:mod:`hybridlm.kv.static`) its shapes never change and
``torch.compile(fullgraph=True)`` captures it whole (on CUDA as a CUDA graph with ``mode="reduce-overhead"``).
"""

from __future__ import annotations

import torch

from .cache import HybridCache


def decode_logits(model, ids: torch.Tensor, cache: HybridCache) -> torch.Tensor:
    """``logits [batch, vocab]`` of token ids ``[batch, 1]`` continuing ``cache`` (a HybridForCausalLM's);
    updates the states in place but not the cache's counters (``cache.advance(None, 1)`` does)."""
    inner = model.model
    hidden, _ = inner.run_blocks(inner.embed_ids(ids), cache, None, cache.positions[:, None], None)
    return model.logits_of(inner.norm(hidden[:, -1]))  # [batch, vocab]


class DecodeStep:
    """``step(tokens [batch], cache) -> logits [batch, vocab]``, advancing the cache by one slot.

    ``compile=True`` runs :func:`decode_logits` through ``torch.compile`` (``fullgraph=True``: a graph break is
    an error, not a silent slowdown) with ``mode`` (default: ``"reduce-overhead"``, i.e. CUDA graphs, on CUDA;
    inductor's default on CPU). A compiled step needs a static cache: with a growing one every step would have
    new shapes and recompile."""

    def __init__(self, model, compile: bool = False, mode: str | None = None):
        self.model, self.compiled = model, compile
        self._logits = decode_logits
        if compile:
            device = model.lm_head.weight.device
            mode = mode or ("reduce-overhead" if device.type == "cuda" else "default")
            self._logits = torch.compile(decode_logits, fullgraph=True, dynamic=False, mode=mode)

    def __call__(self, tokens: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        if self.compiled and cache.capacity is None:
            raise ValueError("a compiled decode step needs a static cache: model.new_cache(batch, max_length=..., "
                             "static=True)")
        cache.check_room(1)
        logits = self._logits(self.model, tokens[:, None], cache)
        cache.advance(None, 1)
        return logits
