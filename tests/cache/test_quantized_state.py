"""Quantized recurrent states (CachePolicy(state_bits=...)): the SSM states of Mamba-1, Mamba-2, Gated DeltaNet, KDA.

Oracles: a naive re-quantization of a plain fp32 cache after every forward (per-head absmax / 127, round to
nearest), which the quantized state's codes must equal; a forward's own tokens read the state as it was, so a
prefill's logits equal the fp32 model's; crop equals never having run the removed tokens (up to the
scans' float rounding, as in fp32); prefix-cache files
and snapshots restore the stored codes bit for bit; nbytes equals the formula."""

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from hybridlm import CachePolicy, PrefixCache, SpeculativeDecoding
from hybridlm.cache import SSMState
from hybridlm.cache import quantized_state as qs
from hybridlm.cache.quantized_state import QuantizedSSMState, dequantize
from hybridlm.decoding.incremental import IncrementalDecoder
from tests.helpers import assert_close_rel, random_ids, tiny_model

POLICIES = [CachePolicy(state_bits=bits, state_rounding=rounding, state_seed=3)
            for bits in (8, "fp8") for rounding in ("nearest", "stochastic", "feedback")]


def naive_int8(ssm: torch.Tensor) -> torch.Tensor:
    """Round each (row, head) of ``ssm`` to 255 levels of its absmax, in float64."""
    x = ssm.double()
    top = x.abs().flatten(2).amax(-1).clamp(min=1e-300).view(*x.shape[:2], *[1] * (x.dim() - 2))
    return (torch.round(x / top * 127) * top / 127).float()


def run(model, ids, policy, prefill=4):
    cache = model.new_cache(ids.shape[0], policy=policy)
    with torch.no_grad():
        chunks = [model(ids[:, :prefill], cache=cache).logits]
        chunks += [model(ids[:, t:t + 1], cache=cache).logits for t in range(prefill, ids.shape[1])]
    return torch.cat(chunks, 1), cache


def stored(cache) -> dict:
    """The stored tensors of the quantized states, and how many tokens each has seen."""
    return {(i, name): t.clone() for i, s in enumerate(cache.states) if isinstance(s, QuantizedSSMState)
            for name, t in [*s._tensors().items(), ("steps", torch.tensor(s.steps))]}


def held(state) -> torch.Tensor:
    """The value a quantized state holds: its dequantized codes, plus the residual with feedback."""
    value = dequantize(state.ssm_codes, state.ssm_scales)
    return value if state.ssm_residual is None else value + state.ssm_residual.float()


@pytest.mark.parametrize("pattern", ["SA", "MA", "DA", "KA"])
def test_int8_nearest_codes_equal_a_naive_requantization_after_every_forward(pattern):
    model = tiny_model(layer_pattern=pattern)
    ids = random_ids(2, 10)
    cache = model.new_cache(2, policy=CachePolicy(state_bits=8))
    plain = model.new_cache(2)
    with torch.no_grad():
        for start, stop in [(0, 4)] + [(t, t + 1) for t in range(4, 10)]:
            got = model(ids[:, start:stop], cache=cache).logits
            expected = model(ids[:, start:stop], cache=plain).logits
            assert_close_rel(got, expected, 1e-4)
            plain.states[0].ssm.copy_(naive_int8(plain.states[0].ssm))
            state = cache.states[0]
            assert isinstance(state, QuantizedSSMState) and state.ssm is None and state.ssm_codes.dtype == torch.int8
            assert_close_rel(dequantize(state.ssm_codes, state.ssm_scales), plain.states[0].ssm, 1e-6)


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_a_prefill_reads_the_state_as_the_fp32_model_does_and_nbytes_is_the_formula(policy):
    model = tiny_model(layer_pattern="SMA")
    ids = random_ids(2, 9)
    with torch.no_grad():
        reference = model(ids).logits
    got, cache = run(model, ids, policy, prefill=9)
    assert torch.allclose(got, reference, atol=1e-6)  # a cold prefill reads zeros: nothing rounded yet
    plain = model.new_cache(2)
    for state, fp32 in zip(cache.states[:2], plain.states[:2]):
        assert state.nbytes() == state.predicted_nbytes() == state.reserved_nbytes()
        n, heads = fp32.ssm.numel(), fp32.ssm.shape[0] * fp32.ssm.shape[1]
        extra = 2 * n if policy.state_rounding == "feedback" else 0
        assert state.nbytes() == fp32.nbytes() - 4 * n + n + 4 * heads + extra
    decoded, _ = run(model, ids, policy)
    assert_close_rel(decoded, reference, 1e-3)


