"""Quantized recurrent states (CachePolicy(state_bits=...)): every fixed-size state kind, each of its
``quantized_fields`` (the SSM states and conv windows of Mamba-1, Mamba-2, Gated DeltaNet and KDA, Performer's
and Linformer's running sums, the short-conv window, Mamba-3's state and previous input).

Oracles: a naive re-quantization of a plain fp32 cache after every forward (absmax / 127 per scale group, round
to nearest, in float64), which the quantized state's codes must equal; a forward's own tokens read the state as it
was, so a prefill's logits equal the fp32 model's; crop equals never having run the removed tokens (up to the
scans' float rounding, as in fp32); prefix-cache files and snapshots restore the stored codes bit for bit; nbytes
equals the formula written from the plain state's shapes."""

import math

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from hybridlm import CachePolicy, PrefixCache, SpeculativeDecoding
from hybridlm.cache import SSMState
from hybridlm.cache import quantized_state as qs
from hybridlm.cache.quantized_state import QuantizedState, dequantize
from hybridlm.decoding.incremental import IncrementalDecoder
from tests.helpers import assert_close_rel, random_ids, relative_error, tiny_model

POLICIES = [CachePolicy(state_bits=bits, state_rounding=rounding, state_seed=3)
            for bits in (8, "fp8") for rounding in ("nearest", "stochastic", "feedback")]
#: one layer of each fixed-state kind, then attention: mamba2, mamba, gated_deltanet, kda, performer, linformer,
#: short_conv, mamba3
KINDS = ["SA", "MA", "DA", "KA", "PA", "LA", "CA", "RA"]
#: what a quantized state of each kind stores in codes (the rest stays as it was)
QUANTIZED = {"S": {"ssm", "conv"}, "M": {"ssm", "conv"}, "D": {"ssm", "conv"}, "K": {"ssm", "conv"},
             "P": {"kv"}, "L": {"keys", "values"}, "C": {"conv"}, "R": {"ssm", "k", "v"}}


def naive_int8(value: torch.Tensor, scale_dims) -> torch.Tensor:
    """Round each scale group of ``value`` (a batch row and index of ``scale_dims``) to 255 levels of its
    absmax, in float64."""
    x = value.double()
    reduced = [d for d in range(1, x.dim()) if d not in scale_dims]
    top = x.abs().amax(dim=reduced, keepdim=True).clamp(min=1e-300)
    return (torch.round(x / top * 127) * top / 127).to(value.dtype)


def run(model, ids, policy, prefill=4):
    cache = model.new_cache(ids.shape[0], policy=policy)
    with torch.no_grad():
        chunks = [model(ids[:, :prefill], cache=cache).logits]
        chunks += [model(ids[:, t:t + 1], cache=cache).logits for t in range(prefill, ids.shape[1])]
    return torch.cat(chunks, 1), cache


def stored(cache) -> dict:
    """The stored tensors of the quantized states, and how many tokens each has seen."""
    return {(i, name): t.clone() for i, s in enumerate(cache.states) if isinstance(s, QuantizedState)
            for name, t in [*s._tensors().items(), ("steps", torch.tensor(s.steps))]}


def held(state, name: str) -> torch.Tensor:
    """The value a quantized state holds in field ``name``: its dequantized codes, plus the residual with
    feedback."""
    value = dequantize(getattr(state, f"{name}_codes"), getattr(state, f"{name}_scales"))
    residual = getattr(state, f"{name}_residual")
    return value if residual is None else value + residual.float()


