"""Our C++ CPU kernels (``hybridlm.ops.cpu_kernels``, the default ``ssd_chunk_scan``, ``selective_scan``,
``gated_delta_rule`` and ``causal_conv1d`` on CPU tensors) against the float64 recurrences and convolution; their
vectorized exp; what they decline to the references; and the build cache (digest-named, verified, written
aside)."""

from __future__ import annotations

import math
import re
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import ops
from hybridlm.files import sha256_of
from hybridlm.ops import backends, cpu_kernels
from hybridlm.ops.causal_conv1d import causal_conv1d_ref
from hybridlm.ops.delta_rule import gated_delta_rule_ref
from hybridlm.ops.selective_scan import selective_scan_ref
from hybridlm.ops.ssd import ssd_chunk_scan_ref
from tests.helpers import assert_close_rel
from tests.ops.test_delta_rule import naive_delta_rule, random_inputs
from tests.ops.test_reference_ops import naive_selective_scan, naive_ssd

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def ssd_inputs(batch, time, groups, heads_per_group, head_dim, dstate, seed=0, skip="heads"):
    """fp32 ``(x, dt, A, B, C, D, s0)``, ``D`` of shape ``[heads]``, ``[heads, head_dim]`` or None (``skip``)."""
    g = torch.Generator().manual_seed(seed)
    heads = groups * heads_per_group
    x, dt = torch.randn(batch, time, heads, head_dim, generator=g), torch.rand(batch, time, heads, generator=g)
    A = -torch.rand(heads, generator=g) * 2
    B, C = (torch.randn(batch, time, groups, dstate, generator=g) for _ in range(2))
    D = {"heads": torch.randn(heads, generator=g), "channels": torch.randn(heads, head_dim, generator=g),
         None: None}[skip]
    return x, dt, A, B, C, D, torch.randn(batch, heads, head_dim, dstate, generator=g)


def exact(x, dt, A, B, C, D, s0):
    """The float64 recurrence, ``D`` (``[heads]``, ``[heads, head_dim]`` or None) added after it."""
    x64 = x.double()
    y, s = naive_ssd(x64, *(t.double() for t in (dt, A, B, C)), torch.zeros(x.shape[2], dtype=torch.float64),
                     s0.double())
    return (y if D is None else y + D.double().reshape(x.shape[2], -1) * x64), s


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 2), time=st.integers(1, 40), groups=st.sampled_from([1, 2]),
       heads_per_group=st.integers(1, 3), head_dim=st.sampled_from([1, 3, 8, 16, 27, 40]),
       dstate=st.integers(1, 9), skip=st.sampled_from(["heads", "channels", None]), seed=st.integers(0, 2**16))
def test_scan_is_the_recurrence(batch, time, groups, heads_per_group, head_dim, dstate, skip, seed):
    """Every block width of head_dim (16, 8 and single entries), grouped B/C, each form of D."""
    x, dt, A, B, C, D, s0 = ssd_inputs(batch, time, groups, heads_per_group, head_dim, dstate, seed, skip)
    y, s = cpu_kernels.ssd_chunk_scan(x, dt, A, B, C, 64, D, initial_state=s0)
    y_exact, s_exact = exact(x, dt, A, B, C, D, s0)
    assert y.dtype == torch.float32 and s.dtype == torch.float32
    assert_close_rel(y, y_exact)
    assert_close_rel(s, s_exact)


def test_no_initial_state_starts_from_zeros_and_the_inputs_are_left_alone():
    x, dt, A, B, C, D, s0 = ssd_inputs(2, 19, 1, 2, 16, 4, seed=1)
    before = [t.clone() for t in (x, dt, A, B, C, D)]
    y, s = cpu_kernels.ssd_chunk_scan(x, dt, A, B, C, 64, D)
    y_exact, s_exact = exact(x, dt, A, B, C, D, torch.zeros_like(s0))
    assert_close_rel(y, y_exact)
    assert_close_rel(s, s_exact)
    assert all(torch.equal(a, b) for a, b in zip(before, (x, dt, A, B, C, D)))


