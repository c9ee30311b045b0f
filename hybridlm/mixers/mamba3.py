"""Mamba-3 (arXiv 2603.15569; mamba-ssm's ``Mamba3``): trapezoidal SSM with a data-dependent rotary state, SISO or MIMO.

in_proj -> (z, x, B, C, dt, A, trap, angles) in mamba-ssm's order; dt = softplus(dt + dt_bias); A = -f(A) with
mamba-ssm's heavy-tailed f (``mamba3_a_activation="softplus"``: f = softplus, as mamba-ssm before its #962 and
flash-linear-attention's Mamba3 layer), at most ``-mamba3_a_floor``; B and C RMS-normed (their biases and the
rotation are applied in the op); y = Mamba-3 scan (:mod:`hybridlm.ops.mamba3`) with the D skip and the SiLU(z)
gate (after a per-head RMSNorm with ``mamba3_outproj_norm``), per rank and summed by ``mimo_o`` for MIMO; out_proj.
There is no causal conv: the trapezoid mixes each token's input with the previous one's, which the state carries.

The state (:class:`Mamba3State`) is mamba-ssm's four ``allocate_inference_cache`` tensors.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm import ops
from hybridlm.cache import RecurrentState
from hybridlm.cache.states import Quantizable
from hybridlm.layers.linear import Linear
from hybridlm.layers.norms import GatedRMSNorm, RMSNorm
from hybridlm.mixers.base import Mixer, check_dt_range, invalid_config, register, zero_padding
from hybridlm.mixers.mamba import inverse_softplus_dt
from hybridlm.mixers.segments import check_stateless
from hybridlm.ops.mamba3 import Mamba3Carry, fold_previous, mamba3_scan_states, rotary_angles

#: mamba-ssm's fixed eps of the B/C norms and of the output norm
NORM_EPS = 1e-5
ROPE_FRACTIONS = (0.5, 1.0)
#: ``mamba3_a_activation``: the positive f of A = -f(dd_A)
A_ACTIVATIONS = ("heavy_tail", "softplus")


@dataclasses.dataclass
class Mamba3State(RecurrentState):
    """Mamba-3's decode state: ``angle [batch, heads, n_angles]`` (fp32, the accumulated rotary angles, in [0,
    2 pi)), ``ssm [batch, heads, head_dim, d_state]`` (fp32), ``k [batch, rank, heads, d_state]`` (the last
    token's rotated, biased B) and ``v [batch, heads, head_dim]`` (its x), in the model dtype:
    ``4 * heads * (n_angles + head_dim * d_state) + (rank * heads * d_state + heads * head_dim) * e`` bytes.
    Quantized (``state_bits``): the SSM state per head, the previous key and x per (rank and) head; the angles
    stay fp32, since their error would turn every later rotation."""

    quantized_fields = {"ssm": Quantizable(), "k": Quantizable((1, 2), accumulates=False),
                        "v": Quantizable(accumulates=False)}

    angle: torch.Tensor
    ssm: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def carry(self) -> Mamba3Carry:
        return Mamba3Carry(self.angle, self.ssm, self.k, self.v)


def heavy_tail(x: torch.Tensor) -> torch.Tensor:
    """mamba-ssm's positive activation for the data-dependent A: ``1 + x`` for ``x >= 0``, ``1 / (1 - x)`` below."""
    return x.clamp_min(0) + 1 / (1 - x.clamp_max(0))


def _held(per_token: torch.Tensor, before: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``per_token [batch, time, ...]`` with each padded token's entry replaced by the last real one's before it
    (``before [batch, ...]`` when none): a padded token leaves the previous key and value as they were."""
    index = torch.where(mask, torch.arange(1, mask.shape[1] + 1, device=mask.device), 0).cummax(1).values
    full = torch.cat([before.unsqueeze(1).to(per_token.dtype), per_token], dim=1)
    return full.gather(1, index.view(*index.shape, *[1] * (full.dim() - 2)).expand(-1, -1, *full.shape[2:]))


@register("mamba3")
class Mamba3(Mixer):
    pattern_letter = "R"
    config_fields = ("mamba3_d_state", "mamba3_expand", "mamba3_head_dim", "mamba3_n_groups", "mamba3_rope_fraction",
                     "mamba3_dt_min", "mamba3_dt_max", "mamba3_dt_init_floor", "mamba3_a_floor",
                     "mamba3_outproj_norm", "mamba3_mimo", "mamba3_mimo_rank", "mamba3_chunk_size",
                     "mamba3_a_activation")
    state_fields = ("mamba3_mimo",)  # SISO and rank-1 MIMO states have one shape but pair the rotation differently
    causal = True
    grows_with_context = False

    @classmethod
    def check_config(cls, config) -> None:
        check_dt_range(config, "mamba3_dt_min", "mamba3_dt_max")
        fraction, n = config.mamba3_rope_fraction, config.mamba3_d_state
        if fraction not in ROPE_FRACTIONS:
            raise invalid_config("mamba3_rope_fraction", fraction, f"must be one of {ROPE_FRACTIONS} (as mamba-ssm)")
        if config.mamba3_a_activation not in A_ACTIVATIONS:
            raise invalid_config("mamba3_a_activation", config.mamba3_a_activation, f"must be one of {A_ACTIVATIONS}")
        if rotary_angles(n, fraction) < 1:
            raise invalid_config("mamba3_d_state", n, f"is too small for any rotary angle at mamba3_rope_fraction="
                                 f"{fraction} (needs at least {int(2 / fraction)} state entries)")
        if config.mamba3_mimo and n % 2:
            raise invalid_config("mamba3_d_state", n, "must be even with mamba3_mimo (MIMO turns entry i with entry "
                                 "i + d_state/2)")
        inner, head_dim = config.mamba3_expand * config.hidden_size, config.mamba3_head_dim
        if inner % head_dim:
            raise invalid_config("mamba3_head_dim", head_dim, f"must divide the inner size {inner}")
        if (inner // head_dim) % config.mamba3_n_groups:
            raise invalid_config("mamba3_n_groups", config.mamba3_n_groups,
                                 f"must divide the number of heads ({inner // head_dim})")

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.config = config
        self.d_inner = config.mamba3_expand * config.hidden_size
        self.d_state, self.n_groups = config.mamba3_d_state, config.mamba3_n_groups
        self.head_dim = config.mamba3_head_dim
        self.num_heads = self.d_inner // self.head_dim
        self.mimo = config.mamba3_mimo
        self.rank = config.mamba3_mimo_rank if self.mimo else 1
        self.n_angles = rotary_angles(self.d_state, config.mamba3_rope_fraction)
        self.rope_pairs = "halves" if self.mimo else "interleaved"  # mamba-ssm's MIMO kernels / its SISO layer
        self.a_floor, self.chunk_size = config.mamba3_a_floor, config.mamba3_chunk_size
        self.a_activation = heavy_tail if config.mamba3_a_activation == "heavy_tail" else F.softplus
        bc = self.rank * self.n_groups * self.d_state
        self.split = [self.d_inner, self.d_inner, bc, bc, self.num_heads, self.num_heads, self.num_heads,
                      self.n_angles]
        self.in_proj = Linear(config.hidden_size, sum(self.split), bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.B_bias = nn.Parameter(torch.ones(self.num_heads, self.rank, self.d_state))
        self.C_bias = nn.Parameter(torch.ones(self.num_heads, self.rank, self.d_state))
        self.B_norm = RMSNorm(self.d_state, eps=NORM_EPS)
        self.C_norm = RMSNorm(self.d_state, eps=NORM_EPS)
        if self.mimo:
            self.mimo_x = nn.Parameter(torch.empty(self.num_heads, self.rank, self.head_dim))
            self.mimo_z = nn.Parameter(torch.empty(self.num_heads, self.rank, self.head_dim))
            self.mimo_o = nn.Parameter(torch.empty(self.num_heads, self.rank, self.head_dim))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedRMSNorm(self.d_inner, self.head_dim, eps=NORM_EPS, norm_before_gate=True) \
            if config.mamba3_outproj_norm else None
        self.out_proj = Linear(self.d_inner, config.hidden_size, bias=False)

    def initial_values(self) -> dict[str, torch.Tensor]:
        c, shape = self.config, (self.num_heads, self.rank, self.d_state)
        values = {"dt_bias": inverse_softplus_dt(self.num_heads, c.mamba3_dt_min, c.mamba3_dt_max,
                                                 c.mamba3_dt_init_floor),
                  "D": torch.ones(self.num_heads), "B_bias": torch.ones(shape), "C_bias": torch.ones(shape),
                  "B_norm.weight": torch.ones(self.d_state), "C_norm.weight": torch.ones(self.d_state)}
        if self.mimo:  # mamba-ssm's: x and the output averaged over the rank, z copied to each
            mimo = torch.ones(self.num_heads, self.rank, self.head_dim)
            values.update(mimo_x=mimo / self.rank, mimo_z=mimo, mimo_o=mimo / self.rank)
        return values

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> Mamba3State:
        heads = self.num_heads
        return Mamba3State(
            angle=torch.zeros(batch_size, heads, self.n_angles, device=device, dtype=torch.float32),
            ssm=torch.zeros(batch_size, heads, self.head_dim, self.d_state, device=device, dtype=torch.float32),
            k=torch.zeros(batch_size, self.rank, heads, self.d_state, device=device, dtype=dtype),
            v=torch.zeros(batch_size, heads, self.head_dim, device=device, dtype=dtype),
        )

    def forward(self, x, state: Mamba3State | None = None, *, mask=None, positions=None, segments=None):
        packed = {}
        if segments is not None:  # packed documents: one row, the scan restarting at each
            check_stateless(self.kind, state, mask)
            x, packed = segments.one_row(x), segments.scan_kwargs()
        batch, time, _ = x.shape
        heads, dim = self.num_heads, self.head_dim
        track = state is not None and state.checkpointing(time)  # keep the state after each token (rollback)
        z, xs, B, C, dd_dt, dd_a, trap, angles = self.in_proj(x).split(self.split, dim=-1)
        dt = zero_padding(F.softplus(dd_dt.float() + self.dt_bias.float()), mask)  # dt = 0: a pad changes nothing
        log_decay = -self.a_activation(dd_a.float()).clamp_min(self.a_floor) * dt
        xs = zero_padding(xs, mask).view(batch, time, heads, dim)  # nor does it enter the next token's trapezoid
        B = self.B_norm(B.view(batch, time, self.rank, self.n_groups, self.d_state))
        C = self.C_norm(C.view(batch, time, self.rank, self.n_groups, self.d_state))
        angles = angles.unsqueeze(2).expand(batch, time, heads, self.n_angles)
        z = z.view(batch, time, heads, dim)
        options = dict(D=self.D, mimo_v=getattr(self, "mimo_x", None), mimo_z=getattr(self, "mimo_z", None),
                       mimo_o=getattr(self, "mimo_o", None), norm_eps=NORM_EPS, rope_pairs=self.rope_pairs,
                       norm_weight=None if self.norm is None else self.norm.weight)
        args = (C, B, xs, log_decay, dt, trap, angles, self.C_bias, self.B_bias)
        carry = state.carry() if state is not None else None
        if carry is not None and mask is not None:
            # the previous token's input enters at each row's first real token (pads before it have dt = 0)
            first = mask.int().argmax(1)
            share = ((1 - torch.sigmoid(trap.float())) * dt)[torch.arange(batch, device=x.device), first]
            carry = Mamba3Carry(carry.angle.clone(), fold_previous(carry, share, options["mimo_v"]),
                                torch.zeros_like(carry.k), torch.zeros_like(carry.v))
        if state is not None and time == 1 and not track:  # decode: the state updated in place
            y = ops.mamba3_step(*(a[:, 0] for a in args[:7]), *args[7:], *carry, z=z[:, 0], **options).unsqueeze(1)
            if mask is not None:
                self._write(state, carry, mask)
        elif track:
            y, per = mamba3_scan_states(*args, z=z, initial_state=carry, chunk_size=self.chunk_size, **options)
            k, v = per.k, per.v
            if mask is not None:
                k, v = _held(k, state.k, mask), _held(v, state.v, mask)
            per = Mamba3Carry(per.angle, per.ssm, k, v)
            self._write(state, Mamba3Carry(*(t[:, -1] for t in per)))
            state.keep_states(**per._asdict())
        else:
            y, final = ops.mamba3_scan(*args, z=z, initial_state=carry, chunk_size=self.chunk_size, **options,
                                       **packed)
            if state is not None:
                self._write(state, final, mask)
        out = self.out_proj(y.reshape(batch, time, self.d_inner))
        return out if segments is None else segments.rows(out)

    @staticmethod
    def _write(state: Mamba3State, new: Mamba3Carry, mask=None) -> None:
        """The state after a forward; a row that was all padding keeps its previous key and value."""
        real = None if mask is None else mask.any(1)
        for name, value in new._asdict().items():
            target = getattr(state, name)
            if real is not None and name in ("k", "v"):
                value = torch.where(real.view(-1, *[1] * (value.dim() - 1)), value.to(target.dtype), target)
            if value is not target:
                target.copy_(value)