@pytest.mark.parametrize("rounding", ["stochastic", "feedback"])
def test_rounding_is_reproducible_and_the_seed_matters(rounding):
    model = tiny_model(layer_pattern="SA")
    ids = random_ids(1, 12)
    runs = [stored(run(model, ids, CachePolicy(state_bits=8, state_rounding=rounding, state_seed=s))[1])
            for s in (1, 1, 2)]
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    if rounding == "stochastic":
        assert any(not torch.equal(runs[0][k], runs[2][k]) for k in runs[0])
    nearest = stored(run(model, ids, CachePolicy(state_bits=8))[1])
    assert any(not torch.equal(runs[0][k], nearest[k]) for k in nearest)


def test_feedback_adds_each_writes_rounding_error_to_the_next_write():
    model = tiny_model(layer_pattern="SA")
    ids = random_ids(1, 8)
    _, cache = run(model, ids, CachePolicy(state_bits=8, state_rounding="feedback"))
    state = cache.states[0]
    previous = state.ssm_residual.float().clone()
    assert previous.abs().max() > 0
    state.checkpointing(1)  # as a forward would: the working value, updated in place, stored after it
    value = torch.randn_like(state.ssm) * state.ssm.abs().max()
    state.ssm.copy_(value)
    state.advance(1)
    written = value + previous
    quantum = state.ssm_scales.view(*state.ssm_scales.shape, 1, 1)
    assert (state.ssm_residual.float().abs() <= quantum * 0.51).all()
    assert_close_rel(dequantize(state.ssm_codes, state.ssm_scales) + state.ssm_residual.float(), written, 1e-2)


@settings(max_examples=6, deadline=None, phases=[Phase.explicit, Phase.generate])
@given(policy=st.sampled_from(POLICIES), block=st.integers(2, 6), keep=st.integers(0, 5),
       pattern=st.sampled_from(["SA", "MA"]))
def test_crop_equals_never_having_run_the_removed_tokens(policy, block, keep, pattern):
    keep = min(keep, block - 1)
    model = tiny_model(layer_pattern=pattern)
    ids = random_ids(2, 6 + block + 2)
    _, cache = run(model, ids[:, :6], policy)
    _, other = run(model, ids[:, :6], policy)
    with torch.no_grad():
        model(ids[:, 6:6 + block], cache=cache)  # a verification block: per-token checkpoints kept
        cache.crop(6 + keep)
        if keep:
            model(ids[:, 6:6 + keep], cache=other)
        # equal up to the scans' own float rounding (as in fp32), which may move a code by one step
        for state, expected in zip(cache.states[:1], other.states[:1]):
            assert state.steps == expected.steps
            assert_close_rel(state.conv, expected.conv, 1e-5)
            assert_close_rel(held(state), held(expected), 1e-2)
        assert_close_rel(model(ids[:, -2:], cache=cache).logits, model(ids[:, -2:], cache=other).logits, 1e-5)


@pytest.mark.parametrize("policy", [POLICIES[0], POLICIES[4]], ids=str)
def test_greedy_speculative_decoding_equals_greedy_under_the_same_policy(policy):
    target = tiny_model(0, layer_types=["mamba2", "attention", "mamba"])
    prompts = [[5, 6, 7, 8, 5, 6, 7, 3, 4, 9, 1, 2], [3, 4, 9, 1, 2, 3, 4, 9, 1]]
    expected = IncrementalDecoder(target, cache_policy=policy).generate(prompts, max_new_tokens=12)
    for speculative in (SpeculativeDecoding(draft_model=tiny_model(1, layer_types=["mamba2"]), num_draft_tokens=3),
                        SpeculativeDecoding(prompt_lookup=2, num_draft_tokens=3)):
        decoder = IncrementalDecoder(target, cache_policy=policy, speculative=speculative)
        assert torch.equal(decoder.generate(prompts, max_new_tokens=12), expected)