def test_reduced_precision_inputs_give_outputs_rounded_once():
    """bf16 inputs: the arithmetic in fp32 (the fp32 scan of the same values, within fp32 accumulation of the exact
    result), the output rounded to bf16 once; the state stays fp32."""
    inputs = [t.bfloat16() for t in ssd_inputs(1, 33, 1, 2, 24, 8, seed=2)]
    y, s = cpu_kernels.ssd_chunk_scan(*inputs[:5], 64, inputs[5], initial_state=inputs[6])
    widened = [t.float() for t in inputs]
    y32, s32 = cpu_kernels.ssd_chunk_scan(*widened[:5], 64, widened[5], initial_state=widened[6])
    y_exact, s_exact = exact(*inputs)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_close_rel(y32, y_exact)
    assert torch.equal(y, y32.bfloat16()) and torch.equal(s, s32)
    half_ulp = torch.finfo(torch.bfloat16).eps / 2
    assert ((y.double() - y_exact).abs() <= y_exact.abs() * half_ulp + 1e-5 * y_exact.abs().max()).all()


def test_threads_split_the_heads_and_give_the_same_bits():
    """Large enough to start a second thread (2M state updates): each head is scanned the same way by whichever
    thread takes it."""
    inputs = ssd_inputs(1, 512, 1, 4, 32, 32, seed=3)
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(cpu_kernels.ssd_chunk_scan(*inputs[:5], 64, inputs[5], initial_state=inputs[6]))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert_close_rel(results[0][0], exact(*inputs)[0], rel=1e-4)


def test_default_cpu_op_runs_the_kernel_and_declines_what_it_cannot_serve():
    backends.reload_environment()
    assert backends.chosen("ssd_chunk_scan", "cpu") == ("cpu", "torch")
    x, dt, A, B, C, D, s0 = ssd_inputs(1, 24, 1, 2, 8, 4, seed=4)
    kernel = cpu_kernels.ssd_chunk_scan(x, dt, A, B, C, 8, D, initial_state=s0)
    assert kernel[0].abs().max() > 0.1
    assert all(torch.equal(a, b) for a, b in zip(ops.ssd_chunk_scan(x, dt, A, B, C, 8, D, initial_state=s0), kernel))
    # float64: the reference
    doubles = [t.double() for t in (x, dt, A, B, C, D, s0)]
    got = ops.ssd_chunk_scan(*doubles[:5], 8, doubles[5], initial_state=doubles[6])
    reference = ssd_chunk_scan_ref(*doubles[:5], 8, doubles[5], initial_state=doubles[6])
    assert reference[0].abs().max() > 0.1 and all(torch.equal(a, b) for a, b in zip(got, reference))
    # gradients: the reference's backward
    leaf = x.clone().requires_grad_()
    y, _ = ops.ssd_chunk_scan(leaf, dt, A, B, C, 8, D, initial_state=s0)
    (grad,) = torch.autograd.grad(y.square().sum(), leaf)
    twin = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(ssd_chunk_scan_ref(twin, dt, A, B, C, 8, D, initial_state=s0)[0].square().sum(),
                                      twin)
    assert expected.abs().max() > 0.1 and torch.equal(grad, expected)  # a gradient that is not trivially zero
    # packed sequences: never offered to a backend that does not take them
    seq_idx = torch.tensor([[0] * 10 + [1] * 14])
    got = ops.ssd_chunk_scan(x, dt, A, B, C, 8, D, seq_idx=seq_idx)
    reference = ssd_chunk_scan_ref(x, dt, A, B, C, 8, D, seq_idx=seq_idx)
    assert reference[0].abs().max() > 0.1 and all(torch.equal(a, b) for a, b in zip(got, reference))
    with pytest.raises(ValueError, match="disagree"):
        cpu_kernels.ssd_chunk_scan(x, dt[:, :5], A, B, C, 8, D)
    with pytest.raises(ValueError, match="initial_state"):
        cpu_kernels.ssd_chunk_scan(x, dt, A, B, C, 8, D, initial_state=s0[:, :1])


def test_forcing_the_reference_on_cpu_turns_the_kernel_off():
    x, dt, A, B, C, D, s0 = ssd_inputs(1, 24, 1, 2, 8, 4, seed=5)
    with ops.use_backend(ssd_chunk_scan="torch"):
        got = ops.ssd_chunk_scan(x, dt, A, B, C, 8, D, initial_state=s0)
    reference = ssd_chunk_scan_ref(x, dt, A, B, C, 8, D, initial_state=s0)
    assert reference[0].abs().max() > 0.1 and all(torch.equal(a, b) for a, b in zip(got, reference))


# --- Mamba-1 ------------------------------------------------------------------------------------------


