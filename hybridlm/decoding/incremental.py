"""The incremental decoder: chunked prefill, then one token at a time from the cache alone.

Prefill feeds the prompt in chunks of ``prefill_chunk_size`` tokens, so peak activation memory is bounded
by the chunk, not the prompt (the cache holds the rest). Decode feeds one token per step and reads nothing
but the cache, through :class:`~hybridlm.decoding.decode_step.DecodeStep`: nothing is read back to the host except, with
stop tokens, whether rows have finished (every ``stop_check_interval`` steps). Prompts of different lengths are
left-padded into one batch; rows that hit a stop token are dropped from the cache (``HybridCache.select``) at
those checks, so finished rows cost nothing, except under ``compile=True``, which keeps the batch fixed.

>>> decoder = IncrementalDecoder(model, prefill_chunk_size=256)
>>> for tokens in decoder.stream([[1, 2, 3], [4, 5]], max_new_tokens=8):  # one tensor per step
...     print(tokens)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from hybridlm.cache import HybridCache
from hybridlm.decoding.decode_step import DecodeStep
from hybridlm.decoding.prefix_cache import bind_prefix_cache
from hybridlm.decoding.sampling import SamplingSettings, choose_next

#: A compiled decoder's static caches hold a multiple of this many slots (each capacity compiles once).
STATIC_CAPACITY_STEP = 256


def left_pad(prompts: Sequence[Sequence[int]] | torch.Tensor, pad_token_id: int = 0):
    """``(ids [batch, longest], mask [batch, longest])`` with every prompt right-aligned."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"prompts must be [batch, time] or lists of token ids, got shape {tuple(prompts.shape)}")
        return prompts, torch.ones_like(prompts, dtype=torch.bool)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = True
    return ids, mask


