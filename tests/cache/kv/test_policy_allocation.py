"""A cache made under a bounded or quantized policy never allocates the full-length contiguous KV, even for a
long ``max_length`` (what IncrementalDecoder passes: prompt + max_new_tokens); layers the policy leaves as they
were still preallocate it."""

import pytest
import torch

from hybridlm import CachePolicy
from hybridlm.cache import KVState
from hybridlm.cache.kv import PagedKV, QuantizedKV, SinkWindowKV
from hybridlm.decoding.bench import peak_rss_mib
from hybridlm.decoding.incremental import IncrementalDecoder
from tests.helpers import random_ids, tiny_model

LONG = 2**20  # 2 KV heads x head_dim 8 x fp32: 64 MiB of keys and values per attention layer at full length


def peak_rise_mib(make) -> float:
    """How far the peak RSS rises above what is resident now while ``make()`` runs."""
    before = peak_rss_mib(reset=True)
    kept = make()
    rise = peak_rss_mib() - before
    del kept
    return rise


@pytest.mark.parametrize("policy", [CachePolicy(sink_tokens=4, window=60), CachePolicy(kv_bits=4, kv_group_size=8),
                                    CachePolicy(heavy_hitters=8, window=8)], ids=["sinks", "kivi", "h2o"])
def test_a_policy_cache_with_a_long_max_length_allocates_no_full_length_kv(policy):
    model = tiny_model(layer_pattern="AMA")
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pytest.skip("the peak RSS cannot be reset here")
    full = peak_rise_mib(lambda: model.new_cache(1, max_length=LONG))
    bounded = peak_rise_mib(lambda: model.new_cache(1, max_length=LONG, policy=policy))
    assert full > 100  # the reference: two layers' full-length buffers were allocated (128 MiB)
    assert bounded < 16


def test_layers_the_policy_leaves_alone_still_preallocate_and_pages_get_the_capacity():
    model = tiny_model(layer_pattern="AMA")
    cache = model.new_cache(1, max_length=64, policy={0: CachePolicy(sink_tokens=2, window=8)})
    assert isinstance(cache.states[0], SinkWindowKV)
    assert type(cache.states[2]) is KVState and cache.states[2].keys.shape[2] == 64
    paged = model.new_cache(1, max_length=64, policy=CachePolicy(page_size=16)).states[0]
    assert isinstance(paged, PagedKV) and len(paged.free) == 64 // 16  # the pool starts with room for max_length


def test_the_decoder_under_a_policy_gives_the_tokens_it_gave_before():
    model = tiny_model(layer_pattern="MA")
    prompt = random_ids(1, 5)
    for policy in (CachePolicy(sink_tokens=2, window=6), CachePolicy(kv_bits=8, kv_group_size=4, kv_residual=4)):
        ours = IncrementalDecoder(model, cache_policy=policy).generate(prompt, max_new_tokens=20)
        cache = model.new_cache(1, policy=policy)  # no max_length: nothing preallocated either way
        with torch.no_grad():
            logits = model(prompt, cache=cache).logits[:, -1:]
            tokens = [prompt]
            for _ in range(20):
                tokens.append(logits.argmax(-1))
                logits = model(tokens[-1], cache=cache).logits
        assert torch.equal(ours, torch.cat(tokens, 1))
        assert isinstance(cache.states[1], (SinkWindowKV, QuantizedKV))
