"""Softmax attention: MHA / GQA / MQA, RoPE (optionally partial), optional sliding window; SDPA underneath."""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..cache import KVState
from ..layers.norms import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .base import HEAD_LAYOUT_FIELDS, Mixer, check_head_layout, invalid_config, register
from .segments import check_stateless


@register("attention")
class Attention(Mixer):
    """Attention over all earlier tokens (or the last ``sliding_window`` of them, itself included).

    ``input_size`` (default ``hidden_size``) is the width the q/k/v projections read; the output is always
    ``hidden_size`` wide (Zamba2's shared block reads the hidden state concatenated with the embeddings).
    ``forward`` is :meth:`project` then :meth:`attend`; callers that add to q/k/v (per-site LoRA adapters)
    call the two themselves."""

    pattern_letter = "A"
    config_fields = HEAD_LAYOUT_FIELDS + ("num_key_value_heads", "rope_theta", "partial_rotary_factor",
                                          "sliding_window", "attention_scale", "attention_qk_norm",
                                          "attention_output_gate")
    state_fields = ("sliding_window", "rope_theta", "partial_rotary_factor")  # keys are kept rotated
    causal = True
    grows_with_context = True

    @classmethod
    def check_config(cls, config) -> None:
        check_head_layout(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % kv_heads:
            raise invalid_config("num_key_value_heads", kv_heads,
                                 f"must divide num_attention_heads={heads} (GQA groups query heads evenly)")
        if int(config.head_dim * config.partial_rotary_factor) % 2:
            raise invalid_config("partial_rotary_factor", config.partial_rotary_factor,
                                 f"head_dim={config.head_dim} * partial_rotary_factor must be even")

    def __init__(self, config, layer_idx: int = 0, input_size: int | None = None):
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        width = input_size or hidden
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.window = config.head_dim, config.sliding_window
        self.scale = config.attention_scale
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        rotary_dim = int(self.head_dim * config.partial_rotary_factor)
        self.rotary = RotaryEmbedding(rotary_dim, config.rope_theta) if rotary_dim else None
        if config.attention_qk_norm:  # RMSNorm of each query and key head before RoPE (LFM2, Qwen3-Next)
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # output gate: o_proj(attention * sigmoid(gate_proj(x))) (Qwen3-Next)
        self.gate_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=bias) \
            if config.attention_output_gate else None

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> KVState:
        """Preallocates ``max_length`` slots when given (a sliding window keeps ``window - 1`` at most)."""
        capacity = max_length if max_length and self.window is None else 0
        return KVState.empty(batch_size, self.num_kv_heads, self.head_dim, capacity=capacity, window=self.window,
                             device=device, dtype=dtype)

    def forward(self, x, state: KVState | None = None, *, mask=None, positions=None, segments=None):
        gate = self.gate_proj(x) if self.gate_proj is not None else None
        return self.attend(*self.project(x), state, mask=mask, positions=positions, segments=segments, gate=gate)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ``[batch, time, heads * head_dim]`` of ``x``."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def attend(self, q, k, v, state: KVState | None = None, *, mask=None, positions=None,
               segments=None, gate=None) -> torch.Tensor:
        """Attention of projected ``q, k, v`` (see :meth:`project`), through ``o_proj``. With packed documents
        (``segments``) a query sees only its own document's keys. ``gate [batch, time, heads * head_dim]``: the
        output gate's pre-activation (with ``attention_output_gate``)."""
        if segments is not None:
            check_stateless("attention", state, mask)
        batch, time, _ = q.shape
        q, k, v = (t.view(batch, time, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        first = state.end if state is not None else 0  # slot of the first new token
        if self.rotary is not None:
            if positions is None:
                positions = torch.arange(first, first + time, device=q.device).expand(batch, time)
            cos, sin = self.rotary.cos_sin(positions, q.dtype)
            q, k = RotaryEmbedding.rotate(q, cos, sin), RotaryEmbedding.rotate(k, cos, sin)

        if state is None:
            keys, values, key_start, cached_padding, padded_before = k, v, 0, None, False
        else:
            key_start, cached_padding, padded_before = state.start, state.padding, state.has_padding
            keys, values = state.append(k, v)
        # Without padding, a window or earlier keys, causality is SDPA's own (much faster than an explicit mask).
        needs_mask = mask is not None or padded_before or self.window is not None or (time > 1 and keys.shape[2] > time)
        allowed = None
        if needs_mask:
            allowed = self._allowed(time, first, key_start, keys.shape[2], cached_padding, mask, q.device)
        packed = {} if segments is None else {"seq_idx": segments.seq_idx}
        out = ops.attention(q, keys, values, mask=allowed, causal=allowed is None and time > 1, scale=self.scale,
                            **packed)

        if state is not None:
            if mask is not None:
                state.padding = state.padding + (~mask).sum(-1)
                state.has_padding = True
            state.trim_to_window()
        out = out.transpose(1, 2).reshape(batch, time, -1)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))

    def _allowed(self, time, first, key_start, n_keys, cached_padding, mask, device) -> torch.Tensor:
        """Boolean ``[batch, 1, time, n_keys]``: causal, inside the window, and not a padded key."""
        q_slots = torch.arange(first, first + time, device=device)
        k_slots = torch.arange(key_start, key_start + n_keys, device=device)
        allowed = k_slots <= q_slots[:, None]
        if self.window is not None:
            allowed = allowed & (q_slots[:, None] - k_slots < self.window)
        cached = n_keys - time
        key_ok = mask if mask is not None else torch.ones(1, time, dtype=torch.bool, device=device)
        if cached:
            held = k_slots[:cached] >= cached_padding[:, None]  # [batch, cached]
            key_ok = torch.cat([held, key_ok.expand(held.shape[0], time)], dim=-1)
        allowed = allowed & key_ok[:, None, :]
        allowed = allowed | (k_slots == q_slots[:, None])  # a padded query sees itself: finite, never read
        return allowed.unsqueeze(1)
