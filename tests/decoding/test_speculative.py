"""Speculative decoding: greedy output equals plain greedy decoding exactly (IncrementalDecoder and transformers'
assisted generation), sampling keeps the target's distribution (rejection sampling, checked statistically), the
acceptance rate is reported, and bad input is a clear error."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import CachePolicy, PrefixCache, SpeculativeDecoding
from hybridlm.cache import HybridCache, KVState
from hybridlm.decoding import speculative as spec_module
from hybridlm.decoding.incremental import IncrementalDecoder
from hybridlm.decoding.sampling import SamplingSettings, sampling_probs
from hybridlm.decoding.speculative import verify
from hybridlm.mixers import MIXERS
from tests.helpers import tiny_model

ATTENTION = ["attention", "attention"]
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 3, 4, 9, 1, 2, 3, 4, 9], [3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 3]]  # repetitive: lookups hit


def perturbed_copy(model, scale: float, seed: int = 7):
    """A draft that agrees with ``model`` often but not always: its weights, plus noise ``scale`` times as large
    as the LM head's weights."""
    draft = tiny_model(0, layer_types=model.config.layer_types)
    draft.load_state_dict(model.state_dict())
    with torch.no_grad():
        noise = torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(seed))
        draft.lm_head.weight.add_(scale * draft.lm_head.weight.std() * noise)
    return draft


def drafters(target):
    return {
        "draft=target": SpeculativeDecoding(draft_model=target, num_draft_tokens=4),
        "perturbed draft": SpeculativeDecoding(draft_model=perturbed_copy(target, 0.1), num_draft_tokens=3),
        "smaller draft": SpeculativeDecoding(draft_model=tiny_model(1, layer_types=["attention"]), num_draft_tokens=2),
        "prompt lookup": SpeculativeDecoding(prompt_lookup=2, num_draft_tokens=3),
    }


@pytest.mark.parametrize("name", ["draft=target", "perturbed draft", "smaller draft", "prompt lookup"])
def test_greedy_speculative_decoder_equals_greedy(name):
    target = tiny_model(0, layer_types=ATTENTION)
    speculative = drafters(target)[name]
    options = dict(max_new_tokens=24, stop_tokens=[11])  # the second row stops after 20 tokens, the first does not
    expected = IncrementalDecoder(target).generate(PROMPTS, **options)  # left-padded batch of two
    assert expected.shape == (2, 15 + 24) and (expected[1, -4:] == 0).all() and (expected[0, -4:] != 0).all()
    decoder = IncrementalDecoder(target, speculative=speculative)
    assert torch.equal(decoder.generate(PROMPTS, **options), expected)
    stats = decoder.stats
    assert stats["draft_tokens"] > 0 and stats["decode_tokens"] == 24
    assert stats["acceptance_rate"] == stats["accepted_draft_tokens"] / stats["draft_tokens"]
    if name == "draft=target":
        assert stats["acceptance_rate"] == 1.0
    if name in ("perturbed draft", "prompt lookup"):  # both the accepting and the rejecting paths ran
        assert 0 < stats["acceptance_rate"] < 1


def test_greedy_speculative_single_row_stops_and_short_budgets():
    target = tiny_model(0, layer_types=ATTENTION)
    decoder = IncrementalDecoder(target, speculative=SpeculativeDecoding(draft_model=perturbed_copy(target, 0.1)))
    plain = IncrementalDecoder(target)
    for new in (0, 1, 2, 5):
        assert torch.equal(decoder.generate([PROMPTS[0]], max_new_tokens=new),
                           plain.generate([PROMPTS[0]], max_new_tokens=new))
    first = int(plain.generate([PROMPTS[0]], max_new_tokens=3)[0, -1])  # a stop token met inside an accepted block
    assert torch.equal(decoder.generate([PROMPTS[0]], max_new_tokens=10, stop_tokens=[first]),
                       plain.generate([PROMPTS[0]], max_new_tokens=10, stop_tokens=[first]))


