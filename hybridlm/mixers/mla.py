"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi Linear): keys and values compressed into one latent
per token, which is all the cache keeps.

Per token: ``kv_a_proj_with_mqa(x) = [c (kv_lora_rank) | k_rot (rope_dim)]``; ``c`` is RMS-normed; each head's
key is ``[k_nope | k_rot]`` and its value ``v`` with ``[k_nope | v] = kv_b_proj(c)`` per head, ``k_rot`` shared by
all heads (the decoupled rotary part: RoPE turns only it, and only with ``mla_rope``; Kimi Linear uses none).
Queries: ``q_proj(x)``, or ``q_b_proj(RMSNorm(q_a_proj(x)))`` with ``mla_q_lora_rank``; each ``[q_nope |
q_rot]``. Softmax scale ``(nope + rope_dim) ** -0.5`` unless ``attention_scale`` says otherwise.

The state is a :class:`~hybridlm.cache.kv.latent.LatentKV`: ``[c | rotated k_rot]`` per token, ``kv_lora_rank +
rope_dim`` elements. Attention runs in one of two equal forms (same numbers up to round-off):

- expanded: ``kv_b_proj`` turns every held latent into per-head keys and values, then plain attention —
  ``n·rank·heads·(nope + v)`` multiply-adds and ``n·heads·(nope + rope + v)`` elements per forward over ``n``
  keys; the cheaper form for a long forward (prefill, training), whose queries share the expansion;
- latent ("absorbed", DeepSeek-V2): ``kv_b_proj = [W_UK | W_UV]`` per head moves to the query side,
  ``score = (q_nope W_UK)·c + q_rot·k_rot`` over the cached (normed) ``c`` itself, ``out = (p·c) W_UVᵀ`` — no
  per-key expansion, ``t·n·heads·(2·rank + rope)`` multiply-adds; the cheaper form for decode and short
  forwards on a warm cache.

