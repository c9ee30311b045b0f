"""Mamba-1: the selective-scan mixer that Jamba interleaves with attention.

in_proj -> (x, z); x -> causal conv + SiLU -> x_proj -> (dt, B, C) [-> Jamba's RMSNorms on dt, B, C];
dt -> dt_proj -> softplus; y = selective_scan(x, dt, A, B, C) + D x, gated by SiLU(z); out_proj.
Weight names follow the common checkpoint layout (in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm import ops
from hybridlm.cache import SSMState
from hybridlm.layers.conv import ShortConv
from hybridlm.layers.linear import Linear
from hybridlm.layers.norms import RMSNorm
from hybridlm.mixers.base import Mixer, check_dt_range, register, zero_padding
from hybridlm.mixers.segments import check_stateless
from hybridlm.ops.causal_conv1d import causal_conv1d_windows
from hybridlm.ops.selective_scan import selective_scan_with_states


def inverse_softplus_dt(size: int, dt_min: float, dt_max: float, floor: float) -> torch.Tensor:
    """Bias whose softplus is log-uniform in ``[dt_min, dt_max]`` (the Mamba time-step initialisation)."""
    dt = torch.exp(torch.rand(size) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


@register("mamba")
class Mamba(Mixer):
    pattern_letter = "M"
    config_fields = ("mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_dt_rank", "mamba_conv_bias",
                     "mamba_proj_bias", "mamba_dt_norm", "mamba_dt_norm_learnable", "mamba_dt_norm_eps",
                     "mamba_dt_min", "mamba_dt_max", "mamba_dt_init_floor")
    causal = True
    grows_with_context = False

    @classmethod
    def check_config(cls, config) -> None:
        check_dt_range(config, "mamba_dt_min", "mamba_dt_max")

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.config = config
        hidden, inner = config.hidden_size, config.mamba_d_inner
        self.d_inner, self.d_state, self.dt_rank = inner, config.mamba_d_state, config.mamba_dt_rank
        self.in_proj = Linear(hidden, 2 * inner, bias=config.mamba_proj_bias)
        self.conv1d = ShortConv(inner, config.mamba_d_conv, bias=config.mamba_conv_bias)
        self.x_proj = Linear(inner, self.dt_rank + 2 * self.d_state, bias=False)
        self.dt_proj = Linear(self.dt_rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(inner, self.d_state))
        self.D = nn.Parameter(torch.empty(inner))
        self.out_proj = Linear(inner, hidden, bias=config.mamba_proj_bias)
        if config.mamba_dt_norm:  # Jamba (and, without weights, Falcon-Mamba) normalises dt, B and C before use
            eps, learnable = config.mamba_dt_norm_eps, config.mamba_dt_norm_learnable
            self.dt_layernorm = RMSNorm(self.dt_rank, eps, learnable)
            self.b_layernorm = RMSNorm(self.d_state, eps, learnable)
            self.c_layernorm = RMSNorm(self.d_state, eps, learnable)

    def initial_values(self) -> dict[str, torch.Tensor]:
        """Fresh values of the parameters a generic initialiser would get wrong (S4D-real A, unit D, dt)."""
        c = self.config
        std = self.dt_rank**-0.5
        return {
            "A_log": torch.log(torch.arange(1, self.d_state + 1, dtype=torch.float32)).expand(self.d_inner, -1),
            "D": torch.ones(self.d_inner),
            "dt_proj.weight": torch.empty(self.d_inner, self.dt_rank).uniform_(-std, std),
            "dt_proj.bias": inverse_softplus_dt(self.d_inner, c.mamba_dt_min, c.mamba_dt_max, c.mamba_dt_init_floor),
        }

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> SSMState:
        return SSMState(
            conv=self.conv1d.init_window(batch_size, device, dtype),
            ssm=torch.zeros(batch_size, self.d_inner, self.d_state, device=device, dtype=torch.float32),
        )

    def forward(self, x, state: SSMState | None = None, *, mask=None, positions=None, segments=None):
        packed = {}
        if segments is not None:  # packed documents: one row, conv window and state restarting at each
            check_stateless(self.kind, state, mask)
            x, packed = segments.one_row(x), segments.scan_kwargs()
        batch, time, _ = x.shape
        track = state is not None and state.checkpointing(time)  # keep the state after each token (rollback)
        u, z = self.in_proj(x).chunk(2, dim=-1)
        conv_in = zero_padding(u, mask).transpose(1, 2)  # [batch, d_inner, time]
        windows = causal_conv1d_windows(conv_in, state.conv) if track and time > 1 else None
        u = self.conv1d(conv_in, state.conv if state is not None else None, **packed)
        dt, B, C = self.x_proj(u.transpose(1, 2)).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        if hasattr(self, "dt_layernorm"):
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        dt = zero_padding(F.softplus(self.dt_proj(dt)), mask)  # dt = 0: a padded token leaves the state as is
        A = -torch.exp(self.A_log.float())
        z = z.transpose(1, 2)
        if state is not None and time == 1:
            y = ops.selective_state_update(
                state.ssm, u[..., 0], dt[:, 0], A, B[:, 0], C[:, 0], D=self.D, z=z[..., 0]
            ).unsqueeze(-1)
            if track:
                state.keep_states()
        elif track:  # one pass of the reference's chunked scan (whichever backend the device has): output and states
            y, per_token = selective_scan_with_states(u, dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2),
                                                      state.ssm, D=self.D, z=z)
            state.ssm.copy_(per_token[:, -1])
            state.keep_states(conv=windows, ssm=per_token)
        else:
            y, final = ops.selective_scan(
                u, dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), D=self.D, z=z,
                initial_state=state.ssm if state is not None else None, **packed,
            )
            if state is not None:
                state.ssm.copy_(final)
        out = self.out_proj(y.transpose(1, 2))  # [batch, time, hidden]
        return out if segments is None else segments.rows(out)
