"""Each pure-PyTorch reference op against the literal recurrence, written out here one step at a time."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import hybridlm.ops.ssd as ssd_module
from hybridlm.ops import cpu_attention, cpu_features, cpu_kernels
from hybridlm.ops.attention import attention_ref
from hybridlm.ops.causal_conv1d import causal_conv1d_ref, causal_conv1d_update_ref
from hybridlm.ops.compressed_attention import causal_compressed_attention_ref
from hybridlm.ops.linear_attention import causal_linear_attention_ref
from hybridlm.ops.selective_scan import _one_decay_per_head, selective_scan_ref, selective_state_update_ref
from hybridlm.ops.ssd import (
    FLUSHED,
    decay_matrix,
    exp_flushed,
    scan_chunk_size,
    scan_slice_tokens,
    segment_sum,
    ssd_chunk_scan_ref,
)
from tests.helpers import assert_close_rel

attention_module = importlib.import_module("hybridlm.ops.attention")  # the module: hybridlm.ops.attention is its op

# --- the literal recurrences ------------------------------------------------------------------------


def naive_selective_scan(u, delta, A, B, C, D, z, h0):
    """h = exp(dt A) h + dt B u;  y = C.h + D u;  y *= silu(z). B, C: [b, g, n, t]; D, z may be None."""
    b, d, t = u.shape
    rep = d // B.shape[1]
    h, ys = h0.clone(), []
    for i in range(t):
        Bi, Ci = B[..., i].repeat_interleave(rep, 1), C[..., i].repeat_interleave(rep, 1)  # [b, d, n]
        h = torch.exp(delta[..., i, None] * A) * h + (delta[..., i] * u[..., i])[..., None] * Bi
        ys.append((h * Ci).sum(-1) + (D * u[..., i] if D is not None else 0))
    y = torch.stack(ys, -1)
    return (y * F.silu(z) if z is not None else y), h


def naive_ssd(x, dt, A, B, C, D, s0):
    """S = exp(dt A) S + dt x (outer) B;  y = S C + D x. Per head; B, C per group."""
    b, t, h, p = x.shape
    rep = h // B.shape[2]
    S, ys = s0.clone(), []
    for i in range(t):
        Bi, Ci = B[:, i].repeat_interleave(rep, 1), C[:, i].repeat_interleave(rep, 1)  # [b, h, n]
        S = torch.exp(dt[:, i, :, None, None] * A[:, None, None]) * S \
            + (dt[:, i, :, None] * x[:, i])[..., None] * Bi[:, :, None, :]
        ys.append((S * Ci[:, :, None, :]).sum(-1) + D[:, None] * x[:, i])
    return torch.stack(ys, 1), S


# --- selective scan (Mamba-1) -------------------------------------------------------------------------


@given(
    batch=st.integers(1, 2), groups=st.sampled_from([1, 2]), dstate=st.integers(1, 5), length=st.integers(1, 45),
    chunk=st.sampled_from([None, 1, 4, 7]), seed=st.integers(0, 2**16),
)
def test_selective_scan_matches_recurrence(batch, groups, dstate, length, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    dim = 4 * groups
    u, delta, z = (torch.randn(batch, dim, length, generator=g) for _ in range(3))
    A = -torch.rand(dim, dstate, generator=g) * 3
    B, C = (torch.randn(batch, groups, dstate, length, generator=g) for _ in range(2))
    D, bias = torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    h0 = torch.randn(batch, dim, dstate, generator=g)
    y, h = selective_scan_ref(u, delta, A, B, C, D, z, delta_bias=bias, delta_softplus=True, initial_state=h0,
                              chunk_size=chunk)
    y_naive, h_naive = naive_selective_scan(u, F.softplus(delta + bias[:, None]), A, B, C, D, z, h0)
    assert_close_rel(y, y_naive)
    assert_close_rel(h, h_naive)


def test_selective_scan_ungrouped_layout_and_gradients():
    """``B [batch, dstate, time]`` equals one group; the gradients equal those of the recurrence."""
    g = torch.Generator().manual_seed(1)
    u, delta = torch.randn(2, 6, 19, generator=g), torch.rand(2, 6, 19, generator=g)
    A, B, C = -torch.rand(6, 3, generator=g), torch.randn(2, 3, 19, generator=g), torch.randn(2, 3, 19, generator=g)
    h0 = torch.randn(2, 6, 3, generator=g)
    inputs = [t.clone().requires_grad_() for t in (u, delta, A, B, C, h0)]
    y, h = selective_scan_ref(*inputs[:5], initial_state=inputs[5], chunk_size=4)
    (y.square().sum() + h.sum()).backward()
    twins = [t.clone().requires_grad_() for t in (u, delta, A, B, C, h0)]
    y2, h2 = naive_selective_scan(*twins[:3], twins[3][:, None], twins[4][:, None], None, None, twins[5])
    (y2.square().sum() + h2.sum()).backward()
    assert_close_rel(y, y2)
    for got, expected in zip(inputs, twins):
        assert_close_rel(got.grad, expected.grad, rel=1e-4)


@pytest.mark.parametrize("groups", [1, 2])
def test_selective_state_update_mamba1_layout(groups):
    g = torch.Generator().manual_seed(2)
    dim, n, steps = 4 * groups, 3, 9
    u, delta, z = (torch.randn(2, dim, steps, generator=g) for _ in range(3))
    A, D = -torch.rand(dim, n, generator=g), torch.randn(dim, generator=g)
    B, C = (torch.randn(2, groups, n, steps, generator=g) for _ in range(2))
    bias, h0 = torch.randn(dim, generator=g), torch.randn(2, dim, n, generator=g)
    state, ys = h0.clone(), []
    for i in range(steps):
        ys.append(selective_state_update_ref(state, u[..., i], delta[..., i], A, B[..., i], C[..., i], D, z[..., i],
                                             dt_bias=bias, dt_softplus=True))
    y_naive, h_naive = naive_selective_scan(u, F.softplus(delta + bias[:, None]), A, B, C, D, z, h0)
    assert_close_rel(torch.stack(ys, -1), y_naive)
    assert_close_rel(state, h_naive)


def test_selective_state_update_mamba2_layout():
    g = torch.Generator().manual_seed(3)
    b, t, h, p, groups, n = 2, 7, 4, 3, 2, 5
    x, dt = torch.randn(b, t, h, p, generator=g), torch.rand(b, t, h, generator=g)
    A, D = -torch.rand(h, generator=g), torch.randn(h, generator=g)
    B, C = (torch.randn(b, t, groups, n, generator=g) for _ in range(2))
    s0 = torch.randn(b, h, p, n, generator=g)
    state, ys = s0.clone(), []
    for i in range(t):
        ys.append(selective_state_update_ref(state, x[:, i], dt[:, i, :, None].expand(b, h, p),
                                             A[:, None, None].expand(h, p, n), B[:, i], C[:, i],
                                             D=D[:, None].expand(h, p)))
    y_naive, s_naive = naive_ssd(x, dt, A, B, C, D, s0)
    assert_close_rel(torch.stack(ys, 1), y_naive)
    assert_close_rel(state, s_naive)


@pytest.mark.parametrize("with_bias", [False, True])
def test_selective_state_update_one_decay_per_head_equals_the_expanded_decay(with_bias):
    """Expanded (stride-0) dt and A take one exp per head: the same state and output, to the bit, as the same
    values laid out in full."""
    g = torch.Generator().manual_seed(4)
    b, h, p, n = 2, 4, 3, 5
    x, dt = torch.randn(b, h, p, generator=g), torch.randn(b, h, generator=g)
    A, D, bias = -torch.rand(h, generator=g), torch.randn(h, generator=g), torch.randn(h, generator=g)
    B, C = (torch.randn(b, 1, n, generator=g) for _ in range(2))
    s0 = torch.randn(b, h, p, n, generator=g)
    tied = (dt[:, :, None].expand(b, h, p), A[:, None, None].expand(h, p, n))
    full = tuple(t.contiguous() for t in tied)
    assert _one_decay_per_head(*tied, None) and not _one_decay_per_head(*full, None)
    kwargs = {"D": D[:, None].expand(h, p), "dt_softplus": with_bias}
    tied_bias = {"dt_bias": bias[:, None].expand(h, p)} if with_bias else {}
    full_bias = {"dt_bias": bias[:, None].expand(h, p).contiguous()} if with_bias else {}
    tied_state, full_state = s0.clone(), s0.clone()
    y_tied = selective_state_update_ref(tied_state, x, *tied, B, C, **kwargs, **tied_bias)
    y_full = selective_state_update_ref(full_state, x, *full, B, C, **kwargs, **full_bias)
    assert torch.equal(y_tied, y_full) and torch.equal(tied_state, full_state)
    assert not torch.equal(tied_state, s0)


# --- SSD (Mamba-2) ------------------------------------------------------------------------------------


@given(
    batch=st.integers(1, 2), groups=st.sampled_from([1, 2]), heads_per_group=st.integers(1, 3),
    head_dim=st.integers(1, 4), dstate=st.integers(1, 5), length=st.integers(1, 40), chunk=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_ssd_matches_recurrence(batch, groups, heads_per_group, head_dim, dstate, length, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    heads = groups * heads_per_group
    x, dt = torch.randn(batch, length, heads, head_dim, generator=g), torch.rand(batch, length, heads, generator=g)
    A, D = -torch.rand(heads, generator=g) * 2, torch.randn(heads, generator=g)
    B, C = (torch.randn(batch, length, groups, dstate, generator=g) for _ in range(2))
    s0 = torch.randn(batch, heads, head_dim, dstate, generator=g)
    y, s = ssd_chunk_scan_ref(x, dt, A, B, C, chunk, D, initial_state=s0)
    y_naive, s_naive = naive_ssd(x, dt, A, B, C, D, s0)
    assert_close_rel(y, y_naive)
    assert_close_rel(s, s_naive)


def test_ssd_with_decays_strong_enough_to_be_flushed_matches_recurrence():
    """Heads whose decay over a chunk falls below FLUSHED (computed as zero) still match the float64 recurrence."""
    g = torch.Generator().manual_seed(5)
    batch, length, heads, head_dim, dstate = 2, 70, 3, 4, 5
    x, dt = torch.randn(batch, length, heads, head_dim, generator=g), torch.rand(batch, length, heads, generator=g)
    A, D = torch.tensor([-0.5, -8.0, -40.0]), torch.randn(heads, generator=g)
    B, C = (torch.randn(batch, length, 1, dstate, generator=g) for _ in range(2))
    s0 = torch.randn(batch, heads, head_dim, dstate, generator=g)
    assert (dt[..., 2] * 40).sum(-1).min() > 200  # far below exp(-80) across a chunk
    y, s = ssd_chunk_scan_ref(x, dt, A, B, C, 32, D, initial_state=s0)
    y_naive, s_naive = naive_ssd(x, dt, A, B, C, D, s0)
    assert_close_rel(y, y_naive)
    assert_close_rel(s, s_naive)


def test_decay_matrix_is_exp_of_segment_sum_with_only_the_tiniest_decays_flushed():
    g = torch.Generator().manual_seed(0)
    x = -torch.rand(6, 64, generator=g) * torch.tensor([0.1, 1.0, 2.0, 4.0, 8.0, 1.0])[:, None]
    x[5, 20] = -torch.inf  # a packed sequence's start: nothing before it reaches past it
    exact = torch.exp(segment_sum(x))
    got = decay_matrix(x)
    kept, flushed = exact > FLUSHED, (exact <= FLUSHED) & (exact > 0)
    assert kept.sum() > 1000 and flushed.sum() > 100  # both kinds occur
    assert torch.equal(got[kept], exact[kept])
    assert (got[~kept] == 0).all()
    assert (got[5, 20:, :20] == 0).all() and (got[5, 19, :20] > 0).all()
    values = torch.tensor([0.0, -1.0, -79.0, -80.5, -87.5, -95.0, -200.0, -torch.inf])
    assert torch.equal(exp_flushed(values), torch.where(values.exp() > FLUSHED, values.exp(), 0.0))


def test_decay_matrix_backward_matches_autograd_through_its_definition():
    g = torch.Generator().manual_seed(1)
    scales = torch.tensor([0.1, 1.0, 3.0, 8.0], dtype=torch.float64)[:, None]
    x = (-torch.rand(4, 48, generator=g, dtype=torch.float64) * scales)
    x[2, 30] = -torch.inf  # a packed sequence's start
    upstream = torch.randn(4, 48, 48, generator=g, dtype=torch.float64)
    ours, = torch.autograd.grad((decay_matrix(x.requires_grad_()) * upstream).sum(), x)
    theirs, = torch.autograd.grad((torch.exp(segment_sum(x)) * upstream).sum(), x)
    assert (ours[:, 1:].abs() > 1e-3).float().mean() > 0.5  # not all zero
    assert torch.equal(ours[:, 0], torch.zeros(4, dtype=torch.float64))  # x[0] never enters a segment sum
    assert_close_rel(ours, theirs, rel=1e-12)
    small = (-torch.rand(2, 7, generator=g, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(decay_matrix, (small,))


def test_cpu_scan_runs_chunks_no_longer_than_its_own():
    cpu = torch.device("cpu")
    assert scan_chunk_size(256, cpu) == 64 and scan_chunk_size(16, cpu) == 16
    assert scan_chunk_size(256, torch.device("meta")) == 256
    g = torch.Generator().manual_seed(2)
    b, t, h, p, n = 1, 150, 2, 3, 4
    x, B, C = (torch.randn(b, t, *shape, generator=g) for shape in ((h, p), (1, n), (1, n)))
    dt, A = torch.rand(b, t, h, generator=g) * 0.5, -torch.rand(h, generator=g)
    D, s0 = torch.randn(h, generator=g), torch.randn(b, h, p, n, generator=g)
    y, s = ssd_chunk_scan_ref(x, dt, A, B, C, 256, D, initial_state=s0)
    y64, s64 = ssd_chunk_scan_ref(x, dt, A, B, C, 64, D, initial_state=s0)
    assert torch.equal(y, y64) and torch.equal(s, s64)
    y_naive, s_naive = naive_ssd(*(v.double() for v in (x, dt, A, B, C, D, s0)))
    assert_close_rel(y, y_naive.float())
    assert_close_rel(s, s_naive.float())


def test_cpu_scan_slices_long_inputs(monkeypatch):
    """A scan longer than a slice chains slices by their states: as the float64 recurrence, with gradients."""
    cpu = torch.device("cpu")
    assert scan_slice_tokens(1, 16, 64, cpu) == 4 * 64 and scan_slice_tokens(1, 2, 64, cpu) == 32 * 64
    assert scan_slice_tokens(1, 16, 64, torch.device("meta")) is None
    monkeypatch.setattr(ssd_module, "CPU_SLICE_CHUNKS", 2)
    monkeypatch.setattr(ssd_module, "CPU_SLICE_ELEMENTS", 1)
    g = torch.Generator().manual_seed(5)
    b, t, h, p, n, chunk = 2, 45, 2, 3, 4, 8  # slices of 16 tokens, the last one short and padded
    assert scan_slice_tokens(b, h, chunk, cpu) == 16
    x = torch.randn(b, t, h, p, generator=g, dtype=torch.float64)
    B, C = (torch.randn(b, t, 1, n, generator=g, dtype=torch.float64) for _ in range(2))
    dt = torch.rand(b, t, h, generator=g, dtype=torch.float64) * 0.5
    A = -torch.rand(h, generator=g, dtype=torch.float64)
    D, s0 = torch.randn(h, generator=g, dtype=torch.float64), torch.randn(b, h, p, n, generator=g, dtype=torch.float64)
    inputs = [v.clone().requires_grad_() for v in (x, dt, A, B, C, D, s0)]
    calls = []
    whole = ssd_module.chunked_decay_scan
    monkeypatch.setattr(ssd_module, "chunked_decay_scan",
                        lambda q, *rest, **options: calls.append(q.shape[1]) or whole(q, *rest, **options))
    y, s = ssd_chunk_scan_ref(*inputs[:5], chunk, inputs[5], initial_state=inputs[6])
    assert calls == [45, 16, 16, 13]
    y_naive, s_naive = naive_ssd(*(v.detach() for v in inputs))
    assert_close_rel(y.double(), y_naive, rel=1e-6)
    assert_close_rel(s.double(), s_naive, rel=1e-6)
    upstream_y, upstream_s = torch.randn(y.shape, generator=g), torch.randn(s.shape, generator=g)
    ours = torch.autograd.grad((y * upstream_y).sum() + (s * upstream_s).sum(), inputs)
    naive_inputs = [v.detach().clone().requires_grad_() for v in inputs]
    y_n, s_n = naive_ssd(*naive_inputs)
    theirs = torch.autograd.grad((y_n * upstream_y.double()).sum() + (s_n * upstream_s.double()).sum(), naive_inputs)
    for mine, reference in zip(ours, theirs):
        assert reference.abs().max() > 1e-3
        assert_close_rel(mine.double(), reference, rel=1e-6)


def test_segment_sum():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = segment_sum(x)
    for i in range(4):
        for j in range(4):
            expected = x[j + 1:i + 1].sum() if j <= i else -torch.inf
            assert out[i, j] == expected


def test_segment_sum_of_strided_log_decays_with_a_sequence_start():
    """A strided input (the scan's head-major view) gives row-major sums; a sum that reaches a log decay of -inf
    (a packed sequence's start) is at most the most negative float, and exp of it is 0; the others are exact."""
    g = torch.Generator().manual_seed(5)
    x = (-torch.rand(6, 3, generator=g)).t()  # [3, 6], strided
    x[1, 3] = -torch.inf
    out = segment_sum(x)
    assert out.is_contiguous()
    for row in range(3):
        for i in range(6):
            for j in range(6):
                part = x[row, j + 1:i + 1]
                if j > i:
                    assert out[row, i, j] == -torch.inf
                elif torch.isinf(part).any():
                    assert out[row, i, j] <= torch.finfo(x.dtype).min and torch.exp(out[row, i, j]) == 0
                else:
                    assert abs(out[row, i, j].item() - part.double().sum().item()) <= 1e-6
    assert (out[1, 3:, :3] <= torch.finfo(x.dtype).min).all() and torch.isfinite(out[0].tril()).all()


# --- causal conv1d ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv1d_gradients_match_the_definition(bias):
    g = torch.Generator().manual_seed(3)
    storage = torch.randn(2, 9, 5, generator=g, dtype=torch.float64)  # time-major, as the mixers' projections
    weight = torch.randn(5, 4, generator=g, dtype=torch.float64)
    b = torch.randn(5, generator=g, dtype=torch.float64) if bias else None
    history = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (storage, weight, history) + ((b,) if bias else ())]

    def ours(storage, weight, history, b=None):
        y, final = causal_conv1d_ref(storage.transpose(1, 2), weight, b, initial_state=history, activation="silu")
        return y, final

    def definition(storage, weight, history, b=None):
        full = torch.cat([history, storage.transpose(1, 2)], -1)
        y = torch.stack([(full[..., t:t + 4] * weight).sum(-1) for t in range(9)], -1)
        return F.silu(y if b is None else y + b[:, None]), full[..., -3:]

    upstream = torch.randn(2, 5, 9, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((ours(*leaves)[0] * upstream).sum(), leaves)
    expected = torch.autograd.grad((definition(*leaves)[0] * upstream).sum(), leaves)
    for a, e in zip(got, expected):
        assert_close_rel(a, e, rel=1e-12)
    assert torch.autograd.gradcheck(lambda *t: ours(*t)[0], leaves)


def test_causal_conv1d_of_bf16_sums_its_taps_in_fp32():
    g = torch.Generator().manual_seed(4)
    x, weight, bias = torch.randn(1, 16, 64, generator=g), torch.randn(16, 4, generator=g), torch.randn(16, generator=g)
    x, weight, bias = (t.bfloat16() for t in (x, weight, bias))
    y, final = causal_conv1d_ref(x, weight, bias)
    exact, _ = causal_conv1d_ref(x.double(), weight.double(), bias.double())
    assert y.dtype == final.dtype == torch.bfloat16
    assert torch.equal(y, exact.bfloat16())  # one rounding, of the fp32 sum (exact here to fp32's precision)
    assert torch.equal(final, x[..., -3:])


@given(width=st.integers(1, 5), length=st.integers(1, 12), activation=st.sampled_from([None, "silu"]),
       seed=st.integers(0, 2**16))
def test_causal_conv1d_matches_definition(width, length, activation, seed):
    g = torch.Generator().manual_seed(seed)
    x, w, bias = torch.randn(2, 3, length, generator=g), torch.randn(3, width, generator=g), torch.randn(3, generator=g)
    history = torch.randn(2, 3, width - 1, generator=g)
    y, final = causal_conv1d_ref(x, w, bias, initial_state=history, activation=activation)
    full = torch.cat([history, x], -1)
    expected = torch.stack([(full[..., t:t + width] * w).sum(-1) + bias for t in range(length)], -1)
    if activation == "silu":
        expected = F.silu(expected)
    assert_close_rel(y, expected)
    assert torch.equal(final, full[..., full.shape[-1] - (width - 1):])
    window, steps = history.clone(), []
    for t in range(length):
        steps.append(causal_conv1d_update_ref(x[..., t], window, w, bias, activation=activation))
    assert_close_rel(torch.stack(steps, -1), expected)
    assert torch.equal(window, final)


def test_causal_conv1d_rejects_bad_weight():
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_ref(torch.randn(1, 3, 5), torch.randn(4, 2))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_ref(torch.randn(1, 3, 5), torch.randn(3, 2), activation="relu")


# --- linear and compressed attention ------------------------------------------------------------------


@given(length=st.integers(1, 30), chunk=st.sampled_from([1, 5, 64]), decay=st.booleans(), seed=st.integers(0, 2**16))
def test_causal_linear_attention_matches_recurrence(length, chunk, decay, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 3, length, 4, generator=g) for _ in range(2))
    v, s0 = torch.randn(2, 3, length, 5, generator=g), torch.randn(2, 3, 5, 4, generator=g)
    log_decay = -torch.rand(2, 3, length, generator=g) if decay else None
    out, final = causal_linear_attention_ref(q, k, v, log_decay, initial_state=s0, chunk_size=chunk)
    S, outs = s0.clone(), []
    for t in range(length):
        if decay:
            S = S * torch.exp(log_decay[:, :, t, None, None])
        S = S + v[:, :, t, :, None] * k[:, :, t, None, :]
        outs.append((S * q[:, :, t, None, :]).sum(-1))
    assert_close_rel(out, torch.stack(outs, 2))
    assert_close_rel(final, S)


@given(length=st.integers(1, 30), chunk=st.sampled_from([1, 6, 64]), seed=st.integers(0, 2**16))
def test_causal_compressed_attention_matches_recurrence(length, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, length, 4, generator=g) for _ in range(3))
    e, f = (torch.randn(2, length, 5, generator=g) for _ in range(2))
    keys0, values0 = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(2))
    out, (keys, values) = causal_compressed_attention_ref(q, k, v, e, f, scale=0.5, initial_state=(keys0, values0),
                                                          chunk_size=chunk)
    K, V, outs = keys0.clone(), values0.clone(), []
    for t in range(length):
        K = K + e[:, None, t, :, None] * k[:, :, t, None, :]
        V = V + f[:, None, t, :, None] * v[:, :, t, None, :]
        weights = torch.softmax((K * q[:, :, t, None, :]).sum(-1) * 0.5, -1)
        outs.append((weights[..., None] * V).sum(-2))
    assert_close_rel(out, torch.stack(outs, 2))
    assert_close_rel(keys, K)
    assert_close_rel(values, V)