def selective_inputs(batch, time, groups, per_group, dstate, seed=0, grouped=True):
    """fp32 ``(u, delta, A, B, C, D, z, bias, h0)``; ``B, C [batch, groups, dstate, time]``, or ``[batch, dstate,
    time]`` (one group) when not ``grouped``. Decay rates span 0.01-30: some decays flush to zero within a token."""
    g = torch.Generator().manual_seed(seed)
    dim = groups * per_group
    u, delta, z = (torch.randn(batch, dim, time, generator=g) for _ in range(3))
    A = -torch.exp(torch.empty(dim, dstate).uniform_(-4.6, 3.4, generator=g))
    shape = (batch, groups, dstate, time) if grouped else (batch, dstate, time)
    B, C = (torch.randn(*shape, generator=g) for _ in range(2))
    D, bias = torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    return u, delta, A, B, C, D, z, bias, torch.randn(batch, dim, dstate, generator=g)


def selective_exact(u, delta, A, B, C, D, z, bias, h0, softplus=True):
    """The float64 recurrence, with the reference's step ``softplus(delta + bias)``."""
    step = delta.double() + (0 if bias is None else bias.double()[:, None])
    step = torch.nn.functional.softplus(step) if softplus else step
    grouped = [t.double() if t.dim() == 4 else t.double()[:, None] for t in (B, C)]
    return naive_selective_scan(u.double(), step, A.double(), *grouped, None if D is None else D.double(),
                                None if z is None else z.double(), h0.double())


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 2), time=st.integers(1, 40), groups=st.sampled_from([1, 2]),
       per_group=st.sampled_from([1, 3, 8, 16, 27]), dstate=st.integers(1, 9), gate=st.booleans(),
       grouped=st.booleans(), seed=st.integers(0, 2**16))
def test_selective_scan_is_the_recurrence(batch, time, groups, per_group, dstate, gate, grouped, seed):
    """Blocks of 16, 8 and single channels within each group, grouped and ungrouped B/C, with and without the
    gate, the bias and the softplus."""
    if not grouped:
        groups = 1
    u, delta, A, B, C, D, z, bias, h0 = selective_inputs(batch, time, groups, per_group, dstate, seed, grouped)
    z = z if gate else None
    y, h = cpu_kernels.selective_scan(u, delta, A, B, C, D, z, delta_bias=bias, delta_softplus=True,
                                      initial_state=h0)
    y_exact, h_exact = selective_exact(u, delta, A, B, C, D, z, bias, h0)
    assert y.dtype == torch.float32 and h.dtype == torch.float32
    assert_close_rel(y, y_exact)
    assert_close_rel(h, h_exact)


def test_selective_scan_without_step_options_or_initial_state():
    u, delta, A, B, C, D, z, bias, h0 = selective_inputs(2, 21, 1, 24, 5, seed=7)
    step = delta.sigmoid()  # a step taken as it is: no bias, no softplus
    y, h = cpu_kernels.selective_scan(u, step, A, B, C)
    y_exact, h_exact = selective_exact(u, step, A, B, C, None, None, None, torch.zeros_like(h0), softplus=False)
    assert_close_rel(y, y_exact)
    assert_close_rel(h, h_exact)


def test_selective_scan_reduced_precision_is_the_fp32_scan_rounded_once():
    inputs = [t.bfloat16() for t in selective_inputs(1, 17, 2, 8, 4, seed=8)]
    kwargs = {"delta_bias": inputs[7], "delta_softplus": True, "initial_state": inputs[8]}
    y, h = cpu_kernels.selective_scan(*inputs[:7], **kwargs)
    widened = [t.float() for t in inputs]
    y32, h32 = cpu_kernels.selective_scan(*widened[:7], **{**kwargs, "delta_bias": widened[7],
                                                           "initial_state": widened[8]})
    assert y.dtype == torch.bfloat16 and torch.equal(y, y32.bfloat16()) and torch.equal(h, h32)
    assert_close_rel(y32, selective_exact(*inputs)[0])


