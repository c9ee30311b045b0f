"""Every reference op with packed sequences (``cu_seqlens`` / ``seq_idx``) equals the op run on each sequence
alone, outputs, final states and gradients, for any lengths (empty sequences and chunk-crossing ones included)."""

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.ops.attention import attention_ref
from hybridlm.ops.backends import BackendUnavailable, Plan
from hybridlm.ops.causal_conv1d import causal_conv1d_ref
from hybridlm.ops.compressed_attention import causal_compressed_attention_ref
from hybridlm.ops.linear_attention import causal_linear_attention_ref
from hybridlm.ops.selective_scan import selective_scan_ref
from hybridlm.ops.ssd import ssd_chunk_scan_ref
from tests.helpers import assert_close_rel

lengths_lists = st.lists(st.integers(0, 13), min_size=1, max_size=5).filter(lambda n: sum(n) > 0)


def bounds_of(lengths):
    return torch.tensor([0, *lengths]).cumsum(0)


def run_both(op, lengths, tensors, time_dims, state, seed, **options):
    """``op`` on the packed inputs and on each sequence alone; checks outputs, final states and the gradients
    of a random linear function of both against each other. ``tensors``: name -> packed tensor, ``time_dims``:
    name -> its time axis (absent: shared by all sequences)."""
    generator = torch.Generator().manual_seed(seed)
    leaves = {name: t.clone().requires_grad_() for name, t in {**tensors, "initial_state": state}.items()
              if t is not None}
    cu = bounds_of(lengths).to(tensors[next(iter(tensors))].device)  # (a Triton kernel's test: on its device)
    y, final = op(**leaves, cu_seqlens=cu, **options)
    probe_y, probe_final = (torch.randn(t.shape, generator=generator).to(t.device) for t in (y, final))
    packed_grads = torch.autograd.grad((y * probe_y).sum() + (final * probe_final).sum(), list(leaves.values()))

    out_dim = time_dims["out"]
    ys, finals, total = [], [], 0
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == b:  # an empty sequence: no output, its state passes through
            finals.append(leaves["initial_state"][i] if "initial_state" in leaves else torch.zeros_like(final[i]))
            continue
        piece = {name: t.narrow(time_dims[name], a, b - a) if name in time_dims else t for name, t in leaves.items()}
        if "initial_state" in leaves:
            piece["initial_state"] = leaves["initial_state"][i:i + 1]
        y_alone, final_alone = op(**piece, **options)
        ys.append(y_alone)
        finals.append(final_alone[0])
        total += (y_alone * probe_y.narrow(out_dim, a, b - a)).sum()
    alone_y, alone_final = torch.cat(ys, dim=out_dim), torch.stack(finals)
    total = total + (alone_final * probe_final).sum()
    alone_grads = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)

    assert alone_y.abs().max() > 0 and alone_final.abs().max() > 0
    assert_close_rel(y, alone_y)
    assert_close_rel(final, alone_final)
    assert any(g is not None and g.abs().max() > 0 for g in alone_grads)
    for got, expected in zip(packed_grads, alone_grads):
        expected = torch.zeros_like(got) if expected is None else expected  # e.g. A with one token, no state
        assert_close_rel(got, expected, 1e-5, allow_zero_reference=True)


@settings(max_examples=12)
@given(lengths=lengths_lists, chunk=st.sampled_from([1, 4, 8]), with_state=st.booleans(), seed=st.integers(0, 99))
def test_ssd(lengths, chunk, with_state, seed):
    torch.manual_seed(seed)
    time, heads, groups, dim, dstate = sum(lengths), 4, 2, 3, 5
    tensors = dict(x=torch.randn(1, time, heads, dim), dt=torch.rand(1, time, heads) * 0.5 + 0.05,
                   A=-torch.rand(heads) - 0.3, B=torch.randn(1, time, groups, dstate),
                   C=torch.randn(1, time, groups, dstate), D=torch.randn(heads))
    state = torch.randn(len(lengths), heads, dim, dstate) if with_state else None
    run_both(ssd_chunk_scan_ref, lengths, tensors, dict(x=1, dt=1, B=1, C=1, out=1), state, seed, chunk_size=chunk)


