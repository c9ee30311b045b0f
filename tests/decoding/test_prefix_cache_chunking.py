"""Turning on an empty PrefixCache changes no output: under the layouts whose outputs depend on where prefill is
cut (H2O, KIVI, sinks + window) the decoder cuts the same places with and without it (the reference: the same
decoder without one), and a chunk size that would cut elsewhere is refused; elsewhere they agree to rounding."""

import pytest
import torch

from hybridlm import CachePolicy, PrefixCache
from hybridlm.decoding.incremental import IncrementalDecoder
from tests.helpers import assert_close_rel, random_ids, tiny_model

CHUNK_DEPENDENT = {
    "h2o": (CachePolicy(heavy_hitters=3, window=4), "HeavyHitterKV"),
    "kivi": (CachePolicy(kv_bits=4, kv_group_size=4, kv_residual=2), "QuantizedKV"),
    "sinks+window": (CachePolicy(sink_tokens=2, window=6), "SinkWindowKV"),
}


def decoders(policy, chunk, block=8):
    model = tiny_model(layer_pattern="MA")
    return (IncrementalDecoder(model, prefill_chunk_size=chunk, cache_policy=policy),
            IncrementalDecoder(model, prefill_chunk_size=chunk, cache_policy=policy,
                               prefix_cache=PrefixCache(block_size=block)))


@pytest.mark.parametrize("name", CHUNK_DEPENDENT)
def test_under_chunk_dependent_layouts_an_empty_prefix_cache_changes_nothing(name):
    policy, layout = CHUNK_DEPENDENT[name]
    prompt = random_ids(1, 30)
    plain, cached = decoders(policy, chunk=4)
    assert torch.equal(cached.prefill(prompt)[1], plain.prefill(prompt)[1])
    assert torch.equal(decoders(policy, chunk=4)[1].generate(prompt, max_new_tokens=8),
                       plain.generate(prompt, max_new_tokens=8))
    with pytest.raises(ValueError, match=rf"{layout} depend on where prefill is cut, so prefill_chunk_size=6 must "
                                         r"divide block_size=8 .*use prefill_chunk_size=4"):
        decoders(policy, chunk=6)
    cached.prefill_chunk_size = 6  # changed after the decoder was made: refused at the prefill
    with pytest.raises(ValueError, match="prefill_chunk_size=6 must divide block_size=8"):
        cached.prefill(prompt)


@pytest.mark.parametrize("policy", [None, CachePolicy(page_size=4)], ids=["contiguous", "paged"])
def test_elsewhere_any_chunk_size_agrees_to_rounding(policy):
    prompt = random_ids(1, 30)
    plain, cached = decoders(policy, chunk=6)
    assert_close_rel(cached.prefill(prompt)[1], plain.prefill(prompt)[1], rel=1e-5)