@pytest.mark.parametrize("pattern", KINDS)
def test_int8_nearest_codes_equal_a_naive_requantization_after_every_forward(pattern):
    model = tiny_model(layer_pattern=pattern)
    ids = random_ids(2, 10)
    cache = model.new_cache(2, policy=CachePolicy(state_bits=8))
    plain = model.new_cache(2)
    state, reference = cache.states[0], plain.states[0]
    assert set(type(reference).quantized_fields) == QUANTIZED[pattern[0]]
    with torch.no_grad():
        for start, stop in [(0, 4)] + [(t, t + 1) for t in range(4, 10)]:
            got = model(ids[:, start:stop], cache=cache).logits
            expected = model(ids[:, start:stop], cache=plain).logits
            assert_close_rel(got, expected, 1e-4)
            for name, spec in type(reference).quantized_fields.items():
                field = getattr(reference, name)
                field.copy_(naive_int8(field, spec.scale_dims))
                assert getattr(state, name) is None and getattr(state, f"{name}_codes").dtype == torch.int8
                assert_close_rel(held(state, name), field, 1e-6)
            for name, tensor in reference._tensors().items():
                if name not in type(reference).quantized_fields:  # kept as they are: equal to the plain model's
                    assert torch.equal(getattr(state, name), tensor), name


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_a_prefill_reads_the_state_as_the_fp32_model_does_and_nbytes_is_the_formula(policy):
    model = tiny_model(layer_pattern="SMPLCRA")
    ids = random_ids(2, 9)
    with torch.no_grad():
        reference = model(ids).logits
    got, cache = run(model, ids, policy, prefill=9)
    assert torch.allclose(got, reference, atol=1e-6)  # a cold prefill reads zeros: nothing rounded yet
    plain = model.new_cache(2)
    for state, fp32 in zip(cache.states[:-1], plain.states[:-1]):
        assert state.nbytes() == state.predicted_nbytes() == state.reserved_nbytes()
        expected = fp32.nbytes()
        for name, spec in type(fp32).quantized_fields.items():
            field = getattr(fp32, name)
            n, groups = field.numel(), field.shape[0] * math.prod(field.shape[d] for d in spec.scale_dims)
            feedback = policy.state_rounding == "feedback" and spec.accumulates
            expected += -field.numel() * field.element_size() + n + 4 * groups + (2 * n if feedback else 0)
        assert state.nbytes() == expected, type(fp32).__name__
        assert state.nbytes() < fp32.nbytes() or policy.state_rounding == "feedback"
    # decoded token by token the states are rounded: an error of the rounding's order (int8 1/254, e4m3 1/16 of
    # each entry; the exact check is the naive re-quantization above), not none
    decoded, _ = run(model, ids, policy)
    error = relative_error(decoded, reference)
    assert 1e-4 < error < (1e-2 if policy.state_bits == 8 else 3e-2)


@pytest.mark.parametrize("rounding", ["stochastic", "feedback"])
def test_rounding_is_reproducible_and_the_seed_matters(rounding):
    model = tiny_model(layer_pattern="SPLRA")
    ids = random_ids(1, 12)
    runs = [stored(run(model, ids, CachePolicy(state_bits=8, state_rounding=rounding, state_seed=s))[1])
            for s in (1, 1, 2)]
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    if rounding == "stochastic":
        for layer in range(4):
            assert any(not torch.equal(runs[0][k], runs[2][k]) for k in runs[0] if k[0] == layer), layer
    nearest = stored(run(model, ids, CachePolicy(state_bits=8))[1])
    for layer in range(4):
        assert any(not torch.equal(runs[0][k], nearest[k]) for k in nearest if k[0] == layer), layer


def test_a_window_rounds_to_nearest_and_its_old_columns_keep_their_codes():
    """A conv window's held tokens are each rounded once: as the window shifts, the columns it keeps keep their
    codes, under stochastic rounding too, and feedback keeps no residual for it."""
    model = tiny_model(layer_pattern="SCA")
    ids = random_ids(2, 9)
    for rounding in ("stochastic", "feedback"):
        policy = CachePolicy(state_bits=8, state_rounding=rounding, state_seed=5)
        _, cache = run(model, ids[:, :8], policy)
        before = [state.conv_codes.clone() for state in cache.states[:2]]
        with torch.no_grad():
            model(ids[:, 8:], cache=cache)
        for state, old in zip(cache.states[:2], before):
            assert state.conv_residual is None
            assert torch.equal(state.conv_codes[..., :-1], old[..., 1:])
            assert not torch.equal(state.conv_codes, old)


@pytest.mark.filterwarnings("ignore:cache_policy. state_bits is not applied to ConvState")
def test_state_windows_false_keeps_the_windows_as_they_are():
    model = tiny_model(layer_pattern="SRCA")
    ids = random_ids(2, 8)
    _, cache = run(model, ids, CachePolicy(state_bits=8, state_windows=False))
    _, plain = run(model, ids, None)
    _, both = run(model, ids, CachePolicy(state_bits=8))
    mamba2, mamba3, short_conv = cache.states[:3]
    assert set(type(mamba2).quantized_fields) == {"ssm"} and set(type(mamba3).quantized_fields) == {"ssm"}
    assert type(short_conv).__name__ == "ConvState"  # nothing of it accumulates: left unquantized
    assert torch.equal(mamba2.conv, plain.states[0].conv)  # the first layer's inputs do not depend on the states
    assert mamba2.conv.dtype == torch.float32 and mamba3.k.dtype == mamba3.v.dtype == torch.float32
    window_bytes = sum(t.numel() * t.element_size() for t in (plain.states[0].conv, plain.states[1].k,
                                                               plain.states[1].v, plain.states[2].conv))
    quantized_window_bytes = sum(sum(getattr(s, f"{name}_{part}").numel() * getattr(s, f"{name}_{part}").element_size()
                                     for part in ("codes", "scales")) for s, name in
                                 [(both.states[0], "conv"), (both.states[1], "k"), (both.states[1], "v"),
                                  (both.states[2], "conv")])
    assert cache.nbytes() - both.nbytes() == window_bytes - quantized_window_bytes > 0
    assert all(s.nbytes() == s.predicted_nbytes() for s in (mamba2, mamba3))


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
    assert (state.ssm_residual.float().abs() <= state.ssm_scales * 0.51).all()
    assert_close_rel(dequantize(state.ssm_codes, state.ssm_scales) + state.ssm_residual.float(), written, 1e-2)


