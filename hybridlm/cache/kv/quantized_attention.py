"""Decode attention read straight from KIVI's packed codes, without a dequantized copy of the history.

One query per row attends over the quantized tokens and the full-precision tail. With codes ``k̂, v̂``, key
scale and zero ``s, z`` per channel and block ``n(t)`` of ``group`` tokens, value scale and zero ``σ, ζ`` per
token and group ``k(c)`` of ``group`` channels::

    q·k_t          = Σ_c (q_c s_{n(t),c}) k̂_{t,c}  +  Σ_c q_c z_{n(t),c}          (a small matmul per block)
    Σ_t p_t v_{t,c} = Σ_t (p_t σ_{t,k(c)}) v̂_{t,c}  +  Σ_t p_t ζ_{t,k(c)}          (one matmul, all groups)

so the only passes over the history are unpacking the codes (a shift-and-mask per bit plane on bytes, then one
conversion: the codes are packed in planes, see :func:`~hybridlm.cache.kv.quantize.pack`) and two matmuls. Equal to
dequantize-then-attend up to float rounding (``tests/cache/kv/test_kv_quant_decode.py``).
"""

from __future__ import annotations

import dataclasses

import torch


def codes_as(packed: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """``packed [..., m]`` (uint8, packed in planes) -> the codes ``[..., m * 8 / bits]`` as ``dtype``, in channel
    order: one shift-and-mask per plane on bytes, then a single conversion."""
    if bits == 8:
        return packed.to(dtype)
    mask = 2**bits - 1
    planes = [packed & mask] + [(packed >> shift) & mask for shift in range(bits, 8, bits)]
    return torch.cat(planes, -1).to(dtype)


@dataclasses.dataclass
class QuantizedHistory:
    """What a quantized layout held when a decode step's view was taken (views into its buffers, which only
    grow past these ranges, so ageing tokens afterwards does not change them).

    ``key_codes, value_codes [batch, kv_heads, quantized, head_dim * bits / 8]``; ``key_scale, key_zero [batch,
    kv_heads, quantized / group, head_dim]``; ``value_scale, value_zero [batch, kv_heads, quantized, head_dim /
    group]``; ``recent_keys, recent_values [batch, kv_heads, recent, head_dim]``; ``valid``: None or ``[batch,
    1, quantized + recent]``."""

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor
    recent_keys: torch.Tensor
    recent_values: torch.Tensor
    valid: torch.Tensor | None
    bits: int
    group: int

    def attend(self, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        """``q [batch, q_heads, 1, head_dim]`` (already rotated) -> ``[batch, q_heads, 1, head_dim]``."""
        batch, q_heads, time, dim = q.shape
        heads = self.recent_keys.shape[1]
        if time != 1 or q_heads % heads:
            raise ValueError(f"quantized decode attention takes one query per row and a multiple of {heads} "
                             f"query heads (got {time} queries, {q_heads} heads)")
        dtype = torch.promote_types(self.recent_keys.dtype, torch.float32)  # bf16 / fp16 caches: fp32 arithmetic
        q = q.to(dtype).view(batch, heads, q_heads // heads, dim) * (scale if scale is not None else dim**-0.5)
        scores = torch.cat([self._quantized_scores(q), q @ self.recent_keys.to(dtype).transpose(-1, -2)], -1)
        if self.valid is not None:
            scores = scores.masked_fill(~self.valid[:, :, None], -torch.inf)  # [b, h, g, n]
        probs = scores.softmax(-1)
        quantized = self.value_codes.shape[2]
        out = self._quantized_values(probs[..., :quantized]) + probs[..., quantized:] @ self.recent_values.to(dtype)
        return out.view(batch, q_heads, 1, dim).to(self.recent_values.dtype)

    def _quantized_scores(self, q: torch.Tensor) -> torch.Tensor:
        """``q [b, h, g, d]`` (scaled) -> scores ``[b, h, g, quantized]`` against the quantized keys."""
        batch, heads, per_head, dim = q.shape
        blocks, group = self.key_scale.shape[2], self.group
        scaled = q[:, :, None] * self.key_scale[:, :, :, None].to(q.dtype)  # [b, h, blocks, g, d]: q_c s_{n,c}
        codes = codes_as(self.key_codes, self.bits, q.dtype).view(batch, heads, blocks, group, dim)
        scores = scaled @ codes.transpose(-1, -2)  # [b, h, blocks, g, group]
        scores = scores + (self.key_zero.to(q.dtype) @ q.transpose(-1, -2))[..., None]  # + Σ_c q_c z_{n,c}
        return scores.permute(0, 1, 3, 2, 4).reshape(batch, heads, per_head, blocks * group)

    def _quantized_values(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs [b, h, g, quantized]`` -> ``[b, h, g, d]``: the probability-weighted quantized values. One
        matmul for all channel groups ``k``: row ``(g, k)`` weighs token ``t`` by ``p_t σ_{t,k}``; channel ``c``
        takes its own group's row (the diagonal blocks)."""
        batch, heads, per_head, quantized = probs.shape
        groups, value_scale = self.value_scale.shape[-1], self.value_scale.to(probs.dtype)
        weights = torch.stack([probs * value_scale[:, :, None, :, k] for k in range(groups)], 3)  # [b,h,g,k,t]
        weights = weights.view(batch, heads, per_head * groups, quantized)
        codes = codes_as(self.value_codes, self.bits, probs.dtype)  # [b, h, quantized, d]
        every = (weights @ codes).view(batch, heads, per_head, groups, groups, self.group)  # rows k, channels (k', j)
        own = every.diagonal(dim1=3, dim2=4).transpose(-1, -2).reshape(batch, heads, per_head, -1)  # k == k'
        return own + (probs @ self.value_zero.to(probs.dtype)).repeat_interleave(self.group, -1)  # + Σ_t p_t ζ_{t,k(c)}
