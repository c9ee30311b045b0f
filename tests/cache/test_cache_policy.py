"""CachePolicy and the bounded KV layouts: ring windows, sinks + window (StreamingLLM), heavy hitters (H2O).

Oracles: a model without a policy (while the context fits, every layout must give the same logits); for sinks
+ window past the window, the parallel attention over the kept tokens re-encoded at positions 0..n-1 (what
StreamingLLM defines); for H2O, a float64 recomputation of the attention mass that picks the kept tokens."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import CachePolicy
from hybridlm.cache import KVState
from hybridlm.cache.kv import HeavyHitterKV, RingKV, SinkWindowKV
from hybridlm.cache.kv import policy as policy_module
from hybridlm.decoding.incremental import IncrementalDecoder
from hybridlm.mixers.attention import Attention
from hybridlm.model.memory import memory_rows
from tests.helpers import assert_close_rel, random_ids, tiny_config, tiny_model
from tests.mixers.test_mla import SIZES as MLA_SIZES

BOUNDED = {
    "sinks+window": CachePolicy(sink_tokens=3, window=9),
    "window": CachePolicy(window=12),
    "h2o": CachePolicy(heavy_hitters=5, window=7),
}


def decode(model, ids, policy, prefill=5, mask=None):
    """Logits of a chunked prefill then one token at a time, under ``policy``."""
    cache = model.new_cache(ids.shape[0], policy=policy)
    with torch.no_grad():
        chunks = [model(ids[:, :prefill], cache=cache, attention_mask=None if mask is None else mask[:, :prefill])]
        for t in range(prefill, ids.shape[1]):
            chunks.append(model(ids[:, t:t + 1], cache=cache))
    return torch.cat([c.logits for c in chunks], 1), cache


@settings(max_examples=6, deadline=None)
@given(name=st.sampled_from(sorted(BOUNDED)), prefill=st.integers(1, 11), pattern=st.sampled_from(["A", "MA"]))
def test_bounded_layouts_equal_full_attention_while_the_context_fits(name, prefill, pattern):
    model = tiny_model(layer_pattern=pattern)
    ids = random_ids(2, 12)
    with torch.no_grad():
        reference = model(ids).logits
    got, cache = decode(model, ids, BOUNDED[name], prefill)
    assert_close_rel(got, reference)


def test_bounded_layouts_with_left_padding_equal_full_attention():
    model = tiny_model(layer_pattern="AM")
    ids = random_ids(2, 11)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :3] = False
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
    for policy in BOUNDED.values():
        got, _ = decode(model, ids, policy, prefill=6, mask=mask)
        assert_close_rel(got[0], reference[0])
        assert_close_rel(got[1, 3:], reference[1, 3:])


def attention_mixer(seed=0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(layer_pattern="A", **overrides)
    return Attention(config).eval(), config


def test_sinks_and_window_past_the_window_attend_the_kept_tokens_at_cache_positions():
    """Each decoded token's output equals attention over sinks + last window tokens, re-encoded at 0..n-1."""
    mixer, config = attention_mixer()
    sinks, window = 2, 5
    x = torch.randn(1, 20, config.hidden_size, generator=torch.Generator().manual_seed(1))
    state = SinkWindowKV.empty(1, config.num_key_value_heads, config.head_dim, sinks=sinks, window=window)
    with torch.no_grad():
        mixer(x[:, :4], state)
        for t in range(4, 20):
            got = mixer(x[:, t:t + 1], state)[:, 0]
            kept = list(range(min(sinks, t + 1))) + list(range(max(sinks, t - window + 1), t + 1))
            expected = mixer(x[:, kept])[:, -1]
            assert_close_rel(got, expected)
            assert state.length == min(t + 1, sinks + window - 1)


