"""The Triton paged decode kernel against the reference (gather the pages, SDPA), in Triton's interpreter on a
machine without GPU: several page sizes, lengths that are not a multiple of the page size, GQA and MQA, pages
scattered over the pool; and a paged cache decoding through the kernel against the contiguous cache."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import CachePolicy, ops
from hybridlm.ops import backends
from hybridlm.ops.paged_attention import paged_attention_ref
from tests.helpers import assert_close_rel, random_ids, tiny_model
from tests.ops.triton_support import DEVICE, assert_close, kernels, poisoned_outputs


def paged_inputs(batch, q_heads, kv_heads, dim, page_size, lengths, pool=40, seed=0, dtype=torch.float32):
    """Random pages, and a block table giving each row distinct pages scattered over the pool."""
    generator = torch.Generator().manual_seed(seed)
    widest = max(-(-n // page_size) for n in lengths)
    assert batch * widest <= pool

    def r(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    table = torch.randperm(pool, generator=generator)[:batch * widest].view(batch, widest).to(torch.int32)
    return dict(q=r(batch, q_heads, 1, dim), key_pages=r(pool, kv_heads, page_size, dim),
                value_pages=r(pool, kv_heads, page_size, dim), block_table=table.to(DEVICE),
                lengths=torch.tensor(lengths, device=DEVICE))


@settings(max_examples=8, deadline=None)
@given(page_size=st.sampled_from([1, 2, 3, 5, 8, 16]), heads=st.sampled_from([(4, 2), (3, 1), (2, 2), (8, 2)]),
       dim=st.sampled_from([4, 8, 12]), lengths=st.lists(st.integers(1, 37), min_size=1, max_size=3),
       scale=st.sampled_from([None, 0.3]))
def test_kernel_matches_the_reference(page_size, heads, dim, lengths, scale):
    inputs = paged_inputs(len(lengths), *heads, dim, page_size, lengths, pool=3 * 37)
    with poisoned_outputs():
        got = kernels.paged_attention(**inputs, scale=scale)
    expected = paged_attention_ref(**inputs, scale=scale)
    assert expected.abs().max() > 0
    assert_close(got, expected, f"page_size={page_size}", rel=1e-5)


def test_kernel_reads_strided_queries_and_bf16_pages():
    inputs = paged_inputs(2, 4, 2, 8, 4, [9, 3], seed=1)
    inputs["q"] = inputs["q"].transpose(1, 3).contiguous().transpose(1, 3)  # same values, other strides
    assert not inputs["q"].is_contiguous()
    assert_close(kernels.paged_attention(**inputs), paged_attention_ref(**inputs), "strided q")
    half = {k: v.bfloat16() if v.is_floating_point() else v for k, v in inputs.items()}
    got = kernels.paged_attention(**half)
    assert got.dtype == torch.bfloat16
    assert_close(got.float(), paged_attention_ref(**inputs), "bf16", rel=2e-2)


def test_kernel_refuses_bad_shapes():
    inputs = paged_inputs(2, 4, 2, 8, 4, [5, 3])
    with pytest.raises(ValueError, match="one query token per row"):
        kernels.paged_attention(**{**inputs, "q": inputs["q"].expand(2, 4, 2, 8)})
    with pytest.raises(ValueError, match="3 key/value heads do not divide 4 query heads"):
        kernels.paged_attention(**paged_inputs(2, 4, 3, 8, 4, [5, 3]))
    with pytest.raises(ValueError, match="lengths"):
        kernels.paged_attention(**{**inputs, "lengths": inputs["lengths"][:1]})


def test_a_paged_cache_decodes_through_the_kernel(monkeypatch):
    """Forced ``paged_attention=triton``: decode steps go to the kernel (counted), prefill to SDPA over the
    gathered pages; the logits match the contiguous cache (to fp32 rounding: the kernel sums in another order)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return kernel(*args, **kwargs)

    kernel = kernels.paged_attention
    monkeypatch.setattr(kernels, "paged_attention", counted)
    backends.reload_environment()
    model = tiny_model(layer_pattern="AM").to(DEVICE)
    ids = random_ids(2, 12).to(DEVICE)
    mask = torch.ones(2, 12, dtype=torch.bool, device=DEVICE)
    mask[1, :3] = False
    logits = {}
    for name, policy in [("paged", CachePolicy(page_size=3)), ("contiguous", None)]:
        cache = model.new_cache(2, policy=policy)
        with torch.no_grad(), ops.use_backend(paged_attention="triton"):
            steps = [model(ids[:, :5], cache=cache, attention_mask=mask[:, :5]).logits]
            steps += [model(ids[:, t:t + 1], cache=cache).logits for t in range(5, 12)]
        logits[name] = torch.cat(steps, 1)
    backends.reload_environment()
    assert len(calls) == 7 and calls[0] == (2, 4, 1, 8)
    assert_close_rel(logits["paged"][0], logits["contiguous"][0], rel=1e-5)
    assert_close_rel(logits["paged"][1, 3:], logits["contiguous"][1, 3:], rel=1e-5)


def test_page_offsets_do_not_wrap():
    """fp16 pages 2**30 elements apart: page 4 starts 2**32 elements in, which a 32-bit offset wraps to page 0.
    Only the pages' memory is touched (8 GiB of address space, a few kB of memory)."""
    torch.manual_seed(0)
    shape = (5, 2, 4, 8)
    pages = []
    for _ in range(2):
        t = torch.empty_strided(shape, (2**30, *torch.empty(shape[1:]).stride()), dtype=torch.float16,
                                device=DEVICE)
        t.copy_(torch.randn(shape))
        pages.append(t)
    q = torch.randn(1, 4, 1, 8, device=DEVICE).half()
    table, lengths = torch.tensor([[4, 2]], dtype=torch.int32, device=DEVICE), torch.tensor([7], device=DEVICE)
    got = kernels.paged_attention(q, *pages, table, lengths)
    expected = paged_attention_ref(q.float(), pages[0].float(), pages[1].float(), table, lengths)
    wrapped = paged_attention_ref(q.float(), pages[0].float(), pages[1].float(), table * 0, lengths)
    assert not torch.allclose(expected, wrapped, atol=1e-2)
    assert_close(got.float(), expected, "page 4", rel=1e-2)