def test_selective_scan_threads_give_the_same_bits_and_the_default_op_runs_it():
    inputs = selective_inputs(1, 256, 2, 64, 16, seed=9)  # 2M state updates: two threads
    kwargs = {"delta_bias": inputs[7], "delta_softplus": True, "initial_state": inputs[8]}
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(cpu_kernels.selective_scan(*inputs[:7], **kwargs))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert_close_rel(results[0][0], selective_exact(*inputs)[0], rel=1e-4)
    backends.reload_environment()
    assert backends.chosen("selective_scan", "cpu") == ("cpu", "torch")
    assert all(torch.equal(a, b) for a, b in zip(ops.selective_scan(*inputs[:7], **kwargs), results[0]))
    leaf = inputs[0].clone().requires_grad_()  # a gradient: the reference
    (grad,) = torch.autograd.grad(ops.selective_scan(leaf, *inputs[1:7], **kwargs)[0].sum(), leaf)
    twin = inputs[0].clone().requires_grad_()
    (expected,) = torch.autograd.grad(selective_scan_ref(twin, *inputs[1:7], **kwargs)[0].sum(), twin)
    assert expected.abs().max() > 0.1 and torch.equal(grad, expected)  # a gradient that is not trivially zero


def test_selective_scan_refuses_disagreeing_shapes_by_name():
    u, delta, A, B, C, D, z, bias, h0 = selective_inputs(1, 9, 2, 4, 3, seed=10)
    with pytest.raises(ValueError, match="disagree"):
        cpu_kernels.selective_scan(u, delta[..., :4], A, B, C)
    with pytest.raises(ValueError, match="selective_scan C"):
        cpu_kernels.selective_scan(u, delta, A, B, C[..., :4])
    with pytest.raises(ValueError, match="groups"):
        cpu_kernels.selective_scan(u, delta, A, B, C[:, :1])
    with pytest.raises(ValueError, match="initial_state"):
        cpu_kernels.selective_scan(u, delta, A, B, C, initial_state=h0[:, :3])


def test_decay_exp_is_within_two_ulp_of_exp_and_flushes_below_exp_minus_80():
    """The kernel's vectorized exp, seen through a one-token scan: h = exp(dt A) h0 with unit dt and B = 0."""
    x = torch.cat([-torch.logspace(-8, math.log10(80), 4000), torch.linspace(-90, 0, 4001)]).double()
    dim = x.numel()
    u = torch.zeros(1, dim, 1)
    A, h0 = x.float()[:, None], torch.ones(1, dim, 1)
    _, h = cpu_kernels.selective_scan(u, torch.ones(1, dim, 1), A, torch.zeros(1, 1, 1), torch.zeros(1, 1, 1),
                                      initial_state=h0)
    exact = torch.exp(A.double())[:, 0]
    kept = A[:, 0] >= -80
    assert kept.sum() > 6000 and (~kept).sum() > 400
    assert ((h[0, kept, 0].double() - exact[kept]).abs() <= 2 * 2**-24 * exact[kept]).all()
    assert (h[0, ~kept, 0] == 0).all()


# --- the gated delta rule ----------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 2), time=st.integers(1, 33), key_heads=st.integers(1, 2), group=st.sampled_from([1, 2]),
       dim_k=st.sampled_from([1, 5, 16]), dim_v=st.sampled_from([1, 3, 8, 16, 27]), gate=st.sampled_from(
           ["head", "channel", None]), with_state=st.booleans(), seed=st.integers(0, 2**16))
def test_delta_rule_is_the_recurrence(batch, time, key_heads, group, dim_k, dim_v, gate, with_state, seed):
    """Every block width of dim_v, grouped keys, gates per head, per channel or none, a scale of its own."""
    q, k, v, log_gate, beta, S0 = (t.float() for t in random_inputs(batch, time, key_heads, group, dim_k, dim_v,
                                                                   gate == "channel", seed))
    log_gate = None if gate is None else log_gate
    initial = S0 if with_state else None
    o, S = cpu_kernels.gated_delta_rule(q, k, v, log_gate, beta, scale=0.7, initial_state=initial)
    gates = torch.zeros_like(beta) if log_gate is None else log_gate
    o_exact, S_exact = naive_delta_rule(*(t.double() for t in (q, k, v, gates, beta)), 0.7,
                                        (S0 if with_state else torch.zeros_like(S0)).double())
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert_close_rel(o, o_exact)
    assert_close_rel(S, S_exact)


