"""The chunked gated delta rule against the literal recurrence, one step at a time, in float64."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridlm.ops.delta_rule as delta_rule_module
import hybridlm.ops.ssd as ssd_module
from hybridlm.ops.delta_rule import gated_delta_rule_ref, gated_delta_rule_step_ref
from tests.helpers import assert_close_rel


def naive_delta_rule(q, k, v, g, beta, scale, S0):
    """S = alpha S (I - beta k k^T) + beta v k^T with S [dim_v, dim_k] (the paper's form);  o = S q scale."""
    heads = v.shape[2]
    group = heads // q.shape[2]
    q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
    S = S0.transpose(-1, -2).clone()  # [b, h, dim_v, dim_k]
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(q.shape[1]):
        kt, bt = k[:, t], beta[:, t, :, None, None]  # [b, h, dim_k], [b, h, 1, 1]
        alpha = torch.exp(g[:, t])
        alpha = torch.diag_embed(alpha) if g.dim() == 4 else alpha[..., None, None] * eye  # [b, h, dim_k, dim_k]
        S = S @ alpha @ (eye - bt * kt[..., :, None] * kt[..., None, :]) + bt * v[:, t, ..., None] * kt[..., None, :]
        outs.append(S @ (q[:, t] * scale)[..., None])
    return torch.stack(outs, 1).squeeze(-1), S.transpose(-1, -2)


def random_inputs(batch, time, key_heads, group, dim_k, dim_v, channelwise, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    heads = key_heads * group
    q = torch.randn(batch, time, key_heads, dim_k, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(batch, time, key_heads, dim_k, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(batch, time, heads, dim_v, generator=g, dtype=dtype)
    gate_shape = (batch, time, heads, dim_k) if channelwise else (batch, time, heads)
    log_gate = -torch.rand(*gate_shape, generator=g, dtype=dtype) * 0.7
    beta = torch.rand(batch, time, heads, generator=g, dtype=dtype)
    S0 = torch.randn(batch, heads, dim_k, dim_v, generator=g, dtype=dtype)
    return q, k, v, log_gate, beta, S0


@settings(max_examples=25)
@given(
    batch=st.integers(1, 2), time=st.integers(1, 40), key_heads=st.integers(1, 2), group=st.sampled_from([1, 2]),
    dim_k=st.sampled_from([1, 4, 8]), dim_v=st.sampled_from([3, 8]), chunk=st.sampled_from([1, 4, 7, 16, 64]),
    channelwise=st.booleans(), with_state=st.booleans(), seed=st.integers(0, 2**16),
)
def test_chunked_matches_recurrence(batch, time, key_heads, group, dim_k, dim_v, chunk, channelwise, with_state, seed):
    q, k, v, log_gate, beta, S0 = random_inputs(batch, time, key_heads, group, dim_k, dim_v, channelwise, seed)
    S0 = S0 if with_state else None
    o, S = gated_delta_rule_ref(q, k, v, log_gate, beta, scale=0.6, initial_state=S0, chunk_size=chunk)
    o_naive, S_naive = naive_delta_rule(q, k, v, log_gate, beta, 0.6, S0 if with_state else torch.zeros_like(S))
    assert o.dtype == S.dtype == torch.float64
    assert o_naive.abs().max() > 0 and S_naive.abs().max() > 0
    assert_close_rel(o, o_naive, rel=1e-10)
    assert_close_rel(S, S_naive, rel=1e-10)


@pytest.mark.parametrize("channelwise", [False, True])
def test_cpu_slices_chain_states(channelwise, monkeypatch):
    """A long input runs in slices, each from the state the one before ended in: the same values bit for bit as
    one pass (the chunks are carried one by one either way), the recurrence's values and gradients."""
    inputs = random_inputs(2, 29, 1, 2, 4, 3, channelwise, seed=8)
    whole = gated_delta_rule_ref(*inputs[:5], initial_state=inputs[5], chunk_size=4)
    monkeypatch.setattr(ssd_module, "CPU_SLICE_CHUNKS", 2)
    monkeypatch.setattr(ssd_module, "CPU_SLICE_ELEMENTS", 1)
    calls = []
    unwatched = delta_rule_module.gated_delta_rule_ref
    monkeypatch.setattr(delta_rule_module, "gated_delta_rule_ref",
                        lambda q, *rest, **options: calls.append(q.shape[1]) or unwatched(q, *rest, **options))
    ours = [t.clone().requires_grad_() for t in inputs]
    o, S = delta_rule_module.gated_delta_rule_ref(*ours[:5], initial_state=ours[5], chunk_size=4)
    assert calls == [29, 8, 8, 8, 5]
    assert torch.equal(o, whole[0]) and torch.equal(S, whole[1])
    twins = [t.clone().requires_grad_() for t in inputs]
    o_naive, S_naive = naive_delta_rule(*twins[:5], 4**-0.5, twins[5])
    assert_close_rel(o, o_naive, rel=1e-10)
    assert_close_rel(S, S_naive, rel=1e-10)
    weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ((o * weights).sum() + S.square().sum()).backward()
    ((o_naive * weights).sum() + S_naive.square().sum()).backward()
    for name, got, expected in zip(("q", "k", "v", "log_gate", "beta", "initial_state"), ours, twins):
        assert expected.grad.abs().max() > 0, name
        assert_close_rel(got.grad, expected.grad, rel=1e-9)


@pytest.mark.parametrize("channelwise", [False, True])
def test_gradients_match_recurrence(channelwise):
    inputs = random_inputs(2, 13, 1, 2, 4, 3, channelwise, seed=5)
    ours = [t.clone().requires_grad_() for t in inputs]
    twins = [t.clone().requires_grad_() for t in inputs]
    o, S = gated_delta_rule_ref(*ours[:5], initial_state=ours[5], chunk_size=4)
    o2, S2 = naive_delta_rule(*twins[:5], 4**-0.5, twins[5])
    weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ((o * weights).sum() + S.square().sum()).backward()
    ((o2 * weights).sum() + S2.square().sum()).backward()
    for name, got, expected in zip(("q", "k", "v", "log_gate", "beta", "initial_state"), ours, twins):
        assert expected.grad.abs().max() > 0, name
        assert_close_rel(got.grad, expected.grad, rel=1e-9)


@pytest.mark.parametrize("channelwise", [False, True])
def test_gates_that_decay_past_float32s_range_match_the_recurrence(channelwise):
    """Gates of -2..-10 a token: the in-chunk decays underflow float32 (flushed to zero below 3.6e-35)."""
    q, k, v, log_gate, beta, S0 = random_inputs(1, 48, 1, 2, 4, 3, channelwise, seed=6)
    log_gate = log_gate / 0.7 * 8.0 - 2.0
    o, S = gated_delta_rule_ref(*(t.float() for t in (q, k, v, log_gate, beta)), initial_state=S0.float(),
                                chunk_size=48)
    o_naive, S_naive = naive_delta_rule(q, k, v, log_gate, beta, 4**-0.5, S0)
    assert log_gate.sum(1).max() < -100  # decays across the chunk far below float32's smallest normal number
    assert_close_rel(o, o_naive.float())
    assert_close_rel(S, S_naive.float())


def test_channelwise_decay_formed_a_slice_of_chunks_at_a_time(monkeypatch):
    """The [..., L, L, dim_k] decay tensor in slices of 2 (batch, head, chunk) triples, the last one short: the
    same outputs, state and gradients as the recurrence."""
    from hybridlm.ops import delta_rule

    chunk, dim_k = 4, 4
    monkeypatch.setattr(delta_rule, "_DECAY_ELEMENTS", 2 * chunk * chunk * dim_k + 1)
    inputs = random_inputs(1, 11, 3, 1, dim_k, 5, channelwise=True, seed=9)  # 3 heads x 3 chunks: slices 2,2,2,2,1
    ours = [t.clone().requires_grad_() for t in inputs]
    twins = [t.clone().requires_grad_() for t in inputs]
    o, S = gated_delta_rule_ref(*ours[:5], initial_state=ours[5], chunk_size=chunk)
    o2, S2 = naive_delta_rule(*twins[:5], dim_k**-0.5, twins[5])
    assert_close_rel(o, o2, rel=1e-10)
    assert_close_rel(S, S2, rel=1e-10)
    (o.square().sum() + S.sum()).backward()
    (o2.square().sum() + S2.sum()).backward()
    for got, expected in zip(ours, twins):
        assert expected.grad.abs().max() > 0
        assert_close_rel(got.grad, expected.grad, rel=1e-9)


def test_float32_and_defaults():
    """fp32 inputs run in fp32 and agree with the float64 result; no gate means no decay; scale defaults to
    dim_k ** -0.5; a state given to a sequence split in two equals the whole sequence."""
    q, k, v, _, beta, _ = random_inputs(1, 50, 2, 1, 8, 4, False, seed=3)
    o64, S64 = gated_delta_rule_ref(q, k, v, None, beta)
    o_naive, S_naive = naive_delta_rule(q, k, v, torch.zeros_like(beta), beta, 8**-0.5, torch.zeros_like(S64))
    assert_close_rel(o64, o_naive, rel=1e-10)
    o32, S32 = gated_delta_rule_ref(*(t.float() for t in (q, k, v)), None, beta.float(), chunk_size=16)
    assert o32.dtype == S32.dtype == torch.float32
    assert_close_rel(o32, o64, rel=1e-5)
    first, S_mid = gated_delta_rule_ref(q[:, :21], k[:, :21], v[:, :21], None, beta[:, :21], chunk_size=8)
    second, S_end = gated_delta_rule_ref(q[:, 21:], k[:, 21:], v[:, 21:], None, beta[:, 21:], initial_state=S_mid)
    assert_close_rel(torch.cat([first, second], 1), o64, rel=1e-10)
    assert_close_rel(S_end, S64, rel=1e-10)


@pytest.mark.parametrize("channelwise", [False, True])
def test_step_matches_recurrence(channelwise):
    q, k, v, log_gate, beta, S0 = random_inputs(2, 6, 2, 2, 4, 5, channelwise, seed=7)
    state, outs = S0.clone(), []
    for t in range(6):
        outs.append(gated_delta_rule_step_ref(state, q[:, t], k[:, t], v[:, t], log_gate[:, t], beta[:, t], scale=0.3))
    o_naive, S_naive = naive_delta_rule(q, k, v, log_gate, beta, 0.3, S0)
    assert_close_rel(torch.stack(outs, 1), o_naive, rel=1e-12)
    assert_close_rel(state, S_naive, rel=1e-12)


def test_packed_sequences_run_alone():
    q, k, v, log_gate, beta, S0 = random_inputs(1, 17, 1, 2, 4, 3, False, seed=9)
    states = torch.cat([S0, S0.flip(-1)])
    o, S = gated_delta_rule_ref(q, k, v, log_gate, beta, initial_state=states, chunk_size=4,
                                cu_seqlens=torch.tensor([0, 6, 17]))
    for i, part in enumerate((slice(0, 6), slice(6, 17))):
        o_alone, S_alone = naive_delta_rule(q[:, part], k[:, part], v[:, part], log_gate[:, part], beta[:, part],
                                            4**-0.5, states[i : i + 1])
        assert_close_rel(o[:, part], o_alone, rel=1e-10)
        assert_close_rel(S[i : i + 1], S_alone, rel=1e-10)


def test_bad_shapes_name_the_argument():
    q, k, v, log_gate, beta, S0 = random_inputs(1, 5, 2, 1, 4, 3, False, seed=0)
    with pytest.raises(ValueError, match="heads a multiple of key_heads"):
        gated_delta_rule_ref(q, k, v[:, :, :1], log_gate[:, :, :1], beta[:, :, :1])
    with pytest.raises(ValueError, match="beta"):
        gated_delta_rule_ref(q, k, v, log_gate, beta[:, :4])
    with pytest.raises(ValueError, match="log_gate"):
        gated_delta_rule_ref(q, k, v, log_gate[..., None].expand(-1, -1, -1, 3), beta)
    with pytest.raises(ValueError, match="initial_state"):
        gated_delta_rule_ref(q, k, v, log_gate, beta, initial_state=S0[..., :2])
