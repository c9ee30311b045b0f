"""Performer (FAVOR+): softmax attention approximated by positive orthogonal random features, causal.

``phi(x) = exp(W x' - |x'|^2 / 2)`` with ``x' = x / head_dim^(1/4)`` and ``W`` the ``features x head_dim``
orthogonal random matrix (kept as a buffer, so it is saved with the weights). Then
``out[t] = sum_s phi(q_t).phi(k_s) v_s / sum_s phi(q_t).phi(k_s)``, a causal linear attention whose state is
``[head_dim + 1, features]`` per head. Overflow is prevented exactly: query features are scaled by their own
maximum and key features by the running maximum of all key log-features so far (a factor common to
numerator and denominator, applied to the state as a decay), so the result is that of the plain formula.
With ``performer_redraw_interval`` set, ``W`` is redrawn every that many training forwards; never in eval.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..cache import LinearAttentionState
from .base import HEAD_LAYOUT_FIELDS, Mixer, check_head_layout, register


def orthogonal_random_features(features: int, dim: int) -> torch.Tensor:
    """``[features, dim]``: blocks of orthonormal rows, each row scaled to the norm of a Gaussian vector."""
    blocks = []
    for _ in range(-(-features // dim)):
        q, _ = torch.linalg.qr(torch.randn(dim, dim))
        blocks.append(q.T)
    norms = torch.randn(features, dim).norm(dim=1, keepdim=True)
    return torch.cat(blocks)[:features] * norms


@register("performer")
class Performer(Mixer):
    pattern_letter = "P"
    config_fields = HEAD_LAYOUT_FIELDS + ("performer_num_features", "performer_redraw_interval")
    causal = True
    grows_with_context = False

    @classmethod
    def check_config(cls, config) -> None:
        check_head_layout(config)

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.num_features, self.redraw_interval = config.performer_num_features, config.performer_redraw_interval
        width = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, width, bias=bias)
        self.k_proj = nn.Linear(hidden, width, bias=bias)
        self.v_proj = nn.Linear(hidden, width, bias=bias)
        self.o_proj = nn.Linear(width, hidden, bias=bias)
        self.register_buffer("projection", orthogonal_random_features(self.num_features, self.head_dim))
        self.training_calls = 0

    def initial_values(self) -> dict[str, torch.Tensor]:
        return {"projection": orthogonal_random_features(self.num_features, self.head_dim)}

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> LinearAttentionState:
        shape = (batch_size, self.num_heads, self.head_dim + 1, self.num_features)
        return LinearAttentionState(
            kv=torch.zeros(shape, device=device, dtype=torch.float32),
            max=torch.zeros(batch_size, self.num_heads, device=device, dtype=torch.float32),
        )

    def _log_features(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float() * self.head_dim**-0.25
        return x @ self.projection.float().T - x.square().sum(-1, keepdim=True) / 2

    def forward(self, x, state: LinearAttentionState | None = None, *, mask=None, positions=None):
        batch, time, _ = x.shape
        if self.training and self.redraw_interval:
            if self.training_calls % self.redraw_interval == 0:
                self.projection.copy_(orthogonal_random_features(self.num_features, self.head_dim))
            self.training_calls += 1
        q, k, v = (proj(x).view(batch, time, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        log_q = self._log_features(q)
        q_feat = torch.exp(log_q - log_q.amax(-1, keepdim=True))  # per-query scale: cancels in the ratio
        log_k = self._log_features(k)
        if mask is not None:  # a padded key has zero features and does not move the running maximum
            log_k = log_k.masked_fill(~mask[:, None, :, None], -torch.inf)
        previous = state.max if state is not None else log_k.new_zeros(batch, self.num_heads)
        running = torch.maximum(log_k.amax(-1).cummax(-1).values, previous.unsqueeze(-1))  # [b, h, t]
        log_decay = torch.cat([previous.unsqueeze(-1), running[..., :-1]], dim=-1) - running
        k_feat = torch.exp(log_k - running.unsqueeze(-1))
        v_ones = torch.cat([v.float(), v.new_ones(batch, self.num_heads, time, 1, dtype=torch.float32)], dim=-1)
        out, final = ops.causal_linear_attention(
            q_feat, k_feat, v_ones, log_decay, initial_state=state.kv if state is not None else None
        )
        if state is not None:
            state.kv.copy_(final)
            state.max.copy_(running[..., -1])
        out = out[..., :-1] / out[..., -1:].clamp_min(torch.finfo(torch.float32).tiny)
        return self.o_proj(out.to(x.dtype).transpose(1, 2).reshape(batch, time, -1))