def test_delta_rule_default_op_runs_the_kernel_in_inference_and_the_reference_otherwise():
    inputs = [t.float() for t in random_inputs(1, 300, 2, 2, 32, 64, False, 11)]  # 2.4M updates: two threads
    q, k, v, log_gate, beta, S0 = inputs
    backends.reload_environment()
    assert backends.chosen("gated_delta_rule", "cpu") == ("cpu", "torch")
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(ops.gated_delta_rule(q, k, v, log_gate, beta, initial_state=S0))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    kernel = cpu_kernels.gated_delta_rule(q, k, v, log_gate, beta, initial_state=S0)
    assert all(torch.equal(a, b) for a, b in zip(results[0], kernel))
    assert_close_rel(kernel[0], naive_delta_rule(*(t.double() for t in (q, k, v, log_gate, beta)), 32**-0.5,
                                                 S0.double())[0], rel=1e-4)
    bf16 = [t.bfloat16() for t in (q, k, v, log_gate, beta)]
    o16, S16 = cpu_kernels.gated_delta_rule(*bf16, initial_state=S0)
    o32, S32 = cpu_kernels.gated_delta_rule(*(t.float() for t in bf16), initial_state=S0)
    assert o16.dtype == torch.bfloat16 and torch.equal(o16, o32.bfloat16()) and torch.equal(S16, S32)
    leaf = v[:, :40].clone().requires_grad_()  # a gradient: the reference
    (grad,) = torch.autograd.grad(ops.gated_delta_rule(q[:, :40], k[:, :40], leaf, log_gate[:, :40],
                                                       beta[:, :40])[0].sum(), leaf)
    twin = v[:, :40].clone().requires_grad_()
    (expected,) = torch.autograd.grad(gated_delta_rule_ref(q[:, :40], k[:, :40], twin, log_gate[:, :40],
                                                           beta[:, :40])[0].sum(), twin)
    assert expected.abs().max() > 0.1 and torch.equal(grad, expected)  # a gradient that is not trivially zero
    with pytest.raises(ValueError, match="beta"):
        cpu_kernels.gated_delta_rule(q, k, v, log_gate, beta[:, :5])


def test_a_compiled_forward_traces_the_reference_and_agrees_with_the_eager_kernel():
    """Inside torch.compile (fullgraph) the C++ scan declines and the dispatcher traces the chunked reference: no
    graph break, and the result of the eager forward, which ran the C++ scan."""
    from hybridlm.mixers.mamba2 import Mamba2
    from tests.mixers.test_short_forward import mixer

    layer = mixer(Mamba2, 0)
    x = torch.randn(1, 40, layer.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), mock.patch.object(cpu_kernels, "load_library", wraps=cpu_kernels.load_library) as loads:
        eager = layer(x)
        assert loads.called  # the eager forward ran the C++ scan
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)(x)
    assert_close_rel(compiled, eager)


def conv_inputs(batch, channels, time, width, seed=0, bias=True, window=True, time_major=True):
    """fp32 ``(x [batch, channels, time], weight, bias, window)``; x laid out time-major (as the mixers' projections
    give it) or channel-major."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, time, channels, generator=g).transpose(1, 2) * 3
    if not time_major:
        x = x.contiguous()
    return (x, torch.randn(channels, width, generator=g), torch.randn(channels, generator=g) if bias else None,
            torch.randn(batch, channels, width - 1, generator=g) if window else None)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), channels=st.integers(1, 40), time=st.integers(1, 70), width=st.integers(1, 5),
       activation=st.sampled_from([None, "silu"]), bias=st.booleans(), window=st.booleans(),
       time_major=st.booleans(), seed=st.integers(0, 2**16))
def test_conv_is_the_convolution(batch, channels, time, width, activation, bias, window, time_major, seed):
    """Every width (2-4 unrolled, others not), tokens reading the window and tokens past it, both layouts of x;
    against the float64 reference, and the window after it exactly."""
    x, weight, b, s0 = conv_inputs(batch, channels, time, width, seed, bias, window, time_major)
    y, final = cpu_kernels.causal_conv1d(x, weight, b, initial_state=s0, activation=activation)
    doubles = [None if t is None else t.double() for t in (x, weight, b, s0)]
    y_exact, final_exact = causal_conv1d_ref(*doubles[:3], initial_state=doubles[3], activation=activation)
    assert y.shape == x.shape and y.dtype == torch.float32 and final.shape == (batch, channels, width - 1)
    assert y_exact.abs().max() > 0.1
    assert_close_rel(y, y_exact)
    assert torch.equal(final, final_exact.float())  # the last inputs, copied


def test_conv_silu_is_within_float_rounding_far_into_both_tails():
    """The SiLU's exp in the kernel (a polynomial, flushing below exp(-80)) against float64 at large |v|."""
    values = torch.tensor([-200.0, -87.5, -80.5, -79.5, -30.0, -1e-3, 0.0, 1e-3, 30.0, 88.0, 200.0])
    x, weight = values.view(1, 1, -1), torch.ones(1, 1)
    y, _ = cpu_kernels.causal_conv1d(x, weight, activation="silu")
    exact = torch.nn.functional.silu(values.double())
    assert torch.all((y[0, 0].double() - exact).abs() <= 1e-6 * exact.abs() + 1e-30)