def test_attention_ref_gqa_and_mask_match_softmax():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g)
    mask = torch.rand(2, 1, 5, 7, generator=g) > 0.3
    mask[..., 0] = True
    out = attention_ref(q, k, v, mask=mask)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ kk.transpose(-1, -2) / 8**0.5).masked_fill(~mask, -torch.inf)
    assert_close_rel(out, scores.softmax(-1) @ vv)
    with pytest.raises(ValueError, match="heads"):
        attention_ref(torch.randn(1, 3, 2, 4), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    with pytest.raises(ValueError, match="as many queries as keys"):
        attention_ref(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), causal=True)


@given(q_heads_per_kv=st.sampled_from([1, 3]), queries=st.sampled_from([1, 2, 5]),
       mask_kind=st.sampled_from(["none", "shared", "per_head"]), dtype=st.sampled_from(["bfloat16", "float16"]),
       key_chunk=st.sampled_from([1024, 8, 1]), kernel=st.booleans(), seed=st.integers(0, 2**16))
def test_reduced_precision_decode_attention_on_cpu_is_fp32_sdpa_rounded_once(q_heads_per_kv, queries, mask_kind,
                                                                              dtype, key_chunk, kernel, seed):
    """A CPU fp16 attention of a few queries, or a bf16 one without AMX-BF16, is written out in fp32
    (SDPA's CPU kernel is several times slower there): it is the exact attention of the same inputs rounded once
    to the model dtype, whether the keys are copied to fp32 whole or in pieces (37 keys: 1 piece, 5 pieces of 8,
    or at most ``MAX_KEY_CHUNKS`` = 4 pieces of 10), or, in bf16, read by our kernel (``kernel``, where a compiler
    builds it) without copies. Both cases are forced here, whatever this CPU has."""
    from hybridlm.ops.attention import FEW_QUERY_ROWS

    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    kv_heads, length = 2, 37
    q = torch.randn(2, kv_heads * q_heads_per_kv, queries, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, kv_heads, length, 16, generator=g).to(dtype) for _ in range(2))
    heads = {"none": None, "shared": 1, "per_head": q.shape[1]}[mask_kind]
    mask = None if heads is None else torch.rand(2, heads, queries, length, generator=g) > 0.4
    if mask is not None:
        mask[..., 0] = True
    assert q.shape[1] // kv_heads * queries <= FEW_QUERY_ROWS
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_module, "CPU_HAS_AMX_BF16", False)
        patch.setattr(attention_module, "FP32_KEY_CHUNK", key_chunk)
        patch.setattr(attention_module, "MAX_KEY_CHUNKS", 4)
        patch.setattr(cpu_attention, "KERNEL_AVAILABLE", kernel and cpu_attention.KERNEL_AVAILABLE)
        out = attention_ref(q, k, v, mask=mask, scale=0.3)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.3,
                                           enable_gqa=True)
    assert out.dtype == dtype and exact.abs().max() > 0.1
    # one rounding to the model dtype (at most one unit in its last place), plus fp32's own few ulps
    torch.testing.assert_close(out.double(), exact, rtol=torch.finfo(dtype).eps, atol=1e-6)
    assert (out == exact.to(dtype)).float().mean() > 0.9  # mostly the correctly rounded value itself

    many = torch.randn(1, 4, FEW_QUERY_ROWS, 16, generator=g).to(dtype)  # 2 heads a group x 16 queries: SDPA
    keys = torch.randn(1, 2, FEW_QUERY_ROWS, 16, generator=g).to(dtype)
    assert torch.equal(attention_ref(many, keys, keys),
                       F.scaled_dot_product_attention(many, keys, keys, enable_gqa=True))


