"""RMSNorm, and the gated, grouped RMSNorm of Mamba-2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or kept in fp64: the precision norms and gates compute in (never lower than the model's)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in fp32 and cast back (as Llama, Mamba and Jamba do).

    ``learnable=False`` drops the weight (Falcon-Mamba's norms on dt, B and C): ``x / rms(x)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, learnable: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size)) if learnable else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = at_least_fp32(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) if self.weight is None else self.weight * x.to(dtype)


class GatedRMSNorm(nn.Module):
    """Mamba-2's output norm: ``rms_norm(x * silu(gate))`` over groups of ``group_size`` channels, or with
    ``norm_before_gate`` ``rms_norm(x) * silu(gate)`` (Falcon-H1)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6, norm_before_gate: bool = False):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"GatedRMSNorm: group_size={group_size} does not divide hidden_size={hidden_size}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        x = at_least_fp32(x)
        if gate is not None and not self.norm_before_gate:
            x = x * F.silu(at_least_fp32(gate))
        grouped = x.unflatten(-1, (-1, self.group_size))
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        if gate is not None and self.norm_before_gate:
            return (self.weight * grouped.flatten(-2) * F.silu(at_least_fp32(gate))).to(dtype)
        return self.weight * grouped.flatten(-2).to(dtype)
