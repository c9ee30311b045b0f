"""The comparison helpers themselves: a comparison must fail whenever the result is wrong."""

import pytest
import torch

from tests.helpers import assert_close_rel, relative_error


def test_relative_error_is_relative_to_the_reference():
    expected = torch.tensor([10.0, -20.0])
    assert relative_error(expected + torch.tensor([0.0, 0.2]), expected) == pytest.approx(0.01, rel=1e-4)
    assert relative_error(expected, expected) == 0.0


def test_an_all_zero_result_is_not_close_to_a_non_zero_reference():
    expected = torch.tensor([1e-30, 0.0, -3e-30])
    assert relative_error(torch.zeros(3), expected) == pytest.approx(1.0)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close_rel(torch.zeros(3), expected)


def test_an_all_zero_reference_needs_saying_so():
    zero = torch.zeros(2, 3)
    with pytest.raises(AssertionError, match="all zero"):
        assert_close_rel(zero, zero)
    assert_close_rel(zero, zero, allow_zero_reference=True)
    assert relative_error(torch.full((2, 3), 1e-30), zero) == float("inf")
    with pytest.raises(AssertionError, match="relative error"):
        assert_close_rel(torch.full((2, 3), 1e-30), zero, allow_zero_reference=True)


def test_nan_and_infinite_values_never_pass():
    expected = torch.ones(3)
    with pytest.raises(AssertionError):
        assert_close_rel(torch.tensor([1.0, float("nan"), 1.0]), expected)
    with pytest.raises(AssertionError, match="not finite"):
        assert_close_rel(expected, torch.tensor([1.0, float("inf"), 1.0]))
    with pytest.raises(AssertionError, match="shapes"):
        assert_close_rel(torch.ones(2), torch.ones(3))