def test_conv_threads_give_the_same_bits_and_the_default_op_runs_it():
    backends.reload_environment()
    assert backends.chosen("causal_conv1d", "cpu") == ("cpu", "torch")
    x, weight, bias, s0 = conv_inputs(2, 160, 300, 4, seed=3)  # 384K multiply-adds: two threads
    results = []
    for threads in (1, 2):
        with mock.patch.object(torch, "get_num_threads", return_value=threads):
            results.append(cpu_kernels.causal_conv1d(x, weight, bias, initial_state=s0, activation="silu"))
    assert results[0][0].abs().max() > 0.1
    assert all(torch.equal(a, b) for a, b in zip(*results))
    with torch.inference_mode():
        got = ops.causal_conv1d(x, weight, bias, initial_state=s0, activation="silu")
    assert all(torch.equal(a, b) for a, b in zip(got, results[0]))


def test_conv_declines_to_the_reference_what_it_cannot_serve():
    x, weight, bias, s0 = conv_inputs(1, 16, 30, 4, seed=4)

    def both(*args, **kwargs):
        got, reference = ops.causal_conv1d(*args, **kwargs), causal_conv1d_ref(*args, **kwargs)
        assert reference[0].abs().max() > 0.1 and all(torch.equal(a, b) for a, b in zip(got, reference))

    both(*(t.double() for t in (x, weight, bias)), initial_state=s0.double(), activation="silu")  # float64
    both(x.bfloat16(), weight, bias, initial_state=s0, activation="silu")  # reduced precision: rounded before SiLU
    both(x, weight, bias, activation="silu", cu_seqlens=torch.tensor([0, 12, 30]))  # packed: not offered
    leaf = x.clone().requires_grad_()  # gradients: the reference's backward
    (grad,) = torch.autograd.grad(ops.causal_conv1d(leaf, weight, bias, activation="silu")[0].square().sum(), leaf)
    twin = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(causal_conv1d_ref(twin, weight, bias, activation="silu")[0].square().sum(),
                                      twin)
    assert expected.abs().max() > 0.1 and torch.equal(grad, expected)


