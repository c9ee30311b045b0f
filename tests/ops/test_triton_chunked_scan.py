"""Triton SSD and linear-attention kernels (one chunked scan) against the PyTorch references."""

import importlib

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridlm.ops.linear_attention import causal_linear_attention_ref
from hybridlm.ops.ssd import ssd_chunk_scan_ref

from .triton_support import DEVICE, check_against_reference, kernels, new_buffer, poisoned_outputs, randn, uniform


def ssd_inputs(batch, length, groups, heads, head_dim, dstate, with_state, d_kind):
    return dict(
        x=randn(batch, length, heads, head_dim), dt=uniform(batch, length, heads, low=0.05, high=0.6),
        A=-uniform(heads, low=0.3, high=1.5), B=randn(batch, length, groups, dstate),
        C=randn(batch, length, groups, dstate),
        D={None: None, "head": randn(heads), "channel": randn(heads, head_dim)}[d_kind],
        initial_state=randn(batch, heads, head_dim, dstate) if with_state else None,
    )


@settings(max_examples=8)
@given(
    batch=st.integers(1, 2), length=st.integers(1, 24), groups=st.sampled_from([1, 2]),
    heads_per_group=st.sampled_from([1, 2]), head_dim=st.integers(1, 8), dstate=st.integers(1, 8),
    chunk=st.sampled_from([5, 8, 16]), with_state=st.booleans(), d_kind=st.sampled_from([None, "head", "channel"]),
)
@example(batch=2, length=37, groups=2, heads_per_group=2, head_dim=5, dstate=6, chunk=8, with_state=True,
         d_kind="head")
def test_ssd_matches_reference(batch, length, groups, heads_per_group, head_dim, dstate, chunk, with_state, d_kind):
    torch.manual_seed(0)
    inputs = ssd_inputs(batch, length, groups, groups * heads_per_group, head_dim, dstate, with_state, d_kind)
    check_against_reference(kernels.ssd_chunk_scan, ssd_chunk_scan_ref, inputs, chunk_size=chunk)


@pytest.mark.parametrize("packing", ["cu_seqlens", "seq_idx"])
def test_packed_ssd_equals_each_sequence_alone(packing):
    """One packed batch (an empty sequence, lengths off the chunk grid) against the reference, which runs each
    sequence alone from its own initial state."""
    torch.manual_seed(1)
    lengths = [5, 11, 0, 7] if packing == "cu_seqlens" else [5, 11, 7]
    bounds = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    inputs = ssd_inputs(1, int(bounds[-1]), 2, 4, 3, 5, False, "head")
    inputs["initial_state"] = randn(len(lengths), 4, 3, 5)
    if packing == "cu_seqlens":
        inputs["cu_seqlens"] = bounds
    else:
        inputs["seq_idx"] = torch.repeat_interleave(torch.arange(len(lengths), device=DEVICE),
                                                    torch.tensor(lengths, device=DEVICE))[None]
    check_against_reference(kernels.ssd_chunk_scan, ssd_chunk_scan_ref, inputs, chunk_size=4)


