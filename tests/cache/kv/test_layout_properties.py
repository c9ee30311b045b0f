"""Properties of every KV layout under every cache policy, on tiny one-layer models: a policy changes the layout,
or is refused, or is warned about; the padding's token ids never change a row's logits (the oracle: the same
run with other padding ids); a state never reserves fewer bytes than it holds; a prefill run without grad does
not stop a later forward in grad mode."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import CachePolicy
from hybridlm.cache import KVLayout
from hybridlm.cache.kv import policy as policy_module
from hybridlm.decoding.incremental import IncrementalDecoder
from hybridlm.decoding.prefix_cache_states import parts
from tests.helpers import assert_close_rel, random_ids, tiny_model
from tests.mixers.test_mla import SIZES as MLA_SIZES

MODELS = {  # one model per default layout: KVState, RingKV, LatentKV
    "attention": dict(layer_pattern="A"),
    "sliding window": dict(layer_pattern="A", sliding_window=5),
    "mla": dict(layer_types=["mla"], **MLA_SIZES),
}
POLICIES = {  # "static": new_cache(static=True) under no policy
    "none": None,
    "static": "static",
    "kivi 4-bit": CachePolicy(kv_bits=4, kv_group_size=4, kv_residual=2),
    "kivi 2-bit": CachePolicy(kv_bits=2, kv_group_size=4, kv_residual=0),
    "window": CachePolicy(window=6),
    "sinks+window": CachePolicy(sink_tokens=2, window=6),
    "quantized sinks+window": CachePolicy(kv_bits=4, kv_group_size=4, kv_residual=2, sink_tokens=2, window=9),
    "h2o": CachePolicy(heavy_hitters=3, window=4),
    "paged": CachePolicy(page_size=3),
}
_models: dict[str, object] = {}


def model_of(name):
    if name not in _models:
        _models[name] = tiny_model(**MODELS[name])
    return _models[name]


def new_cache(model, batch, max_length, policy):
    """``(cache, None)``, or ``(None, refusal)``; a cache whose policy left a layout as it was must come with a
    warning naming that layout."""
    policy_module._said.clear()
    static = policy == "static"
    chosen = None if static else policy
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cache = model.new_cache(batch, max_length, policy=chosen, static=static)
        except ValueError as refusal:
            return None, str(refusal)
    if policy is not None:
        said = " ".join(str(w.message) for w in caught)
        default = model.new_cache(batch, max_length)
        for made, plain in zip(cache.states, default.states):
            for part, plain_part in zip(parts(made), parts(plain)):
                if isinstance(plain_part, KVLayout) and type(part) is type(plain_part):
                    assert type(part).__name__ in said, f"{policy} left {type(part).__name__} as it was, silently"
    return cache, None


def check_bytes(cache) -> None:
    assert cache.reserved_nbytes() >= cache.nbytes()
    for state in cache.states:
        for part in parts(state):
            assert part.reserved_nbytes() >= part.nbytes() > 0, type(part).__name__


def run(model, cache, ids, mask, chunk, steps):
    """Logits of a chunked prefill without grad, then ``steps`` decode steps in grad mode, checking the bytes
    after every forward."""
    logits = []
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            logits.append(model(ids[:, start:start + chunk], attention_mask=mask[:, start:start + chunk],
                                cache=cache).logits)
            check_bytes(cache)
    step = logits[-1][:, -1:].argmax(-1)
    for _ in range(steps):
        logits.append(model(step, cache=cache).logits.detach())
        check_bytes(cache)
        step = logits[-1].argmax(-1)
    return torch.cat(logits, 1)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model_name", MODELS)
@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 3), pads=st.lists(st.integers(0, 6), min_size=2, max_size=2), extra=st.integers(1, 9),
       chunk=st.integers(1, 7), steps=st.integers(1, 3), seed=st.integers(0, 999))
def test_padding_ids_never_change_outputs_and_reserved_bytes_cover_held_ones(model_name, policy, batch, pads, extra,
                                                                               chunk, steps, seed):
    model = model_of(model_name)
    pads = [0, *pads][:batch]
    length = max(pads) + extra
    mask = torch.arange(length)[None, :] >= torch.tensor(pads)[:, None]  # [batch, length]: left padding
    ids = random_ids(batch, length, seed=seed)
    cache, refusal = new_cache(model, batch, length + steps, POLICIES[policy])
    if cache is None:
        assert model_name != "attention" and refusal, refusal  # the contiguous layout takes every policy
        return
    expected = run(model, cache, ids, mask, chunk, steps)
    other = torch.where(mask, ids, random_ids(batch, length, seed=seed + 1))
    got = run(model, new_cache(model, batch, length + steps, POLICIES[policy])[0], other, mask, chunk, steps)
    real = torch.cat([mask, mask.new_ones(batch, steps)], 1)
    assert_close_rel(got[real], expected[real], rel=0)


@pytest.mark.parametrize("policy", [name for name in POLICIES if name != "static"])
def test_a_forward_in_grad_mode_continues_a_prefill_made_without_grad(policy):
    """IncrementalDecoder.prefill (no grad, chunks of 5: the quantized window evicts groups), then 5 tokens in grad
    mode: the logits that forward gives without grad on a copy of the cache."""
    model = model_of("attention")
    cache, _ = IncrementalDecoder(model, prefill_chunk_size=5, cache_policy=POLICIES[policy]).prefill(
        random_ids(1, 30))
    tokens = random_ids(1, 5, seed=3)
    with torch.no_grad():
        expected = model(tokens, cache=cache.snapshot()).logits
    assert_close_rel(model(tokens, cache=cache).logits.detach(), expected, rel=0)