@pytest.mark.parametrize("amx_bf16", [True, False])
def test_cpu_decode_attention_takes_sdpa_only_where_its_kernel_is_fast(amx_bf16, monkeypatch):
    """With AMX-BF16, a bf16 decode attention is SDPA's own (bit for bit); fp16, and bf16 without
    AMX-BF16, take the fp32 written-out attention, which differs from SDPA's rounding on these inputs (bf16: our
    kernel where it is built, the written-out one where not)."""
    monkeypatch.setattr(attention_module, "CPU_HAS_AMX_BF16", amx_bf16)
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(1, 6, 1, 64, generator=g).to(dtype)
        k, v = (torch.randn(1, 2, 300, 64, generator=g).to(dtype) for _ in range(2))
        sdpa = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        fp32 = attention_module._fp32_grouped_attention(q, k, v, None, None)
        assert not torch.equal(sdpa, fp32)  # the inputs tell the two apart
        expected = sdpa if dtype == torch.bfloat16 and amx_bf16 else fp32
        with monkeypatch.context() as patch:
            patch.setattr(cpu_attention, "KERNEL_AVAILABLE", False)
            assert torch.equal(attention_ref(q, k, v), expected)
        if dtype == torch.bfloat16 and not amx_bf16 and cpu_attention.KERNEL_AVAILABLE:
            expected = cpu_kernels.grouped_attention(q, k, v)
        assert torch.equal(attention_ref(q, k, v), expected)


