"""Linformer: attention over a low-rank projection of the sequence axis of keys and values.

The paper's form (``linformer_causal=False``) needs the whole sequence: with ``E, F [rank, max_length]``,
``out = softmax(Q (E K)^T / sqrt(d)) (F V)``, every query seeing every token, so it cannot decode.

The causal form (the default, and the one a language model uses) restricts both projections to the prefix:
``out[t] = softmax(q_t (E_{<=t} K_{<=t})^T / sqrt(d)) (F_{<=t} V_{<=t})``, where ``E_{<=t}`` keeps the
columns of positions ``0..t``. The compressed keys and values are running sums, so the state is two
``[rank, head_dim]`` matrices per head whatever the length, and prefill and decode compute the same thing.
It differs from the paper in that (a) a query sees a compression of its prefix only, whose scale grows with
``t`` (sums, not means, exactly as the paper's ``E K`` over the prefix), and (b) columns are indexed by
position id, so left padding does not shift them. Positions must stay below ``linformer_max_length``.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..cache import CompressedKVState
from .base import HEAD_LAYOUT_FIELDS, Mixer, check_head_layout, register, zero_padding


@register("linformer")
class Linformer(Mixer):
    pattern_letter = "L"
    config_fields = HEAD_LAYOUT_FIELDS + ("linformer_rank", "linformer_max_length", "linformer_causal")
    causal_field = "linformer_causal"  # the paper's form (False) sees the whole sequence
    grows_with_context = False
    max_positions_field = "linformer_max_length"  # E and F have one column per position

    @classmethod
    def check_config(cls, config) -> None:
        check_head_layout(config)

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.rank, self.max_length = config.linformer_rank, config.linformer_max_length
        self.causal = config.linformer_causal
        width = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, width, bias=bias)
        self.k_proj = nn.Linear(hidden, width, bias=bias)
        self.v_proj = nn.Linear(hidden, width, bias=bias)
        self.o_proj = nn.Linear(width, hidden, bias=bias)
        self.key_projection = nn.Parameter(torch.empty(self.rank, self.max_length))
        self.value_projection = nn.Parameter(torch.empty(self.rank, self.max_length))

    def initial_values(self) -> dict[str, torch.Tensor]:
        std = self.rank**-0.5
        return {name: torch.randn(self.rank, self.max_length) * std for name in ("key_projection", "value_projection")}

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> CompressedKVState:
        if not self.causal:
            raise ValueError("a bidirectional Linformer (linformer_causal=False) has no state: it cannot decode")
        shape = (batch_size, self.num_heads, self.rank, self.head_dim)
        return CompressedKVState(keys=torch.zeros(shape, device=device, dtype=torch.float32),
                                 values=torch.zeros(shape, device=device, dtype=torch.float32))

    def forward(self, x, state: CompressedKVState | None = None, *, mask=None, positions=None):
        batch, time, _ = x.shape
        if positions is None:
            first = state.seen if state is not None else 0
            positions = torch.arange(first, first + time, device=x.device).expand(batch, time)
        if int(positions.max()) >= self.max_length:
            raise ValueError(f"Linformer: position {int(positions.max())} >= linformer_max_length={self.max_length}")
        q, k, v = (proj(x).view(batch, time, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        e = zero_padding(self.key_projection.T[positions], mask)  # [batch, time, rank]; padding adds nothing
        f = zero_padding(self.value_projection.T[positions], mask)
        scale = self.head_dim**-0.5
        if self.causal:
            out, (keys, values) = ops.causal_compressed_attention(
                q, k, v, e, f, scale=scale, initial_state=(state.keys, state.values) if state is not None else None
            )
            if state is not None:
                state.keys.copy_(keys)
                state.values.copy_(values)
                state.seen += time
        else:
            if state is not None:
                raise ValueError("a bidirectional Linformer (linformer_causal=False) cannot continue from a state")
            keys = torch.einsum("btr,bhtd->bhrd", e, k)
            values = torch.einsum("btr,bhtd->bhrd", f, v)
            out = torch.softmax(q @ keys.transpose(-1, -2) * scale, dim=-1) @ values
        return self.o_proj(out.to(x.dtype).transpose(1, 2).reshape(batch, time, -1))
