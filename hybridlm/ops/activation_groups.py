"""The inputs of a product quantized to int8 per group of features, as llama.cpp's Q8_0 quantizes activations: the
reference of the int8 x int8 linear (``cpu_kernels.int8_linear_rows``), which quantizes inside its C++ kernel, and
the path of the products it does not serve (other devices, or no C++ compiler). A group's scale is ``max |x| / 127``
and its codes ``round(x / scale)``, half to even, in [-127, 127] (0 where the group is all zero), all in fp32."""

from __future__ import annotations

import torch


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes like x's shape, as fp32 integers; scales [..., in / group] fp32)`` of ``x [..., in]``."""
    if group <= 0 or x.shape[-1] % group:
        raise ValueError(f"quantize_groups: {x.shape[-1]} features do not split into groups of {group}")
    grouped = x.float().unflatten(-1, (-1, group))  # [..., groups, group]
    scales = grouped.abs().amax(-1) / 127  # [..., groups]
    codes = torch.where(scales.unsqueeze(-1) > 0, torch.round(grouped / scales.unsqueeze(-1)), 0.0)
    return codes.flatten(-2), scales


def round_through_int8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` as its int8 codes per group represent it (fp32): what the int8 x int8 product multiplies."""
    codes, scales = quantize_groups(x, group)
    return (codes.unflatten(-1, (-1, group)) * scales.unsqueeze(-1)).flatten(-2)
