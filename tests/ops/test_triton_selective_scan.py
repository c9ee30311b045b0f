"""Triton Mamba-1 selective scan and the decode state update against the PyTorch references."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridlm.ops.selective_scan import selective_scan_ref

from .triton_support import check_against_reference, kernels, randn, uniform


def scan_inputs(batch, dim, length, dstate, groups, options):
    grouped = (batch, groups, dstate, length) if groups > 1 else (batch, dstate, length)
    return dict(
        u=randn(batch, dim, length), delta=randn(batch, dim, length, scale=0.5),
        A=-uniform(dim, dstate, low=0.2, high=2), B=randn(*grouped), C=randn(*grouped),
        D=randn(dim) if "D" in options else None, z=randn(batch, dim, length) if "z" in options else None,
        delta_bias=randn(dim, scale=0.5) if "bias" in options else None,
        initial_state=randn(batch, dim, dstate) if "state" in options else None,
    )


@settings(max_examples=8)
@given(
    batch=st.integers(1, 2), channels_per_group=st.sampled_from([1, 2, 3, 4]), groups=st.sampled_from([1, 2]),
    length=st.integers(1, 40), dstate=st.integers(1, 6), chunk=st.sampled_from([None, 4, 8]),
    softplus=st.booleans(), options=st.sets(st.sampled_from(["D", "z", "bias", "state"])),
)
@example(batch=2, channels_per_group=4, groups=2, length=37, dstate=5, chunk=8, softplus=True,
         options={"D", "z", "bias", "state"})
def test_selective_scan_matches_reference(batch, channels_per_group, groups, length, dstate, chunk, softplus, options):
    torch.manual_seed(0)
    inputs = scan_inputs(batch, channels_per_group * groups, length, dstate, groups, options)
    if not softplus:
        inputs["delta"] = inputs["delta"].abs()  # a step size is positive
    check_against_reference(kernels.selective_scan, selective_scan_ref, inputs, delta_softplus=softplus,
                            chunk_size=chunk)


def test_bf16_inputs_keep_their_dtype():
    """bf16 in, bf16 out (and bf16 gradients), an fp32 state, within a few bf16 roundings of the reference."""
    torch.manual_seed(2)
    inputs = scan_inputs(2, 4, 13, 3, 2, {"D", "z", "state"})
    inputs = {k: v.bfloat16() if k in ("u", "delta", "B", "C", "z") else v for k, v in inputs.items()}
    y, final = check_against_reference(kernels.selective_scan, selective_scan_ref, inputs, rel=1e-2,
                                       delta_softplus=True)
    assert (y.dtype, final.dtype) == (torch.bfloat16, torch.float32)


def test_decode_steps_equal_the_scan():
    """Mamba-1 decode: the state update kernel token by token equals the scan over the whole sequence."""
    torch.manual_seed(1)
    batch, dim, length, dstate, groups = 2, 6, 11, 4, 2
    inputs = scan_inputs(batch, dim, length, dstate, groups, {"D", "z", "bias", "state"})
    y_scan, final = kernels.selective_scan(**inputs, delta_softplus=True, chunk_size=4)

    state = inputs["initial_state"].clone()
    steps = [
        kernels.selective_state_update(
            state, inputs["u"][..., t], inputs["delta"][..., t], inputs["A"], inputs["B"][..., t],
            inputs["C"][..., t], D=inputs["D"], z=inputs["z"][..., t], dt_bias=inputs["delta_bias"], dt_softplus=True,
        )
        for t in range(length)
    ]
    torch.testing.assert_close(torch.stack(steps, -1), y_scan, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, final, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_named():
    inputs = scan_inputs(1, 4, 5, 3, 1, {"D"})
    with pytest.raises(ValueError, match="D must be"):
        kernels.selective_scan(**{**inputs, "D": randn(3)})
    with pytest.raises(ValueError, match="groups do not divide"):
        kernels.selective_scan(**{**inputs, "B": randn(1, 3, 3, 5), "C": randn(1, 3, 3, 5)})
    with pytest.raises(ValueError, match="groups do not divide"):
        kernels.selective_state_update(randn(1, 4, 3), randn(1, 4), randn(1, 4), randn(4, 3), randn(1, 3, 3),
                                       randn(1, 3, 3))
    with pytest.raises(ValueError, match="dt must be"):
        kernels.selective_state_update(randn(1, 4, 3), randn(1, 4), randn(1, 5), randn(4, 3), randn(1, 3),
                                       randn(1, 3))
