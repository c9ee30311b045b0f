"""Prefix caching: a hit continues exactly as a cold prefill, hits are counted in whole blocks, the byte budget
holds (least recently used evicted first), snapshots survive a save / load, and bad input is refused."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import CachePolicy, PrefixCache
from hybridlm.cache import StateGroup
from hybridlm.config import MIXER_TYPES
from hybridlm.decoding.incremental import IncrementalDecoder
from tests.helpers import assert_close_rel, random_ids, tiny_model

BLOCK = 8
HYBRID = dict(layer_pattern="MSAP")  # Mamba, Mamba-2, attention, Performer
WINDOWED = dict(layer_pattern="MSA", sliding_window=5)  # the attention layer keeps a ring of 5 slots

# (model settings, cache policy): the default layouts, a sliding window, and the KV policies
CASES = {
    "hybrid": (HYBRID, None),
    "sliding-window": (WINDOWED, None),
    "quantized-kv": (HYBRID, CachePolicy(kv_bits=4, kv_group_size=8, kv_residual=4)),
    "sinks+window": (HYBRID, CachePolicy(sink_tokens=2, window=6)),
    "heavy-hitters": (HYBRID, CachePolicy(heavy_hitters=3, window=4)),
    "paged-kv": (HYBRID, CachePolicy(page_size=4)),
    "parallel-layer": (dict(layer_types=["mamba", "attention+mamba2"]), None),  # a state of two parts
}


@pytest.fixture(scope="module")
def hybrid():
    return tiny_model(**HYBRID)


def prompt(length: int, seed: int) -> torch.Tensor:
    return random_ids(1, length, seed=seed)


def state_fields(cache) -> dict:
    """Every field of every state of ``cache`` (a rollback history aside), and its counters."""
    fields = {"positions": cache.positions, "seen": cache.seen}
    for index, state in enumerate(cache.states):
        for part_index, part in enumerate(state.parts.values() if isinstance(state, StateGroup) else [state]):
            fields.update({(index, part_index, f.name): getattr(part, f.name) for f in dataclasses.fields(part)
                           if f.name != "history"})
    return fields


def assert_same_fields(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[name].shape == value.shape and torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


def prefill_counts(decoder) -> dict:
    return {name: decoder.stats[name] for name in ("prefix_hit_tokens", "prefill_tokens")}


@pytest.mark.parametrize("case", CASES)
def test_a_continuation_after_a_hit_equals_a_cold_prefill(case):
    overrides, policy = CASES[case]
    model = tiny_model(**overrides)
    shared = prompt(3 * BLOCK, seed=1)
    first = torch.cat([shared, prompt(3, seed=2)], dim=1)
    second = torch.cat([shared, prompt(5, seed=3)], dim=1)
    # chunks cut at every block boundary in both decoders, so the cold run performs the very same forwards (a
    # chunk size that does not divide the block is refused under H2O, KIVI and sinks + window)
    cold = IncrementalDecoder(model, prefill_chunk_size=BLOCK, cache_policy=policy)
    cached = IncrementalDecoder(model, prefill_chunk_size=BLOCK, cache_policy=policy,
                                prefix_cache=PrefixCache(block_size=BLOCK, max_bytes=10**8))
    cached.generate(first, max_new_tokens=4)  # stores blocks 1-3, then decodes on (a snapshot must not follow it)
    assert cached.stats["prefix_hit_tokens"] == 0

    cold_cache, cold_logits = cold.prefill(second, reserve=3)
    hit_cache, hit_logits = cached.prefill(second, reserve=3)
    assert prefill_counts(cached) == {"prefix_hit_tokens": 3 * BLOCK, "prefill_tokens": 5}
    if policy is None or policy.page_size is None:  # a restored page pool holds no free pages: the same tokens
        assert_same_fields(state_fields(hit_cache), state_fields(cold_cache))  # in other pages
    assert cold_logits.abs().max() > 0
    assert torch.equal(hit_logits, cold_logits)
    cold_tokens = cold.generate(second, max_new_tokens=6)
    assert torch.equal(cached.generate(second, max_new_tokens=6), cold_tokens)
    assert prefill_counts(cached) == {"prefix_hit_tokens": 3 * BLOCK, "prefill_tokens": 5}
    assert cached.stats["decode_tokens"] == 6


def test_small_prefill_chunks_hit_equals_cold_and_matches_one_forward(hybrid):
    """Chunks of 3 inside blocks of 8: cold and hit cut the prompt alike (exactly equal), and both match a
    single full forward up to rounding."""
    decoder = IncrementalDecoder(hybrid, prefill_chunk_size=3, prefix_cache=PrefixCache(block_size=BLOCK))
    ids = prompt(2 * BLOCK + 7, seed=4)
    _, cold = decoder.prefill(ids)
    _, hit = decoder.prefill(ids)
    assert decoder.stats["prefix_hit_tokens"] == 2 * BLOCK
    assert torch.equal(hit, cold)
    with torch.no_grad():
        assert_close_rel(hit, hybrid(ids).logits[:, -1], rel=1e-5)


LAYER_KINDS = list(MIXER_TYPES) + ["none", "attention+mamba2", "mamba+performer"]
stacks = st.lists(st.tuples(st.sampled_from(LAYER_KINDS), st.sampled_from(["dense", "moe", "none"]))
                  .filter(lambda layer: layer != ("none", "none")), min_size=1, max_size=3)


@settings(max_examples=10, deadline=None)
@given(stack=stacks, batch=st.integers(1, 2), block=st.integers(2, 6), chunk=st.integers(1, 8),
       blocks=st.integers(1, 3), tail=st.integers(1, 5), seed=st.integers(0, 1000))
def test_any_stack_continues_exactly_after_a_hit(stack, batch, block, chunk, blocks, tail, seed):
    model = tiny_model(seed % 7, layer_types=[m for m, _ in stack], mlp_types=[f for _, f in stack])
    shared = random_ids(batch, blocks * block, seed=seed)
    first = torch.cat([shared, random_ids(batch, 2, seed=seed + 1)], dim=1)
    second = torch.cat([shared, random_ids(batch, tail, seed=seed + 2)], dim=1)
    decoder = IncrementalDecoder(model, prefill_chunk_size=chunk, prefix_cache=PrefixCache(block_size=block))
    decoder.prefill(first)
    _, hit = decoder.prefill(second)
    assert decoder.stats["prefix_hit_tokens"] == blocks * block
    cold_decoder = IncrementalDecoder(model, prefill_chunk_size=chunk, prefix_cache=PrefixCache(block_size=block))
    _, cold = cold_decoder.prefill(second)
    assert cold_decoder.stats["prefix_hit_tokens"] == 0 and cold.abs().max() > 0
    assert torch.equal(hit, cold)


@settings(max_examples=8, deadline=None)
@given(shared_blocks=st.integers(0, 4), where=st.integers(0, BLOCK - 1), tail=st.integers(1, 2 * BLOCK))
def test_a_prompt_sharing_the_first_k_blocks_hits_k_blocks(hybrid, shared_blocks, where, tail):
    cache = PrefixCache(block_size=BLOCK)
    decoder = IncrementalDecoder(hybrid, prefill_chunk_size=5, prefix_cache=cache)
    cached = prompt(5 * BLOCK + 2, seed=5)
    decoder.prefill(cached)
    assert len(cache) == 5
    request = torch.cat([cached[:, : 5 * BLOCK].clone(), prompt(tail, seed=6)], dim=1)
    if shared_blocks < 5:  # differ from the cached prompt inside block k + 1
        position = shared_blocks * BLOCK + where
        request[0, position] = (cached[0, position] % 60) + 1
    assert cache.cached_tokens(request[0]) == shared_blocks * BLOCK
    decoder.prefill(request)
    assert prefill_counts(decoder) == {"prefix_hit_tokens": shared_blocks * BLOCK,
                             "prefill_tokens": request.shape[1] - shared_blocks * BLOCK}


def test_the_last_token_is_always_prefilled(hybrid):
    decoder = IncrementalDecoder(hybrid, prefix_cache=PrefixCache(block_size=BLOCK))
    ids = prompt(2 * BLOCK, seed=7)
    _, cold = decoder.prefill(ids)
    _, hit = decoder.prefill(ids)  # both blocks are cached; the second is re-run to get its last logits
    assert prefill_counts(decoder) == {"prefix_hit_tokens": BLOCK, "prefill_tokens": BLOCK}
    assert torch.equal(hit, cold)


def test_rows_of_a_batch_hit_their_common_cached_prefix(hybrid):
    cache = PrefixCache(block_size=BLOCK)
    decoder = IncrementalDecoder(hybrid, prefill_chunk_size=BLOCK, prefix_cache=cache)
    cold = IncrementalDecoder(hybrid, prefill_chunk_size=BLOCK)
    prefixes = random_ids(2, 2 * BLOCK, seed=8)
    decoder.prefill(torch.cat([prefixes, random_ids(2, 3, seed=9)], dim=1))  # each row's blocks stored apart
    assert len(cache) == 4
    request = torch.cat([prefixes, random_ids(2, 4, seed=10)], dim=1)
    _, hit = decoder.prefill(request)
    assert decoder.stats["prefix_hit_tokens"] == 2 * BLOCK
    assert torch.equal(hit, cold.prefill(request)[1])
    mixed = request.clone()
    mixed[1, BLOCK] += 1  # row 1 shares one block only: the batch hits one block
    decoder.prefill(mixed)
    assert decoder.stats["prefix_hit_tokens"] == BLOCK


def test_lru_eviction_keeps_the_budget_and_drops_the_least_recently_used():
    model = tiny_model(layer_pattern="MS")  # fixed-size states: every snapshot has the same size
    probe = PrefixCache(block_size=BLOCK)
    IncrementalDecoder(model, prefix_cache=probe).prefill(prompt(BLOCK + 1, seed=11))
    one = probe.nbytes
    assert len(probe) == 1 and one > 0
    cache = PrefixCache(block_size=BLOCK, max_bytes=3 * one + one // 2)
    decoder = IncrementalDecoder(model, prefix_cache=cache)
    prompts = [prompt(BLOCK + 1, seed=20 + i) for i in range(4)]
    for ids in prompts[:3]:
        decoder.prefill(ids)
    decoder.prefill(prompts[0])  # a hit: prompt 0 is now the most recently used, prompt 1 the least
    assert decoder.stats["prefix_hit_tokens"] == BLOCK
    decoder.prefill(prompts[3])
    assert len(cache) == 3 and cache.nbytes <= cache.max_bytes
    assert [cache.cached_tokens(ids[0]) for ids in prompts] == [BLOCK, 0, BLOCK, BLOCK]


def test_a_chain_stores_each_blocks_keys_and_values_once(hybrid):
    cache = PrefixCache(block_size=BLOCK)
    IncrementalDecoder(hybrid, prefill_chunk_size=5, prefix_cache=cache).prefill(prompt(4 * BLOCK + 1, seed=16))
    one_block = hybrid.new_cache(1)
    with torch.no_grad():
        hybrid(prompt(BLOCK, seed=17), cache=one_block)
    assert one_block.nbytes_by_kind()["attention"] > 0
    assert len(cache) == 4 and cache.nbytes == 4 * one_block.nbytes()  # not 1 + 2 + 3 + 4 blocks of keys


def test_eviction_takes_the_last_block_of_a_chain_first():
    model = tiny_model(layer_pattern="MS")
    probe = PrefixCache(block_size=BLOCK)
    IncrementalDecoder(model, prefix_cache=probe).prefill(prompt(BLOCK + 1, seed=11))
    cache = PrefixCache(block_size=BLOCK, max_bytes=3 * probe.nbytes + probe.nbytes // 2)
    decoder = IncrementalDecoder(model, prefix_cache=cache)
    chain, other = prompt(3 * BLOCK + 1, seed=18), prompt(BLOCK + 1, seed=19)
    decoder.prefill(chain)
    decoder.prefill(other)  # the chain's first block is the oldest, but its later blocks need it: block 3 goes
    assert [cache.cached_tokens(ids[0]) for ids in (chain, other)] == [2 * BLOCK, BLOCK]
    decoder.prefill(chain)  # restores blocks 1-2, stores block 3 again: now the other prompt is the oldest tail
    assert decoder.stats["prefix_hit_tokens"] == 2 * BLOCK
    assert [cache.cached_tokens(ids[0]) for ids in (chain, other)] == [3 * BLOCK, 0]


def test_the_budget_holds_with_growing_attention_snapshots(hybrid):
    cache = PrefixCache(block_size=BLOCK, max_bytes=60_000)
    decoder = IncrementalDecoder(hybrid, prefill_chunk_size=6, prefix_cache=cache)
    for seed in range(4):
        decoder.generate(prompt(5 * BLOCK + seed, seed=30 + seed), max_new_tokens=2)
        held = [entry.snapshot for entry in cache._entries.values()]
        assert sum(s.nbytes() for s in held) <= sum(s.reserved_nbytes() for s in held) == cache.nbytes
        assert 0 < cache.nbytes <= cache.max_bytes
    assert len(cache) < 4 * 5  # something was evicted


@pytest.mark.parametrize("policy", [None, CachePolicy(kv_bits=4, kv_group_size=8, kv_residual=4),
                                    CachePolicy(page_size=4)])
def test_save_and_load_give_identical_continuations(hybrid, tmp_path, policy):
    cache = PrefixCache(block_size=BLOCK)
    decoder = IncrementalDecoder(hybrid, prefill_chunk_size=BLOCK, cache_policy=policy, prefix_cache=cache)
    shared = prompt(2 * BLOCK, seed=12)
    decoder.generate(torch.cat([shared, prompt(3, seed=13)], dim=1), max_new_tokens=2)
    request = torch.cat([shared, prompt(4, seed=14)], dim=1)
    cold = IncrementalDecoder(hybrid, prefill_chunk_size=BLOCK, cache_policy=policy).generate(request,
                                                                                              max_new_tokens=6)
    cache.save(tmp_path / "prefix.safetensors")

    loaded = PrefixCache.load(tmp_path / "prefix.safetensors", hybrid)
    assert len(loaded) == len(cache) == 2 and loaded.nbytes == cache.nbytes
    reloaded = IncrementalDecoder(hybrid, prefill_chunk_size=BLOCK, cache_policy=policy, prefix_cache=loaded)
    assert torch.equal(reloaded.generate(request, max_new_tokens=6), cold)
    assert reloaded.stats["prefix_hit_tokens"] == 2 * BLOCK


def test_loading_under_a_smaller_budget_drops_chain_tails(tmp_path):
    model = tiny_model(layer_pattern="MS")
    cache = PrefixCache(block_size=BLOCK)
    decoder = IncrementalDecoder(model, prefix_cache=cache)
    chain = prompt(3 * BLOCK + 1, seed=40)
    decoder.prefill(chain)
    cache.save(tmp_path / "prefix.safetensors")
    one = cache.nbytes // 3
    loaded = PrefixCache.load(tmp_path / "prefix.safetensors", model, max_bytes=2 * one + one // 2)
    assert len(loaded) == 2 and loaded.cached_tokens(chain[0]) == 2 * BLOCK


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("block_size", 0), ("block_size", -3), ("max_bytes", 0),
                                          ("block_size", 2.5)])
def test_bad_sizes_are_refused(field, value):
    with pytest.raises(ValueError, match=f"PrefixCache: {field}="):
        PrefixCache(**{field: value})


def test_a_budget_below_one_block_is_refused(hybrid):
    with pytest.raises(ValueError, match="max_bytes=1,000 is below one block's snapshot"):
        IncrementalDecoder(hybrid, prefix_cache=PrefixCache(block_size=BLOCK, max_bytes=1000))


def test_another_models_cache_file_is_refused(hybrid, tmp_path):
    cache = PrefixCache(block_size=BLOCK)
    IncrementalDecoder(hybrid, prefix_cache=cache).prefill(prompt(BLOCK + 1, seed=15))
    cache.save(tmp_path / "prefix.safetensors")
    with pytest.raises(ValueError, match="layer kinds or state shapes"):
        PrefixCache.load(tmp_path / "prefix.safetensors", tiny_model(layer_pattern="MSAA"))
    with pytest.raises(ValueError, match="same shapes, different weights"):
        PrefixCache.load(tmp_path / "prefix.safetensors", tiny_model(seed=1, **HYBRID))
    assert len(PrefixCache.load(tmp_path / "prefix.safetensors", tiny_model(**HYBRID))) == 1  # same weights


def test_a_cache_serves_one_model_and_one_policy(hybrid):
    cache = PrefixCache(block_size=BLOCK)
    IncrementalDecoder(hybrid, prefix_cache=cache)
    with pytest.raises(ValueError, match="same shapes, different weights"):
        IncrementalDecoder(tiny_model(seed=2, **HYBRID), prefix_cache=cache)
    with pytest.raises(ValueError, match="cache_policy="):
        IncrementalDecoder(hybrid, cache_policy=CachePolicy(kv_bits=8, kv_group_size=8), prefix_cache=cache)


def test_padded_batches_and_foreign_objects_are_refused(hybrid, tmp_path):
    decoder = IncrementalDecoder(hybrid, prefix_cache=PrefixCache(block_size=BLOCK))
    with pytest.raises(ValueError, match="prompts of different lengths"):
        decoder.generate([[1, 2, 3], [4, 5]], max_new_tokens=1)
    with pytest.raises(TypeError, match="prefix_cache must be a hybridlm.PrefixCache"):
        IncrementalDecoder(hybrid, prefix_cache={})
    (tmp_path / "other.safetensors").write_bytes(b"")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a hybridlm prefix cache"):
        PrefixCache.load(tmp_path / "other.safetensors", hybrid)


def test_paged_kv_takes_one_prompt_per_call(hybrid):
    decoder = IncrementalDecoder(hybrid, cache_policy=CachePolicy(page_size=4),
                                 prefix_cache=PrefixCache(block_size=BLOCK))
    with pytest.raises(ValueError, match="with paged KV .* one prompt per call, got a batch of 2"):
        decoder.prefill(random_ids(2, BLOCK + 1))


def test_a_cache_serves_one_kind_of_cache(hybrid):
    cache = PrefixCache(block_size=BLOCK)
    decoder = IncrementalDecoder(hybrid, prefix_cache=cache)
    ids = prompt(BLOCK + 1, seed=50)
    decoder.prefill(ids)
    static = hybrid.new_cache(1, max_length=BLOCK + 1, static=True)  # what a compiled decoder prefills into
    with pytest.raises(ValueError, match="caches hold .*StaticKV.* use one PrefixCache per kind of cache"):
        cache.prefill(decoder, ids, None, static)


def test_snapshots_of_static_caches_restore_exactly_and_survive_a_file(hybrid, tmp_path):
    """A compiled decoder prefills into static caches (fixed capacity); fed such caches directly here."""
    def static(ids):
        return hybrid.new_cache(1, max_length=ids.shape[1] + 4, static=True)

    decoder = IncrementalDecoder(hybrid, prefill_chunk_size=BLOCK, prefix_cache=PrefixCache(block_size=BLOCK))
    shared = prompt(2 * BLOCK, seed=51)
    first, second = (torch.cat([shared, prompt(n, seed=52 + n)], dim=1) for n in (3, 5))
    decoder.prefix_cache.prefill(decoder, first, None, static(first))
    decoder.prefix_cache.save(tmp_path / "static.safetensors")
    cold = IncrementalDecoder(hybrid, prefill_chunk_size=BLOCK)
    cold_cache, cold_logits = cold.prefill(second, cache=static(second))
    for cache in (decoder.prefix_cache, PrefixCache.load(tmp_path / "static.safetensors", hybrid)):
        hit_cache, hit_logits = cache.prefill(decoder, second, None, static(second))
        assert decoder.stats["prefix_hit_tokens"] == 2 * BLOCK
        assert torch.equal(hit_logits, cold_logits)
        assert_same_fields(state_fields(hit_cache), state_fields(cold_cache))