@settings(max_examples=6, deadline=None)
@given(stack=st.lists(st.sampled_from(sorted(MIXERS)), min_size=1, max_size=3), k=st.integers(1, 5),
       seed=st.integers(0, 99))
def test_greedy_speculative_equals_greedy_on_hybrid_stacks(stack, k, seed):
    """Every state kind rolls back: recurrent ones in the target (a verification block) and in the draft (its
    one-token draft steps, kept with ``keep_checkpoints``); both routes, the decoder's with a padded batch."""
    target = tiny_model(seed, layer_types=stack)
    draft = perturbed_copy(target, 0.1)
    expected = IncrementalDecoder(target).generate(PROMPTS, max_new_tokens=12)
    for speculative in (SpeculativeDecoding(draft_model=draft, num_draft_tokens=k),
                        SpeculativeDecoding(prompt_lookup=2, num_draft_tokens=k)):
        assert torch.equal(IncrementalDecoder(target, speculative=speculative).generate(PROMPTS, max_new_tokens=12),
                           expected)
    ids = torch.tensor([PROMPTS[0]])
    expected = target.generate(ids, max_new_tokens=12, do_sample=False)
    for kwargs in (dict(assistant_model=draft), dict(prompt_lookup_num_tokens=k)):
        assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False, **kwargs), expected)


def test_greedy_speculative_with_a_prefix_cache_hit_equals_greedy():
    target = tiny_model(0, layer_types=["mamba2", "attention"])
    prompt = [list(range(1, 40)) + PROMPTS[0]]
    expected = IncrementalDecoder(target).generate(prompt, max_new_tokens=16)
    decoder = IncrementalDecoder(target, prefix_cache=PrefixCache(block_size=16),
                                 speculative=SpeculativeDecoding(draft_model=perturbed_copy(target, 0.1)))
    for hit in (0, 48):  # cold, then the first three blocks restored
        assert torch.equal(decoder.generate(prompt, max_new_tokens=16), expected)
        assert decoder.stats["prefix_hit_tokens"] == hit and decoder.stats["accepted_draft_tokens"] > 0


def test_greedy_speculative_on_a_compiled_decoders_static_cache_equals_greedy():
    """``compile=True`` prefills into a static cache; verification blocks and crops work on it (the rounds run
    eagerly: nothing is compiled here)."""
    target = tiny_model(0, layer_types=["mamba2", "attention"])
    expected = IncrementalDecoder(target).generate(PROMPTS, max_new_tokens=12)
    for speculative in (SpeculativeDecoding(draft_model=perturbed_copy(target, 0.1), num_draft_tokens=3),
                        SpeculativeDecoding(prompt_lookup=2, num_draft_tokens=3)):
        decoder = IncrementalDecoder(target, compile=True, speculative=speculative)
        assert torch.equal(decoder.generate(PROMPTS, max_new_tokens=12), expected)
        assert decoder.stats["draft_tokens"] > 0
        if speculative.draft_model is not None:  # crops after partial acceptance ran
            assert 0 < decoder.stats["acceptance_rate"] < 1


POLICIES = {  # each rolls back past what it has aged: quantized groups, slots pushed out of the window
    "quantized": CachePolicy(kv_bits=4, kv_group_size=4, kv_residual=2),
    "quantized sinks+window": CachePolicy(kv_bits=4, kv_group_size=4, kv_residual=2, sink_tokens=2, window=8),
    "sinks+window": CachePolicy(sink_tokens=2, window=6),
    "paged": CachePolicy(page_size=4),
}


