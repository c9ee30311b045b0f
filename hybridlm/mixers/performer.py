"""Performer (FAVOR+): softmax attention approximated by positive orthogonal random features, causal.

``phi(x) = exp(W x' - |x'|^2 / 2)`` with ``x' = x / head_dim^(1/4)`` and ``W`` the ``features x head_dim``
orthogonal random matrix (kept as a buffer, so it is saved with the weights). Then
``out[t] = sum_s phi(q_t).phi(k_s) v_s / sum_s phi(q_t).phi(k_s)``, a causal linear attention whose state is
``[head_dim + 1, features]`` per head.

Overflow and underflow are avoided without changing the result: query features are scaled by their own
maximum, and key features by the running maximum of the key log-features seen so far (a factor common to
numerator and denominator, applied to the state as a decay). The running maximum starts at the first real key,
not at any fixed value, so keys whose log-features are all far below (or above) 0 keep their relative weights.
The one inexact case is a range beyond fp32's exp: a query whose largest term ``phi_f(q_t) phi_f(k_s)`` is
more than ~``e^87`` below (its own largest feature) x (the largest key feature so far) loses its terms to
underflow. That needs both queries and keys with log-features spread over hundreds (inputs far larger than a
normalised hidden state gives); keys alone far below 0, however far, lose nothing to underflow.

Redrawing ``W`` (``performer_redraw_interval``) is a training-loop decision, never a side effect of a forward (an
activation-checkpoint recompute must see the features of the forward it repeats): the loop calls
``model.after_optimizer_step()`` once per optimizer step, which counts steps in a buffer saved with the weights
and draws new features every ``performer_redraw_interval`` steps from a generator seeded by this layer's
``feature_seed`` buffer and the step, so every data-parallel rank (and a resumed run) draws the same features.
"""

from __future__ import annotations

import torch

from hybridlm import ops
from hybridlm.cache import LinearAttentionState
from hybridlm.layers.linear import Linear
from hybridlm.mixers.base import HEAD_LAYOUT_FIELDS, Mixer, check_head_layout, register
from hybridlm.mixers.segments import check_stateless
from hybridlm.ops.ssd import decay_scan_states


