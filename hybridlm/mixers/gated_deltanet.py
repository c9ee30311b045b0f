"""Gated DeltaNet: the gated delta rule as Qwen3-Next, Qwen3.5 and OLMo-Hybrid use it.

in_proj_qkvz -> (q, k, v, z), in_proj_ba -> (b, a); (q, k, v) -> short causal conv + SiLU; q, k L2-normalised;
``beta = sigmoid(b)``, log gate ``g = -exp(A_log) * softplus(a + dt_bias)``; o = gated_delta_rule(q, k, v, g,
beta) per value head; o = RMSNorm(o) * SiLU(z) per head (one norm weight shared by the heads); out_proj.
Key heads may serve groups of consecutive value heads (``deltanet_num_value_heads`` a multiple of
``deltanet_num_key_heads``). Our projections keep q, k, v, z (and b, a) as contiguous blocks; formats whose
checkpoints interleave them per key head (Qwen3-Next) reorder the rows on load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm import ops
from hybridlm.cache import SSMState
from hybridlm.layers.conv import ShortConv
from hybridlm.layers.linear import Linear
from hybridlm.layers.norms import GatedRMSNorm, at_least_fp32
from hybridlm.mixers.base import Mixer, invalid_config, register, zero_padding
from hybridlm.mixers.segments import check_stateless
from hybridlm.ops.causal_conv1d import causal_conv1d_windows
from hybridlm.ops.delta_rule import gated_delta_rule_states

L2_EPS = 1e-6  # as fla and transformers: x / sqrt(sum(x^2) + eps)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(|x|^2 + 1e-6)`` over the last dim, in fp32 (fp64 for fp64 input)."""
    x = at_least_fp32(x)
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2_EPS)


def check_positive(config, names) -> None:
    for name in names:
        if getattr(config, name) < 1:
            raise invalid_config(name, getattr(config, name), "must be > 0")


def delta_rule_state(mixer, batch_size: int, device, dtype) -> SSMState:
    """The empty state of a delta-rule mixer (Gated DeltaNet, KDA): its conv window and the ``[heads, dim_k,
    dim_v]`` matrix (fp32, or fp64 in an fp64 model)."""
    return SSMState(
        conv=mixer.conv1d.init_window(batch_size, device, dtype),
        ssm=torch.zeros(batch_size, mixer.heads, mixer.dim_k, mixer.dim_v, device=device,
                        dtype=torch.promote_types(dtype or torch.float32, torch.float32)),
    )


