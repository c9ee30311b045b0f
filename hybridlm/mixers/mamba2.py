"""Mamba-2: multi-head SSD with grouped B/C, gated RMSNorm, and the common checkpoint layout.

in_proj -> (z, xBC, dt); xBC -> causal conv + SiLU -> (x, B, C); dt -> softplus(dt + dt_bias), clamped to
the dt limits; y = SSD(x, dt, A, B, C) + D x; y = RMSNorm(y * SiLU(z)) per group; out_proj.
``mamba2_norm`` chooses the output gating: that (default), RMSNorm(y) * SiLU(z), or y * SiLU(z) with no norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm import ops
from hybridlm.cache import SSMState
from hybridlm.layers.conv import ShortConv
from hybridlm.layers.linear import Linear
from hybridlm.layers.norms import GatedRMSNorm
from hybridlm.mixers.base import Mixer, check_dt_range, invalid_config, register, zero_padding
from hybridlm.mixers.mamba import inverse_softplus_dt
from hybridlm.mixers.segments import check_stateless
from hybridlm.ops import ssd
from hybridlm.ops.causal_conv1d import causal_conv1d_windows


@register("mamba2")
class Mamba2(Mixer):
    pattern_letter = "S"
    config_fields = ("mamba2_d_state", "mamba2_d_conv", "mamba2_expand", "mamba2_head_dim", "mamba2_n_groups",
                     "mamba2_chunk_size", "mamba2_conv_bias", "mamba2_proj_bias", "mamba2_dt_min", "mamba2_dt_max",
                     "mamba2_dt_init_floor", "mamba2_dt_limit", "mamba2_inner_size", "mamba2_norm")
    causal = True
    grows_with_context = False

    @classmethod
    def check_config(cls, config) -> None:
        check_dt_range(config, "mamba2_dt_min", "mamba2_dt_max")
        limit = config.mamba2_dt_limit
        if len(limit) != 2 or not 0.0 <= limit[0] < limit[1]:
            raise invalid_config("mamba2_dt_limit", limit, "must be [low, high] with 0 <= low < high (high may be "
                                 "inf)")
        inner, head_dim = config.mamba2_d_inner, config.mamba2_head_dim
        if inner % head_dim:
            raise invalid_config("mamba2_head_dim", head_dim, f"must divide the SSD inner size {inner}")
        if (inner // head_dim) % config.mamba2_n_groups:
            raise invalid_config("mamba2_n_groups", config.mamba2_n_groups,
                                 f"must divide the number of SSD heads ({inner // head_dim})")

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.config = config
        hidden, inner = config.hidden_size, config.mamba2_d_inner
        self.d_inner, self.d_state, self.n_groups = inner, config.mamba2_d_state, config.mamba2_n_groups
        self.num_heads, self.head_dim = config.mamba2_num_heads, config.mamba2_head_dim
        self.chunk_size, self.dt_limit = config.mamba2_chunk_size, tuple(config.mamba2_dt_limit)
        self.conv_dim = inner + 2 * self.n_groups * self.d_state
        self.in_proj = Linear(hidden, inner + self.conv_dim + self.num_heads, bias=config.mamba2_proj_bias)
        self.conv1d = ShortConv(self.conv_dim, config.mamba2_d_conv, bias=config.mamba2_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm = None if config.mamba2_norm == "none" else GatedRMSNorm(
            inner, inner // self.n_groups, eps=config.rms_norm_eps,
            norm_before_gate=config.mamba2_norm == "norm_before_gate")
        self.out_proj = Linear(inner, hidden, bias=config.mamba2_proj_bias)

    def initial_values(self) -> dict[str, torch.Tensor]:
        c = self.config
        return {
            "A_log": torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)),
            "D": torch.ones(self.num_heads),
            "dt_bias": inverse_softplus_dt(self.num_heads, c.mamba2_dt_min, c.mamba2_dt_max, c.mamba2_dt_init_floor),
        }

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> SSMState:
        return SSMState(
            conv=self.conv1d.init_window(batch_size, device, dtype),
            ssm=torch.zeros(batch_size, self.num_heads, self.head_dim, self.d_state, device=device,
                            dtype=torch.float32),
        )

    def forward(self, x, state: SSMState | None = None, *, mask=None, positions=None, segments=None):
        packed = {}
        if segments is not None:  # packed documents: one row, conv window and state restarting at each
            check_stateless(self.kind, state, mask)
            x, packed = segments.one_row(x), segments.scan_kwargs()
        batch, time, _ = x.shape
        track = state is not None and state.checkpointing(time)  # keep the state after each token (rollback)
        z, xBC, dt = self.in_proj(x).split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        conv_in = zero_padding(xBC, mask).transpose(1, 2)  # [batch, conv_dim, time]
        windows = causal_conv1d_windows(conv_in, state.conv) if track and time > 1 else None
        xBC = self.conv1d(conv_in, state.conv if state is not None else None, **packed)
        group_width = self.n_groups * self.d_state
        xs, B, C = xBC.transpose(1, 2).split([self.d_inner, group_width, group_width], dim=-1)
        dt = F.softplus(dt + self.dt_bias)
        if self.dt_limit != (0.0, float("inf")):
            dt = dt.clamp(*self.dt_limit)
        dt = zero_padding(dt, mask)  # dt = 0: a padded token leaves the state as is
        A = -torch.exp(self.A_log.float())
        B = B.view(batch, time, self.n_groups, self.d_state)
        C = C.view(batch, time, self.n_groups, self.d_state)
        xs = xs.reshape(batch, time, self.num_heads, self.head_dim)
        if state is not None and time == 1:
            heads, dim = self.num_heads, self.head_dim
            y = ops.selective_state_update(
                state.ssm, xs[:, 0], dt[:, 0, :, None].expand(batch, heads, dim),
                A[:, None, None].expand(heads, dim, self.d_state), B[:, 0], C[:, 0],
                D=self.D[:, None].expand(heads, dim),
            ).unsqueeze(1)
            if track:
                state.keep_states()
        elif track or (state is not None and ssd.per_token_is_faster(xs, self.d_state)
                       and ops.runs_reference("ssd_chunk_scan", xs.device.type)):
            # the reference's per-token states (whichever backend the device has), read out by C: kept for
            # rollback, or a short forward on CPU where this beats the chunked reference (not the C++ scan)
            per_token = ssd.ssd_states(xs, dt, A, B, state.ssm)  # [batch, time, heads, head_dim, d_state]
            y = ssd.ssd_readout(per_token, C, xs, self.D)
            state.ssm.copy_(per_token[:, -1])
            if track:
                state.keep_states(conv=windows, ssm=per_token)
        else:
            y, final = ops.ssd_chunk_scan(
                xs, dt, A, B, C, self.chunk_size, D=self.D,
                initial_state=state.ssm if state is not None else None, **packed,
            )
            if state is not None:
                state.ssm.copy_(final)
        y = y.reshape(batch, time, self.d_inner)
        y = y * F.silu(z) if self.norm is None else self.norm(y, z)
        out = self.out_proj(y)  # [batch, time, hidden]
        return out if segments is None else segments.rows(out)
