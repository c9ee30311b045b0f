"""Rotary position embedding (the "rotate half" layout of Llama and transformers), optionally partial."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` channels of each head by angles ``position * theta^(-2i/rotary_dim)``."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"RotaryEmbedding: rotary_dim={rotary_dim} must be even")
        self.rotary_dim, self.theta = rotary_dim, theta

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [batch, time]`` -> ``cos, sin [batch, 1, time, rotary_dim]``.

        The frequencies are recomputed per call (``rotary_dim / 2`` values) rather than kept in a buffer, so
        that no state is lost when a model is materialised from the meta device."""
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=positions.device).float()
        inv_freq = 1.0 / (self.theta ** (exponents / self.rotary_dim))
        freqs = positions.float().unsqueeze(-1) * inv_freq
        angles = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply to ``x [batch, heads, time, head_dim]``; channels past ``rotary_dim`` pass through."""
        rot = cos.shape[-1]
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        half = rot // 2
        rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
        out = x_rot * cos + rotated * sin
        return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out