@pytest.mark.parametrize("policy", [POLICIES[1], POLICIES[5]], ids=str)
def test_prefix_cache_files_restore_the_quantized_state_bit_for_bit(policy, tmp_path):
    model = tiny_model(layer_pattern="SMA")
    block = 4
    cache = PrefixCache(block_size=block)
    decoder = IncrementalDecoder(model, prefill_chunk_size=block, cache_policy=policy, prefix_cache=cache)
    shared = random_ids(1, 2 * block, seed=12)
    decoder.generate(torch.cat([shared, random_ids(1, 3, seed=13)], 1), max_new_tokens=2)
    request = torch.cat([shared, random_ids(1, 4, seed=14)], 1)
    cold = IncrementalDecoder(model, prefill_chunk_size=block, cache_policy=policy).generate(request,
                                                                                            max_new_tokens=6)
    cache.save(tmp_path / "prefix.safetensors")
    loaded = PrefixCache.load(tmp_path / "prefix.safetensors", model)
    assert loaded.nbytes == cache.nbytes
    reloaded = IncrementalDecoder(model, prefill_chunk_size=block, cache_policy=policy, prefix_cache=loaded)
    assert torch.equal(reloaded.generate(request, max_new_tokens=6), cold)
    assert reloaded.stats["prefix_hit_tokens"] == 2 * block


def test_select_clone_snapshot_and_restore_keep_the_stored_form():
    model = tiny_model(layer_pattern="SA")
    ids = random_ids(3, 7)
    _, cache = run(model, ids, CachePolicy(state_bits=8, state_rounding="feedback"))
    snapshot = cache.snapshot()
    rows = cache.select(torch.tensor([2, 0]))
    state, picked = cache.states[0], rows.states[0]
    for name in ("conv", "ssm_codes", "ssm_scales", "ssm_residual"):
        assert torch.equal(getattr(picked, name), getattr(state, name)[[2, 0]])
    with torch.no_grad():
        after = model(ids[:, -1:], cache=cache).logits
        cache.restore(snapshot)
        assert torch.equal(model(ids[:, -1:], cache=cache).logits, after)
    assert cache.states[0].nbytes() == cache.states[0].predicted_nbytes()


def test_state_bits_scope_by_layer_index_and_kind():
    model = tiny_model(layer_pattern="SSA")
    cache = model.new_cache(1, policy={1: CachePolicy(state_bits=8, kv_bits=8, kv_group_size=8)})
    assert [type(s).__name__ for s in cache.states] == ["SSMState", "QuantizedSSMState", "KVState"]
    cache = model.new_cache(1, policy=CachePolicy(state_bits="fp8", kv_bits=8, kv_group_size=8))
    assert [type(s).__name__ for s in cache.states] == ["QuantizedSSMState", "QuantizedSSMState", "QuantizedKV"]
    assert cache.states[0].ssm_codes.dtype == torch.float8_e4m3fn
    assert type(model.new_cache(1, policy=CachePolicy(kv_bits=8, kv_group_size=8)).states[0]) is SSMState


@pytest.mark.parametrize("fields, match", [
    (dict(state_bits=4), "state_bits=4"), (dict(state_bits=16), "state_bits=16"),
    (dict(state_bits="int8"), "state_bits='int8'"), (dict(state_bits=True), "state_bits=True"),
    (dict(state_rounding="nearest"), "state_rounding='nearest' needs state_bits"),
    (dict(state_bits=8, state_rounding="up"), "state_rounding='up'"),
])
def test_bad_state_settings_are_clear_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        CachePolicy(**fields)


def test_fp8_without_float8_dtypes_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    qs._fp8_dtype.cache_clear()
    try:
        with pytest.raises(ValueError, match='state_bits="fp8".*no float8'):
            CachePolicy(state_bits="fp8")
    finally:
        qs._fp8_dtype.cache_clear()
