"""A warm forward that keeps per-token states (rollback) reads its output out of them instead of scanning twice:
its outputs and states must equal the plain forward's, and the per-token forms the ops' outputs."""

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import ops
from hybridlm.mixers.mamba import Mamba
from hybridlm.mixers.mamba2 import Mamba2
from hybridlm.ops import cpu_kernels, ssd
from hybridlm.ops.selective_scan import selective_scan_ref, selective_scan_with_states
from hybridlm.ops.ssd import ssd_chunk_scan_ref, ssd_readout, ssd_states
from tests.helpers import assert_close_rel, tiny_config


def mixer(cls, seed: int, **overrides):
    torch.manual_seed(seed)
    layer = cls(tiny_config(**overrides)).eval()
    with torch.no_grad():
        for param in layer.parameters():  # weights and the SSM parameters, all drawn so that nothing is trivial
            param.normal_(0.0, 0.3)
        for name, value in layer.initial_values().items():
            if name == "A_log":
                layer.get_parameter(name).copy_(value)
    return layer


@settings(max_examples=12, deadline=None)
@given(cls=st.sampled_from([Mamba, Mamba2]), time=st.sampled_from([2, 3, 5, 9, 17, 64]),
       batch=st.integers(1, 2), groups=st.sampled_from([1, 2]), seed=st.integers(0, 99))
def test_tracked_and_short_warm_forwards_equal_the_chunked_scan(cls, time, batch, groups, seed):
    """A forward keeping per-token states, and a short plain one on CPU (Mamba-2 reads both out of the states),
    against a plain forward through the chunked scan."""
    layer = mixer(cls, seed, mamba2_n_groups=groups)
    hidden = layer.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    prompt, block = torch.randn(batch, 6, hidden, generator=gen), torch.randn(batch, time, hidden, generator=gen)
    with torch.no_grad():
        tracked = layer.init_state(batch)
        layer(prompt, tracked)
        short, scanned = tracked.clone(), tracked.clone()
        short.paused = scanned.paused = True
        got = layer(block, tracked)
        got_short = layer(block, short)
        with mock.patch.object(ssd, "PER_TOKEN_ELEMENTS", 0):  # the chunked scan, whatever the size
            expected = layer(block, scanned)
    assert tracked.history is not None and scanned.history is None  # one side kept per-token states, one did not
    for out, state in ((got, tracked), (got_short, short)):
        assert_close_rel(out, expected)
        assert_close_rel(state.ssm, scanned.ssm)
        assert torch.equal(state.conv, scanned.conv)


def test_short_forwards_take_the_per_token_form_on_cpu_only_when_small():
    x = torch.zeros(1, 4, 16, 32)
    assert ssd.per_token_is_faster(x, 64) and not ssd.per_token_is_faster(torch.zeros(1, 64, 16, 32), 64)
    assert not ssd.per_token_is_faster(x.to("meta"), 64)


@pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None, reason="the C++ CPU scan cannot be built here")
def test_a_short_forward_takes_the_cpp_scan_where_it_runs_else_the_per_token_form():
    """The per-token form beats the chunked reference on short forwards, not the C++ scan (2-3x slower than it):
    it is taken only while the reference is what ssd_chunk_scan runs. Both give the chunked scan's result."""
    layer = mixer(Mamba2, 3)
    block = torch.randn(1, 4, layer.config.hidden_size, generator=torch.Generator().manual_seed(3))
    outputs = {}
    for backend in ("cpu", "torch"):
        state = layer.init_state(1)
        with torch.no_grad(), ops.use_backend(ssd_chunk_scan=backend), \
                mock.patch.object(ssd, "ssd_states", wraps=ssd.ssd_states) as per_token:
            assert ops.runs_reference("ssd_chunk_scan", "cpu") == (backend == "torch")
            outputs[backend] = layer(block, state), state.ssm.clone()
        assert per_token.called == (backend == "torch")
    assert_close_rel(outputs["cpu"][0], outputs["torch"][0])
    assert_close_rel(outputs["cpu"][1], outputs["torch"][1])


