"""Our CUDA selective scan (kernels/ through hybridlm.ops.cuda) against the reference, forward and backward.

Two targets run the same kernel source through the same binding and autograd wrapper:

* ``cuda``: the extension built by torch on a GPU machine, on CUDA tensors;
* ``emulated``: on any machine with a host compiler and the CUDA headers, the kernels compiled for the CPU under
  ``cuda_emulation/`` (a block is 128 threads with real barriers and warp shuffles; output buffers are filled
  with NaN first), on CPU tensors. It checks the kernels' logic (scans, indexing, chunk hand-over, every
  gradient, every element written); not nvcc's code generation.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridlm.ops import cuda
from hybridlm.ops.selective_scan import selective_scan_ref
from tests.helpers import assert_close_rel

from .cuda_build import EMULATED_LIBRARY, build_emulated_library, cuda_include, host_compiler

CHUNK = 1024  # kChunk in kernels/selective_scan/selective_scan.h


@pytest.fixture(scope="module", params=["emulated", "cuda"])
def target(request, tmp_path_factory):
    """(operator library, device) of one target."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        reason = cuda.unavailable_reason()
        if reason is not None:
            pytest.skip(f"the CUDA extension cannot be built here: {reason}")
        return cuda.load_library(), "cuda"
    if cuda_include() is None or host_compiler() is None:
        pytest.skip("the emulation needs a host C++ compiler and the CUDA headers (cuda_bf16.h) next to nvcc")
    torch.ops.load_library(str(build_emulated_library(tmp_path_factory.mktemp("emulated"))))
    return getattr(torch.ops, EMULATED_LIBRARY), "cpu"


def scan_inputs(device, batch, dim, dstate, length, groups, *, seed=0, dtype=torch.float32, options=()):
    """Inputs of a selective scan; ``options`` names the optional ones to include. ``groups=None``: 3-d B, C."""
    generator = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device)

    grouping = (batch, dstate, length) if groups is None else (batch, groups, dstate, length)
    inputs = dict(u=r(batch, dim, length).to(dtype), delta=r(batch, dim, length, scale=0.5).to(dtype),
                  A=-torch.rand(dim, dstate, generator=generator).to(device) - 0.2,
                  B=r(*grouping).to(dtype), C=r(*grouping).to(dtype))
    optional = dict(D=r(dim), z=r(batch, dim, length).to(dtype), delta_bias=r(dim, scale=0.5),
                    initial_state=r(batch, dim, dstate))
    inputs.update({name: value for name, value in optional.items() if name in options})
    inputs["delta_softplus"] = "softplus" in options
    if "softplus" not in options:  # keep the steps positive, as a model's are
        inputs["delta"] = inputs["delta"].abs()
    return inputs


def compare(target, inputs, rel, final_state_gradient=True):
    """Outputs and the gradients of every tensor input equal the reference's under the same output gradients."""
    library, device = target
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    options = {k: v for k, v in inputs.items() if k not in tensors}
    results = []
    for scan in (lambda **kw: cuda.scan_with(library, **kw), selective_scan_ref):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in tensors.items()}
        results.append((leaves, *scan(**leaves, **options)))
    (leaves, y, final), (ref_leaves, y_ref, final_ref) = results
    assert y.dtype == y_ref.dtype and final.dtype == torch.float32
    assert_close_rel(y, y_ref, rel)
    assert_close_rel(final, final_ref, 1e-5 if y.dtype == torch.float32 else rel)
    generator = torch.Generator().manual_seed(1)
    dy = torch.randn(y.shape, generator=generator).to(device, y.dtype)
    dfinal = torch.randn(final.shape, generator=generator).to(device) if final_state_gradient else None
    grads, ref_grads = (
        torch.autograd.grad([out, last] if dfinal is not None else [out], list(lv.values()),
                            [dy, dfinal] if dfinal is not None else [dy])
        for out, last, lv in ((y, final, leaves), (y_ref, final_ref, ref_leaves))
    )
    # one step from a zero state never multiplies the state by exp(delta A): A's gradient is exactly zero then
    zero_A_gradient = y.shape[-1] == 1 and "initial_state" not in tensors
    for name, got, expected in zip(leaves, grads, ref_grads):
        assert got.dtype == expected.dtype, name
        assert not got.isnan().any(), f"gradient of {name} has NaN"
        try:
            assert_close_rel(got, expected, rel, allow_zero_reference=name == "A" and zero_A_gradient)
        except AssertionError as error:
            raise AssertionError(f"gradient of {name}: {error}") from None


OPTIONS = ("D", "z", "delta_bias", "softplus", "initial_state")


@settings(max_examples=5)
@given(batch=st.integers(1, 2), dim=st.sampled_from([2, 4]), dstate=st.integers(1, 5), length=st.integers(1, 70),
       groups=st.sampled_from([None, 1, 2]), options=st.sets(st.sampled_from(OPTIONS)))
@example(batch=2, dim=4, dstate=3, length=37, groups=2, options=set(OPTIONS))
def test_matches_reference(target, batch, dim, dstate, length, groups, options):
    compare(target, scan_inputs(target[1], batch, dim, dstate, length, groups, options=options), rel=1e-5)


def test_state_is_handed_over_between_chunks(target):
    """Two chunks and a partial third: the state crosses chunk boundaries forward and its adjoint backward."""
    inputs = scan_inputs(target[1], 1, 2, 3, 2 * CHUNK + 45, 2, options=OPTIONS)
    compare(target, inputs, rel=1e-5)


@pytest.mark.parametrize("dtype,rel", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_half_inputs_keep_an_fp32_state(target, dtype, rel):
    """Against the reference on the same half-precision inputs (it computes in fp32 and rounds the results)."""
    inputs = scan_inputs(target[1], 2, 4, 4, 50, None, dtype=dtype, options=("D", "z", "initial_state"))
    compare(target, inputs, rel=rel, final_state_gradient=False)


def test_a_zero_length_scan_returns_the_initial_state(target):
    inputs = scan_inputs(target[1], 2, 4, 3, 0, 1, options=("initial_state",))
    y, final = cuda.scan_with(target[0], **inputs)
    assert y.shape == (2, 4, 0) and torch.equal(final, inputs["initial_state"])


def test_cuda_selective_scan_has_the_reference_signature():
    # packed input (seq_idx / cu_seqlens) is optional: the dispatcher declines a backend that does not take it
    reference = inspect.signature(selective_scan_ref)
    packing = ("seq_idx", "cu_seqlens")
    unpacked = reference.replace(parameters=[p for n, p in reference.parameters.items() if n not in packing])
    assert inspect.signature(cuda.selective_scan) == unpacked


def test_cuda_selective_scan_checks_its_arguments_before_building():
    inputs = scan_inputs("cpu", 1, 4, 3, 5, 2)
    with pytest.raises(ValueError, match="needs CUDA tensors, got cpu"):
        cuda.selective_scan(**inputs)
    bad = [("A", torch.zeros(5, 3), r"A must be \[dim=4, dstate <= 256\]"),
           ("B", torch.zeros(1, 3, 3, 5), "3 groups of B do not divide dim=4"),
           ("C", torch.zeros(1, 2, 3, 6), "C must be .* time=5"),
           ("z", torch.zeros(1, 4, 6), r"z must be \[1, 4, 5\]"),
           ("initial_state", torch.zeros(1, 4, 2), r"initial_state must be \[1, 4, 3\]")]
    # float64 and dstate > 256 are declined (the next backend runs): tests/ops/test_kernel_safety.py
    for name, value, message in bad:
        with pytest.raises(ValueError, match=message):
            cuda.selective_scan(**{**inputs, name: value})
