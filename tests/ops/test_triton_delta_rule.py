"""The Triton gated delta rule against the reference: outputs, final states and every gradient, with per-head
and per-channel gates, grouped key heads, initial states and packed sequences; outputs poisoned with NaN."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.ops.delta_rule import gated_delta_rule_ref
from tests.helpers import assert_close_rel
from tests.ops.triton_support import DEVICE, kernels, poisoned_outputs

NAMES = ("q", "k", "v", "log_gate", "beta", "initial_state")


def inputs(batch, time, key_heads, group, dim_k, dim_v, channelwise, seed):
    g = torch.Generator().manual_seed(seed)
    heads = key_heads * group
    q = torch.randn(batch, time, key_heads, dim_k, generator=g)
    k = F.normalize(torch.randn(batch, time, key_heads, dim_k, generator=g), dim=-1)
    v = torch.randn(batch, time, heads, dim_v, generator=g)
    gate_shape = (batch, time, heads, dim_k) if channelwise else (batch, time, heads)
    log_gate = -torch.rand(*gate_shape, generator=g) * 0.5
    beta = torch.rand(batch, time, heads, generator=g)
    state = torch.randn(batch, heads, dim_k, dim_v, generator=g) * 0.3
    return [t.to(DEVICE) for t in (q, k, v, log_gate, beta, state)]


def run_both(tensors, **kwargs):
    """Outputs and gradients (by name) of the kernel and of the reference, for one random projection."""
    results = []
    for op in (kernels.gated_delta_rule, gated_delta_rule_ref):
        leaves = [t.clone().requires_grad_() for t in tensors]
        with poisoned_outputs():
            o, final = op(*leaves[:5], initial_state=leaves[5], **kwargs)
            weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(o.device)
            ((o * weights).sum() + (final * final.detach()).sum()).backward()
        results.append((o.detach(), final.detach(), {n: t.grad for n, t in zip(NAMES, leaves)}))
    return results


@pytest.mark.parametrize("shape", [
    dict(batch=1, time=67, key_heads=1, group=2, dim_k=8, dim_v=5, channelwise=False),  # crosses a checkpoint
    dict(batch=2, time=9, key_heads=2, group=1, dim_k=5, dim_v=20, channelwise=True),  # 3 value blocks of 8
])
def test_forward_and_gradients_match_the_reference(shape, monkeypatch):
    monkeypatch.setattr(kernels.delta_rule, "STATE_TILE", 64)  # 8 x 8 state tiles: several value blocks
    (o, final, grads), (o_ref, final_ref, grads_ref) = run_both(inputs(**shape, seed=3))
    assert_close_rel(o, o_ref, rel=1e-5)
    assert_close_rel(final, final_ref, rel=1e-5)
    for name in NAMES:
        assert_close_rel(grads[name], grads_ref[name], rel=1e-4)


@settings(max_examples=4, deadline=None)
@given(batch=st.integers(1, 2), time=st.integers(1, 12), key_heads=st.integers(1, 2), group=st.sampled_from([1, 3]),
       dim_k=st.integers(1, 9), dim_v=st.integers(1, 9), channelwise=st.booleans(), seed=st.integers(0, 999))
def test_random_shapes(batch, time, key_heads, group, dim_k, dim_v, channelwise, seed):
    (o, final, grads), (o_ref, final_ref, grads_ref) = run_both(
        inputs(batch, time, key_heads, group, dim_k, dim_v, channelwise, seed))
    assert_close_rel(o, o_ref, rel=1e-5)
    assert_close_rel(final, final_ref, rel=1e-5)
    for name in NAMES:
        assert_close_rel(grads[name], grads_ref[name], rel=1e-4)


def test_packed_sequences_and_no_gate():
    q, k, v, log_gate, beta, _ = inputs(1, 23, 1, 2, 4, 3, False, seed=5)
    states = torch.randn(3, 2, 4, 3, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    cu = torch.tensor([0, 5, 6, 23], device=DEVICE)
    for gate in (log_gate, None):
        tensors = [q, k, v, gate if gate is not None else torch.zeros_like(log_gate), beta, states]
        (o, final, grads), (o_ref, final_ref, grads_ref) = run_both(tensors, cu_seqlens=cu)
        assert_close_rel(o, o_ref, rel=1e-5)
        assert_close_rel(final, final_ref, rel=1e-5)
        for name in NAMES:
            assert_close_rel(grads[name], grads_ref[name], rel=1e-4)
    o, final = kernels.gated_delta_rule(q, k, v, None, beta)
    o_ref, final_ref = gated_delta_rule_ref(q, k, v, None, beta)
    assert_close_rel(o, o_ref, rel=1e-5)
    assert_close_rel(final, final_ref, rel=1e-5)


def test_bad_initial_state_for_packed_sequences():
    q, k, v, log_gate, beta, state = inputs(1, 8, 1, 1, 4, 3, False, seed=0)
    with pytest.raises(ValueError, match="3 sequences"):
        kernels.gated_delta_rule(q, k, v, log_gate, beta, initial_state=state,
                                 cu_seqlens=torch.tensor([0, 2, 4, 8], device=DEVICE))


def test_models_run_the_kernel_through_the_backend_selection():
    """A Gated DeltaNet + KDA stack forced onto the kernel (ordinary and packed rows) gives the reference's logits
    and gradients."""
    from hybridlm import ops
    from tests.helpers import tiny_model

    model = tiny_model(0, layer_pattern="DK", deltanet_num_key_heads=2, deltanet_key_head_dim=4,
                       deltanet_value_head_dim=3).to(DEVICE)
    ids = torch.randint(1, 61, (1, 7), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]], device=DEVICE)  # two packed documents
    results = []
    for backend in ("triton", "torch"):
        model.zero_grad()
        with ops.use_backend(gated_delta_rule=backend):
            assert ops.backends.chosen("gated_delta_rule", ids.device.type) == (backend,)
            logits = model(ids).logits + model(ids, position_ids=positions).logits
        logits.square().sum().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (got, got_grads), (expected, expected_grads) = results
    assert_close_rel(got, expected, rel=1e-5)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert_close_rel(g, e, rel=1e-4, allow_zero_reference=True)