@pytest.mark.parametrize(("key_chunk", "most", "pieces"), [(1024, 16, 1), (8, 16, 5), (1, 4, 4), (37, 16, 1)])
def test_written_out_attention_copies_the_keys_to_fp32_in_pieces(key_chunk, most, pieces, monkeypatch):
    """37 keys in pieces of ``FP32_KEY_CHUNK``, at most ``MAX_KEY_CHUNKS`` of them: one product of the queries
    with each piece's keys and one of the probabilities with its values, summed; equal to the whole copy up to
    fp32's summation order."""
    monkeypatch.setattr(attention_module, "FP32_KEY_CHUNK", key_chunk)
    monkeypatch.setattr(attention_module, "MAX_KEY_CHUNKS", most)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 6, 1, 16, generator=g).bfloat16()
    k, v = (torch.randn(2, 2, 37, 16, generator=g).bfloat16() for _ in range(2))
    products, matmul = [], torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: products.append(b.shape[-2:]) or matmul(a, b))
    out = attention_module._fp32_grouped_attention(q, k, v, None, 0.3)
    monkeypatch.undo()
    assert len(products) == 2 * pieces and sum(shape[-1] for shape in products[:pieces]) == 37
    whole = attention_module._fp32_grouped_attention(q, k, v, None, 0.3)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.3, enable_gqa=True)
    assert exact.abs().max() > 0.1
    torch.testing.assert_close(out.double(), exact, rtol=torch.finfo(torch.bfloat16).eps, atol=1e-6)
    assert (out.float() - whole.float()).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * exact.abs().max()
    if pieces == 1:  # the operations of a single fp32 copy, bit for bit
        queries = q.float().reshape(2, 2, 3, 16)
        one_copy = torch.matmul((torch.matmul(queries, k.float().transpose(-1, -2)) * 0.3).softmax(-1), v.float())
        assert torch.equal(out, one_copy.reshape(2, 6, 1, 16).bfloat16())


