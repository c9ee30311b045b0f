"""HybridCache.crop: rolling back to any token of a block equals a forward that stopped there."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import CachePolicy
from hybridlm.cache import KVState, LayerState, StateGroup
from hybridlm.cache.kv.latent import LatentKV
from hybridlm.cache.kv.layouts import _WindowKV
from hybridlm.cache.kv.paged import PagedKV
from hybridlm.cache.kv.quantize import QuantizedKV
from hybridlm.cache.kv.quantized_window import QuantizedSinkWindowKV
from hybridlm.cache.rollback import StateHistory
from hybridlm.mixers.base import MIXERS
from hybridlm.ops.causal_conv1d import causal_conv1d_ref, causal_conv1d_windows
from hybridlm.ops.delta_rule import gated_delta_rule_ref, gated_delta_rule_states
from hybridlm.ops.selective_scan import selective_scan_ref, selective_scan_states
from hybridlm.ops.ssd import ssd_chunk_scan_ref, ssd_states
from tests.helpers import assert_close_rel, random_ids, tiny_model


def contents(state: LayerState) -> dict[str, torch.Tensor]:
    """What a state holds for the tokens it has seen (a contiguous KV state's filled slots only)."""
    if isinstance(state, StateGroup):
        return {f"{name}.{key}": t for name, part in state.parts.items() for key, t in contents(part).items()}
    tensors = state._tensors()
    if isinstance(state, (KVState, LatentKV)):  # [batch, heads, capacity, width] buffers: the filled slots
        tensors = {name: t[:, :, : state.seen] if t.dim() == 4 else t for name, t in tensors.items()}
    if isinstance(state, _WindowKV):  # the slots a later token sees (the spill is bookkeeping)
        slots = torch.arange(state.seen)
        index = state._index(slots[(slots < state.pinned) | (slots > state.seen - state.window)])
        return {"keys": state.keys[:, :, index], "values": state.values[:, :, index], "padding": state.padding}
    if isinstance(state, PagedKV):  # as the contiguous layout would hold them (pages are bookkeeping)
        keys, values = state._gather(state.seen)
        return {"keys": keys, "values": values, "padding": state.padding}
    if isinstance(state, QuantizedSinkWindowKV):  # the sinks and what a later query sees (not the groups kept
        pending = state._pending()                # past the window for a rollback)
        old_keys, old_values = state.dequantized()
        sinks = state.held_sinks
        return {"sinks": torch.cat([state.sink_keys[:, :, :sinks], state.sink_values[:, :, :sinks]], 2),
                "old_keys": old_keys[:, :, pending:], "old_values": old_values[:, :, pending:],
                "padding": state.padding, "keys": state.recent_keys[:, :, : state.recent],
                "values": state.recent_values[:, :, : state.recent],
                "counts": torch.tensor([state.held_sinks, state.evicted + pending, state._left(), state.recent])}
    if isinstance(state, QuantizedKV):
        old_keys, old_values = state.dequantized()
        return {"old_keys": old_keys, "old_values": old_values, "padding": state.padding,
                "keys": state.recent_keys[:, :, : state.recent], "values": state.recent_values[:, :, : state.recent]}
    return tensors


def assert_same_cache(got, expected, rel=1e-5):
    assert got.seen == expected.seen
    assert torch.equal(got.positions, expected.positions)
    for index, (a, b) in enumerate(zip(got.states, expected.states)):
        ca, cb = contents(a), contents(b)
        assert ca.keys() == cb.keys(), index
        for name in cb:
            if cb[name].is_floating_point():
                finite = cb[name].isfinite()
                assert torch.equal(finite, ca[name].isfinite()), (index, name)
                assert_close_rel(ca[name][finite], cb[name][finite], rel, allow_zero_reference=True)
            else:
                assert torch.equal(ca[name], cb[name]), (index, name)


def nonzero(cache) -> bool:
    """Every state that has a float tensor holds something non-zero (so a comparison proves something)."""
    return all(any(t.is_floating_point() and bool(t.nan_to_num(neginf=0.0).ne(0).any()) for t in contents(s).values())
               for s in cache.states if contents(s))


def run(model, ids, cache, mask=None):
    with torch.no_grad():
        return model(ids, cache=cache, attention_mask=mask).logits


def check_rollback(model, prompt, block, after, mask=None, rel=1e-5, policy=None):
    """``prompt`` then ``block`` into one cache, cropped back to each token of the block, against a cache that
    saw only ``prompt`` and the block up to there; then both continue with ``after``."""
    batch, warm, k = prompt.shape[0], prompt.shape[1], block.shape[1]
    full_mask = None if mask is None else torch.cat([mask, mask.new_ones(batch, k + after.shape[1])], 1)
    for j in range(k + 1):
        reference = model.new_cache(batch, policy=policy)
        run(model, prompt, reference, mask)
        if j:
            run(model, block[:, :j], reference, None if mask is None else full_mask[:, : warm + j])
        assert nonzero(reference)
        cache = model.new_cache(batch, policy=policy)
        run(model, prompt, cache, mask)
        run(model, block, cache, None if mask is None else full_mask[:, : warm + k])
        cache.crop(warm + j)
        assert_same_cache(cache, reference, rel)
        cont_mask = None if mask is None else full_mask[:, : warm + j + after.shape[1]]
        assert_close_rel(run(model, after, cache, cont_mask), run(model, after, reference, cont_mask), rel)


KINDS = sorted(MIXERS) + ["none", "attention+mamba2", "mamba+performer", "gated_deltanet+short_conv"]  # every kind


@settings(max_examples=4, deadline=None)
@given(layers=st.integers(1, 3), warm=st.integers(1, 9), k=st.integers(1, 8), seed=st.integers(0, 99))
def test_attention_crop_equals_a_forward_that_stopped_there(layers, warm, k, seed):
    model = tiny_model(seed, layer_pattern="A" * layers)
    prompt, block, after = (random_ids(2, n, seed=seed + i) for i, n in enumerate((warm, k, 2)))
    check_rollback(model, prompt, block, after)


@settings(max_examples=10, deadline=None)
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3), moe=st.booleans(), warm=st.integers(1, 7),
       k=st.integers(2, 9), seed=st.integers(0, 99))