@settings(max_examples=12)
@given(lengths=lengths_lists, chunk=st.sampled_from([1, 4, 16]), with_state=st.booleans(),
       gated=st.booleans(), seed=st.integers(0, 99))
def test_linear_attention(lengths, chunk, with_state, gated, seed):
    torch.manual_seed(seed)
    time, heads, features, dim = sum(lengths), 2, 3, 4
    tensors = dict(q=torch.randn(1, heads, time, features), k=torch.randn(1, heads, time, features),
                   v=torch.randn(1, heads, time, dim),
                   log_decay=-torch.rand(1, heads, time) if gated else None)
    state = torch.randn(len(lengths), heads, dim, features) if with_state else None
    run_both(causal_linear_attention_ref, lengths, tensors, dict(q=2, k=2, v=2, log_decay=2, out=2), state, seed,
             chunk_size=chunk)


@settings(max_examples=12)
@given(lengths=lengths_lists, chunk=st.sampled_from([2, 16]), with_state=st.booleans(), seed=st.integers(0, 99))
def test_selective_scan(lengths, chunk, with_state, seed):
    torch.manual_seed(seed)
    time, dim, dstate = sum(lengths), 6, 4
    tensors = dict(u=torch.randn(1, dim, time), delta=torch.rand(1, dim, time) * 0.5, A=-torch.rand(dim, dstate) - 0.2,
                   B=torch.randn(1, dstate, time), C=torch.randn(1, dstate, time), D=torch.randn(dim),
                   z=torch.randn(1, dim, time), delta_bias=torch.randn(dim) * 0.1)
    state = torch.randn(len(lengths), dim, dstate) if with_state else None
    run_both(selective_scan_ref, lengths, tensors, dict(u=2, delta=2, B=2, C=2, z=2, out=2), state, seed,
             chunk_size=chunk, delta_softplus=True)


def test_selective_scan_blocks_of_time(monkeypatch):
    """Sequences crossing the blocks the scan splits long inputs into."""
    module = importlib.import_module("hybridlm.ops.selective_scan")  # the package's name is the op
    monkeypatch.setattr(module, "_BLOCK_ELEMENTS", 6 * 4 * 4)  # blocks of 4 tokens with chunk 4
    test_selective_scan.hypothesis.inner_test(lengths=[3, 0, 9, 1, 6], chunk=4, with_state=True, seed=5)


@settings(max_examples=12)
@given(lengths=lengths_lists, width=st.sampled_from([2, 4]),
       with_state=st.booleans(), seed=st.integers(0, 99))
def test_causal_conv1d(lengths, width, with_state, seed):
    torch.manual_seed(seed)
    time, channels = sum(lengths), 5
    tensors = dict(x=torch.randn(1, channels, time), weight=torch.randn(channels, width), bias=torch.randn(channels))
    state = torch.randn(len(lengths), channels, width - 1) if with_state else None
    run_both(causal_conv1d_ref, lengths, tensors, dict(x=2, out=2), state, seed, activation="silu")


def compressed_attention(**tensors):
    """The compressed sums as one tensor ``[batch or n_seqs, 2, heads, rank, dim]``, for :func:`run_both`."""
    out, (keys, values) = causal_compressed_attention_ref(**tensors)
    return out, torch.stack([keys, values], dim=1)