@pytest.mark.parametrize("name", POLICIES)
def test_greedy_speculative_equals_greedy_under_each_cache_policy(name, monkeypatch):
    """With the same cache policy, both routes give plain greedy decoding's tokens; rejections roll the cache back
    past its full-precision tail (quantized groups put back) and past the window (slots put back)."""
    policy, crops = POLICIES[name], []
    record = HybridCache.crop
    monkeypatch.setattr(HybridCache, "crop", lambda cache, length: crops.append(
        (cache.seen, cache.seen + length if length <= 0 else length, cache.states[0])) or record(cache, length))
    target = tiny_model(0, layer_types=["attention", "mamba2"])
    draft = perturbed_copy(target, 0.1)
    expected = IncrementalDecoder(target, cache_policy=policy).generate(PROMPTS, max_new_tokens=24)
    for speculative in (SpeculativeDecoding(draft_model=draft, num_draft_tokens=3),
                        SpeculativeDecoding(prompt_lookup=2, num_draft_tokens=3)):
        crops.clear()
        decoder = IncrementalDecoder(target, cache_policy=policy, speculative=speculative)
        assert torch.equal(decoder.generate(PROMPTS, max_new_tokens=24), expected)
        target_crops = [(seen, stop, state) for seen, stop, state in crops if not isinstance(state, KVState)]
        assert 0 <= decoder.stats["acceptance_rate"] < 1 and target_crops  # (the draft's cache has no policy)
        if policy.kv_bits != 16:  # a crop put quantized groups back (the tail alone would not do)
            assert any(state._canonical_left(stop) < state._canonical_left(seen) for seen, stop, state in target_crops)
        if policy.window is not None:
            assert any(stop > policy.sink_tokens + policy.window for _, stop, _ in target_crops)
    ids = torch.tensor([PROMPTS[0]])
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, cache_policy=policy)
    for kwargs in (dict(assistant_model=draft), dict(prompt_lookup_num_tokens=3)):
        assert torch.equal(target.generate(ids, max_new_tokens=24, do_sample=False, cache_policy=policy, **kwargs),
                           expected)


def test_speculative_decoding_refuses_a_policy_that_cannot_roll_back_before_any_work():
    target = tiny_model(0, layer_types=["attention", "mamba2"])
    decoder = IncrementalDecoder(target, cache_policy=CachePolicy(heavy_hitters=2, window=4),
                                 speculative=SpeculativeDecoding(prompt_lookup=2))
    with pytest.raises(ValueError, match=r"state 0 \(attention, HeavyHitterKV\): H2O \(heavy hitters\) cannot roll "
                                         "back.*without heavy_hitters"):
        next(decoder.stream(PROMPTS, max_new_tokens=8))
    assert decoder.stats["prefill_tokens"] == 0  # refused before the prefill


@pytest.mark.parametrize("kwargs", [dict(assistant_model="draft"), dict(assistant_model="target"),
                                    dict(prompt_lookup_num_tokens=3)], ids=["draft", "draft=target", "lookup"])
def test_transformers_assisted_generation_equals_greedy(kwargs):
    target = tiny_model(0, layer_types=ATTENTION)
    models = {"draft": perturbed_copy(target, 0.1), "target": target}
    kwargs = {key: models.get(value, value) for key, value in kwargs.items()}
    ids = torch.tensor([PROMPTS[0]])
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    assert expected.shape == (1, 15 + 24)
    assert torch.equal(target.generate(ids, max_new_tokens=24, do_sample=False, **kwargs), expected)


# --- sampling keeps the target's distribution --------------------------------------------------------------------
#
# N samples from a distribution over K cells: the empirical total variation distance to it has mean at most
# sqrt(K / N) / 2 (Cauchy-Schwarz over the cells' standard deviations), and exceeds that mean by t with probability
# at most exp(-2 N t^2) (McDiarmid: one sample moves it by at most 1 / N). TV_SLACK = 0.02 makes that 1e-7 or less.

TV_SLACK = 0.02


def tv_bound(cells: int, samples: int) -> float:
    return 0.5 * math.sqrt(cells / samples) + TV_SLACK


def total_variation(samples: torch.Tensor, cells: int, exact: torch.Tensor) -> float:
    empirical = torch.bincount(samples, minlength=cells).double() / samples.numel()
    return 0.5 * float((empirical - exact.double()).abs().sum())