@settings(max_examples=10, deadline=None, phases=[Phase.explicit, Phase.generate])
@given(policy=st.sampled_from(POLICIES), block=st.integers(2, 6), keep=st.integers(0, 5),
       pattern=st.sampled_from(["SA", "MA", "PA", "LA", "CA", "RA"]))
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
        state, expected = cache.states[0], other.states[0]
        assert state.steps == expected.steps
        for name in type(state).quantized_fields:
            assert_close_rel(held(state, name), held(expected, name), 1e-2)
        assert_close_rel(model(ids[:, -2:], cache=cache).logits, model(ids[:, -2:], cache=other).logits, 1e-4)


@pytest.mark.parametrize("policy", [POLICIES[1], POLICIES[5]], ids=str)
def test_a_verification_block_reads_and_keeps_the_states_its_decode_steps_would(policy):
    """A block of 2 to 64 tokens on a warm cache (speculative verification) reaches each quantized state one token
    at a time: its logits are the decode steps', its checkpoints what each step stores, up to the float rounding
    of the block's batched projections (1e-7 here; read as one forward, the block's states would differ from the
    steps' by the rounding itself, 1.6e-2, and its logits by 5e-3)."""
    model = tiny_model(layer_pattern="SMRPLCA")
    ids = random_ids(2, 11)
    _, block_cache = run(model, ids[:, :6], policy)
    _, step_cache = run(model, ids[:, :6], policy)
    with torch.no_grad():
        block = model(ids[:, 6:10], cache=block_cache).logits
        steps = [model(ids[:, t:t + 1], cache=step_cache).logits for t in range(6, 10)]
    assert_close_rel(block, torch.cat(steps, 1), 1e-5)
    assert_same_states(block_cache, step_cache)
    _, two_steps = run(model, ids[:, :8], policy)  # the same prefill, then one-token steps
    block_cache.crop(8)  # back to the checkpoint after the block's second token
    assert_same_states(block_cache, two_steps)


def assert_same_states(cache, expected) -> None:
    """The same codes, and held values within 1e-5 of the largest, plus one rounding of the residual where there is
    one: a residual (feedback rounding) is stored in bf16, so the float rounding of a block's batched projections
    (1e-7) can move a stored residual across a rounding boundary, by one bf16 step: at most 2^-7 of it (seen on
    AVX-512 CPUs, whose GEMM kernels round a block of rows differently from one row)."""
    for state, other in zip(cache.states, expected.states):
        if isinstance(state, QuantizedState):
            assert state.steps == other.steps
            for name in type(state).quantized_fields:
                codes, other_codes = getattr(state, f"{name}_codes"), getattr(other, f"{name}_codes")
                assert torch.equal(codes.view(torch.uint8), other_codes.view(torch.uint8)), f"{name}: codes differ"
                residual = getattr(other, f"{name}_residual")
                if residual is None:
                    assert_close_rel(held(state, name), held(other, name), 1e-5)
                    continue
                got, want = held(state, name), held(other, name)
                assert bool(want.ne(0).any()), f"{name}: the reference is all zero"
                one_rounding = residual.float().abs() * 2.0 ** -7  # one step of bf16 (8 significant bits)
                bound = 1e-5 * want.abs().max() + one_rounding
                excess = float(((got - want).abs() - bound).max())
                assert excess <= 0, f"{name}: held values differ by up to {excess:.3g} past the bound"


