"""Shared setup of the Triton kernel tests (``test_triton_*.py``).

The kernels run on the GPU when there is one, else in Triton's CPU interpreter. ``TRITON_INTERPRET=1`` must be
set before the kernels are defined (when ``hybridlm.ops.triton`` is first imported) and stay set while they run,
so importing this module sets it for the rest of the test process, but only on machines without CUDA.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import pytest
import torch

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
else:  # the references are the oracle: keep their fp32 products exact (no tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

kernels = importlib.import_module("hybridlm.ops.triton")
_common = importlib.import_module("hybridlm.ops.triton._common")
if DEVICE == "cpu" and not _common.INTERPRETED:
    raise RuntimeError("hybridlm.ops.triton was imported before TRITON_INTERPRET=1 was set; its kernels cannot run")
poisoned_outputs, new_buffer = _common.poisoned_outputs, _common.new_buffer


def randn(*shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE) * scale


def uniform(*shape, low: float, high: float) -> torch.Tensor:
    return torch.rand(*shape, device=DEVICE) * (high - low) + low


def assert_close(got: torch.Tensor, expected: torch.Tensor, name: str, rel: float = 1e-5) -> None:
    """``max |got - expected| <= rel * max(max |expected|, 1)``; NaN anywhere fails.

    The test inputs are of order 1, so a result that is exactly zero (e.g. the gradient of a decay that only
    ever multiplies a zero state) is held to the rounding of order-1 terms, not to zero.
    """
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    assert got.dtype == expected.dtype, f"{name}: dtype {got.dtype} != {expected.dtype}"
    assert not got.isnan().any(), f"{name}: NaN (an element the kernels never wrote?)"
    if expected.numel():
        error = (got - expected).abs().max() / expected.abs().max().clamp_min(1.0)
        assert error <= rel, f"{name}: relative error {float(error):.3g} > {rel}"


def check_against_reference(kernel, reference, inputs: dict, rel: float = 1e-5, **options) -> list[torch.Tensor]:
    """Run ``kernel(**inputs, **options)`` (every buffer NaN-poisoned) and ``reference`` likewise; compare the
    outputs and the gradients of every tensor input under the same random output gradients.

    Returns the kernel's outputs.
    """
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}

    def run(fn, poison: bool):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in tensors.items()}
        with poisoned_outputs() if poison else contextlib.nullcontext():
            outputs = fn(**{**inputs, **leaves}, **options)
        return leaves, outputs

    got_leaves, got = run(kernel, poison=True)
    ref_leaves, expected = run(reference, poison=False)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert_close(g.detach(), e.detach(), f"output {i}", rel)
    cotangents = [randn(*e.shape) for e in expected]
    ref_grads = torch.autograd.grad(expected, list(ref_leaves.values()), cotangents, allow_unused=True)
    with poisoned_outputs():
        got_grads = torch.autograd.grad(got, list(got_leaves.values()), cotangents, allow_unused=True)
    for name, g, e in zip(tensors, got_grads, ref_grads):
        assert (g is None) == (e is None), f"gradient of {name}: {g is None=} vs {e is None=}"
        if e is not None:
            assert_close(g, e, f"gradient of {name}", rel)
    return got