def run_delta_rule(state: SSMState | None, q, k, v, log_gate, beta, chunk_size: int, windows, packed: dict):
    """The delta rule over the new tokens (``ops.gated_delta_rule`` arguments; a one-token step on a warm state),
    ``state.ssm`` updated in place; with conv ``windows`` (rollback tracking), the state after each token kept.
    Returns ``o [batch, time, heads, dim_v]``. Shared by Gated DeltaNet and KDA."""
    if state is not None and q.shape[1] == 1:
        o = ops.gated_delta_rule_step(state.ssm, q[:, 0], k[:, 0], v[:, 0], log_gate[:, 0], beta[:, 0])
        if windows is not None:
            state.keep_states(conv=windows, ssm=state.ssm.unsqueeze(1))
        return o.unsqueeze(1)  # [batch, 1, heads, dim_v]
    if windows is not None:  # the states after each token (the reference's chunked WY form) give o as well
        per_token = gated_delta_rule_states(k, v, log_gate, beta, state.ssm, chunk_size)  # [b, t, h, dim_k, dim_v]
        q_heads = q.repeat_interleave(v.shape[2] // q.shape[2], dim=2).to(per_token.dtype)  # [b, t, h, dim_k]
        o = torch.einsum("bthk,bthkv->bthv", q_heads * q.shape[-1] ** -0.5, per_token).to(v.dtype)
        state.ssm.copy_(per_token[:, -1])
        state.keep_states(conv=windows, ssm=per_token)
        return o
    o, final = ops.gated_delta_rule(q, k, v, log_gate, beta, chunk_size=chunk_size,
                                    initial_state=state.ssm if state is not None else None, **packed)
    if state is not None:
        state.ssm.copy_(final)
    return o


@register("gated_deltanet")
class GatedDeltaNet(Mixer):
    pattern_letter = "D"
    config_fields = ("deltanet_num_key_heads", "deltanet_num_value_heads", "deltanet_key_head_dim",
                     "deltanet_value_head_dim", "deltanet_conv_size", "deltanet_chunk_size", "deltanet_beta_scale",
                     "deltanet_norm_eps")
    causal = True
    grows_with_context = False

    @classmethod
    def check_config(cls, config) -> None:
        check_positive(config, cls.config_fields[:6])  # the head layout and sizes (integers)
        if config.deltanet_num_value_heads % config.deltanet_num_key_heads:
            raise invalid_config("deltanet_num_value_heads", config.deltanet_num_value_heads,
                                 f"must be a multiple of deltanet_num_key_heads={config.deltanet_num_key_heads} "
                                 "(each key head serves a group of consecutive value heads)")

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        hidden = config.hidden_size
        self.key_heads, self.heads = config.deltanet_num_key_heads, config.deltanet_num_value_heads
        self.dim_k, self.dim_v = config.deltanet_key_head_dim, config.deltanet_value_head_dim
        self.chunk_size, self.beta_scale = config.deltanet_chunk_size, config.deltanet_beta_scale
        self.key_dim, self.value_dim = self.key_heads * self.dim_k, self.heads * self.dim_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = Linear(hidden, self.conv_dim + self.value_dim, bias=False)
        self.in_proj_ba = Linear(hidden, 2 * self.heads, bias=False)
        self.conv1d = ShortConv(self.conv_dim, config.deltanet_conv_size, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        norm_eps = config.deltanet_norm_eps if config.deltanet_norm_eps is not None else config.rms_norm_eps
        self.norm = GatedRMSNorm(self.dim_v, self.dim_v, eps=norm_eps, norm_before_gate=True)
        self.out_proj = Linear(self.value_dim, hidden, bias=False)

    def initial_values(self) -> dict[str, torch.Tensor]:
        """Qwen3-Next's: ``A`` uniform in [0.01, 16] (log kept away from -inf), ``dt_bias`` ones."""
        return {"A_log": torch.empty(self.heads).uniform_(0.01, 16).log(), "dt_bias": torch.ones(self.heads)}

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> SSMState:
        return delta_rule_state(self, batch_size, device, dtype)

    def forward(self, x, state: SSMState | None = None, *, mask=None, positions=None, segments=None):
        packed = {}
        if segments is not None:  # packed documents: one row, conv window and state restarting at each
            check_stateless(self.kind, state, mask)
            x, packed = segments.one_row(x), segments.scan_kwargs()
        batch, time, _ = x.shape
        track = state is not None and state.checkpointing(time)  # keep the state after each token (rollback)
        qkv, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).split([self.heads, self.heads], dim=-1)  # [batch, time, heads] each
        conv_in = zero_padding(qkv, mask).transpose(1, 2)  # [batch, conv_dim, time]
        windows = causal_conv1d_windows(conv_in, state.conv) if track else None
        qkv = self.conv1d(conv_in, state.conv if state is not None else None, **packed)
        q, k, v = qkv.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2_normalize(q.view(batch, time, self.key_heads, self.dim_k))  # [batch, time, key_heads, dim_k]
        k = l2_normalize(k.view(batch, time, self.key_heads, self.dim_k))
        v = v.reshape(batch, time, self.heads, self.dim_v)
        # beta = g = 0: a padded token changes nothing
        beta = zero_padding(torch.sigmoid(at_least_fp32(b)) * self.beta_scale, mask)
        decay_rate = at_least_fp32(self.A_log).exp()  # [heads]
        log_gate = zero_padding(-decay_rate * F.softplus(at_least_fp32(a) + self.dt_bias), mask)
        o = run_delta_rule(state, q, k, v, log_gate, beta, self.chunk_size, windows if track else None, packed)
        o = self.norm(o.to(x.dtype), z.view(batch, time, self.heads, self.dim_v))  # [batch, time, heads, dim_v]
        out = self.out_proj(o.reshape(batch, time, self.value_dim))  # [batch, time, hidden]
        return out if segments is None else segments.rows(out)
