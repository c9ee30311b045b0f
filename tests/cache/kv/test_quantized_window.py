"""Quantized sinks + window (QuantizedSinkWindowKV): CachePolicy(kv_bits=..., sink_tokens=..., window=...).

Oracles: SinkWindowKV (with the residual covering the window nothing visible is quantized, so the outputs must
match); a float64 quantize-then-dequantize written here per group (the held window); the bytes counted slot by
slot (the formula); the unquantized sinks + window model (the error must shrink with more bits); a cache that
never went past the crop point (rollback)."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridlm import CachePolicy
from hybridlm.cache.kv.quantized_window import QuantizedSinkWindowKV
from hybridlm.cli import main
from hybridlm.decoding.incremental import IncrementalDecoder
from tests.helpers import assert_close_rel, random_ids, relative_error, tiny_model


def decode(model, ids, policy, prefill, mask=None):
    """Logits of a prefill of ``prefill`` tokens (``mask``: its real tokens) then one token at a time, and the
    cache."""
    cache = model.new_cache(ids.shape[0], policy=policy)
    with torch.no_grad():
        chunks = [model(ids[:, :prefill], cache=cache, attention_mask=mask)]
        chunks += [model(ids[:, t:t + 1], cache=cache) for t in range(prefill, ids.shape[1])]
    return torch.cat([c.logits for c in chunks], 1), cache


def quantized_state(cache) -> QuantizedSinkWindowKV:
    states = [s for s in cache.states if isinstance(s, QuantizedSinkWindowKV)]
    assert states, "the policy did not select QuantizedSinkWindowKV"
    return states[0]


@pytest.mark.parametrize("prefill, residual", [(5, 7), (13, 100)])
def test_with_the_residual_covering_the_window_it_equals_sinks_and_window(prefill, residual):
    model = tiny_model(layer_pattern="MA")
    ids = random_ids(2, 34)
    expected, _ = decode(model, ids, CachePolicy(sink_tokens=2, window=8), prefill)
    policy = CachePolicy(kv_bits=2, kv_group_size=4, kv_residual=residual, sink_tokens=2, window=8)
    got, cache = decode(model, ids, policy, prefill)
    state = quantized_state(cache)
    assert state.evicted > 0  # groups were quantized as they aged, and left the window
    assert_close_rel(got, expected)


def test_with_left_padding_and_a_covering_residual_it_equals_sinks_and_window():
    model = tiny_model(layer_pattern="AM")
    ids = random_ids(2, 30)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :3] = False
    expected, _ = decode(model, ids, CachePolicy(sink_tokens=4, window=8), 6, mask)
    got, _ = decode(model, ids, CachePolicy(kv_bits=4, kv_group_size=4, kv_residual=8, sink_tokens=4, window=8), 6,
                    mask)
    assert_close_rel(got[0], expected[0])
    assert_close_rel(got[1, 3:], expected[1, 3:])


def held_slot_bytes(tokens, sinks, window, bits, group, residual, heads, dim, e=8):
    """Bytes per row, slot by slot: a sink or tail slot full precision, a slot of a quantized group packed codes
    plus its share of the scales; a group is gone once its last slot is before ``tokens - window + 1``."""
    body = list(range(sinks, tokens))
    quantized = body[: group * (max(0, len(body) - residual) // group)]
    total = 8  # padding counter
    for slot in range(tokens):
        if slot not in quantized:
            total += 2 * heads * dim * e
            continue
        last_of_group = sinks + ((slot - sinks) // group + 1) * group - 1
        if last_of_group >= tokens - window + 1:
            total += heads * (2 * dim * bits // 8 + 4 * dim * e // group)  # codes, key and value scales + zeros
    return total


def reference_dequantized(x, bits, group, dim):
    """KIVI round trip in float64: keys ``x [tokens, dim]`` per channel over the group's tokens (``dim=0``),
    values per token over groups of channels (``dim=1``)."""
    if dim == 0:
        blocks = x.reshape(-1, group, x.shape[1])
    else:
        blocks = x.reshape(x.shape[0], -1, group)
    low, high = blocks.amin(dim + 1, keepdim=True), blocks.amax(dim + 1, keepdim=True)
    scale = (high - low) / (2**bits - 1)
    codes = torch.round((blocks - low) / scale).clamp(0, 2**bits - 1)
    return (codes * scale + low).reshape(x.shape), scale.abs().amax()


@settings(max_examples=8, deadline=None)
@given(chunks=st.lists(st.integers(1, 9), min_size=3, max_size=12), bits=st.sampled_from([2, 4, 8]),
       sinks=st.integers(0, 3), residual=st.integers(0, 14))
@example(chunks=[1, 1, 1, 9, 9, 9], bits=4, sinks=3, residual=0)  # decoding into the sinks, then past the window
def test_the_held_window_is_the_dequantized_reference_and_bytes_match_the_formula(chunks, bits, sinks, residual):
    check_held_window(chunks, bits, sinks, residual)


def test_the_held_window_check_compares_quantized_tokens():
    assert check_held_window([6, 1, 1, 1, 9, 1, 1, 1], bits=2, sinks=2, residual=1) >= 2


def check_held_window(chunks, bits, sinks, residual) -> int:
    """Feeds ``chunks`` of random float64 keys and values; each view equals the reference and the bytes the
    slot-by-slot count. Returns how many views held quantized tokens."""
    heads, dim, group, window = 2, 8, 4, 10
    state = QuantizedSinkWindowKV.empty(1, heads, dim, sinks=sinks, window=window, bits=bits, group=group,
                                        residual=residual, dtype=torch.float64)
    generator = torch.Generator().manual_seed(len(chunks))
    keys = torch.randn(1, heads, sum(chunks), dim, dtype=torch.float64, generator=generator)
    values = torch.randn(1, heads, sum(chunks), dim, dtype=torch.float64, generator=generator)
    views_with_codes = 0
    for seen, time in zip(torch.tensor(chunks).cumsum(0).tolist(), chunks):
        first = seen - time
        held_before = (state.held_sinks, state.sinks + state.evicted, state.quantized)
        view = state.update(keys[:, :, first:seen], values[:, :, first:seen], torch.arange(first, seen)[None], None,
                            None)
        _, body_start, quantized = held_before  # the view reads the codes held before; new tokens age after it
        held_sinks = min(seen, sinks)
        expected_slots = list(range(held_sinks)) + list(range(body_start, seen))
        # a verification block (2 to 64 tokens on a warm cache) adds dequantized copies of the tail tokens that a
        # decode step inside it reads as codes (hybridlm.cache.kv.stepwise)
        read_as_codes = sinks + group * (max(0, seen - 1 - sinks - min(residual, window - 1)) // group)
        copies = list(range(body_start + quantized, read_as_codes)) if first and time > 1 else []
        assert view.slots.tolist() == expected_slots + copies
        assert body_start <= max(sinks, first - window + 1)  # the first new token sees its whole window
        ref_keys, ref_values = (x[:, :, expected_slots + copies].clone() for x in (keys, values))
        if copies:
            part = slice(len(expected_slots), None)
            for h in range(heads):
                ref_keys[0, h, part] = reference_dequantized(keys[0, h, copies], bits, group, 0)[0]
                ref_values[0, h, part] = reference_dequantized(values[0, h, copies], bits, group, 1)[0]
        if quantized:
            part = slice(held_sinks, held_sinks + quantized)
            for h in range(heads):
                ref_keys[0, h, part], key_step = reference_dequantized(keys[0, h, body_start:body_start + quantized],
                                                                       bits, group, 0)
                ref_values[0, h, part], value_step = reference_dequantized(
                    values[0, h, body_start:body_start + quantized], bits, group, 1)
                # the quantization is not trivial, and within half a step of the original
                original = keys[0, h, body_start:body_start + quantized]
                assert (ref_keys[0, h, part] - original).abs().max() > 0
                assert (ref_keys[0, h, part] - original).abs().max() <= key_step / 2 + 1e-12
            views_with_codes += 1
        torch.testing.assert_close(view.keys, ref_keys, rtol=0, atol=1e-12)
        torch.testing.assert_close(view.values, ref_values, rtol=0, atol=1e-12)
        assert state.seen == seen
        formula = held_slot_bytes(seen, sinks, window, bits, group, min(residual, window - 1), heads, dim)
        assert state.nbytes() == state.predicted_nbytes(seen) == formula
    return views_with_codes


def test_decoding_three_windows_stays_finite_and_the_error_shrinks_with_more_bits():
    model = tiny_model(layer_pattern="MA", hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    window, ids = 16, random_ids(1, 48)
    expected, _ = decode(model, ids, CachePolicy(sink_tokens=2, window=window), prefill=4)
    errors = {}
    for bits in (8, 4, 2):
        policy = CachePolicy(kv_bits=bits, kv_group_size=8, kv_residual=2, sink_tokens=2, window=window)
        got, cache = decode(model, ids, policy, prefill=4)
        assert torch.isfinite(got).all()
        assert quantized_state(cache).evicted > 0
        errors[bits] = relative_error(got, expected)
    assert 0 < errors[8] < errors[4] < errors[2] < 0.5, errors
    assert errors[8] < 1e-2, errors


def held(state) -> dict:
    """What a cache that stopped here holds: the counts, sinks, tail and dequantized codes of every group a later
    query can see (groups kept past the window only for a rollback left out)."""
    pending = state._pending()
    keys, values = state.dequantized()
    return {"sinks": state.sink_keys[:, :, :state.held_sinks], "tail": state.recent_keys[:, :, :state.recent],
            "codes": torch.cat([keys[:, :, pending:], values[:, :, pending:]], 2),
            "counts": torch.tensor([state.held_sinks, state.evicted + pending, state._left(), state.recent])}


def decode_keeping(model, ids, policy, prefill, keep):
    """As :func:`decode` (the cache only), with ``keep_checkpoints(keep)`` after the prefill."""
    cache = model.new_cache(ids.shape[0], policy=policy)
    model(ids[:, :prefill], cache=cache)
    cache.keep_checkpoints(keep)
    for t in range(prefill, ids.shape[1]):
        model(ids[:, t:t + 1], cache=cache)
    return cache


def test_crop_equals_a_cache_that_stopped_there_and_without_kept_tokens_is_refused():
    """Decoded one token at a time, nothing is kept: a crop that would need a group back in full precision
    (quantized since) or a group back in the window is refused, naming which. With ``keep_checkpoints(5)`` every
    crop of up to 5 slots equals a cache that stopped there."""
    model = tiny_model(layer_pattern="A")
    ids = random_ids(1, 40)
    policy = CachePolicy(kv_bits=4, kv_group_size=4, kv_residual=2, sink_tokens=2, window=8)
    refusals, put_back = set(), 0
    with torch.no_grad():
        for keep in (0, 5):
            for stop in range(26, 34):
                cache = decode_keeping(model, ids[:, :stop], policy, 4, keep)
                state = quantized_state(cache)
                for back in range(1, 6) if not keep else [stop % 5 + 1]:
                    reason = state.rewind_blocker(back)
                    if reason is not None:
                        assert not keep, reason
                        refusals.add("checkpoint" if "earliest kept checkpoint" in reason else "window")
                        with pytest.raises(ValueError, match="cannot remove"):
                            cache.crop(stop - back)
                        continue
                    fresh = decode_keeping(model, ids[:, :stop - back], policy, 4, keep)
                    put_back += state._left() > quantized_state(fresh)._left()
                    cache.crop(stop - back)
                    assert state.nbytes() == state.predicted_nbytes(stop - back) == quantized_state(fresh).nbytes()
                    assert held(state).keys() == held(quantized_state(fresh)).keys()
                    for name, value in held(quantized_state(fresh)).items():
                        assert torch.equal(held(state)[name], value), name
                    got = model(ids[:, stop - back:stop], cache=cache).logits
                    expected = model(ids[:, stop - back:stop], cache=fresh).logits
                    assert_close_rel(got, expected)
                    break
    assert refusals == {"checkpoint", "window"} and put_back > 0


def test_policy_selects_it_and_still_refuses_heavy_hitters_and_pages():
    model = tiny_model(layer_pattern="A")
    cache = model.new_cache(1, policy=CachePolicy(kv_bits=8, kv_group_size=4, window=8))
    assert isinstance(cache.states[0], QuantizedSinkWindowKV) and cache.states[0].sinks == 0
    with pytest.raises(ValueError, match="kv_bits=4 with heavy_hitters"):
        CachePolicy(kv_bits=4, heavy_hitters=2, window=8)
    with pytest.raises(ValueError, match="page_size"):
        CachePolicy(kv_bits=4, sink_tokens=2, window=8, page_size=16)
    with pytest.raises(ValueError, match="kv_group_size=3 does not divide"):
        model.new_cache(1, policy=CachePolicy(kv_bits=4, kv_group_size=3, window=8))


def test_select_and_clone_keep_the_quantized_window():
    model = tiny_model(layer_pattern="A")
    ids = random_ids(2, 30)
    policy = CachePolicy(kv_bits=4, kv_group_size=4, kv_residual=2, sink_tokens=2, window=8)
    _, cache = decode(model, ids, policy, prefill=4)
    state = quantized_state(cache)
    row = state.select(torch.tensor([1]))
    copy = state.clone()
    assert row.batch_size == 1 and (row.evicted, row.quantized, row.recent) == (state.evicted, state.quantized,
                                                                                 state.recent)
    assert torch.equal(row.key_codes, state.key_codes[1:]) and copy.key_codes is not state.key_codes


def test_generate_cli_with_quantized_sinks_and_window(capsys, tmp_path):
    """170 tokens: past the sinks, the default kv_residual (128) and a group (32), so groups are quantized."""
    model = tiny_model(layer_pattern="MA", hidden_size=64, num_attention_heads=2, num_key_value_heads=1)  # head_dim 32
    model.save_pretrained(tmp_path)
    main(["generate", "--model", str(tmp_path), "--ids", "3,4,5", "--max-new-tokens", "170", "--kv-bits", "4",
          "--sink-tokens", "4", "--window", "64"])
    printed = [int(t) for t in capsys.readouterr().out.split()]
    policy = CachePolicy(kv_bits=4, sink_tokens=4, window=64)
    tokens = IncrementalDecoder(model, cache_policy=policy).generate([[3, 4, 5]], max_new_tokens=170)[0, 3:]
    assert printed == tokens.tolist()[: len(printed)] and len(printed) > 0


def test_generate_cli_passes_kv_residual_and_group_size(capsys, tmp_path):
    """A short window needs a short full-precision residual to quantize anything: the flags reach the policy."""
    model = tiny_model(layer_pattern="MA", hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    model.save_pretrained(tmp_path)
    main(["generate", "--model", str(tmp_path), "--ids", "3,4,5", "--max-new-tokens", "40", "--kv-bits", "4",
          "--kv-residual", "4", "--kv-group-size", "8", "--sink-tokens", "2", "--window", "16"])
    printed = [int(t) for t in capsys.readouterr().out.split()]
    policy = CachePolicy(kv_bits=4, kv_residual=4, kv_group_size=8, sink_tokens=2, window=16)
    decoder = IncrementalDecoder(model, cache_policy=policy)
    tokens = decoder.generate([[3, 4, 5]], max_new_tokens=40)[0, 3:]
    assert printed == tokens.tolist()[: len(printed)] and len(printed) > 0
    _, cache = decode(model, random_ids(1, 43), policy, prefill=3)
    assert quantized_state(cache).quantized > 0  # with these flags, window tokens really are quantized


@pytest.mark.parametrize("flags", [["--kv-residual", "4"], ["--kv-group-size", "8"]])
def test_generate_cli_refuses_quantization_flags_without_kv_bits(flags, tmp_path, capsys):
    """--kv-residual / --kv-group-size without --kv-bits would do nothing: an error naming them, not silence."""
    tiny_model(layer_pattern="MA").save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main(["generate", "--model", str(tmp_path), "--ids", "3,4,5", "--max-new-tokens", "2", *flags])
    assert stopped.value.code == 2
    assert f"{flags[0]} only apply with --kv-bits 8, 4 or 2" in capsys.readouterr().err