def test_h2o_keeps_the_recent_window_and_the_heaviest_tokens():
    mixer, config = attention_mixer(num_key_value_heads=1)
    heavy, window = 3, 4
    x = torch.randn(1, 16, config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    mixer = mixer.double()
    state = HeavyHitterKV.empty(1, 1, config.head_dim, heavy=heavy, window=window, dtype=torch.float64)
    q_all, k_all, _ = (t.view(1, 16, -1, config.head_dim).transpose(1, 2) for t in mixer.project(x))
    positions = torch.arange(16)[None]
    q_all, k_all = mixer._rotate(q_all, positions), mixer._rotate(k_all, positions)
    kept, mass = [], {}
    with torch.no_grad():
        for t in range(16):
            got = mixer(x[:, t:t + 1], state)[:, 0]
            held = kept + [t]
            expected = mixer(x[:, held], positions=torch.tensor([held]))[:, -1]
            assert_close_rel(got, expected)
            scores = (q_all[0, :, t] @ k_all[0, 0, held].T) * config.head_dim ** -0.5  # [q_heads, held]
            for slot, p in zip(held, scores.softmax(-1).sum(0).tolist()):
                mass[slot] = mass.get(slot, 0.0) + p
            recent = [s for s in held if s > t - window]
            others = sorted((s for s in held if s <= t - window), key=lambda s: -mass[s])[:heavy]
            kept = sorted(recent + others) if len(held) > heavy + window else held
            assert sorted(state.slots[0, 0].tolist()) == kept


def test_memory_is_constant_over_five_thousand_decoded_tokens():
    mixer, config = attention_mixer(hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    layouts = [SinkWindowKV.empty(1, 1, config.head_dim, sinks=4, window=16),
               HeavyHitterKV.empty(1, 1, config.head_dim, heavy=8, window=8),
               RingKV.empty(1, 1, config.head_dim, window=16)]
    x = torch.randn(1, 1, config.hidden_size)
    with torch.no_grad():
        for state in layouts:
            sizes = set()
            for step in range(5_000):  # past 4,096: a doubling reallocation would show
                mixer(x, state)
                if step >= 32:
                    sizes.add(state.nbytes())
            assert sizes == {state.predicted_nbytes(5_000)}, type(state).__name__
            assert state.seen == 5_000


def test_ring_window_decodes_in_place_and_equals_the_parallel_form():
    model = tiny_model(layer_pattern="AM", sliding_window=4)
    ids = random_ids(2, 14)
    with torch.no_grad():
        reference = model(ids).logits
        cache = model.new_cache(2)
        model(ids[:, :6], cache=cache)
        ring = cache.states[0]
        assert isinstance(ring, RingKV)
        storage = (ring.keys.data_ptr(), ring.values.data_ptr())
        steps = [model(ids[:, t:t + 1], cache=cache).logits for t in range(6, 14)]
        assert (ring.keys.data_ptr(), ring.values.data_ptr()) == storage
    assert_close_rel(torch.cat(steps, 1), reference[:, 6:])
    assert ring.nbytes() == ring.predicted_nbytes(14)


@pytest.mark.parametrize("policy", [*BOUNDED.values(), CachePolicy(kv_bits=4, kv_group_size=8, kv_residual=0)],
                         ids=[*BOUNDED, "kivi"])
def test_cache_container_api_under_a_policy(policy):
    """select / reorder / snapshot / restore / to / nbytes_by_kind keep working for every layout."""
    model = tiny_model(layer_pattern="AM")
    ids = random_ids(3, 20)
    cache = model.new_cache(3, policy=policy)
    with torch.no_grad():
        model(ids[:, :18], cache=cache)
        snapshot = cache.snapshot()
        step = ids[:, 18:19]
        expected = model(step, cache=cache).logits
        cache.restore(snapshot)
        assert torch.equal(model(step, cache=cache).logits, expected)
        picked = snapshot.select(torch.tensor([2, 0]))
        assert_close_rel(model(step[[2, 0]], cache=picked).logits, expected[[2, 0]])
        moved = snapshot.to("cpu")
        assert moved.policy == policy and moved.nbytes() == snapshot.nbytes()
    kinds = snapshot.nbytes_by_kind()
    assert kinds["attention"] == snapshot.states[0].nbytes() == snapshot.states[0].predicted_nbytes(18)


def test_policy_reaches_generate_and_the_incremental_decoder():
    model = tiny_model(layer_pattern="AM")
    policy = CachePolicy(sink_tokens=2, window=6)
    prompt = random_ids(1, 5)
    ours = IncrementalDecoder(model, prefill_chunk_size=2, cache_policy=policy).generate(prompt, max_new_tokens=12)
    theirs = model.generate(prompt, max_new_tokens=12, do_sample=False, cache_policy=policy)
    assert torch.equal(ours, theirs)
    with torch.no_grad():
        cache = model(prompt, use_cache=True, cache_policy=policy).cache
    assert cache.policy == policy and isinstance(cache.states[0], SinkWindowKV)


@pytest.mark.parametrize("kwargs, field", [
    (dict(kv_bits=3), "kv_bits"),
    (dict(kv_bits=4.0), r"kv_bits=4\.0 must be one of"),  # a float passed 4.0 in (2, 4, 8, 16), then failed in torch
    (dict(kv_group_size=0), "kv_group_size"),
    (dict(sink_tokens=4, window=2), "smaller than sink_tokens"),
    (dict(sink_tokens=4), "need window"),
    (dict(heavy_hitters=4, sink_tokens=2, window=8), "not both"),
    (dict(kv_bits=4, heavy_hitters=2, window=8), "heavy_hitters is not supported"),
])
def test_bad_policies_are_rejected(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CachePolicy(**kwargs)


def test_group_size_must_divide_head_dim_and_policy_cannot_change():
    model = tiny_model(layer_pattern="AM")  # head_dim 8
    with pytest.raises(ValueError, match="kv_group_size=3 does not divide the attention head_dim=8"):
        model.new_cache(1, policy=CachePolicy(kv_bits=4, kv_group_size=3))
    cache = model.new_cache(1, policy=CachePolicy(window=8))
    with torch.no_grad(), pytest.raises(ValueError, match="cannot change during generation"):
        model(random_ids(1, 2), cache=cache, cache_policy=CachePolicy(window=9))
    for use_cache in (None, False):  # a policy with no cache to shape
        with torch.no_grad(), pytest.raises(ValueError, match="cache_policy is given but no cache is used"):
            model(random_ids(1, 2), use_cache=use_cache, cache_policy=CachePolicy(window=8))
    with pytest.raises(ValueError, match="cache_policy is given but no cache is used"):
        model.generate(random_ids(1, 2), max_new_tokens=2, do_sample=False, use_cache=False,
                       cache_policy=CachePolicy(window=8))
    with pytest.raises(ValueError, match="layers in"):
        model.new_cache(1, policy={7: CachePolicy(window=8)})


def test_policy_on_a_model_without_attention_is_a_no_op_said_once():
    model = tiny_model(layer_pattern="MS")
    policy_module._said.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            cache = model.new_cache(1, policy=CachePolicy(sink_tokens=1, window=4))
    assert sum("no attention layers" in str(w.message) for w in caught) == 1
    assert [type(s).__name__ for s in cache.states] == ["SSMState", "SSMState"]


def test_per_layer_policy():
    model = tiny_model(layer_pattern="AMA")
    cache = model.new_cache(1, policy={2: CachePolicy(window=6)})
    assert type(cache.states[0]).__name__ == "KVState" and isinstance(cache.states[2], SinkWindowKV)


def said(make) -> list[str]:
    """The warnings ``make()`` gives, each said once."""
    policy_module._said.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()
    return [str(w.message) for w in caught]


def test_a_policy_reaching_mla_latents_is_refused_naming_the_layout():
    model = tiny_model(layer_types=["mla", "attention"], **{**MLA_SIZES, "head_dim": 8, "num_key_value_heads": 1})
    for policy in (CachePolicy(kv_bits=4, kv_group_size=4), CachePolicy(sink_tokens=2, window=8),
                   CachePolicy(heavy_hitters=2, window=4), CachePolicy(page_size=4)):
        with pytest.raises(ValueError, match=r"cannot apply to state 0, a LatentKV \(it takes no policy\); give "
                                             "that layer no policy"):
            model.new_cache(1, policy=policy)
    cache = model.new_cache(1, policy={1: CachePolicy(sink_tokens=2, window=8)})
    assert [type(state).__name__ for state in cache.states] == ["LatentKV", "SinkWindowKV"]


def test_what_a_policy_replaces_is_the_layout_classes_answer(monkeypatch):
    model = tiny_model(layer_pattern="A")
    monkeypatch.setattr(KVState, "policy_features", frozenset({"window"}))
    assert isinstance(model.new_cache(1, policy=CachePolicy(window=8)).states[0], SinkWindowKV)
    with pytest.raises(ValueError, match=r"kv_bits cannot apply to state 0, a KVState \(it takes window\)"):
        model.new_cache(1, policy=CachePolicy(kv_bits=4, kv_group_size=4))


def test_states_a_policy_leaves_as_they_are_are_warned_about_once():
    windowed = tiny_model(layer_pattern="AMA", sliding_window=4)
    messages = said(lambda: [windowed.new_cache(1, policy=CachePolicy(kv_bits=4, kv_group_size=4)) for _ in "ab"])
    assert messages == ["cache_policy: kv_bits is not applied to RingKV layers, which stay as they are: a layer's "
                        "own sliding window is bounded already, and no policy may let it see beyond it"]
    messages = said(lambda: tiny_model(layer_pattern="AM").new_cache(1, policy={1: CachePolicy(window=4)}))
    assert messages == ["cache_policy: states [1] hold no attention keys and values; their policies change nothing"]


def test_the_memory_report_quantizes_the_layouts_that_take_kv_bits():
    config = tiny_config(layer_types=["mla", "attention"], **{**MLA_SIZES, "hidden_size": 96, "num_key_value_heads": 3})
    full, quantized = (row["bytes_per_token_by_kind"] for row in memory_rows(config, [4096], kv_bits=[16, 4]))
    assert quantized["mla"] == full["mla"] == (MLA_SIZES["mla_kv_lora_rank"] + MLA_SIZES["mla_qk_rope_head_dim"]) * 2
    assert 0 < quantized["attention"] < full["attention"] / 2  # 4-bit codes and their scales, a full-precision tail