def two_token_chain(vocab: int = 8):
    """A target p and a different draft q over two steps: ``p0 [vocab]``, ``p1 [vocab, vocab]`` (row: first token)."""
    g = torch.Generator().manual_seed(3)
    p0, q0 = (torch.randn(vocab, generator=g) * 1.5).softmax(-1), (torch.randn(vocab, generator=g) * 1.5).softmax(-1)
    p1, q1 = ((torch.randn(vocab, vocab, generator=g) * 1.5).softmax(-1) for _ in range(2))
    return p0, p1, q0, q1


def sample_pairs(rows: int, point_mass: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs ``verify`` with k = 2 on ``rows`` independent rows; returns each row's first two emitted tokens as one
    cell ``first * vocab + second`` and the exact distribution of those cells under p."""
    p0, p1, q0, q1 = two_token_chain()
    vocab = p0.shape[0]
    g = torch.Generator().manual_seed(seed)
    if point_mass:  # prompt lookup: always the same two draft tokens
        drafts = torch.tensor([[2, 5]]).expand(rows, 2)
        q = torch.nn.functional.one_hot(drafts, vocab).float()
    else:
        x0 = torch.multinomial(q0, rows, replacement=True, generator=g)
        x1 = torch.multinomial(q1[x0], 1, generator=g).squeeze(-1)
        drafts, q = torch.stack([x0, x1], 1), torch.stack([q0.expand(rows, vocab), q1[x0]], 1)
    bonus = torch.full((rows, vocab), 1.0 / vocab)  # p after two tokens: not part of the checked pair
    logits = torch.stack([p0.expand(rows, vocab), p1[drafts[:, 0]], bonus], 1).log()
    accepted, following = verify(drafts, torch.full((rows,), 2), q, logits, SamplingSettings(do_sample=True), g)
    first = torch.where(accepted > 0, drafts[:, 0], following)
    second = torch.where(accepted > 1, drafts[:, 1], following)
    fresh = torch.multinomial(p1[first], 1, generator=g).squeeze(-1)  # the next round's token when 0 were accepted
    second = torch.where(accepted == 0, fresh, second)
    return first * vocab + second, (p0[:, None] * p1).flatten()


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft model", "prompt lookup"])
def test_rejection_sampling_keeps_the_target_distribution(point_mass, monkeypatch):
    rows = 40_000
    cells, exact = sample_pairs(rows, point_mass)
    assert total_variation(cells, 64, exact) < tv_bound(64, rows)
    # control: the same check fails for a wrong acceptance rule (accept with probability p(x), ignoring q) ...
    if not point_mass:  # (for a point mass that rule is the right one)
        monkeypatch.setattr(spec_module, "acceptance_probability", lambda p_x, q_x: p_x)
        assert total_variation(sample_pairs(rows, point_mass)[0], 64, exact) > tv_bound(64, rows)
        monkeypatch.undo()
    # ... and for resampling from p instead of the residual max(0, p - q) after a rejection
    monkeypatch.setattr(spec_module, "residual", lambda p, q: p)
    assert total_variation(sample_pairs(rows, point_mass)[0], 64, exact) > tv_bound(64, rows)


def sharpened(model, factor: float):
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    return model


def test_speculative_sampling_decoder_keeps_the_target_distribution():
    """End to end: many rows of one prompt, a draft far from the target; the first three new tokens (the first from
    the prompt's logits, the others from draft-and-verify rounds) follow the target's exact distribution, top-k
    filtered (so p is zero where q is not). With this many rows a round keeps the smallest accepted count, 0: each
    round checks one position, rejection included; test_rejection_sampling_keeps_the_target_distribution checks
    longer accepted runs."""
    vocab, rows, sample = 4, 20_000, SamplingSettings(do_sample=True, top_k=3)
    target = sharpened(tiny_model(0, layer_types=ATTENTION, vocab_size=vocab), 8.0)
    draft = sharpened(tiny_model(5, layer_types=["attention"], vocab_size=vocab), 8.0)
    prompt = torch.tensor([1, 2, 3, 0])
    decoder = IncrementalDecoder(target, speculative=SpeculativeDecoding(draft_model=draft, num_draft_tokens=2))
    out = decoder.generate(prompt.expand(rows, 4), do_sample=True, top_k=3, max_new_tokens=4, seed=1)[:, 4:7]
    assert decoder.stats["draft_tokens"] == rows * (2 + 1)  # rounds of k = 2, then 1 (the budget)
    with torch.no_grad():
        firsts = torch.cat([prompt.expand(vocab, 4), torch.arange(vocab)[:, None]], 1)  # [vocab, 5]
        pairs = torch.cat([prompt.expand(vocab ** 2, 4), torch.cartesian_prod(*[torch.arange(vocab)] * 2)], 1)
        p0, q0 = (sampling_probs(m(prompt[None]).logits[0, -1], sample) for m in (target, draft))  # [vocab]
        p1, q1 = (sampling_probs(m(firsts).logits[:, -1], sample) for m in (target, draft))  # [vocab, vocab]
        p2 = sampling_probs(target(pairs).logits[:, -1], sample).view(vocab, vocab, vocab)
    exact = (p0[:, None, None] * p1[:, :, None] * p2).flatten()
    # the draft is far from the target, so what the acceptance rule does matters
    assert 0.5 * float((p0 - q0).abs().sum()) > 0.1 and 0.5 * float((p1 - q1).abs().sum(-1).max()) > 0.2
    cells = (out[:, 0] * vocab + out[:, 1]) * vocab + out[:, 2]
    assert total_variation(cells, vocab ** 3, exact) < tv_bound(vocab ** 3, rows)


# --- bad input ---------------------------------------------------------------------------------------------------

def test_bad_speculative_settings_are_clear_errors():
    target = tiny_model(0, layer_types=ATTENTION)
    with pytest.raises(ValueError, match="vocab_size=50 but the target model has 61"):
        IncrementalDecoder(target, speculative=SpeculativeDecoding(draft_model=tiny_model(1, vocab_size=50,
                                                                                            layer_types=ATTENTION)))
    with pytest.raises(ValueError, match="num_draft_tokens=0"):
        SpeculativeDecoding(prompt_lookup=2, num_draft_tokens=0)
    with pytest.raises(ValueError, match="exactly one of draft_model and prompt_lookup"):
        SpeculativeDecoding()
    with pytest.raises(ValueError, match="exactly one of draft_model and prompt_lookup"):
        SpeculativeDecoding(draft_model=target, prompt_lookup=2)
    with pytest.raises(ValueError, match="prompt_lookup=0"):
        SpeculativeDecoding(prompt_lookup=0)


def test_transformers_route_refuses_a_draft_with_another_vocabulary():
    target = tiny_model(0, layer_types=ATTENTION)
    with pytest.raises(ValueError, match="different tokenizers"):
        target.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=4, do_sample=False,
                        assistant_model=tiny_model(1, vocab_size=50, layer_types=ATTENTION))


def test_assisted_generation_with_pad_as_an_ordinary_output_token_equals_greedy():
    """transformers infers a draft's mask as ``ids != pad_token_id`` each round: a pad id in the output so far is
    a real token there, as everywhere else."""
    target = tiny_model(0, layer_types=["attention", "mamba2"])
    ids = torch.tensor([PROMPTS[0]])
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    pad = int(expected[0, ids.shape[1]])  # the first new token, not in the prompt, output again later
    assert pad not in PROMPTS[0] and int((expected[0] == pad).sum()) > 2
    for kwargs in (dict(assistant_model=perturbed_copy(target, 0.1)), dict(prompt_lookup_num_tokens=3)):
        assert torch.equal(target.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=pad, **kwargs),
                           expected)


def test_a_pad_id_after_a_real_prompt_token_says_the_mask_was_inferred_from_it():
    target = tiny_model(0, layer_types=ATTENTION)
    with pytest.raises(ValueError, match=r"attention_mask was inferred from pad_token_id=8 .* \(row 0, position 3\)"):
        target.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=2, do_sample=False, pad_token_id=8)
