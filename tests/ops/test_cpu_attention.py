"""The decode-step attention kernel (``kernels/cpu/attention.cpp`` through ``cpu_kernels.grouped_attention``)
against the float64 softmax attention of the same bf16 inputs: grouped heads, masks, strided cache views; slots
no query may see are not read; threads; errors. Where ``attention_ref`` calls it: tests/ops/test_reference_ops.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.ops import cpu_kernels
from tests.helpers import on_one_and_two_threads

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")

FP32_EPS = 2.0 ** -24
BF16_EPS = 2.0 ** -8  # half the spacing of bf16: one rounding of the output


def exact_attention(q, k, v, mask, scale):
    """float64 ``softmax(q k^T * scale, masked) v`` with grouped heads; ``[batch, q_heads, q_len, dim_v]``."""
    group = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = q.double() @ k64.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return scores.softmax(-1) @ v64, (q.double().abs() @ k64.abs().transpose(-1, -2) * scale).amax(-1)


def cache_views(batch, kv_heads, slots, dim, dim_v, generator):
    """bf16 keys and values as a static cache holds them: the first ``slots`` of a longer buffer."""
    k = torch.randn(batch, kv_heads, slots + 5, dim, generator=generator).bfloat16()[:, :, :slots]
    v = torch.randn(batch, kv_heads, slots + 5, dim_v, generator=generator).bfloat16()[:, :, :slots]
    return k, v


@settings(max_examples=50, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), group=st.integers(1, 4), q_len=st.integers(1, 3),
       slots=st.integers(1, 50), dim=st.sampled_from([1, 5, 8, 16, 64, 67]), dim_v=st.sampled_from([3, 8, 64]),
       mask_kind=st.sampled_from(["none", "shared", "per_head"]), scale=st.sampled_from([None, 0.3]),
       seed=st.integers(0, 2**16))
def test_kernel_is_the_softmax_attention(batch, kv_heads, group, q_len, slots, dim, dim_v, mask_kind, scale, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * group, q_len, dim, generator=g).bfloat16()
    k, v = cache_views(batch, kv_heads, slots, dim, dim_v, g)
    heads = {"none": None, "shared": 1, "per_head": q.shape[1]}[mask_kind]
    mask = None if heads is None else torch.rand(batch, heads, q_len, slots, generator=g) > 0.4
    if mask is not None:
        mask[..., -1] = True  # every query sees something (a row that sees nothing: below)
    out = cpu_kernels.grouped_attention(q, k, v, mask, scale)
    exact, score_magnitude = exact_attention(q, k, v, mask, dim ** -0.5 if scale is None else scale)
    assert out.shape == exact.shape and out.dtype == torch.bfloat16
    # fp32 scores (off by up to dim * eps * sum |q k|), their exps (a few ulps), the sums over slots, one rounding
    fp32 = (4 * dim * score_magnitude + 4 * slots + 8)[..., None] * FP32_EPS * v.double().abs().max()
    bound = BF16_EPS * exact.abs() + fp32
    assert (exact.abs() > 10 * bound).any()  # an attention that a wrong or zero result would not match
    excess = ((out.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"kernel off the float64 attention by {excess:.3g} beyond the rounding bound"


def test_slots_no_query_sees_are_not_read_and_a_row_that_sees_none_is_nan():
    """NaN keys and values in slots every query is masked from leave the output finite (they are skipped, not
    multiplied by zero); a query that sees no slot gets NaN, as torch's softmax over nothing does."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 1, 16, generator=g).bfloat16()
    k, v = cache_views(1, 2, 12, 16, 16, g)
    mask = torch.ones(1, 4, 1, 12, dtype=torch.bool)
    mask[..., 7:] = False
    k[:, :, 7:], v[:, :, 7:] = math.nan, math.nan
    out = cpu_kernels.grouped_attention(q, k, v, mask)
    exact, _ = exact_attention(q, k[:, :, :7], v[:, :, :7], None, 0.25)
    assert out.isfinite().all() and (out.double() - exact).abs().max() <= 2 * BF16_EPS * exact.abs().max()
    mask[:, 1] = False
    out = cpu_kernels.grouped_attention(q, k, v, mask)
    assert out[:, 1].isnan().all() and out[:, [0, 2, 3]].isfinite().all()


def test_threads_give_the_same_bits():
    """(batch row, key/value head) pairs are split over threads, each summed alike: 2 threads, bit for bit 1 (the
    work, 2^22 multiply-adds, starts the second thread)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 8, 2, 64, generator=g).bfloat16()
    k, v = cache_views(4, 4, 512, 64, 64, g)
    one, two = on_one_and_two_threads(lambda: cpu_kernels.grouped_attention(q, k, v))
    assert torch.equal(one, two)


def test_the_op_in_a_compiled_graph_gives_eager_bits():
    """``torch.ops.hybridlm.cpu_attention`` (C++ kernel, fake shape in Python) passes torch's op checks, and a
    graph that calls it gives the eager call's bits."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 6, 1, 16, generator=g).bfloat16()
    k, v = cache_views(2, 3, 20, 16, 8, g)
    mask = torch.rand(2, 1, 1, 20, generator=g) > 0.3
    cpu_kernels.load_torch_ops()
    torch.library.opcheck(torch.ops.hybridlm.cpu_attention, (q, k, v, mask, None))
    compiled = torch.compile(lambda *args: torch.ops.hybridlm.cpu_attention(*args, 0.5), backend="aot_eager",
                             fullgraph=True)
    expected = cpu_kernels.grouped_attention(q, k, v, mask, 0.5)
    assert expected.isfinite().all() and expected.abs().max() > 0.05  # every row sees a slot: no NaN, not zero
    assert torch.equal(compiled(q, k, v, mask), expected)


@pytest.mark.parametrize("case, message", [
    ("heads", "kv_heads dividing q_heads"),
    ("3-D query", "kv_heads dividing q_heads"),
    ("dim", "kv_heads dividing q_heads"),
    ("fp32 keys", "takes bf16 keys and values"),
    ("strided rows", "rows are contiguous"),
    ("float mask", "takes a boolean mask"),
])
def test_errors_name_the_problem(case, message):
    q = torch.randn(1, 4, 1, 8).bfloat16()
    k = v = torch.randn(1, 2, 6, 8).bfloat16()
    mask = None
    if case == "heads":
        q = torch.randn(1, 3, 1, 8).bfloat16()
    elif case == "3-D query":
        q = q[0]
    elif case == "dim":
        k = torch.randn(1, 2, 6, 4).bfloat16()
    elif case == "fp32 keys":
        k = k.float()
    elif case == "strided rows":
        v = torch.randn(1, 2, 6, 16).bfloat16()[..., ::2]
    else:
        mask = torch.ones(1, 1, 1, 6)
    with pytest.raises(ValueError, match=message):
        cpu_kernels.grouped_attention(q, k, v, mask)