class IncrementalDecoder:
    """Generates from a :class:`~hybridlm.HybridForCausalLM` with chunked prefill and cached decode."""

    def __init__(self, model, prefill_chunk_size: int = 512, cache_policy=None, prefix_cache=None, speculative=None,
                 compile: bool | str = False, stop_check_interval: int = 1):
        """``cache_policy``: a :class:`~hybridlm.CachePolicy` for the caches this decoder makes; ``prefix_cache``: a
        :class:`~hybridlm.PrefixCache` that prompts are restored from and snapshotted into; ``speculative``: a
        :class:`~hybridlm.SpeculativeDecoding` (draft model or prompt lookup, :mod:`hybridlm.decoding.speculative`).
        ``compile``: decode with a static cache and a step compiled by ``torch.compile``
        (:mod:`hybridlm.decoding.decode_step`); a string is the compile mode (``"max-autotune-no-cudagraphs"``:
        on a CPU, inductor's own small-batch matmul kernels, faster steps for a longer compile).
        ``stop_check_interval``: with stop tokens, read back every this many steps whether rows have finished (1:
        every step, ending the stream at once; N: one host sync per N steps, but up to N - 1 all-padding steps
        may follow the last stop)."""
        if prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size={prefill_chunk_size} must be >= 1")
        if stop_check_interval < 1:
            raise ValueError(f"stop_check_interval={stop_check_interval} must be >= 1")
        mode = compile if isinstance(compile, str) else None
        self.decode_step = DecodeStep(model, compile=bool(compile), mode=mode)
        self.stop_check_interval = stop_check_interval
        self.model = model
        self.prefill_chunk_size = prefill_chunk_size
        self.cache_policy = cache_policy
        self.prefix_cache = bind_prefix_cache(prefix_cache, model, cache_policy, prefill_chunk_size)
        if speculative is not None:
            speculative.check_target(model)
        self.speculative = speculative
        self.stats: dict = {}  # counters of the last call (prefix_hit_tokens, prefill_tokens, decode_tokens, ...)

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor | None = None,
                cache: HybridCache | None = None, reserve: int = 0) -> tuple[HybridCache, torch.Tensor]:
        """Run the prompt through the model chunk by chunk; returns the cache and the last position's logits.

        ``reserve`` extra slots are preallocated in attention layers for the tokens to come."""
        ids = ids.to(self.device)
        mask = mask.to(self.device) if mask is not None else None
        if cache is None:
            length = ids.shape[1] + reserve
            if self.decode_step.compiled:  # a capacity shared by nearby lengths: one compiled step serves them all
                length = -(-length // STATIC_CAPACITY_STEP) * STATIC_CAPACITY_STEP
            cache = self.model.new_cache(ids.shape[0], max_length=length, policy=self.cache_policy,
                                         static=self.decode_step.compiled)
            if self.prefix_cache is not None:
                return self.prefix_cache.prefill(self, ids, mask, cache)
        self.stats.update(prefix_hit_tokens=0, prefill_tokens=ids.shape[1])
        logits = None
        for start in range(0, ids.shape[1], self.prefill_chunk_size):
            stop = start + self.prefill_chunk_size
            chunk_mask = mask[:, start:stop] if mask is not None else None
            logits = self.model(ids[:, start:stop], attention_mask=chunk_mask, cache=cache, logits_to_keep=1).logits
        if logits is None:
            raise ValueError("prefill needs at least one prompt token")
        return cache, logits[:, -1]

    @torch.no_grad()
    def stream(self, prompts, **settings) -> Iterator[torch.Tensor]:
        """Yield the next token of every row, step by step (``[batch]``; finished rows yield ``pad_token_id``).

        ``prompts``: a ``[batch, time]`` tensor (no padding) or a list of token-id lists of any lengths."""
        settings = SamplingSettings(**settings)
        self.stats = {"prefix_hit_tokens": 0, "prefill_tokens": 0, "decode_tokens": 0}
        if self.speculative is not None:
            yield from self.speculative.stream(self, prompts, settings)
            return
        ids, mask = left_pad(prompts, settings.pad_token_id)
        self._check_length(ids.shape[1] + settings.max_new_tokens)
        generator = None
        if settings.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(settings.seed)
        cache, logits = self.prefill(ids, None if bool(mask.all()) else mask, reserve=settings.max_new_tokens)
        stops = torch.tensor(list(settings.stop_tokens), dtype=torch.long, device=self.device)
        rows = torch.arange(ids.shape[0], device=self.device)  # the output row of each cache row
        finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=self.device)  # per cache row
        for index in range(settings.max_new_tokens):
            chosen = choose_next(logits, settings, generator)
            if len(stops):
                chosen = chosen.masked_fill(finished, settings.pad_token_id)
                finished = finished | torch.isin(chosen, stops)
            step = chosen if len(rows) == ids.shape[0] else \
                chosen.new_full((ids.shape[0],), settings.pad_token_id).index_copy_(0, rows, chosen)
            self.stats["decode_tokens"] += 1
            yield step
            if len(stops) and (index + 1) % self.stop_check_interval == 0:
                done = int(finished.sum())  # the one host sync of a step, and only with stop tokens
                if done == len(rows):
                    return
                if done and not self.decode_step.compiled:  # a compiled step keeps its shapes
                    keep = (~finished).nonzero().squeeze(-1)
                    cache, rows, chosen, finished = cache.select(keep), rows[keep], chosen[keep], finished[keep]
            logits = self.decode_step(chosen, cache)

    def generate(self, prompts, **settings) -> torch.Tensor:
        """``[batch, prompt + new]``: the (left-padded) prompts followed by the generated tokens."""
        pad = settings.get("pad_token_id", 0)
        ids, _ = left_pad(prompts, pad)
        steps = list(self.stream(prompts, **settings))
        new = torch.stack(steps, dim=1) if steps else ids.new_zeros(ids.shape[0], 0)
        return torch.cat([ids.to(new.device), new], dim=1)

    def _check_length(self, total: int) -> None:
        limit = self.model.config.max_length_limit
        if limit is not None and total > limit:
            raise ValueError(f"prompt plus max_new_tokens is {total} tokens, more than this model's limit of "
                             f"{limit} (max_position_embeddings / linformer_max_length)")