def test_conv_refuses_disagreeing_shapes_and_unknown_activations_by_name():
    x, weight, bias, s0 = conv_inputs(2, 8, 10, 4, seed=5)
    for function in (cpu_kernels.causal_conv1d, causal_conv1d_ref):
        with pytest.raises(ValueError, match=r"weight must be \[channels=8, width\]"):
            function(x, weight[:4], bias)
        with pytest.raises(ValueError, match=r"initial_state must be \[batch=2, channels=8, width - 1=3\]"):
            function(x, weight, bias, initial_state=s0[:, :, :2])
        with pytest.raises(ValueError, match="activation='gelu'"):
            function(x, weight, bias, activation="gelu")
        with pytest.raises(ValueError, match=r"x must be \[batch, channels, time\]"):
            function(x[0], weight, bias)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty library cache, and no library loaded yet in this process."""
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_library", None)
    return tmp_path


def assert_the_library_serves(path, library, monkeypatch):
    """``path`` is whole again (its digest beside it), and ``library``, loaded from it, runs the SSD exactly."""
    assert cpu_kernels._intact(path) and path.stat().st_size > 1000
    inputs = ssd_inputs(1, 9, 1, 1, 4, 3, seed=6)
    monkeypatch.setattr(cpu_kernels, "_library", library)
    assert_close_rel(cpu_kernels.ssd_chunk_scan(*inputs[:5], 8, inputs[5], initial_state=inputs[6])[0],
                     exact(*inputs)[0])


def test_build_writes_the_library_and_its_digest_and_rebuilds_a_corrupted_one(fresh_cache, monkeypatch):
    path = cpu_kernels.library_path()
    assert path.parent == fresh_cache and path.name.startswith("cpu_kernels-")
    cpu_kernels.load_library()
    assert sorted(p.name for p in fresh_cache.iterdir()) == [path.name, path.name + ".sha256"]  # nothing aside left
    truncated = path.with_name("truncated")
    truncated.write_bytes(path.read_bytes()[:1000])
    truncated.replace(path)  # a new file: the library this process has mapped stays whole (in place: SIGBUS)
    monkeypatch.setattr(cpu_kernels, "_library", None)
    assert_the_library_serves(path, cpu_kernels.load_library(), monkeypatch)


def test_a_library_that_passes_its_digest_but_does_not_load_is_rebuilt(fresh_cache, monkeypatch):
    """A cached library whose digest matches but which the loader refuses (here: bytes that are no library, with
    their own digest written beside them) is built again, once, and then serves."""
    path = cpu_kernels.library_path()
    fresh_cache.mkdir(exist_ok=True)
    path.write_bytes(b"not a shared library")
    cpu_kernels._digest_file(path).write_text(sha256_of(path))
    assert cpu_kernels._intact(path)
    assert_the_library_serves(path, cpu_kernels.load_library(), monkeypatch)


def test_the_cache_name_follows_the_sources_flags_compiler_and_cpu(fresh_cache, tmp_path, monkeypatch):
    first = cpu_kernels.library_path()
    shipped, copy = cpu_kernels.SOURCE_DIR, tmp_path / "sources"
    copy.mkdir()
    for path in shipped.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", copy)
    assert cpu_kernels.library_path() == first
    with (copy / "fast_exp.h").open("a") as header:  # a header counts, as the .cpp files do
        header.write("// changed\n")
    assert cpu_kernels.library_path() != first
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", shipped)
    monkeypatch.setattr(cpu_kernels, "FLAGS", (*cpu_kernels.FLAGS, "-DNDEBUG"))
    assert cpu_kernels.library_path() != first
    monkeypatch.setattr(cpu_kernels, "FLAGS", cpu_kernels.FLAGS[:-1])
    monkeypatch.setattr(cpu_kernels, "_cpu_identity", lambda: "model name: another CPU")
    assert cpu_kernels.library_path() != first


def test_a_failing_compiler_is_reported_with_its_output_and_leaves_no_file(fresh_cache, tmp_path_factory,
                                                                           monkeypatch):
    script = tmp_path_factory.mktemp("bin") / "broken-cxx"
    script.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken 1.0; exit 0; fi\n"
                      "echo 'scans.cpp:1: error: no such intrinsic' >&2; exit 1\n")
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    with pytest.raises(RuntimeError, match=r"building .*cpu_kernels-.*\.so .*broken-cxx failed:\n.*no such intrinsic"):
        cpu_kernels.load_library()
    assert list(fresh_cache.iterdir()) == []
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert "not found" in cpu_kernels.unavailable_reason()


def test_the_ops_library_is_named_by_torch_and_a_failed_build_leaves_torch_paths(fresh_cache, tmp_path_factory,
                                                                                 monkeypatch):
    """The dispatcher ops' C++ kernels (linear, attention) are a second library, built against this torch's
    headers and named by its version; when it cannot be built the error names it, and the decode-step paths
    warn once and keep torch's products and attention."""
    from hybridlm.ops import cpu_attention, cpu_linear

    script = tmp_path_factory.mktemp("bin") / "broken-cxx"
    script.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken 1.0; exit 0; fi\n"
                      "echo 'torch/library.h: No such file' >&2; exit 1\n")
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setattr(cpu_kernels, "_torch_ops_loaded", None)
    with pytest.raises(RuntimeError, match=rf"building .*torch_ops-{re.escape(torch.__version__)}-.*\.so .*"
                                           r"broken-cxx failed:\n.*torch/library.h: No such file"):
        cpu_kernels.load_torch_ops()
    assert list(fresh_cache.iterdir()) == []
    with pytest.warns(UserWarning, match="keeps torch's own products and attention"):
        assert cpu_kernels.torch_ops_ready() is False
    monkeypatch.setattr(cpu_linear, "SERVES_THIS_CPU", True)
    monkeypatch.setattr(cpu_attention, "KERNEL_AVAILABLE", True)
    x, weight = torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    kv = torch.randn(1, 1, 5, 8).bfloat16()
    with torch.no_grad():
        assert cpu_linear.kernel_linear(x, weight, None) is None
        assert cpu_attention.kernel_attention(x.view(1, 1, 2, 8), kv, kv, None, None) is None
