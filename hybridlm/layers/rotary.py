"""Rotary position embedding (the "rotate half" layout of Llama and transformers), optionally partial, with the
frequency scalings long-context checkpoints use (``rope_scaling``):

* ``linear`` (position interpolation): every frequency divided by ``factor``;
* ``dynamic`` (NTK-aware): the base grows with the longest position of the call once it passes
  ``original_max_position_embeddings``; below that it is plain RoPE;
* ``llama3`` (Llama 3.1): long wavelengths divided by ``factor``, short ones kept, a smooth blend between;
* ``yarn``: the same blend by rotations per original context (``beta_fast`` / ``beta_slow``), and cos/sin scaled
  by an attention factor (``0.1 * ln(factor) + 1`` unless given).

The keys of ``rope_scaling`` are transformers' ``rope_parameters`` keys, so a checkpoint's settings carry over.
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: Each scaling type: the ``rope_scaling`` keys it needs, and those it may have (besides ``rope_type``).
SCALING_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor", "original_max_position_embeddings"}), frozenset()),
    "llama3": (frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
               frozenset()),
    "yarn": (frozenset({"factor", "original_max_position_embeddings"}),
             frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"})),
}


def scaling_problem(scaling: dict) -> str | None:
    """What is wrong with a ``rope_scaling`` dict (its type, a missing or unknown key, a factor below 1), or None."""
    rope_type = scaling.get("rope_type")
    if rope_type not in SCALING_KEYS:
        return f"rope_type {rope_type!r} is not supported (hybridlm implements {sorted(SCALING_KEYS)})"
    required, optional = SCALING_KEYS[rope_type]
    given = set(scaling) - {"rope_type"}
    if required - given:
        return f"{rope_type} scaling needs {sorted(required - given)}"
    if given - required - optional:
        return f"{rope_type} scaling does not read {sorted(given - required - optional)}"
    numbers = {key: scaling[key] for key in given if key != "truncate"}
    bad = [key for key, value in numbers.items()
           if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0)]
    if bad:
        return f"{', '.join(sorted(bad))} must be positive numbers"
    if scaling["factor"] < 1:
        return f"factor={scaling['factor']} must be >= 1"
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        return "high_freq_factor must exceed low_freq_factor"
    return None


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict) -> float:
    """The factor YaRN scales cos and sin by: ``attention_factor`` if given, else from ``factor`` (and the
    ``mscale`` / ``mscale_all_dim`` pair when both are set, as DeepSeek's configs do)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    return _yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` channels of each head by angles ``position * inv_freq[i]``, with
    ``inv_freq[i] = theta^(-2i/rotary_dim)`` as ``scaling`` (a ``rope_scaling`` dict, see the module) changes it."""

    def __init__(self, rotary_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"RotaryEmbedding: rotary_dim={rotary_dim} must be even")
        if scaling is not None and (problem := scaling_problem(scaling)):
            raise ValueError(f"RotaryEmbedding: rope_scaling={scaling!r}: {problem}")
        self.rotary_dim, self.theta, self.scaling = rotary_dim, theta, scaling
        rope_type = scaling["rope_type"] if scaling else "default"
        self.rope_type = rope_type
        self.attention_factor = yarn_attention_factor(scaling) if rope_type == "yarn" else 1.0

    def _exponents(self, device) -> torch.Tensor:
        """``2i / rotary_dim`` for ``i < rotary_dim / 2``."""
        return torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).float() / self.rotary_dim

    def inverse_frequencies(self, positions: torch.Tensor) -> torch.Tensor:
        """``inv_freq [rotary_dim / 2]`` for a call over ``positions`` (only ``dynamic`` reads them: its base
        follows the longest position, on the device, without a host sync)."""
        exponents = self._exponents(positions.device)
        s = self.scaling
        if self.rope_type == "dynamic":
            original, factor = s["original_max_position_embeddings"], s["factor"]
            length = torch.clamp(positions.max().float() + 1, min=original)
            base = self.theta * (factor * length / original - (factor - 1)) ** (self.rotary_dim / (self.rotary_dim - 2))
            return 1.0 / base ** exponents
        inv_freq = 1.0 / (self.theta ** exponents)
        if self.rope_type == "linear":
            return inv_freq / s["factor"]
        if self.rope_type == "llama3":
            return self._llama3(inv_freq)
        if self.rope_type == "yarn":
            return self._yarn(inv_freq)
        return inv_freq

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Wavelengths longer than ``original / low_freq_factor`` slowed by ``factor``, shorter than ``original /
        high_freq_factor`` kept, and in between a linear blend in ``original / wavelength``."""
        s = self.scaling
        original, factor = s["original_max_position_embeddings"], s["factor"]
        low, high = s["low_freq_factor"], s["high_freq_factor"]
        wavelength = 2 * math.pi / inv_freq
        blend = ((original / wavelength - low) / (high - low)).clamp(0, 1)  # 0: slowed, 1: kept
        return inv_freq / factor * (1 - blend) + inv_freq * blend

    def _yarn(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Dimensions that turn fewer than ``beta_slow`` times over the original context interpolated (slowed by
        ``factor``), more than ``beta_fast`` times kept, a linear ramp over the dimensions between."""
        s = self.scaling
        original, dim = s["original_max_position_embeddings"], self.rotary_dim

        def dimension_of(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = dimension_of(s.get("beta_fast") or 32), dimension_of(s.get("beta_slow") or 1)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # a step instead of a ramp
        index = torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device)
        interpolated = ((index - low) / (high - low)).clamp(0, 1)  # 0: kept, 1: slowed
        return inv_freq * (1 - interpolated) + inv_freq / s["factor"] * interpolated

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [batch, time]`` -> ``cos, sin [batch, 1, time, rotary_dim]``.

        The frequencies are recomputed per call (``rotary_dim / 2`` values) rather than kept in a buffer, so
        that no state is lost when a model is materialised from the meta device."""
        freqs = positions.float().unsqueeze(-1) * self.inverse_frequencies(positions)
        angles = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply to ``x [batch, heads, time, head_dim]``; channels past ``rotary_dim`` pass through."""
        rot = cos.shape[-1]
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        half = rot // 2
        rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
        out = x_rot * cos + rotated * sin
        return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out