@settings(max_examples=10)
@given(lengths=lengths_lists, chunk=st.sampled_from([1, 4, 16]), mean=st.booleans(), seed=st.integers(0, 99))
def test_compressed_attention(lengths, chunk, mean, seed):
    """Linformer's causal form; with ``mean``, each query divides by its own sequence's token count."""
    torch.manual_seed(seed)
    time, heads, dim, rank = sum(lengths), 2, 4, 3
    tensors = dict(q=torch.randn(1, heads, time, dim), k=torch.randn(1, heads, time, dim),
                   v=torch.randn(1, heads, time, dim), e=torch.randn(1, time, rank), f=torch.randn(1, time, rank),
                   normalizer=torch.cat([torch.arange(1, n + 1) for n in lengths])[None].float() if mean else None)
    run_both(compressed_attention, lengths, tensors, dict(q=2, k=2, v=2, e=1, f=1, normalizer=1, out=2), None, seed,
             chunk_size=chunk, scale=0.5)


def test_compressed_attention_packed_takes_no_initial_state():
    q = torch.randn(1, 1, 4, 2)
    sums = (torch.zeros(2, 1, 3, 2), torch.zeros(2, 1, 3, 2))
    with pytest.raises(ValueError, match="no initial_state"):
        causal_compressed_attention_ref(q, q, q, torch.randn(1, 4, 3), torch.randn(1, 4, 3), scale=1.0,
                                        initial_state=sums, cu_seqlens=torch.tensor([0, 1, 4]))


@settings(max_examples=10)
@given(lengths=st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=4), min_size=1, max_size=3)
       .filter(lambda rows: len({sum(r) for r in rows}) == 1), seed=st.integers(0, 99))
def test_attention_seq_idx(lengths, seed):
    """Rows of equal length, each packing its own documents; GQA."""
    torch.manual_seed(seed)
    batch, time = len(lengths), sum(lengths[0])
    q, k, v = torch.randn(batch, 4, time, 8), torch.randn(batch, 2, time, 8), torch.randn(batch, 2, time, 8)
    seq_idx = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths])
    packed = attention_ref(q, k, v, causal=True, seq_idx=seq_idx)
    for row, row_lengths in enumerate(lengths):
        for a, b in zip(bounds_of(row_lengths)[:-1].tolist(), bounds_of(row_lengths)[1:].tolist()):
            alone = attention_ref(*(t[row:row + 1, :, a:b] for t in (q, k, v)), causal=True)
            assert_close_rel(packed[row:row + 1, :, a:b], alone)


def test_attention_seq_idx_with_a_mask_keeps_both():
    q = k = v = torch.randn(1, 2, 6, 4)
    window = torch.ones(6, 6, dtype=torch.bool).tril() & ~torch.ones(6, 6, dtype=torch.bool).tril(-2)  # 2 keys
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1]])
    packed = attention_ref(q, k, v, mask=window, seq_idx=seq_idx)
    for a in (0, 3):
        assert_close_rel(packed[..., a:a + 3, :], attention_ref(q[..., a:a + 3, :], k[..., a:a + 3, :],
                                                                v[..., a:a + 3, :], mask=window[:3, :3]))


def test_packed_input_never_reaches_a_backend_that_cannot_take_it():
    calls = []

    def unpacked_only(x, *, initial_state=None):
        calls.append("fast")
        return x

    def reference(x, *, initial_state=None, cu_seqlens=None):
        calls.append("reference")
        return x

    plan = Plan((unpacked_only,), reference, ("fast", "torch"))
    plan(torch.zeros(1), cu_seqlens=torch.tensor([0, 1]))
    plan(torch.zeros(1))
    assert calls == ["reference", "fast"]
    with pytest.raises(BackendUnavailable, match="cannot take packed sequences"):
        Plan((), unpacked_only, ("fast",))(torch.zeros(1), seq_idx=torch.zeros(1, 1, dtype=torch.long))


def test_attention_seq_idx_must_match_the_tokens():
    q = torch.randn(1, 2, 4, 3)
    with pytest.raises(ValueError, match="seq_idx must be integer"):
        attention_ref(q, q, q, causal=True, seq_idx=torch.zeros(1, 5, dtype=torch.long))
