"""Kimi Delta Attention (KDA, Kimi Linear): the gated delta rule with one decay per key channel.

q, k, v projections -> one short causal conv + SiLU over ``[q | k | v]``; q, k L2-normalised; ``beta =
sigmoid(b_proj(x))`` per head; the log decay of each key channel ``g = -exp(A_log[head]) * softplus(f_b(f_a(x)) +
dt_bias)`` (a rank-``dim_k`` projection); ``o = gated_delta_rule(q, k, v, g, beta)`` with the channel-wise gate
(:func:`hybridlm.ops.gated_delta_rule`); ``o = RMSNorm(o) * sigmoid(g_b(g_a(x)))`` per head (one norm weight
shared by the heads); o_proj. The names are Kimi Linear's.

It reads Gated DeltaNet's ``deltanet_*`` fields (heads, head widths, conv width, chunk, output-norm eps); key
and value heads must be equal. State: :class:`~hybridlm.cache.SSMState`, the conv window ``[2 heads dim_k +
heads dim_v, conv - 1]`` and the fp32 matrix ``[heads, dim_k, dim_v]``. A padded token enters the conv window as
zeros and has ``beta = g = 0``, so the state passes it unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.cache import SSMState
from hybridlm.layers.conv import ShortConv
from hybridlm.layers.linear import Linear
from hybridlm.layers.norms import RMSNorm, at_least_fp32
from hybridlm.mixers.base import Mixer, invalid_config, register, zero_padding
from hybridlm.mixers.gated_deltanet import check_positive, delta_rule_state, l2_normalize, run_delta_rule
from hybridlm.mixers.segments import check_stateless
from hybridlm.ops.causal_conv1d import causal_conv1d_windows


@register("kda")
class KimiDeltaAttention(Mixer):
    pattern_letter = "K"
    config_fields = ("deltanet_num_key_heads", "deltanet_num_value_heads", "deltanet_key_head_dim",
                     "deltanet_value_head_dim", "deltanet_conv_size", "deltanet_chunk_size", "deltanet_norm_eps")
    causal = True
    grows_with_context = False

    @classmethod
    def check_config(cls, config) -> None:
        check_positive(config, cls.config_fields[:6])  # the head layout and sizes (integers)
        if config.deltanet_num_value_heads != config.deltanet_num_key_heads:
            raise invalid_config("deltanet_num_value_heads", config.deltanet_num_value_heads,
                                 f"kda layers need as many value heads as key heads "
                                 f"(deltanet_num_key_heads={config.deltanet_num_key_heads})")

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        hidden = config.hidden_size
        self.heads, self.chunk_size = config.deltanet_num_key_heads, config.deltanet_chunk_size
        self.dim_k, self.dim_v = config.deltanet_key_head_dim, config.deltanet_value_head_dim
        key_dim, value_dim = self.heads * self.dim_k, self.heads * self.dim_v
        self.q_proj = Linear(hidden, key_dim, bias=False)
        self.k_proj = Linear(hidden, key_dim, bias=False)
        self.v_proj = Linear(hidden, value_dim, bias=False)
        self.conv1d = ShortConv(2 * key_dim + value_dim, config.deltanet_conv_size, bias=False)
        self.f_a_proj = Linear(hidden, self.dim_k, bias=False)  # the decay's low-rank projection
        self.f_b_proj = Linear(self.dim_k, key_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(key_dim))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.b_proj = Linear(hidden, self.heads, bias=False)
        self.g_a_proj = Linear(hidden, self.dim_v, bias=False)  # the output gate's low-rank projection
        self.g_b_proj = Linear(self.dim_v, value_dim, bias=False)
        norm_eps = config.deltanet_norm_eps if config.deltanet_norm_eps is not None else config.rms_norm_eps
        self.o_norm = RMSNorm(self.dim_v, norm_eps)
        self.o_proj = Linear(value_dim, hidden, bias=False)

    def initial_values(self) -> dict[str, torch.Tensor]:
        """fla's: ``A`` uniform in [1, 16]; ``softplus(dt_bias)`` log-uniform in [1e-3, 0.1]."""
        dt = torch.empty(self.dt_bias.shape).uniform_(math.log(1e-3), math.log(0.1)).exp().clamp(min=1e-4)
        return {"A_log": torch.empty(self.heads).uniform_(1, 16).log(), "dt_bias": dt + torch.log(-torch.expm1(-dt))}

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> SSMState:
        return delta_rule_state(self, batch_size, device, dtype)

    def forward(self, x, state: SSMState | None = None, *, mask=None, positions=None, segments=None):
        packed = {}
        if segments is not None:  # packed documents: one row, conv window and state restarting at each
            check_stateless(self.kind, state, mask)
            x, packed = segments.one_row(x), segments.scan_kwargs()
        batch, time, _ = x.shape
        track = state is not None and state.checkpointing(time)  # keep the state after each token (rollback)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [batch, time, conv channels]
        conv_in = zero_padding(qkv, mask).transpose(1, 2)  # [batch, conv channels, time]
        windows = causal_conv1d_windows(conv_in, state.conv) if track else None
        qkv = self.conv1d(conv_in, state.conv if state is not None else None, **packed).transpose(1, 2)
        q, k, v = qkv.split([self.heads * self.dim_k] * 2 + [self.heads * self.dim_v], dim=-1)
        q = l2_normalize(q.view(batch, time, self.heads, self.dim_k))  # [batch, time, heads, dim_k]
        k = l2_normalize(k.view(batch, time, self.heads, self.dim_k))
        v = v.reshape(batch, time, self.heads, self.dim_v)
        beta = zero_padding(torch.sigmoid(at_least_fp32(self.b_proj(x))), mask)  # [batch, time, heads]
        decay = at_least_fp32(self.f_b_proj(self.f_a_proj(x))) + self.dt_bias  # [batch, time, heads * dim_k]
        rate = at_least_fp32(self.A_log).exp()[:, None]  # [heads, 1]
        log_gate = zero_padding(-rate * F.softplus(decay.view(batch, time, self.heads, self.dim_k)), mask)
        o = run_delta_rule(state, q, k, v, log_gate, beta, self.chunk_size, windows, packed)  # [b, t, heads, dim_v]
        gate = self.g_b_proj(self.g_a_proj(x)).view(batch, time, self.heads, self.dim_v)
        o = self.o_norm(o.to(x.dtype)) * torch.sigmoid(gate)  # [batch, time, heads, dim_v]
        out = self.o_proj(o.reshape(batch, time, -1))  # [batch, time, hidden]
        return out if segments is None else segments.rows(out)