@pytest.mark.parametrize("per_channel_D", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ssd_readout_of_the_per_token_states_is_the_scan(per_channel_D, dtype):
    gen = torch.Generator().manual_seed(0)
    batch, time, heads, dim, groups, dstate = 2, 13, 4, 8, 2, 6
    x = torch.randn(batch, time, heads, dim, generator=gen).to(dtype)
    dt = torch.rand(batch, time, heads, generator=gen)
    A = -torch.rand(heads, generator=gen) - 0.1
    B, C = (torch.randn(batch, time, groups, dstate, generator=gen).to(dtype) for _ in range(2))
    D = torch.randn(heads, dim, generator=gen) if per_channel_D else torch.randn(heads, generator=gen)
    s0 = torch.randn(batch, heads, dim, dstate, generator=gen)
    y, final = ssd_chunk_scan_ref(x, dt, A, B, C, 4, D, initial_state=s0)
    states = ssd_states(x, dt, A, B, s0)
    got = ssd_readout(states, C, x, D)
    assert got.dtype == y.dtype
    assert_close_rel(got.float(), y.float(), 1e-5 if dtype == torch.float32 else 1e-2)
    assert_close_rel(states[:, -1], final)


@pytest.mark.parametrize("groups", [1, 2])
def test_selective_scan_with_states_is_the_scan(groups):
    gen = torch.Generator().manual_seed(1)
    batch, dim, time, dstate = 2, 8, 37, 4
    u, z = (torch.randn(batch, dim, time, generator=gen) for _ in range(2))
    delta = torch.rand(batch, dim, time, generator=gen)
    A = -torch.rand(dim, dstate, generator=gen) - 0.1
    B, C = (torch.randn(batch, groups, dstate, time, generator=gen) for _ in range(2))
    D, h0 = torch.randn(dim, generator=gen), torch.randn(batch, dim, dstate, generator=gen)
    y, final = selective_scan_ref(u, delta, A, B, C, D, z, initial_state=h0)
    got, states = selective_scan_with_states(u, delta, A, B, C, h0, D=D, z=z)
    assert_close_rel(got, y)
    assert_close_rel(states[:, -1], final)


@settings(max_examples=8, deadline=None)
@given(kind=st.sampled_from(["gated_deltanet", "kda"]), time=st.sampled_from([2, 3, 9, 64]),
       batch=st.integers(1, 2), seed=st.integers(0, 99))
def test_tracked_delta_rule_forward_equals_the_plain_one(kind, time, batch, seed):
    """Gated DeltaNet and KDA read a tracked forward's output out of its per-token states: equal to the plain
    forward through the reference op (the chunked WY form both share; the C++ CPU scan, the plain forward's default,
    rounds differently and more closely: tests/ops/test_cpu_kernels.py), and so are the final state and the conv
    window."""
    from hybridlm.mixers import MIXERS

    layer = mixer(MIXERS[kind], seed)
    hidden = tiny_config().hidden_size
    gen = torch.Generator().manual_seed(seed)
    prompt, block = torch.randn(batch, 6, hidden, generator=gen), torch.randn(batch, time, hidden, generator=gen)
    with torch.no_grad():
        tracked = layer.init_state(batch)
        layer(prompt, tracked)
        plain = tracked.clone()
        plain.paused = True
        got = layer(block, tracked)
        with ops.use_backend(gated_delta_rule="torch"):
            expected = layer(block, plain)
    assert tracked.history is not None and plain.history is None
    assert expected.abs().max() > 0 and plain.ssm.abs().max() > 0
    assert_close_rel(got, expected)
    assert_close_rel(tracked.ssm, plain.ssm)
    assert torch.equal(tracked.conv, plain.conv)