def test_bf16_inputs_keep_their_dtype():
    """bf16 in, bf16 out (and bf16 gradients), fp32 states, within a few bf16 roundings of the reference."""
    torch.manual_seed(4)
    inputs = ssd_inputs(1, 19, 1, 2, 4, 8, True, "head")
    inputs = {k: v.bfloat16() if k in ("x", "dt", "B", "C") else v for k, v in inputs.items()}
    y, final = check_against_reference(kernels.ssd_chunk_scan, ssd_chunk_scan_ref, inputs, rel=1e-2, chunk_size=8)
    assert (y.dtype, final.dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("decay", [False, True])
def test_linear_attention_matches_reference(decay):
    torch.manual_seed(2)
    batch, heads, length, features, dim = 2, 2, 21, 6, 5
    inputs = dict(
        q=uniform(batch, heads, length, features, low=0.0, high=1.0),
        k=uniform(batch, heads, length, features, low=0.0, high=1.0), v=randn(batch, heads, length, dim),
        log_decay=-uniform(batch, heads, length, low=0.0, high=0.5) if decay else None,
        initial_state=randn(batch, heads, dim, features).abs(),
    )
    check_against_reference(kernels.causal_linear_attention, causal_linear_attention_ref, inputs, chunk_size=8)


def test_decode_steps_equal_the_chunked_scan():
    """Mamba-2 decode: the state update kernel token by token (raw dt through dt_bias and softplus, broadcast
    A and D as the mixer passes them) ends where the chunked scan over the whole sequence ends."""
    torch.manual_seed(3)
    batch, length, groups, heads, head_dim, dstate = 2, 9, 2, 4, 3, 5
    inputs = ssd_inputs(batch, length, groups, heads, head_dim, dstate, True, "head")
    raw_dt, dt_bias = randn(batch, length, heads), randn(heads, scale=0.5)
    dt = torch.nn.functional.softplus(raw_dt + dt_bias)
    y_scan, final = kernels.ssd_chunk_scan(**{**inputs, "dt": dt}, chunk_size=4)

    state = inputs["initial_state"].clone()
    expand = (heads, head_dim)
    steps = [
        kernels.selective_state_update(
            state, inputs["x"][:, t], raw_dt[:, t, :, None].expand(batch, *expand),
            inputs["A"][:, None, None].expand(*expand, dstate), inputs["B"][:, t], inputs["C"][:, t],
            D=inputs["D"][:, None].expand(*expand), dt_bias=dt_bias[:, None].expand(*expand), dt_softplus=True,
        )
        for t in range(length)
    ]
    torch.testing.assert_close(torch.stack(steps, 1), y_scan, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, final, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_named():
    x, dt, A, B, C = randn(1, 6, 2, 3), randn(1, 6, 2), randn(2), randn(1, 6, 1, 4), randn(1, 6, 1, 4)
    with pytest.raises(ValueError, match="initial_state"):
        kernels.ssd_chunk_scan(x, dt, A, B, C, 4, initial_state=randn(2, 2, 3, 4))
    with pytest.raises(ValueError, match="batch size 1"):
        kernels.ssd_chunk_scan(x.expand(2, -1, -1, -1), dt.expand(2, -1, -1), A, B.expand(2, -1, -1, -1),
                               C.expand(2, -1, -1, -1), 4, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="disagree"):
        kernels.ssd_chunk_scan(x, dt[:, :5], A, B, C, 4)
    with pytest.raises(ValueError, match="chunk_size"):
        kernels.ssd_chunk_scan(x, dt, A, B, C, 0)



def test_poisoning_reaches_the_kernel_buffers():
    """The NaN checks are only as good as the poisoning: a buffer a kernel must fill starts as NaN."""
    with poisoned_outputs():
        assert new_buffer((4, 3), randn(1)).isnan().all()


def test_no_tokens_keep_the_initial_state():
    state = randn(2, 2, 3, 4)
    with poisoned_outputs():
        y, final = kernels.ssd_chunk_scan(randn(2, 0, 2, 3), randn(2, 0, 2), randn(2), randn(2, 0, 1, 4),
                                          randn(2, 0, 1, 4), 4, initial_state=state)
    assert y.shape == (2, 0, 2, 3)
    torch.testing.assert_close(final, state, rtol=0, atol=0)


def test_state_dimensions_above_one_block():
    """dstate and head_dim above the kernels' K block (64): the state dimension is looped over in blocks, the last
    one partly masked (dstate 80 = 64 + 16), forward and every gradient."""
    torch.manual_seed(5)
    inputs = ssd_inputs(1, 10, 1, 2, 72, 80, True, "head")
    inputs["B"], inputs["C"] = inputs["B"] * 80**-0.5, inputs["C"] * 80**-0.5
    check_against_reference(kernels.ssd_chunk_scan, ssd_chunk_scan_ref, inputs, chunk_size=4)


def listed_chunks(sequences, chunk):
    """The chunk table ``[row, start, end]`` and ``[first, last]`` per sequence ``(row, start, end)``, by a loop."""
    rows, starts, ends, first, last = [], [], [], [], []
    for row, start, end in sequences:
        first.append(len(starts))
        for s in range(start, end, chunk):
            rows.append(row), starts.append(s), ends.append(min(s + chunk, end))
        last.append(len(starts))
    return [rows, starts, ends], [first, last]


@pytest.mark.parametrize("batch,time,chunk", [(1, 1, 1), (3, 10, 4), (2, 8, 8), (2, 0, 1), (1, 7, 16)])
def test_fixed_length_chunk_table_built_on_the_device_equals_the_listed_one(batch, time, chunk):
    built = kernels.chunked_scan.uniform_chunks(batch, time, chunk, DEVICE)
    table, seqs = listed_chunks([(b, 0, time) for b in range(batch)], chunk)
    assert built.table.dtype == built.seqs.dtype == torch.int32 and built.size == chunk
    assert built.table.tolist() == (table if table[0] else [[], [], []]) and built.seqs.tolist() == seqs


@pytest.mark.parametrize("lengths,chunk", [([5, 11, 0, 7], 4), ([0], 3), ([3], 8), ([8, 8], 4), ([1, 0, 0, 9], 3)])
def test_packed_chunk_table_built_on_the_device_equals_the_listed_one(lengths, chunk):
    """From ``cu_seqlens`` on the device: the listed chunks, then spare empty ones (start = end = time) up to the
    capacity ``time // chunk + n_seqs``, owned by no sequence."""
    bounds = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    time = int(bounds[-1])
    built = kernels.chunked_scan.packed_chunks(bounds, chunk, time)
    (rows, starts, ends), seqs = listed_chunks([(0, a, b) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())],
                                               chunk)
    spare = time // chunk + len(lengths) - len(starts)
    assert spare >= 0 and built.table.dtype == built.seqs.dtype == torch.int32
    assert built.table.tolist() == [rows + [0] * spare, starts + [time] * spare, ends + [time] * spare]
    assert built.seqs.tolist() == seqs


def test_packed_ssd_while_capturing_reads_cu_seqlens_on_the_device_only(monkeypatch):
    """Under CUDA-graph capture (simulated here: the check is what changes) ``cu_seqlens`` is never copied to the
    host, and the result still equals the reference's, gradients included; a malformed one is still named."""
    chunks = importlib.import_module("hybridlm.ops.triton.chunks")
    monkeypatch.setattr(chunks, "_capturing", lambda device: True)
    monkeypatch.setattr(chunks, "packed_sequences", lambda *a, **k: pytest.fail("cu_seqlens read on the host"))
    torch.manual_seed(8)
    lengths = [6, 0, 9, 3]
    inputs = ssd_inputs(1, sum(lengths), 1, 2, 3, 4, False, "head")
    inputs["initial_state"] = randn(len(lengths), 2, 3, 4)
    inputs["cu_seqlens"] = torch.tensor([0, *lengths], device=DEVICE).cumsum(0).int()
    check_against_reference(kernels.ssd_chunk_scan, ssd_chunk_scan_ref, inputs, chunk_size=4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kernels.ssd_chunk_scan(**{**inputs, "cu_seqlens": inputs["cu_seqlens"][None]}, chunk_size=4)


def test_chunk_scores_are_the_causal_half_of_q_k_per_group():
    """C.B^T once per chunk and group (the products every head of the group reads): the causal half of
    ``q k^T`` inside each chunk, in float64 by an einsum; a short last chunk's unused rows are never read."""
    torch.manual_seed(6)
    chunked_scan = kernels.chunked_scan
    batch, time, groups, dk, chunk = 2, 45, 2, 40, 24  # two K blocks of 32 in fp32; the last chunk 21 tokens
    q, k = randn(batch, time, groups, dk), randn(batch, time, groups, dk)
    chunks = chunked_scan.uniform_chunks(batch, time, chunk, DEVICE)
    scores = chunked_scan.chunk_scores(q, k, chunks)
    assert scores.shape == (4, groups, chunk, chunk)
    for c, (row, start, end) in enumerate(chunks.table.T.tolist()):
        qc, kc = q[row, start:end].double(), k[row, start:end].double()
        expected = torch.einsum("ign,jgn->gij", qc, kc).tril().float()
        got = scores[c, :, : end - start, : end - start].tril()
        assert expected.abs().max() > 1
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_fp32_tiles_narrower_than_the_chunk():
    """A chunk of 48 tokens in fp32: score tiles of 32 columns inside output tiles of 64 rows, dstate 40 in two
    K blocks of 32, four heads per group reading one set of scores (forward and every gradient)."""
    torch.manual_seed(7)
    chunked_scan = kernels.chunked_scan
    assert chunked_scan._score_blocks(48, 40, randn(1)) == (32, 32)
    assert chunked_scan._score_blocks(48, 40, randn(1).bfloat16()) == (64, 64)
    inputs = ssd_inputs(1, 70, 1, 4, 3, 40, True, "channel")
    inputs["B"], inputs["C"] = inputs["B"] * 40**-0.5, inputs["C"] * 40**-0.5
    check_against_reference(kernels.ssd_chunk_scan, ssd_chunk_scan_ref, inputs, chunk_size=48)


def test_chunk_scan_dots_are_output_rows_before_the_row_scale_dotted_with_their_group_row():
    """``dot_with`` (the backward's q.dq, k.dk, x.dv): each output row before the row scale, dotted with the row
    of its head's group, summed over two value blocks (80 = 64 + 16); in float64 by an einsum."""
    torch.manual_seed(9)
    chunked_scan = kernels.chunked_scan
    batch, time, groups, heads, dk, dv, chunk = 1, 11, 2, 4, 8, 80, 4
    q, k = randn(batch, time, groups, dk), randn(batch, time, groups, dk)
    v, r = randn(batch, time, heads, dv), randn(batch, time, groups, dv)
    chunks = chunked_scan.uniform_chunks(batch, time, chunk, DEVICE)
    g_cum = chunked_scan.chunk_cumsum(-uniform(batch, time, heads, low=0.1, high=0.5), chunks)
    states, scale = randn(chunks.count, heads, dv, dk), uniform(batch, time, heads, low=0.5, high=1.5)
    plain = chunked_scan.chunk_scan(q, k, v, states, g_cum, chunks)
    with poisoned_outputs():
        out, dots = chunked_scan.chunk_scan(q, k, v, states, g_cum, chunks, scale=scale, scale_rows=True,
                                            dot_with=r)
    by_group = plain.double().view(batch, time, groups, heads // groups, dv)  # head h = group * 2 + e
    expected = torch.einsum("btgep,btgp->btge", by_group, r.double()).flatten(2)
    assert expected.abs().max() > 1
    torch.testing.assert_close(dots, expected.float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out, plain * scale[..., None], rtol=1e-6, atol=1e-6)
