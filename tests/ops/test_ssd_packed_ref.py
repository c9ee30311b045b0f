"""The reference SSD on packed variable-length batches (``seq_idx`` / ``cu_seqlens``)."""

import pytest
import torch

from hybridlm.ops.ssd import ssd_chunk_scan_ref


def literal_ssd(x, dt, A, B, C, D, state):
    """One sequence, step by step: ``S = exp(dt A) S + dt x (outer) B``, ``y = S C + D x``. ``x [time, heads,
    dim]``, ``B, C [time, groups, dstate]``, ``state [heads, dim, dstate]``."""
    rep = x.shape[1] // B.shape[1]
    ys = []
    for t in range(x.shape[0]):
        Bt, Ct = B[t].repeat_interleave(rep, 0), C[t].repeat_interleave(rep, 0)  # [heads, dstate]
        state = torch.exp(dt[t] * A)[:, None, None] * state + (dt[t, :, None] * x[t])[..., None] * Bt[:, None]
        ys.append((state * Ct[:, None]).sum(-1) + D[:, None] * x[t])
    return torch.stack(ys) if ys else x.new_zeros(0, *x.shape[1:]), state


def packed_inputs(lengths, heads=4, groups=2, dim=3, dstate=5, seed=0):
    torch.manual_seed(seed)
    time = sum(lengths)
    return dict(
        x=torch.randn(1, time, heads, dim), dt=torch.rand(1, time, heads) * 0.5 + 0.05, A=-torch.rand(heads) - 0.3,
        B=torch.randn(1, time, groups, dstate), C=torch.randn(1, time, groups, dstate), D=torch.randn(heads),
        initial_state=torch.randn(len(lengths), heads, dim, dstate),
    )


def test_packed_scan_runs_each_sequence_from_its_own_state():
    lengths = [5, 0, 11, 1, 7]  # an empty sequence, lengths off the chunk grid
    inputs = packed_inputs(lengths)
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    y, final = ssd_chunk_scan_ref(**inputs, chunk_size=4, cu_seqlens=cu_seqlens)
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        y_alone, final_alone = literal_ssd(
            inputs["x"][0, start:end], inputs["dt"][0, start:end], inputs["A"], inputs["B"][0, start:end],
            inputs["C"][0, start:end], inputs["D"], inputs["initial_state"][i],
        )
        torch.testing.assert_close(y[0, start:end], y_alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[i], final_alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final[1], inputs["initial_state"][1], rtol=0, atol=0)


def test_seq_idx_and_cu_seqlens_describe_the_same_packing():
    lengths = [3, 6, 2]
    inputs = packed_inputs(lengths, seed=1)
    cu_seqlens = torch.tensor([0, 3, 9, 11])
    seq_idx = torch.tensor([[0] * 3 + [1] * 6 + [2] * 2])
    by_bounds = ssd_chunk_scan_ref(**inputs, chunk_size=4, cu_seqlens=cu_seqlens)
    by_index = ssd_chunk_scan_ref(**inputs, chunk_size=4, seq_idx=seq_idx)
    by_both = ssd_chunk_scan_ref(**inputs, chunk_size=4, seq_idx=seq_idx, cu_seqlens=cu_seqlens)
    for a, b, c in zip(by_bounds, by_index, by_both):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("packing", "message"),
    [
        (dict(cu_seqlens=torch.tensor([0, 3, 10])), "cu_seqlens must rise"),
        (dict(cu_seqlens=torch.tensor([1, 3, 11])), "cu_seqlens must rise"),
        (dict(cu_seqlens=torch.tensor([0, 6, 3, 11])), "cu_seqlens must rise"),
        (dict(seq_idx=torch.tensor([[0] * 3 + [2] * 8])), "without gaps"),
        (dict(seq_idx=torch.tensor([[1] * 11])), "without gaps"),
        (dict(seq_idx=torch.zeros(1, 10, dtype=torch.long)), "seq_idx must be integer"),
        (dict(seq_idx=torch.tensor([[0] * 5 + [1] * 6]), cu_seqlens=torch.tensor([0, 3, 11])), "disagree"),
        (dict(cu_seqlens=torch.tensor([0, 11])), "1 packed sequences but 2 initial states"),
    ],
)
def test_bad_packing_is_named(packing, message):
    inputs = packed_inputs([3, 8])
    with pytest.raises(ValueError, match=message):
        ssd_chunk_scan_ref(**inputs, chunk_size=4, **packing)


def test_packing_needs_batch_one():
    inputs = packed_inputs([3, 8])
    batched = {k: v.expand(2, *v.shape[1:]) if k in ("x", "dt", "B", "C") else v for k, v in inputs.items()}
    with pytest.raises(ValueError, match="batch size 1"):
        ssd_chunk_scan_ref(**batched, chunk_size=4, cu_seqlens=torch.tensor([0, 3, 11]))
