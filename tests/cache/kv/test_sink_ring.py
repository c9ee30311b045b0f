"""The window of sinks + window (StreamingLLM) is a ring like a sliding-window layer's: decoding past the
window writes each token in place into the buffer made with the cache (no allocation, no copy), and each
step still attends over exactly the sinks and the last window tokens, re-encoded at positions 0..n-1."""

import torch

from hybridlm import CachePolicy
from hybridlm.cache.kv import SinkWindowKV
from hybridlm.mixers.attention import Attention
from tests.helpers import assert_close_rel, random_ids, tiny_config, tiny_model


def test_sinks_and_window_decode_in_place_in_the_buffer_made_with_the_cache():
    torch.manual_seed(0)
    config = tiny_config(layer_pattern="A")
    mixer = Attention(config).eval()
    sinks, window, total = 2, 5, 24
    x = torch.randn(1, total, config.hidden_size, generator=torch.Generator().manual_seed(3))
    state = SinkWindowKV.empty(1, config.num_key_value_heads, config.head_dim, sinks=sinks, window=window)
    storage = (state.keys.data_ptr(), state.values.data_ptr(), state.keys.shape)
    with torch.no_grad():
        mixer(x[:, :3], state)
        for t in range(3, total):
            got = mixer(x[:, t:t + 1], state)[:, 0]
            assert (state.keys.data_ptr(), state.values.data_ptr(), state.keys.shape) == storage, t
            kept = list(range(sinks)) + list(range(max(sinks, t - window + 1), t + 1))
            assert_close_rel(got, mixer(x[:, kept])[:, -1])
    assert state.seen == total and state.nbytes() == state.predicted_nbytes(total)


def test_a_model_under_sinks_and_window_keeps_its_buffers_while_decoding():
    model = tiny_model(layer_pattern="AM")
    ids = random_ids(2, 30)
    cache = model.new_cache(2, policy=CachePolicy(sink_tokens=3, window=6))
    with torch.no_grad():
        model(ids[:, :4], cache=cache)
        state = cache.states[0]
        storage = (state.keys.data_ptr(), state.values.data_ptr())
        sizes = []
        for t in range(4, 30):
            model(ids[:, t:t + 1], cache=cache)
            sizes.append(cache.nbytes())
    assert isinstance(state, SinkWindowKV) and (state.keys.data_ptr(), state.values.data_ptr()) == storage
    assert state.keys.shape[2] == 3 + 6 and state.length == 3 + 6 - 1
    assert sizes[:4] == sorted(set(sizes[:4])) and set(sizes[3:]) == {sizes[-1]}  # grows to S + W - 1, then flat
