"""Softmax attention: MHA / GQA / MQA, RoPE (optionally partial), optional sliding window; SDPA underneath."""

from __future__ import annotations

import torch

from hybridlm import ops
from hybridlm.cache import KVLayout, KVState, KVView
from hybridlm.cache.kv.layouts import RingKV
from hybridlm.layers.linear import Linear
from hybridlm.layers.norms import RMSNorm
from hybridlm.layers.rotary import RotaryEmbedding, scaling_problem
from hybridlm.mixers.base import HEAD_LAYOUT_FIELDS, Mixer, check_head_layout, invalid_config, register
from hybridlm.mixers.segments import check_stateless
from hybridlm.ops.attention import attention_with_probs, slot_mask


@register("attention")
class Attention(Mixer):
    """Attention over all earlier tokens (or the last ``sliding_window`` of them, itself included).

    ``input_size`` (default ``hidden_size``) is the width the q/k/v projections read; the output is always
    ``hidden_size`` wide (Zamba2's shared block reads the hidden state concatenated with the embeddings).
    ``forward`` is :meth:`project` then :meth:`attend`; callers that add to q/k/v (per-site LoRA adapters)
    call the two themselves."""

    pattern_letter = "A"
    config_fields = HEAD_LAYOUT_FIELDS + ("num_key_value_heads", "rope_theta", "rope_scaling",
                                          "partial_rotary_factor", "sliding_window", "attention_scale",
                                          "attention_output_bias", "attention_qk_norm", "attention_output_gate",
                                          "attention_qk_norm_whole")
    # keys are kept normalised and rotated
    state_fields = ("sliding_window", "rope_theta", "rope_scaling", "partial_rotary_factor", "attention_qk_norm",
                    "attention_qk_norm_whole")
    causal = True
    grows_with_context = True

    @classmethod
    def check_config(cls, config) -> None:
        check_head_layout(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % kv_heads:
            raise invalid_config("num_key_value_heads", kv_heads,
                                 f"must divide num_attention_heads={heads} (GQA groups query heads evenly)")
        if config.attention_qk_norm_whole and not config.attention_qk_norm:
            raise invalid_config("attention_qk_norm_whole", True, "needs attention_qk_norm=True (it says how the "
                                 "q/k norms are laid out)")
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        if rotary_dim % 2:
            raise invalid_config("partial_rotary_factor", config.partial_rotary_factor,
                                 f"head_dim={config.head_dim} * partial_rotary_factor must be even")
        if config.rope_scaling is not None:
            problem = scaling_problem(config.rope_scaling) if rotary_dim else \
                "this attention has no RoPE (partial_rotary_factor=0) to scale"
            if problem:
                raise invalid_config("rope_scaling", config.rope_scaling, problem)

    def __init__(self, config, layer_idx: int = 0, input_size: int | None = None):
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        width = input_size or hidden
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.window = config.head_dim, config.sliding_window
        self.scale = config.attention_scale
        self.q_proj = Linear(width, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        out_bias = bias if config.attention_output_bias is None else config.attention_output_bias
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=out_bias)
        rotary_dim = int(self.head_dim * config.partial_rotary_factor)
        self.rotary = RotaryEmbedding(rotary_dim, config.rope_theta, config.rope_scaling) if rotary_dim else None
        # RMSNorm of each query and key head before RoPE (LFM2, Qwen3-Next), or of all heads together (OLMo)
        self.qk_norm_whole = config.attention_qk_norm and config.attention_qk_norm_whole
        if config.attention_qk_norm:
            q_width, k_width = (self.num_heads, self.num_kv_heads) if self.qk_norm_whole else (1, 1)
            self.q_norm = RMSNorm(q_width * self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(k_width * self.head_dim, config.rms_norm_eps)
        # output gate: o_proj(attention * sigmoid(gate_proj(x))) (Qwen3-Next)
        self.gate_proj = Linear(width, self.num_heads * self.head_dim, bias=bias) \
            if config.attention_output_gate else None

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> KVLayout:
        """Preallocates ``max_length`` slots when given; a sliding window writes into a ring of ``window``
        slots instead (a cache policy may swap in another layout: :mod:`hybridlm.cache.kv`)."""
        if self.window is not None:
            return RingKV.empty(batch_size, self.num_kv_heads, self.head_dim, window=self.window, device=device,
                                dtype=dtype)
        return KVState.empty(batch_size, self.num_kv_heads, self.head_dim, capacity=max_length or 0,
                             device=device, dtype=dtype)

    def forward(self, x, state: KVLayout | None = None, *, mask=None, positions=None, segments=None):
        gate = self.gate_proj(x) if self.gate_proj is not None else None
        return self.attend(*self.project(x), state, mask=mask, positions=positions, segments=segments, gate=gate)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ``[batch, time, heads * head_dim]`` of ``x``."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def attend(self, q, k, v, state: KVLayout | None = None, *, mask=None, positions=None,
               segments=None, gate=None) -> torch.Tensor:
        """Attention of projected ``q, k, v`` (see :meth:`project`), through ``o_proj``. With a state, the state
        takes the new keys and values and hands back what to attend over (a :class:`KVView`). With packed
        documents (``segments``) a query sees only its own document's keys. ``gate [batch, time, heads *
        head_dim]``: the output gate's pre-activation (with ``attention_output_gate``)."""
        if segments is not None:
            check_stateless(self.kind, state, mask)
        batch, time, _ = q.shape
        if self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(batch, time, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # [b, h, t, d]
        if hasattr(self, "q_norm") and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if positions is None:
            first = state.end if state is not None else 0
            positions = torch.arange(first, first + time, device=q.device).expand(batch, time)
        rotate = self._rotate if self.rotary is not None else None
        if state is None:
            view = self._parallel_view(k, v, positions, rotate, mask)
        else:
            view = state.update(k, v, positions, rotate, mask)
        if rotate is not None:
            q = rotate(q, view.query_positions)
        packed = {} if segments is None else {"seq_idx": segments.seq_idx}
        out = self._attend_view(q, view, state, packed).transpose(1, 2).reshape(batch, time, -1)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        return RotaryEmbedding.rotate(x, cos, sin)

    def _parallel_view(self, k, v, positions, rotate, mask) -> KVView:
        """The training form: the keys are the new tokens themselves."""
        slots = torch.arange(k.shape[2], device=k.device)
        keys = rotate(k, positions) if rotate is not None else k
        valid = mask[:, None, :] if mask is not None else None  # [batch, 1, time]
        return KVView(keys, v, slots, valid, query_slots=slots, query_positions=positions, window=self.window,
                      in_order=True)

    def _attend_view(self, q, view: KVView, state, packed) -> torch.Tensor:
        """``q [batch, heads, time, head_dim]`` over the view's keys, masked by slot, window and validity."""
        if view.attend is not None:  # the layout attends in place (the paged decode kernel)
            return view.attend(q, self.scale)
        time, n_keys = q.shape[2], view.keys.shape[2]
        wants_probs = state is not None and state.needs_attention_probs
        # In order, without padding or a window, causality is SDPA's own (much faster than an explicit mask).
        plain = view.in_order and view.valid is None and view.window is None and (time == 1 or time == n_keys)
        if plain and not wants_probs:
            return ops.attention(q, view.keys, view.values, causal=time > 1, scale=self.scale, **packed)
        allowed = slot_mask(view.query_slots, view.slots, key_valid=view.valid, key_pinned=view.pinned,
                            window=view.window, q_heads=q.shape[1])
        if wants_probs:
            out, probs = attention_with_probs(q, view.keys, view.values, mask=allowed, scale=self.scale)
            state.observe(probs)
            return out
        return ops.attention(q, view.keys, view.values, mask=allowed, scale=self.scale, **packed)
