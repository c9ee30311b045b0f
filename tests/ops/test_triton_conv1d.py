"""Triton causal conv1d (sequence form and decode update) against the PyTorch references."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridlm.ops.causal_conv1d import causal_conv1d_ref

from .triton_support import check_against_reference, kernels, randn


@settings(max_examples=8)
@given(
    batch=st.integers(1, 2), channels=st.integers(1, 40), length=st.integers(1, 80), width=st.integers(1, 4),
    activation=st.sampled_from([None, "silu"]), with_bias=st.booleans(), with_state=st.booleans(),
)
@example(batch=2, channels=37, length=70, width=4, activation="silu", with_bias=True, with_state=True)
@example(batch=1, channels=3, length=2, width=4, activation=None, with_bias=False, with_state=True)
def test_conv_matches_reference(batch, channels, length, width, activation, with_bias, with_state):
    torch.manual_seed(0)
    inputs = dict(
        x=randn(batch, channels, length), weight=randn(channels, width), bias=randn(channels) if with_bias else None,
        initial_state=randn(batch, channels, width - 1) if with_state else None,
    )
    check_against_reference(kernels.causal_conv1d, causal_conv1d_ref, inputs, activation=activation)


def test_bf16_inputs_keep_their_dtype():
    """bf16 in, bf16 out and window (and gradients), within a few bf16 roundings of the reference."""
    torch.manual_seed(2)
    inputs = dict(x=randn(2, 5, 11), weight=randn(5, 4), bias=randn(5), initial_state=randn(2, 5, 3))
    inputs = {k: v.bfloat16() for k, v in inputs.items()}
    y, final = check_against_reference(kernels.causal_conv1d, causal_conv1d_ref, inputs, rel=1e-2, activation="silu")
    assert (y.dtype, final.dtype) == (torch.bfloat16, torch.bfloat16)


def test_decode_steps_equal_the_sequence():
    """The update kernel token by token gives the outputs and the window of one pass over the sequence."""
    torch.manual_seed(1)
    batch, channels, length, width = 2, 5, 9, 4
    x, weight, bias, window = randn(batch, channels, length), randn(channels, width), randn(channels), \
        randn(batch, channels, width - 1)
    y_seq, final = kernels.causal_conv1d(x, weight, bias, initial_state=window, activation="silu")
    steps = [kernels.causal_conv1d_update(x[..., t], window, weight, bias, activation="silu") for t in range(length)]
    torch.testing.assert_close(torch.stack(steps, -1), y_seq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(window, final, rtol=0, atol=0)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="activation"):
        kernels.causal_conv1d(randn(1, 3, 4), randn(3, 2), activation="relu")
    with pytest.raises(ValueError, match="weight"):
        kernels.causal_conv1d(randn(1, 3, 4), randn(4, 2))
    with pytest.raises(ValueError, match="initial_state"):
        kernels.causal_conv1d(randn(1, 3, 4), randn(3, 2), initial_state=randn(1, 3, 2))
    with pytest.raises(ValueError, match="conv_state"):
        kernels.causal_conv1d_update(randn(1, 3), randn(1, 3, 2), randn(3, 2))
