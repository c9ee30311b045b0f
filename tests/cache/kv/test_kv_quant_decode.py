"""Decode attention read from KIVI's codes against the reference: dequantize the history, then attention."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import CachePolicy
from hybridlm.cache.kv import QuantizedKV
from hybridlm.cache.kv.quantize import pack
from hybridlm.cache.kv.quantized_attention import QuantizedHistory
from tests.helpers import assert_close_rel, random_ids, tiny_model


def reference_attention(state: QuantizedKV, q: torch.Tensor, scale: float, valid) -> torch.Tensor:
    """What the reference path computes: the dequantized history and the full-precision tail, through SDPA."""
    old_keys, old_values = state.dequantized()
    keys = torch.cat([old_keys, state.recent_keys[:, :, :state.recent]], 2)
    values = torch.cat([old_values, state.recent_values[:, :, :state.recent]], 2)
    mask = None if valid is None else valid[:, :, None].expand(-1, q.shape[1], 1, -1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != keys.shape[1])


@settings(max_examples=12, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), dim_group=st.sampled_from([(16, 4), (16, 16), (32, 8), (24, 8), (8, 8)]),
       heads=st.sampled_from([(1, 1), (2, 4), (2, 6)]), chunks=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       residual=st.integers(0, 9), padded=st.booleans(), seed=st.integers(0, 99))
def test_attention_from_codes_equals_dequantize_then_attend(bits, dim_group, heads, chunks, residual, padded, seed):
    dim, group = dim_group
    kv_heads, q_heads = heads
    generator = torch.Generator().manual_seed(seed)
    state = QuantizedKV.empty(2, kv_heads, dim, bits=bits, group=group, residual=residual, dtype=torch.float64)
    seen = 0
    for i, time in enumerate(chunks + [residual + group, 1]):  # at least one group quantized
        keys, values = (torch.randn(2, kv_heads, time, dim, generator=generator, dtype=torch.float64) * 2
                        for _ in range(2))
        mask = None
        if padded and i == 0:  # row 1 starts with min(3, time - 1) padding slots
            mask = torch.ones(2, time, dtype=torch.bool)
            mask[1, :min(3, time - 1)] = False
        state.update(keys, values, torch.arange(seen, seen + time).expand(2, time), None, mask)
        seen += time
    assert state.quantized
    q = torch.randn(2, q_heads, 1, dim, generator=generator, dtype=torch.float64)
    slots = torch.arange(state.seen)
    valid = state._validity(slots)
    expected = reference_attention(state, q, 0.3, valid)
    assert_close_rel(state.history(valid).attend(q, 0.3), expected, rel=1e-10)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_planes_hold_contiguous_channel_ranges(bits):
    """The packed layout decode relies on: plane i of byte j is channel i * m + j."""
    codes = torch.randint(0, 2**bits, (3, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits)
    width = packed.shape[-1]
    for i in range(8 // bits):
        plane = (packed >> (i * bits)) & (2**bits - 1)
        assert torch.equal(plane, codes[:, i * width:(i + 1) * width])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_model_decode_from_codes_matches_the_reference_path(bits, monkeypatch):
    model = tiny_model(layer_pattern="AMA").double()
    ids = random_ids(2, 30)
    policy = CachePolicy(kv_bits=bits, kv_group_size=4, kv_residual=3)

    def decode():
        cache = model.new_cache(2, policy=policy)
        with torch.no_grad():
            out = [model(ids[:, :9], cache=cache).logits]
            out += [model(ids[:, t:t + 1], cache=cache).logits for t in range(9, ids.shape[1])]
        assert cache.states[0].quantized >= 24
        return torch.cat(out, 1)

    calls = []
    attend = QuantizedHistory.attend
    monkeypatch.setattr(QuantizedHistory, "attend", lambda self, q, scale: calls.append(1) or attend(self, q, scale))
    fused = decode()
    assert len(calls) >= 2 * 15  # two attention layers read the codes on (nearly) every decode step
    monkeypatch.setattr(QuantizedKV, "fused_decode", False)
    calls.clear()
    assert_close_rel(fused, decode(), rel=1e-10)
    assert not calls


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bfloat16_cache_attends_in_float32(bits):
    """A bfloat16 cache's codes read in float32 arithmetic: within a bfloat16 rounding step (2**-7) of the same
    held data attended in float64 (bfloat16 arithmetic throughout was 3-5e-2 off)."""
    generator = torch.Generator().manual_seed(bits)
    state = QuantizedKV.empty(1, 2, 64, bits=bits, group=32, residual=16, dtype=torch.bfloat16)
    keys, values = (torch.randn(1, 2, 300, 64, generator=generator, dtype=torch.bfloat16) for _ in range(2))
    state.update(keys, values, torch.arange(300)[None], None, None)
    exact = QuantizedKV.empty(1, 2, 64, bits=bits, group=32, residual=16, dtype=torch.float64)
    for name, tensor in vars(state).items():
        if isinstance(tensor, torch.Tensor):
            setattr(exact, name, tensor.double() if tensor.is_floating_point() else tensor)
    exact.quantized, exact.recent = state.quantized, state.recent
    q = torch.randn(1, 4, 1, 64, generator=generator)
    got = state.history().attend(q.bfloat16(), 0.125)
    assert got.dtype == torch.bfloat16
    assert_close_rel(got.double(), reference_attention(exact, q.double(), 0.125, None), rel=2**-7)
