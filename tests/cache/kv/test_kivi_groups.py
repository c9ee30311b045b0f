"""KIVI's two quantization directions, checked on what the cache holds: keys per channel over blocks of
``group`` tokens, values per token over groups of ``group`` channels (an independent float64 loop written
here), each within half a quantization step of its own group, and the newest tokens kept exactly."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.cache.kv import QuantizedKV


def kivi_loop(x: torch.Tensor, bits: int, group: int, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [n, dim]`` (n whole groups for keys) quantized and dequantized group by group, and each entry's
    half step. ``per_channel``: a group is one channel over ``group`` consecutive tokens (keys); else one token
    over ``group`` consecutive channels (values)."""
    out, half_step = torch.empty_like(x), torch.empty_like(x)
    n, dim = x.shape
    groups = ([(slice(t, t + group), c) for t in range(0, n, group) for c in range(dim)] if per_channel else
              [(t, slice(c, c + group)) for t in range(n) for c in range(0, dim, group)])
    for index in groups:
        part = x[index]
        low, high = part.min(), part.max()
        step = (high - low) / (2**bits - 1)
        codes = ((part - low) / step).round().clamp(0, 2**bits - 1) if step > 0 else torch.zeros_like(part)
        out[index], half_step[index] = codes * step + low, step / 2
    return out, half_step


@settings(max_examples=6, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), group=st.sampled_from([2, 4]), residual=st.integers(0, 5),
       chunks=st.lists(st.integers(1, 9), min_size=1, max_size=4), seed=st.integers(0, 99))
def test_the_cache_quantizes_keys_per_channel_and_values_per_token(bits, group, residual, chunks, seed):
    batch, heads, dim = 2, 2, 8
    generator = torch.Generator().manual_seed(seed)
    n = sum(chunks)
    # channel offsets far apart and token-wise trends: grouping in the wrong direction misses the bound
    keys = torch.randn(batch, heads, n, dim, dtype=torch.float64, generator=generator) + \
        10 * torch.arange(dim, dtype=torch.float64)
    values = torch.randn(batch, heads, n, dim, dtype=torch.float64, generator=generator) + \
        10 * torch.arange(n, dtype=torch.float64)[:, None]
    state = QuantizedKV.empty(batch, heads, dim, bits=bits, group=group, residual=residual, dtype=torch.float64)
    first = 0
    for time in chunks:
        state.update(keys[:, :, first:first + time], values[:, :, first:first + time],
                     torch.arange(first, first + time).expand(batch, time), None, None)
        first += time
    q = group * (max(0, n - residual) // group)
    assert state.quantized == q
    held_keys, held_values = state.dequantized()
    for b in range(batch):
        for h in range(heads):
            for held, x, per_channel in [(held_keys, keys, True), (held_values, values, False)]:
                expected, half_step = kivi_loop(x[b, h, :q], bits, group, per_channel)
                assert torch.allclose(held[b, h], expected, rtol=0, atol=1e-9)
                assert bool(((held[b, h] - x[b, h, :q]).abs() <= half_step * (1 + 1e-9) + 1e-12).all())
    assert torch.equal(state.recent_keys[:, :, : n - q], keys[:, :, q:])  # the tail: full precision, exact
    assert torch.equal(state.recent_values[:, :, : n - q], values[:, :, q:])
    if q:
        assert bool(((held_keys - keys[:, :, :q]).abs() > 0).any())  # codes, not a full-precision copy