Each forward takes the form with fewer multiply-adds (:meth:`LatentAttention.attends_in_latent`).
"""

from __future__ import annotations

import torch

from hybridlm import ops
from hybridlm.cache import KVView
from hybridlm.cache.kv.latent import LatentKV
from hybridlm.layers.linear import Linear
from hybridlm.layers.norms import RMSNorm
from hybridlm.layers.rotary import RotaryEmbedding
from hybridlm.mixers.base import Mixer, invalid_config, register
from hybridlm.mixers.segments import check_stateless
from hybridlm.ops.attention import slot_mask

LATENT_NORM_EPS = 1e-6  # the q and kv latent norms' eps in DeepSeek-V3 and Kimi Linear (not rms_norm_eps)


@register("mla")
class LatentAttention(Mixer):
    pattern_letter = "T"
    config_fields = ("num_attention_heads", "attention_bias", "attention_scale", "rope_theta", "mla_kv_lora_rank",
                     "mla_q_lora_rank", "mla_qk_nope_head_dim", "mla_qk_rope_head_dim", "mla_v_head_dim", "mla_rope")
    state_fields = ("mla_rope", "rope_theta")  # the rotary part is cached rotated
    causal = True
    grows_with_context = True
    weights_read_directly = ("kv_b_proj",)  # the latent form absorbs it into the queries and outputs

    @classmethod
    def check_config(cls, config) -> None:
        if config.mla_rope and config.mla_qk_rope_head_dim % 2:
            raise invalid_config("mla_qk_rope_head_dim", config.mla_qk_rope_head_dim, "must be even with mla_rope")
        if config.mla_qk_nope_head_dim + config.mla_qk_rope_head_dim == 0:
            raise invalid_config("mla_qk_nope_head_dim", 0, "queries and keys need a width: nope + rope dims > 0")

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.heads, self.rank = config.num_attention_heads, config.mla_kv_lora_rank
        self.nope, self.rope = config.mla_qk_nope_head_dim, config.mla_qk_rope_head_dim
        self.v_dim = config.mla_v_head_dim
        self.scale = config.attention_scale
        qk_dim = self.heads * (self.nope + self.rope)
        if config.mla_q_lora_rank is None:
            self.q_proj = Linear(hidden, qk_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, config.mla_q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.mla_q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(config.mla_q_lora_rank, qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.heads * self.v_dim, hidden, bias=bias)
        self.rotary = RotaryEmbedding(self.rope, config.rope_theta) if config.mla_rope and self.rope else None
        self.latent_attention: bool | None = None  # None: the cheaper form per forward; True / False force one

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> LatentKV:
        return LatentKV.empty(batch_size, self.rank + self.rope, capacity=max_length or 0, device=device, dtype=dtype)

    def forward(self, x, state: LatentKV | None = None, *, mask=None, positions=None, segments=None):
        if segments is not None:
            check_stateless(self.kind, state, mask)
        batch, time, _ = x.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, time, self.heads, -1).transpose(1, 2)  # [batch, heads, time, nope + rope]
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c), k_rot], dim=-1)[:, None]  # [batch, 1, time, rank + rope]
        if positions is None:
            first = state.end if state is not None else 0
            positions = torch.arange(first, first + time, device=x.device).expand(batch, time)
        if self.rotary is not None:
            q, latent = self._rotate_tail(q, positions), self._rotate_tail(latent, positions)
        if state is None:
            slots = torch.arange(time, device=x.device)
            view = KVView(latent, None, slots, mask[:, None, :] if mask is not None else None, query_slots=slots,
                          query_positions=positions, in_order=True)
        else:
            view = state.update(latent, None, positions, None, mask)
        latent = view.keys.to(x.dtype)  # [batch, 1, n, rank + rope]
        if self.attends_in_latent(time, latent.shape[2]):
            out = self._attend_in_latent(q, latent, view, segments)
        else:
            out = self._attend_expanded(q, latent, view, segments)
        return self.o_proj(out.transpose(1, 2).reshape(batch, time, -1))  # [batch, time, hidden]

    def attends_in_latent(self, queries: int, keys: int) -> bool:
        """Whether ``queries`` new tokens over ``keys`` held ones cost fewer multiply-adds in latent space than
        expanded (the attention products of both forms plus expanding the keys, or absorbing the queries and
        outputs). ``latent_attention`` (True / False) forces the form. Never with an adapted or otherwise
        wrapped ``kv_b_proj`` (e.g. LoRA): absorbing reads its weight, which would leave the adapter out."""
        if type(self.kv_b_proj) is not Linear:
            return False
        if self.latent_attention is not None:
            return self.latent_attention
        per_head = self.heads * (self.nope + self.v_dim)
        expanded = keys * self.rank * per_head + queries * keys * self.heads * (self.nope + self.rope + self.v_dim)
        latent = queries * self.rank * per_head + queries * keys * self.heads * (2 * self.rank + self.rope)
        return latent < expanded

    def _attend_expanded(self, q, latent, view, segments) -> torch.Tensor:
        """``q [batch, heads, time, nope + rope]`` over the held latents expanded to keys and values (SDPA):
        ``[batch, heads, time, v_dim]``."""
        keys, values = self._expand(latent)  # [batch, heads, n, nope + rope], [batch, heads, n, v_dim]
        time, packed = q.shape[2], {"seq_idx": segments.seq_idx} if segments is not None else {}
        if view.valid is None and (time == 1 or time == keys.shape[2]):  # causality alone: SDPA's own path
            return ops.attention(q, keys, values, causal=time > 1, scale=self._scale(), **packed)
        allowed = slot_mask(view.query_slots, view.slots, key_valid=view.valid, q_heads=self.heads)
        return ops.attention(q, keys, values, mask=allowed, scale=self._scale(), **packed)

    def _attend_in_latent(self, q, latent, view, segments) -> torch.Tensor:
        """``q [batch, heads, time, nope + rope]`` over the held latents ``[batch, 1, n, rank + rope]`` without
        expanding them: ``kv_b_proj``'s key half absorbed into the queries, its value half applied to the
        attention-weighted latent. ``[batch, heads, time, v_dim]``."""
        batch, heads, time, _ = q.shape
        n = latent.shape[2]
        w_uk, w_uv = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, self.rank).split(
            [self.nope, self.v_dim], dim=1)  # [heads, nope, rank], [heads, v_dim, rank]
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        q_latent = torch.cat([torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk), q_rot], dim=-1) * self._scale()
        held = latent[:, 0]  # [batch, n, rank + rope]: one matrix for all heads (heads folded into the rows)
        scores = torch.bmm(q_latent.reshape(batch, heads * time, -1), held.transpose(1, 2))  # [b, h·t, n]
        scores = scores.view(batch, heads, time, n)
        if not (view.valid is None and time == 1 and segments is None):  # a lone query sees every held key
            allowed = slot_mask(view.query_slots, view.slots, key_valid=view.valid)  # [batch or 1, 1, t, n]
            if segments is not None:  # packed (stateless): only keys of the query's own sequence
                allowed = allowed & (segments.seq_idx[:, :, None] == segments.seq_idx[:, None, :])[:, None]
            scores = scores.masked_fill(~allowed, -torch.inf)
        probs = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
        mixed = torch.bmm(probs.view(batch, heads * time, n), held[..., : self.rank])  # [b, h·t, rank]
        return torch.einsum("bhtr,hvr->bhtv", mixed.view(batch, heads, time, self.rank), w_uv)

    def _scale(self) -> float:
        return self.scale if self.scale is not None else (self.nope + self.rope) ** -0.5

    def _rotate_tail(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [batch, heads, time, width]`` with RoPE on its last ``rope`` channels (the decoupled part)."""
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        head, tail = x.split([x.shape[-1] - self.rope, self.rope], dim=-1)
        return torch.cat([head, RotaryEmbedding.rotate(tail, cos, sin)], dim=-1)

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Held latents ``[batch, 1, n, rank + rope]`` -> keys ``[batch, heads, n, nope + rope]`` and values
        ``[batch, heads, n, v_dim]``."""
        batch, _, n, _ = latent.shape
        c, k_rot = latent[:, 0].split([self.rank, self.rope], dim=-1)  # [batch, n, rank], [batch, n, rope]
        kv = self.kv_b_proj(c).view(batch, n, self.heads, -1).transpose(1, 2)  # [batch, heads, n, nope + v]
        k_nope, values = kv.split([self.nope, self.v_dim], dim=-1)
        keys = torch.cat([k_nope, k_rot[:, None].expand(batch, self.heads, n, self.rope)], dim=-1)
        return keys, values