def orthogonal_random_features(features: int, dim: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[features, dim]``: blocks of orthonormal rows, each row scaled to the norm of a Gaussian vector."""
    blocks = []
    for _ in range(-(-features // dim)):
        q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=generator))
        blocks.append(q.T)
    norms = torch.randn(features, dim, generator=generator).norm(dim=1, keepdim=True)
    return torch.cat(blocks)[:features] * norms


def new_feature_seed() -> torch.Tensor:
    """A seed for a layer's feature redraws, drawn from the global RNG like any initial weight."""
    return torch.randint(0, 2**62, (), dtype=torch.long)


def stabilised_keys(log_k: torch.Tensor, previous: torch.Tensor,
                    segments=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key features relative to the running maximum of the key log-features, and the state's decay per step.

    ``log_k [batch, heads, time, features]`` (-inf for padding), ``previous [batch, heads]``: the maximum before
    this call (-inf when no real key was seen). Returns ``k_feat`` (same shape as ``log_k``; ``exp(log_k - m_t)``
    with ``m_t`` the running maximum), ``log_decay [batch, heads, time]`` (``m_{t-1} - m_t <= 0``, the factor
    that moves the state to the new reference) and ``running [batch, heads, time]`` (``m_t``). While a row has
    seen no real key its state is empty, so it needs no decay and its reference can be anything (0 here).
    With packed documents (``segments``, rows laid end to end) the running maximum restarts at each document;
    the decay at a document's first token does not matter: the scan forgets the state there.
    """
    peaks = log_k.amax(-1)  # [b, h, t]
    so_far = peaks.cummax(-1).values if segments is None else segments.running_max(peaks)  # [b, h, t]
    running = torch.maximum(so_far, previous.unsqueeze(-1))  # [b, h, t]
    before = torch.cat([previous.unsqueeze(-1), running[..., :-1]], dim=-1)  # [b, h, t]: m_{t-1}
    log_decay = torch.where(before.isfinite(), before - running, 0.0)  # [b, h, t]
    reference = running.nan_to_num(neginf=0.0)  # [b, h, t]
    k_feat = torch.exp(log_k - reference.unsqueeze(-1))  # [b, h, t, f]; padding: exp(-inf) = 0
    return k_feat, log_decay, running


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
        self.q_proj = Linear(hidden, width, bias=bias)
        self.k_proj = Linear(hidden, width, bias=bias)
        self.v_proj = Linear(hidden, width, bias=bias)
        self.o_proj = Linear(width, hidden, bias=bias)
        self.register_buffer("projection", orthogonal_random_features(self.num_features, self.head_dim))
        self.register_buffer("feature_seed", new_feature_seed())
        self.register_buffer("optimizer_steps", torch.zeros((), dtype=torch.long))

    def initial_values(self) -> dict[str, torch.Tensor]:
        return {"projection": orthogonal_random_features(self.num_features, self.head_dim),
                "feature_seed": new_feature_seed(), "optimizer_steps": torch.zeros((), dtype=torch.long)}

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Count one optimizer step; every ``redraw_interval`` steps, draw new features from the seed and step."""
        self.optimizer_steps += 1
        step = int(self.optimizer_steps)
        if self.redraw_interval and step % self.redraw_interval == 0:
            generator = torch.Generator().manual_seed((int(self.feature_seed) + step) % 2**63)
            features = orthogonal_random_features(self.num_features, self.head_dim, generator)
            self.projection.copy_(features)

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> LinearAttentionState:
        shape = (batch_size, self.num_heads, self.head_dim + 1, self.num_features)
        return LinearAttentionState(
            kv=torch.zeros(shape, device=device, dtype=torch.float32),
            max=torch.full((batch_size, self.num_heads), -torch.inf, device=device, dtype=torch.float32),
        )

    def _log_features(self, x: torch.Tensor) -> torch.Tensor:
        """``log phi(x)``: ``[batch, heads, time, head_dim] -> [batch, heads, time, features]`` (fp32)."""
        x = x.float() * self.head_dim**-0.25
        return x @ self.projection.float().T - x.square().sum(-1, keepdim=True) / 2

    def forward(self, x, state: LinearAttentionState | None = None, *, mask=None, positions=None, segments=None):
        packed = {}
        if segments is not None:  # packed documents: one row, sums and stabiliser restarting at each
            check_stateless(self.kind, state, mask)
            x, packed = segments.one_row(x), segments.scan_kwargs()
        batch, time, _ = x.shape
        track = state is not None and state.checkpointing(time)  # keep the sums after each token (rollback)
        q, k, v = (proj(x).view(batch, time, self.num_heads, -1).transpose(1, 2)  # [b, h, t, d]
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        log_q = self._log_features(q)  # [b, h, t, f]
        q_feat = torch.exp(log_q - log_q.amax(-1, keepdim=True))  # per-query scale: cancels in the ratio
        log_k = self._log_features(k)  # [b, h, t, f]
        if mask is not None:  # a padded key has zero features and does not move the running maximum
            log_k = log_k.masked_fill(~mask[:, None, :, None], -torch.inf)
        previous = state.max if state is not None else log_k.new_full((batch, self.num_heads), -torch.inf)
        k_feat, log_decay, running = stabilised_keys(log_k, previous, segments)
        ones = v.new_ones(batch, self.num_heads, time, 1, dtype=torch.float32)
        v_ones = torch.cat([v.float(), ones], dim=-1)  # [b, h, t, d + 1]: the last column sums the normaliser
        out, final = ops.causal_linear_attention(
            q_feat, k_feat, v_ones, log_decay, initial_state=state.kv if state is not None else None, **packed
        )  # [b, h, t, d + 1]
        if state is not None:
            if track:  # [b, t, h, d + 1, f]
                per_token = decay_scan_states(*(t.transpose(1, 2) for t in (k_feat, v_ones, log_decay)), state.kv)
            state.kv.copy_(final)
            state.max.copy_(running[..., -1])
            if track:
                state.keep_states(kv=per_token, max=running.transpose(1, 2))
        # the normaliser is 0 only for a query with no real key at or before it (padding): its output is then 0
        out = out[..., :-1] / out[..., -1:].clamp_min(torch.finfo(torch.float32).tiny)
        out = self.o_proj(out.to(x.dtype).transpose(1, 2).reshape(batch, time, -1))  # [batch, time, hidden]
        return out if segments is None else segments.rows(out)