def test_every_kind_crops_to_any_token_of_a_block(kinds, moe, warm, k, seed):
    """A warm cache takes a block of ``k`` tokens (no option asked: up to 64 tokens keep their states)."""
    if all(kind == "none" for kind in kinds):
        kinds = kinds + ["mamba"]
    mlp = ["moe" if moe else "dense"] * len(kinds)
    model = tiny_model(seed, layer_types=kinds, mlp_types=mlp)
    prompt, block, after = (random_ids(2, n, seed=seed + i) for i, n in enumerate((warm, k, 3)))
    check_rollback(model, prompt, block, after)


def test_left_padded_rows_crop_exactly_for_every_kind():
    model = tiny_model(layer_pattern="AMSPLDC")
    mask = torch.tensor([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    check_rollback(model, random_ids(2, 5), random_ids(2, 5, seed=1), random_ids(2, 2, seed=2), mask)


def test_attention_crop_with_left_padding_and_into_the_padding():
    model = tiny_model(layer_pattern="AA")
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    check_rollback(model, random_ids(2, 5), random_ids(2, 4, seed=1), random_ids(2, 2, seed=2), mask)
    cache = model.new_cache(2)
    run(model, random_ids(2, 5), cache, mask)
    cache.crop(1)  # row 0 keeps one padding slot and no real token
    assert cache.positions.tolist() == [0, 1]
    assert cache.states[0].padding.tolist() == [1, 0]


def test_crop_conventions():
    model = tiny_model(layer_pattern="A")
    cache = model.new_cache(1)
    run(model, random_ids(1, 6), cache)
    cache.crop(0)  # transformers' "remove nothing"
    assert cache.get_seq_length() == 6
    cache.crop(-2)  # remove two
    assert cache.get_seq_length() == 4
    cache.crop(3)  # keep three
    assert cache.get_seq_length() == 3 and cache.states[0].length == 3


@pytest.mark.parametrize("length, message", [(7, "beyond the 6 token slots seen"), (-7, "past the start"),
                                             (2.0, "must be an int")])
def test_bad_crop_is_a_clear_error_and_changes_nothing(length, message):
    model = tiny_model(layer_pattern="A")
    cache = model.new_cache(1)
    run(model, random_ids(1, 6), cache)
    with pytest.raises((ValueError, TypeError), match=message):
        cache.crop(length)
    assert cache.get_seq_length() == 6 and cache.states[0].length == 6


def test_recurrent_crop_without_a_checkpoint_is_a_clear_error():
    model = tiny_model(layer_pattern="AM")
    cache = model.new_cache(1)
    run(model, random_ids(1, 6), cache)
    run(model, random_ids(1, 1), cache)  # one-token forwards keep no checkpoints unless asked
    before = cache.snapshot()
    with pytest.raises(ValueError, match=r"state 1 \(mamba\) cannot remove the last 2 token slots"):
        cache.crop(-2)
    assert_same_cache(cache, before, rel=0)


def test_keep_checkpoints_spans_one_token_forwards_and_is_counted():
    """A draft model decodes one token per forward and is then cropped back several: asked for, the states of
    the last n tokens are kept across forwards (a ring), and their bytes show in reserved_nbytes."""
    model = tiny_model(layer_pattern="AMSPLDC")
    prompt, steps = random_ids(1, 5), random_ids(1, 7, seed=1)
    plain = model.new_cache(1)
    run(model, prompt, plain)
    cache = model.new_cache(1)
    run(model, prompt, cache)
    cache.keep_checkpoints(4)
    for i in range(7):
        run(model, steps[:, i : i + 1], cache)
        run(model, steps[:, i : i + 1], plain)
    assert cache.nbytes() == plain.nbytes() and cache.reserved_nbytes() > plain.reserved_nbytes()
    with pytest.raises(ValueError, match="before its earliest kept checkpoint"):
        cache.crop(-5)  # beyond the ring of 4
    for back in (3, 1):
        reference = model.new_cache(1)
        run(model, torch.cat([prompt, steps[:, : cache.seen - 5 - back]], 1), reference)
        assert nonzero(reference)
        cache.crop(-back)
        assert_same_cache(cache, reference)
        assert_close_rel(run(model, steps[:, :2], cache.snapshot()), run(model, steps[:, :2], reference))
    with pytest.raises(ValueError, match="before its earliest kept checkpoint"):
        cache.crop(-1)  # the ring held 4 tokens back and 4 were removed
    run(model, steps[:, :3], cache)  # decoding on keeps states again
    cache.crop(-3)
    assert cache.seen == 8


LAYOUTS = {  # overrides, policy, prompt and block lengths
    "ring": (dict(sliding_window=4), None, 7, 4),
    "sinks+window": ({}, CachePolicy(sink_tokens=2, window=4), 7, 4),
    "window": ({}, CachePolicy(window=4), 7, 4),
    "quantized": ({}, CachePolicy(kv_bits=4, kv_group_size=4, kv_residual=2), 7, 8),
    "quantized sinks+window": ({}, CachePolicy(kv_bits=4, kv_group_size=4, kv_residual=2, sink_tokens=2, window=8),
                               11, 8),
    "quantized window": ({}, CachePolicy(kv_bits=2, kv_group_size=2, kv_residual=1, window=6), 9, 6),
    "paged": ({}, CachePolicy(page_size=4), 7, 4),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_layouts_crop_to_any_token_of_a_block(layout):
    """Window layouts put back the slots the block pushed out; paged KV gives back pages; quantized KV drops the
    groups the block quantized and puts their tokens back in full precision (residual 2, groups of 4: 4 tokens
    quantized after the prompt of 7, 12 after the block of 8); quantized sinks + window also keeps the groups the
    block pushed out of the window (masked out) until the next forward."""
    overrides, policy, warm, k = LAYOUTS[layout]
    model = tiny_model(layer_pattern="AMA", **overrides)
    mask = torch.tensor([[0] * 2 + [1] * (warm - 2), [1] * warm], dtype=torch.bool)
    check_rollback(model, random_ids(2, warm), random_ids(2, k, seed=1), random_ids(2, 3, seed=2), mask,
                   policy=policy)


@pytest.mark.parametrize("layout", ["ring", "sinks+window", "quantized", "quantized sinks+window"])
def test_window_and_quantized_layouts_keep_what_they_age_across_one_token_forwards(layout):
    """A draft model's one-token steps: asked, window layouts keep the slots they push out and quantized ones
    the full-precision tokens they quantize (and the groups they evict), the last 5 slots' worth."""
    overrides, policy, *_ = LAYOUTS[layout]
    model = tiny_model(layer_pattern="A", **overrides)
    ids = random_ids(1, 14)
    cache = model.new_cache(1, policy=policy)
    run(model, ids[:, :6], cache)
    plain_reserved = cache.reserved_nbytes()
    cache.keep_checkpoints(5)
    for i in range(6, 14):
        run(model, ids[:, i : i + 1], cache)
    assert cache.reserved_nbytes() > plain_reserved  # the kept slots are counted
    too_far = -9 if layout == "quantized" else -7  # quantized KV keeps whole groups: here 8 tokens' worth
    with pytest.raises(ValueError, match="before its earliest kept checkpoint|already left the window"):
        cache.crop(too_far)
    cache.crop(8)
    reference = model.new_cache(1, policy=policy)
    run(model, ids[:, :8], reference)
    assert_same_cache(cache, reference)
    assert_close_rel(run(model, ids[:, 8:11], cache), run(model, ids[:, 8:11], reference))


def test_layouts_that_cannot_roll_back_say_so():
    model = tiny_model(layer_pattern="A")
    cache = model.new_cache(1, policy=CachePolicy(heavy_hitters=2, window=3))
    run(model, random_ids(1, 6), cache)
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="H2O .* cannot roll back"):
        cache.crop(-1)
    quantized = model.new_cache(1, policy=CachePolicy(kv_bits=8, kv_group_size=4, kv_residual=2))
    run(model, random_ids(1, 9), quantized)  # a prefill: 4 quantized, 5 in full precision, nothing kept
    quantized.crop(-3)  # within the full-precision tail
    with pytest.raises(ValueError, match="puts 4 quantized tokens back in full precision, and 0 were kept"):
        quantized.crop(-1)


def test_a_long_forward_keeps_only_the_asked_checkpoints():
    """Asked for 3, a 10-token forward computes and keeps the states of its last 3 tokens only (the first 7 run
    without per-token states), and the outputs are those of an unsplit forward."""
    model = tiny_model(layer_pattern="MSPLDC")
    ids = random_ids(1, 14)
    plain, cache = model.new_cache(1), model.new_cache(1)
    run(model, ids[:, :4], plain)
    run(model, ids[:, :4], cache)
    cache.keep_checkpoints(3)
    assert_close_rel(run(model, ids[:, 4:], cache), run(model, ids[:, 4:], plain))
    per_state = [s.nbytes() for s in cache.states]
    assert [s.reserved_nbytes() for s in cache.states] == [4 * n + n for n in per_state]  # 4 entries + the state
    with pytest.raises(ValueError, match="before its earliest kept checkpoint"):
        cache.crop(10)
    cache.crop(11)
    reference = model.new_cache(1)
    run(model, ids[:, :11], reference)
    assert_same_cache(cache, reference)


def test_plain_decoding_keeps_nothing():
    model = tiny_model(layer_pattern="AMSPLDC")
    cache = model.new_cache(1)
    run(model, random_ids(1, 6), cache)  # a prefill (cold) keeps nothing either
    assert all(getattr(s, "history", None) is None for s in cache.states)
    run(model, random_ids(1, 3, seed=1), cache)  # a warm block keeps its states until the next forward
    assert all(s.history is not None for s in cache.states[1:])
    run(model, random_ids(1, 1, seed=2), cache)
    assert all(s.history is None for s in cache.states[1:])
    assert all(s.reserved_nbytes() == s.nbytes() for s in cache.states[1:])


def test_transformers_hooks():
    """transformers' assisted generation checks is_croppable and calls activate_past_recording, then crop(-n)."""
    model = tiny_model(layer_pattern="AM")
    cache = model.new_cache(1)
    assert cache.is_croppable
    cache.activate_past_recording()
    assert cache.states[1].checkpoint_limit == 64
    cache.activate_past_recording(recurrent_states_to_keep=5)  # transformers 5.25 passes the draft length
    assert cache.states[1].checkpoint_limit == 64
    cache.activate_past_recording(recurrent_states_to_keep=100)
    assert cache.states[1].checkpoint_limit == 100
    with pytest.raises(ValueError, match="tokens must be an int >= 0"):
        cache.keep_checkpoints(-1)


@settings(max_examples=20, deadline=None)
@given(capacity=st.integers(1, 6), ops=st.lists(st.tuples(st.booleans(), st.integers(1, 8)), max_size=30))
def test_state_history_ring_against_a_list(capacity, ops):
    """Pushes and rewinds of the ring agree with a plain list of the last ``capacity`` entries."""
    history = StateHistory.starting_at({"s": torch.zeros(1, 2)}, capacity)
    expected, value = [0.0], 1.0
    for push, n in ops:
        if push:
            history.push({"s": torch.arange(value, value + n).view(1, n, 1).expand(1, n, 2)})
            expected, value = (expected + [value + i for i in range(n)])[-capacity:], value + n
        elif n < history.count:
            newest = history.rewind(n)["s"]
            expected = expected[:-n]
            assert newest.tolist() == [[expected[-1]] * 2]
        assert history.count == len(expected)


@settings(max_examples=6, deadline=None)
@given(time=st.integers(1, 40), seed=st.integers(0, 99))
def test_per_token_state_forms_match_each_prefix_of_the_ops(time, seed):
    """Each vectorised per-token form, at token t, equals the op's own final state after the first t tokens
    (fp32 scans: 1e-5; the delta rule in float64: 1e-10; conv windows bit for bit)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, dtype=dtype)

    b, d, n, h, p = 2, 6, 4, 4, 3
    u, dt, A, B, h0 = randn(b, d, time), randn(b, d, time).exp() / 4, -randn(d, n).exp(), randn(b, 2, n, time), \
        randn(b, d, n)
    x, dt2, A2, B2, C2, s0 = randn(b, time, h, p), randn(b, time, h).exp() / 4, -randn(h).exp(), \
        randn(b, time, 2, n), randn(b, time, 2, n), randn(b, h, p, n)
    f64 = dict(dtype=torch.float64)
    q, k = (torch.nn.functional.normalize(randn(b, time, 2, n, **f64), dim=-1) for _ in range(2))
    v, beta, S0 = randn(b, time, h, p, **f64), randn(b, time, h, **f64).sigmoid(), randn(b, h, n, p, **f64)
    gates = {"head": -randn(b, time, h, **f64).exp(), "channel": -randn(b, time, h, n, **f64).exp()}
    conv_x, window, weight = randn(b, d, time), randn(b, d, 3), randn(d, 4)
    scan_states = selective_scan_states(u, dt, A, B, h0)
    ssd = ssd_states(x, dt2, A2, B2, s0)
    delta = {kind: gated_delta_rule_states(k, v, gate, beta, S0, chunk_size=16) for kind, gate in gates.items()}
    windows = causal_conv1d_windows(conv_x, window)
    for t in {1, time // 2 + 1, time}:
        assert_close_rel(scan_states[:, t - 1], selective_scan_ref(u[..., :t], dt[..., :t], A, B[..., :t],
                                                                   B[..., :t], initial_state=h0)[1])
        assert_close_rel(ssd[:, t - 1], ssd_chunk_scan_ref(x[:, :t], dt2[:, :t], A2, B2[:, :t], C2[:, :t], 8,
                                                           initial_state=s0)[1])
        for kind, gate in gates.items():
            final = gated_delta_rule_ref(q[:, :t], k[:, :t], v[:, :t], gate[:, :t], beta[:, :t], initial_state=S0,
                                         chunk_size=8)[1]
            assert_close_rel(delta[kind][:, t - 1], final, 1e-10)
        assert torch.equal(windows[:, t - 1], causal_conv1d_ref(conv_x[..., :t], weight, initial_state=window)[1])
