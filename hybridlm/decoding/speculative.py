"""Speculative decoding for :class:`~hybridlm.decoding.incremental.IncrementalDecoder`: a cheap drafter proposes ``k``
tokens,
the target model scores them all in one forward, the longest acceptable prefix is kept plus one token of the
target's own, and the rejected tail is rolled back with ``HybridCache.crop``.

Two drafters: a smaller draft model with the target's vocabulary, or prompt lookup (the tokens that followed the
latest earlier occurrence of the sequence's last n-gram). Greedy verification keeps a draft token while it equals
the target's argmax, so the output is exactly greedy decoding's. Sampling uses rejection sampling (Leviathan et al.
2023; Chen et al. 2023): a draft token ``x`` drawn from ``q`` is kept with probability ``min(1, p(x) / q(x))``; at
the first rejection the token is drawn from ``norm(max(0, p - q))``; after ``k`` acceptances from ``p``. Every
emitted token is then distributed as the target's ``p`` (after temperature / top-k / top-p). Prompt lookup drafts
deterministically: ``q`` is a point mass.

The rows of a batch share one cache length, so a round keeps the smallest accepted count over the rows. A row that
accepted more emits, at that position, its accepted draft token, which is the token rejection sampling emits there;
cutting the round at a point chosen by the other rows (independent of this row) leaves the distribution unchanged.

>>> decoder = IncrementalDecoder(model, speculative=SpeculativeDecoding(draft_model=draft, num_draft_tokens=4))
>>> decoder.generate([[1, 2, 3]], max_new_tokens=32); decoder.stats["acceptance_rate"]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridlm.cache import HybridCache
from hybridlm.decoding.decode_step import DecodeStep
from hybridlm.decoding.incremental import IncrementalDecoder, left_pad
from hybridlm.decoding.sampling import SamplingSettings, choose_next, sampling_probs


@dataclass(frozen=True)
class SpeculativeDecoding:
    """What drafts the tokens: ``draft_model`` (a causal LM sharing the target's vocabulary, hence tokenizer) or
    ``prompt_lookup`` (the longest n-gram to look up, e.g. 3); ``num_draft_tokens`` (k) drafted per round."""

    draft_model: Any = None
    prompt_lookup: int | None = None
    num_draft_tokens: int = 4

    def __post_init__(self):
        if (self.draft_model is None) == (self.prompt_lookup is None):
            raise ValueError("SpeculativeDecoding: pass exactly one of draft_model and prompt_lookup")
        if isinstance(self.num_draft_tokens, bool) or not isinstance(self.num_draft_tokens, int) \
                or self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens!r} must be an int >= 1")
        if self.prompt_lookup is not None and (not isinstance(self.prompt_lookup, int) or self.prompt_lookup < 1):
            raise ValueError(f"prompt_lookup={self.prompt_lookup!r} must be an int >= 1 (the longest n-gram matched)")

    def check_target(self, model) -> None:
        """Raise unless the draft model can draft for ``model`` (same vocabulary)."""
        if self.draft_model is None:
            return
        draft_vocab, target_vocab = self.draft_model.config.vocab_size, model.config.vocab_size
        if draft_vocab != target_vocab:
            raise ValueError(f"draft_model has vocab_size={draft_vocab} but the target model has {target_vocab}: "
                             "speculative decoding needs a draft model with the target's vocabulary (tokenizer)")

    def stream(self, decoder, prompts, settings: SamplingSettings) -> Iterator[torch.Tensor]:
        """What ``decoder.stream`` yields when it decodes speculatively (see :func:`speculative_stream`)."""
        return speculative_stream(decoder, prompts, settings)


def check_rollback(model, policy) -> None:
    """Raise, before any work, unless a cache made under ``policy`` can roll back (speculative decoding crops the
    target's cache after every verification): naming each state whose layout never can (H2O heavy hitters)."""
    probe = model.new_cache(1, policy=policy)
    refused = [f"state {index} ({kind}, {_layout_names(state)}): {state.rewind_blocker(1)}"
               for index, (kind, state) in enumerate(zip(probe.layer_types, probe.states)) if not state.croppable]
    if refused:
        raise ValueError("speculative decoding rolls the cache back after each verification, and under this "
                         f"cache_policy {'; '.join(refused)}. Use a policy without heavy_hitters (quantized KV, "
                         "sinks + window and paged KV roll back exactly)")


def _layout_names(state) -> str:
    parts = getattr(state, "parts", None)
    return "+".join(type(part).__name__ for part in parts.values()) if parts else type(state).__name__


def rollback(cache: HybridCache, length: int) -> None:
    """Keep the first ``length`` token slots of ``cache`` (nothing to do when it holds no more)."""
    if cache.seen > length:
        cache.crop(length - cache.seen)  # transformers' convention: a negative count of tokens to remove


class DraftModelDrafter:
    """Drafts with a smaller model. Its cache holds every token of the sequence but the last; each round feeds
    the tokens it has not seen (one or two), then one token per draft step."""

    def __init__(self, model, settings: SamplingSettings, generator: torch.Generator | None, chunk_size: int):
        self.decoder = IncrementalDecoder(model, prefill_chunk_size=chunk_size)
        self.step = DecodeStep(model)  # one-token steps without forward's input checks (the ids are the draft's)
        self.model, self.settings, self.generator = model, settings, generator
        self.cache: HybridCache | None = None

    def start(self, ids: torch.Tensor, mask: torch.Tensor | None, reserve: int, draft_tokens: int) -> None:
        self.cache, _ = self.decoder.prefill(ids, mask, reserve=reserve)
        self.cache.keep_checkpoints(draft_tokens)  # a round's one-token draft steps are undone after verification

    def propose(self, tokens: torch.Tensor, k: int):
        """``(drafts [batch, k], lengths [batch], q [batch, k, vocab] or None when greedy)``."""
        device = self.decoder.device
        if k == 0:
            return tokens.new_zeros(tokens.shape[0], 0), tokens.new_zeros(tokens.shape[0]), None
        logits = self.model(tokens[:, self.cache.seen:].to(device), cache=self.cache, logits_to_keep=1).logits[:, -1]
        drafts, probs = [], []
        for index in range(k):
            if self.settings.greedy:
                drafts.append(logits.argmax(-1))  # [batch]
            else:
                probs.append(sampling_probs(logits, self.settings))  # [batch, vocab]
                drafts.append(torch.multinomial(probs[-1], 1, generator=self.generator).squeeze(-1))
            if index + 1 < k:
                logits = self.step(drafts[-1], self.cache)
        drafts = torch.stack(drafts, 1)
        lengths = torch.full((tokens.shape[0],), k, dtype=torch.long)
        q = torch.stack(probs, 1).to(tokens.device) if probs else None  # greedy: q is not needed
        return drafts.to(tokens.device), lengths.to(tokens.device), q

    def keep(self, length: int) -> None:
        rollback(self.cache, length)

    def select(self, rows: torch.Tensor) -> None:
        self.cache = self.cache.select(rows)


class PromptLookupDrafter:
    """Drafts the tokens that followed the latest earlier occurrence of the sequence's last n-gram (n from
    ``max_ngram`` down to 1); a row without a match drafts nothing this round."""

    def __init__(self, max_ngram: int, vocab_size: int, settings: SamplingSettings):
        self.max_ngram, self.vocab_size, self.settings = max_ngram, vocab_size, settings
        self.padding: list[int] = []

    def start(self, ids: torch.Tensor, mask: torch.Tensor | None, reserve: int, draft_tokens: int) -> None:
        self.padding = [0] * ids.shape[0] if mask is None else (~mask).sum(-1).tolist()

    def propose(self, tokens: torch.Tensor, k: int):
        rows = [self.lookup(tokens[row, pad:], k) for row, pad in enumerate(self.padding)]
        drafts = tokens.new_zeros(len(rows), k)
        for row, found in enumerate(rows):
            drafts[row, : len(found)] = found
        lengths = torch.tensor([len(found) for found in rows], dtype=torch.long, device=tokens.device)
        q = None if self.settings.greedy else F.one_hot(drafts, self.vocab_size).float()  # point masses
        return drafts, lengths, q

    def lookup(self, sequence: torch.Tensor, k: int) -> torch.Tensor:
        """Up to ``k`` tokens that followed the latest earlier occurrence of ``sequence [time]``'s last n-gram."""
        for n in range(min(self.max_ngram, sequence.shape[0] - 1), 0, -1):
            earlier = sequence.unfold(0, n, 1)[:-1]  # [time - n, n]: every n-gram but the last one
            hits = (earlier == sequence[-n:]).all(-1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return sequence[start : start + k]
        return sequence[:0]

    def keep(self, length: int) -> None:
        pass

    def select(self, rows: torch.Tensor) -> None:
        self.padding = [self.padding[row] for row in rows.tolist()]


def verify(drafts: torch.Tensor, lengths: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor,
           settings: SamplingSettings, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the number of draft tokens accepted and the token that follows them.

    ``drafts [batch, k]`` of which the first ``lengths [batch]`` are real; ``q [batch, k, vocab]`` the draft
    distributions (None when greedy); ``logits [batch, k + 1, vocab]`` the target's at the last token and at each
    draft token. Returns ``accepted [batch]`` and ``next_token [batch]``."""
    k = drafts.shape[1]
    drafted = torch.arange(k, device=drafts.device) < lengths[:, None]  # [batch, k]
    if settings.greedy:
        best = logits.argmax(-1)  # [batch, k + 1]
        accepted = ((drafts == best[:, :k]) & drafted).long().cumprod(-1).sum(-1)  # [batch]
        return accepted, best.gather(1, accepted[:, None]).squeeze(1)
    p = sampling_probs(logits, settings)  # [batch, k + 1, vocab]
    q_full = torch.zeros_like(p)  # no draft (and after the last): q = 0, so the residual is p itself
    if k:
        q_full[:, :k] = q * drafted[..., None]
    p_x = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [batch, k]
    q_x = q_full[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(p_x.shape, generator=generator, device=p_x.device)
    keep = (u < acceptance_probability(p_x, q_x)) & drafted
    accepted = keep.long().cumprod(-1).sum(-1)  # [batch]
    rows = torch.arange(p.shape[0], device=p.device)
    return accepted, torch.multinomial(residual(p[rows, accepted], q_full[rows, accepted]), 1,
                                       generator=generator).squeeze(-1)


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """``min(1, p(x) / q(x))`` for draft tokens ``x`` drawn from ``q`` (so ``q(x) > 0``)."""
    return (p_x / q_x).clamp(max=1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What to sample from after rejecting a draft token: ``max(0, p - q)`` (unnormalised; ``p`` where that is
    all zero, which only rounding can cause since a rejection needs some ``p(x) < q(x)``)."""
    left = (p - q).clamp(min=0)  # [batch, vocab]
    return torch.where(left.sum(-1, keepdim=True) > 0, left, p)


def speculative_stream(decoder, prompts, settings: SamplingSettings) -> Iterator[torch.Tensor]:
    """:meth:`IncrementalDecoder.stream` with ``decoder.speculative``: the same steps (``[batch]`` per token),
    several tokens per target forward; counters in ``decoder.stats``."""
    spec: SpeculativeDecoding = decoder.speculative
    model, device = decoder.model, decoder.device
    ids, mask = left_pad(prompts, settings.pad_token_id)
    decoder._check_length(ids.shape[1] + settings.max_new_tokens)
    stats = decoder.stats
    stats.update(draft_tokens=0, accepted_draft_tokens=0, target_forwards=0, acceptance_rate=0.0)
    check_rollback(model, decoder.cache_policy)
    if settings.max_new_tokens == 0:
        return
    generator = None if settings.seed is None else torch.Generator(device=device).manual_seed(settings.seed)
    ids = ids.to(device)
    mask = None if bool(mask.all()) else mask.to(device)
    cache, logits = decoder.prefill(ids, mask, reserve=settings.max_new_tokens)
    if spec.draft_model is not None:
        drafter = DraftModelDrafter(spec.draft_model, settings, generator, decoder.prefill_chunk_size)
    else:
        drafter = PromptLookupDrafter(spec.prompt_lookup, model.config.vocab_size, settings)
    drafter.start(ids, mask, settings.max_new_tokens + spec.num_draft_tokens, spec.num_draft_tokens)
    stops = torch.tensor(list(settings.stop_tokens), dtype=torch.long, device=device)
    active = torch.arange(ids.shape[0], device=device)  # rows still generating, in cache order
    new = choose_next(logits, settings, generator)[:, None]  # [active, tokens emitted this round]
    tokens = torch.cat([ids, new], 1)  # the sequences so far; the target's cache holds all but the last token
    emitted = 0
    while True:
        running = torch.ones_like(active, dtype=torch.bool)
        for column in new.unbind(1):
            step = torch.full((ids.shape[0],), settings.pad_token_id, dtype=torch.long, device=device)
            step[active[running]] = column[running]
            stats["decode_tokens"] = stats.get("decode_tokens", 0) + 1
            yield step
            running &= ~torch.isin(column, stops)
        emitted += new.shape[1]
        if emitted == settings.max_new_tokens or not bool(running.any()):
            return
        if not bool(running.all()):
            keep = running.nonzero().squeeze(-1)
            cache, active, tokens = cache.select(keep), active[keep], tokens[keep]
            drafter.select(keep)
        new = _round(model, cache, drafter, tokens, min(spec.num_draft_tokens, settings.max_new_tokens - emitted - 1),
                     settings, generator, stats)
        tokens = torch.cat([tokens, new], 1)


def _round(model, cache: HybridCache, drafter, tokens: torch.Tensor, k: int, settings: SamplingSettings,
           generator, stats: dict) -> torch.Tensor:
    """Draft ``k`` tokens, verify them in one target forward, roll both caches back to what was kept; returns the
    new tokens ``[batch, kept + 1]``."""
    drafts, lengths, q = drafter.propose(tokens, k)  # [batch, k], [batch], [batch, k, vocab] or None
    block = torch.cat([tokens[:, -1:], drafts], 1)  # [batch, k + 1]
    logits = model(block, cache=cache).logits  # [batch, k + 1, vocab]
    accepted, following = verify(drafts, lengths, q, logits, settings, generator)
    kept = int(accepted.min())  # one cache length for all rows
    chosen = torch.where(accepted > kept, torch.cat([drafts, following[:, None]], 1)[:, kept], following)
    rollback(cache, tokens.shape[1] + kept)
    drafter.keep(tokens.shape[1] + kept)
    stats["draft_tokens"] += int(lengths.sum())
    stats["accepted_draft_tokens"] += kept * tokens.shape[0]
    stats["target_forwards"] += 1
    stats["acceptance_rate"] = stats["accepted_draft_tokens"] / max(stats["draft_tokens"], 1)
    return torch.cat([drafts[:, :kept], chosen[:, None]], 1)