@pytest.mark.parametrize("policy", [POLICIES[0], POLICIES[4]], ids=str)
def test_greedy_speculative_decoding_equals_greedy_under_the_same_policy(policy):
    target = tiny_model(0, layer_types=["mamba2", "attention", "mamba", "mamba3", "performer", "short_conv"])
    prompts = [[5, 6, 7, 8, 5, 6, 7, 3, 4, 9, 1, 2], [3, 4, 9, 1, 2, 3, 4, 9, 1]]
    expected = IncrementalDecoder(target, cache_policy=policy).generate(prompts, max_new_tokens=12)
    for speculative in (SpeculativeDecoding(draft_model=tiny_model(1, layer_types=["mamba2"]), num_draft_tokens=3),
                        SpeculativeDecoding(prompt_lookup=2, num_draft_tokens=3)):
        decoder = IncrementalDecoder(target, cache_policy=policy, speculative=speculative)
        assert torch.equal(decoder.generate(prompts, max_new_tokens=12), expected)


@pytest.mark.parametrize("policy", [POLICIES[1], POLICIES[5]], ids=str)
def test_prefix_cache_files_restore_the_quantized_state_bit_for_bit(policy, tmp_path):
    model = tiny_model(layer_pattern="SMRPCA")
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
    model = tiny_model(layer_pattern="SRA")
    ids = random_ids(3, 7)
    _, cache = run(model, ids, CachePolicy(state_bits=8, state_rounding="feedback"))
    snapshot = cache.snapshot()
    rows = cache.select(torch.tensor([2, 0]))
    for state, picked in zip(cache.states[:2], rows.states[:2]):
        names = [name for name, t in state._tensors().items()]
        assert {"ssm_codes", "ssm_scales", "ssm_residual"} <= set(names)
        for name in names:
            assert torch.equal(getattr(picked, name), getattr(state, name)[[2, 0]]), name
    with torch.no_grad():
        after = model(ids[:, -1:], cache=cache).logits
        cache.restore(snapshot)
        assert torch.equal(model(ids[:, -1:], cache=cache).logits, after)
    assert all(state.nbytes() == state.predicted_nbytes() for state in cache.states[:2])


def test_the_working_value_has_the_plain_states_dtype():
    """In a bf16 model the conv window (and Mamba-3's previous input) is read in bf16, the SSM state in fp32."""
    model = tiny_model(layer_pattern="SRA").to(torch.bfloat16)
    cache = model.new_cache(1, dtype=torch.bfloat16, policy=CachePolicy(state_bits=8))
    plain = model.new_cache(1, dtype=torch.bfloat16)
    for state, reference in zip(cache.states[:2], plain.states[:2]):
        state.checkpointing(1)
        for name in type(state).quantized_fields:
            assert getattr(state, name).dtype == getattr(reference, name).dtype, name
        state.advance(1)
    assert plain.states[0].conv.dtype == torch.bfloat16 and plain.states[0].ssm.dtype == torch.float32
    with torch.no_grad():
        logits = model(random_ids(1, 5), cache=cache).logits
    assert torch.isfinite(logits).all()


def test_state_bits_scope_by_layer_index_and_kind():
    model = tiny_model(layer_pattern="SSA")
    cache = model.new_cache(1, policy={1: CachePolicy(state_bits=8, kv_bits=8, kv_group_size=8)})
    assert [type(s).__name__ for s in cache.states] == ["SSMState", "QuantizedSSMState", "KVState"]
    cache = model.new_cache(1, policy=CachePolicy(state_bits="fp8", kv_bits=8, kv_group_size=8))
    assert [type(s).__name__ for s in cache.states] == ["QuantizedSSMState", "QuantizedSSMState", "QuantizedKV"]
    assert cache.states[0].ssm_codes.dtype == cache.states[0].conv_codes.dtype == torch.float8_e4m3fn
    assert type(model.new_cache(1, policy=CachePolicy(kv_bits=8, kv_group_size=8)).states[0]) is SSMState
    names = [type(s).__name__ for s in tiny_model(layer_pattern="PLCRA").new_cache(
        1, policy=CachePolicy(state_bits=8)).states]
    assert names == ["QuantizedLinearAttentionState", "QuantizedCompressedKVState", "QuantizedConvState",
                     "QuantizedMamba3State", "KVState"]


@pytest.mark.parametrize("fields, match", [
    (dict(state_bits=4), "state_bits=4"), (dict(state_bits=16), "state_bits=16"),
    (dict(state_bits="int8"), "state_bits='int8'"), (dict(state_bits=True), "state_bits=True"),
    (dict(state_rounding="nearest"), "state_rounding='nearest' needs state_bits"),
    (dict(state_bits=8, state_rounding="up"), "state_rounding='up'"),
    (dict(state_windows=False), "state_windows=False needs state_bits"),
    (dict(state_bits=8, state_windows=0), "state_windows=0 must be True or False"),
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
