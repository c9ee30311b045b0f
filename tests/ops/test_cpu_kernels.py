"""Our C++ CPU scan (``hybridlm.ops.cpu_kernels``, the default ``ssd_chunk_scan`` on CPU tensors) against the
float64 recurrence; what it declines to the reference; and its build cache (digest-named, verified, written aside)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import ops
from hybridlm.ops import backends, cpu_kernels
from hybridlm.ops.ssd import ssd_chunk_scan_ref
from tests.helpers import assert_close_rel
from tests.ops.test_reference_ops import naive_ssd

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                reason=f"CPU scans unavailable: {cpu_kernels.unavailable_reason()}")


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
    assert all(torch.equal(a, b) for a, b in zip(ops.ssd_chunk_scan(x, dt, A, B, C, 8, D, initial_state=s0), kernel))
    # float64: the reference
    doubles = [t.double() for t in (x, dt, A, B, C, D, s0)]
    got = ops.ssd_chunk_scan(*doubles[:5], 8, doubles[5], initial_state=doubles[6])
    reference = ssd_chunk_scan_ref(*doubles[:5], 8, doubles[5], initial_state=doubles[6])
    assert all(torch.equal(a, b) for a, b in zip(got, reference))
    # gradients: the reference's backward
    leaf = x.clone().requires_grad_()
    y, _ = ops.ssd_chunk_scan(leaf, dt, A, B, C, 8, D, initial_state=s0)
    (grad,) = torch.autograd.grad(y.square().sum(), leaf)
    twin = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(ssd_chunk_scan_ref(twin, dt, A, B, C, 8, D, initial_state=s0)[0].square().sum(),
                                      twin)
    assert torch.equal(grad, expected)
    # packed sequences: never offered to a backend that does not take them
    seq_idx = torch.tensor([[0] * 10 + [1] * 14])
    got = ops.ssd_chunk_scan(x, dt, A, B, C, 8, D, seq_idx=seq_idx)
    reference = ssd_chunk_scan_ref(x, dt, A, B, C, 8, D, seq_idx=seq_idx)
    assert all(torch.equal(a, b) for a, b in zip(got, reference))
    with pytest.raises(ValueError, match="disagree"):
        cpu_kernels.ssd_chunk_scan(x, dt[:, :5], A, B, C, 8, D)
    with pytest.raises(ValueError, match="initial_state"):
        cpu_kernels.ssd_chunk_scan(x, dt, A, B, C, 8, D, initial_state=s0[:, :1])


def test_forcing_the_reference_on_cpu_turns_the_kernel_off():
    x, dt, A, B, C, D, s0 = ssd_inputs(1, 24, 1, 2, 8, 4, seed=5)
    with ops.use_backend(ssd_chunk_scan="torch"):
        got = ops.ssd_chunk_scan(x, dt, A, B, C, 8, D, initial_state=s0)
    reference = ssd_chunk_scan_ref(x, dt, A, B, C, 8, D, initial_state=s0)
    assert all(torch.equal(a, b) for a, b in zip(got, reference))


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty library cache, and no library loaded yet in this process."""
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_library", None)
    return tmp_path


def test_build_writes_the_library_and_its_digest_and_rebuilds_a_corrupted_one(fresh_cache, monkeypatch):
    path = cpu_kernels.library_path()
    assert path.parent == fresh_cache and path.name.startswith("cpu_scans-")
    cpu_kernels.load_library()
    assert sorted(p.name for p in fresh_cache.iterdir()) == [path.name, path.name + ".sha256"]  # nothing aside left
    truncated = path.with_name("truncated")
    truncated.write_bytes(path.read_bytes()[:1000])
    truncated.replace(path)  # a new file: the library this process has mapped stays whole (in place: SIGBUS)
    monkeypatch.setattr(cpu_kernels, "_library", None)
    library = cpu_kernels.load_library()
    assert cpu_kernels._intact(path) and path.stat().st_size > 1000
    inputs = ssd_inputs(1, 9, 1, 1, 4, 3, seed=6)
    monkeypatch.setattr(cpu_kernels, "_library", library)
    assert_close_rel(cpu_kernels.ssd_chunk_scan(*inputs[:5], 8, inputs[5], initial_state=inputs[6])[0],
                     exact(*inputs)[0])


def test_the_cache_name_follows_the_source_flags_compiler_and_cpu(fresh_cache, monkeypatch):
    first = cpu_kernels.library_path()
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
    with pytest.raises(RuntimeError, match=r"building .*cpu_scans-.*\.so .*broken-cxx failed:\n.*no such intrinsic"):
        cpu_kernels.load_library()
    assert list(fresh_cache.iterdir()) == []
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert "not found" in cpu_kernels.unavailable_reason()