def test_cpu_features_are_read_from_torchs_cpu_capabilities_and_are_absent_without_them(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": True, "avx512_bf16": True},
                        raising=False)
    assert cpu_features.cpu_has_amx_bf16()
    assert cpu_features.dtypes_without_cpu_products() == {torch.float16}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": False, "avx512_bf16": True,
                                                                "avx512_fp16": True})
    assert not cpu_features.cpu_has_amx_bf16()
    assert cpu_features.dtypes_without_cpu_products() == set()
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})
    assert cpu_features.dtypes_without_cpu_products() == {torch.bfloat16, torch.float16}
    monkeypatch.delattr(torch.cpu, "get_capabilities")  # an older torch: torch's own paths everywhere
    assert not cpu_features.cpu_has_amx_bf16()
    assert cpu_features.dtypes_without_cpu_products() == set()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_reduced_precision_decode_attention_is_fp32_sdpa_rounded_once(dtype, monkeypatch):
    """Compiled (as in a compiled decode step), the written-out attention is still the exact attention of its inputs
    rounded once, its keys copied to fp32 in pieces."""
    monkeypatch.setattr(attention_module, "CPU_HAS_AMX_BF16", False)
    monkeypatch.setattr(attention_module, "FP32_KEY_CHUNK", 16)  # 41 keys in 3 pieces
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 1, 16, generator=g).to(dtype)  # 3 query heads per key/value head, one query
    k, v = (torch.randn(2, 2, 41, 16, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(2, 6, 1, 41, generator=g) > 0.3
    mask[..., 0] = True
    out = torch.compile(attention_ref, fullgraph=True, dynamic=False)(q, k, v, mask=mask, scale=0.3)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.3,
                                           enable_gqa=True)
    assert out.dtype == dtype and exact.abs().max() > 0.1
    torch.testing.assert_close(out.double(), exact, rtol=torch.finfo(dtype).eps, atol=1e-6)
    assert (out == exact.to(dtype)).float().mean() > 0.9
