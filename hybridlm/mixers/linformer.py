"""Linformer: attention over a low-rank projection of the sequence axis of keys and values.

The paper's form (``linformer_causal=False``) needs the whole sequence: with ``E, F [rank, max_length]``,
``out = softmax(Q (E K)^T / sqrt(d)) (F V)``, every query seeing every token, so it cannot decode.

The causal form (the default, and the one a language model uses) restricts both projections to the prefix:
``out[t] = softmax(q_t (E_{<=t} K_{<=t})^T / (n_t sqrt(d))) (F_{<=t} V_{<=t}) / n_t``, where ``E_{<=t}`` keeps
the columns of positions ``0..t`` and ``n_t`` is the number of real tokens in the prefix
(``linformer_prefix_reduction="mean"``, the default), or 1 (``"sum"``: the paper's ``E K`` over the prefix,
whose scale grows with ``t``, so late queries get ever sharper softmaxes over ever larger values).
The compressed keys and values are running sums, so the state is two ``[rank, head_dim]`` matrices per head
and a token count whatever the length, and prefill and decode compute the same thing. Columns are indexed by
position id, so left padding does not shift them; positions must lie in ``[0, linformer_max_length)``.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm import ops
from hybridlm.cache import CompressedKVState
from hybridlm.layers.linear import Linear
from hybridlm.mixers.base import HEAD_LAYOUT_FIELDS, Mixer, check_head_layout, invalid_config, register, zero_padding
from hybridlm.mixers.segments import check_stateless

PREFIX_REDUCTIONS = ("mean", "sum")


@register("linformer")
class Linformer(Mixer):
    pattern_letter = "L"
    config_fields = HEAD_LAYOUT_FIELDS + ("linformer_rank", "linformer_max_length", "linformer_causal",
                                          "linformer_prefix_reduction")
    causal_field = "linformer_causal"  # the paper's form (False) sees the whole sequence
    grows_with_context = False
    max_positions_field = "linformer_max_length"  # E and F have one column per position

    @classmethod
    def check_config(cls, config) -> None:
        check_head_layout(config)
        if config.linformer_prefix_reduction not in PREFIX_REDUCTIONS:
            raise invalid_config("linformer_prefix_reduction", config.linformer_prefix_reduction,
                                 f"allowed: {PREFIX_REDUCTIONS}")

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.rank, self.max_length = config.linformer_rank, config.linformer_max_length
        self.causal = config.linformer_causal
        self.prefix_reduction = config.linformer_prefix_reduction
        width = self.num_heads * self.head_dim
        self.q_proj = Linear(hidden, width, bias=bias)
        self.k_proj = Linear(hidden, width, bias=bias)
        self.v_proj = Linear(hidden, width, bias=bias)
        self.o_proj = Linear(width, hidden, bias=bias)
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
                                 values=torch.zeros(shape, device=device, dtype=torch.float32),
                                 tokens=torch.zeros(batch_size, device=device, dtype=torch.long))

    def forward(self, x, state: CompressedKVState | None = None, *, mask=None, positions=None, segments=None):
        packed, counted = {}, None  # packed documents: one row, sums and token counts restarting at each
        if segments is not None:
            check_stateless(self.kind, state, mask)
            if not self.causal:
                raise ValueError("a bidirectional Linformer (linformer_causal=False) cannot take packed documents")
            counted = segments.one_row(segments.positions()) + 1  # [1, batch * time]: tokens so far, per document
            positions = segments.one_row(positions if positions is not None else segments.positions())
            x, packed = segments.one_row(x), segments.scan_kwargs()
        batch, time, _ = x.shape
        if positions is None:
            first = state.seen if state is not None else 0
            positions = torch.arange(first, first + time, device=x.device).expand(batch, time)
        self._check_positions(positions)
        q, k, v = (proj(x).view(batch, time, self.num_heads, -1).transpose(1, 2)  # [b, h, t, d]
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        e = zero_padding(self.key_projection.T[positions], mask)  # [b, t, rank]; padding adds nothing
        f = zero_padding(self.value_projection.T[positions], mask)  # [b, t, rank]
        scale = self.head_dim**-0.5
        if not self.causal:
            if state is not None:
                raise ValueError("a bidirectional Linformer (linformer_causal=False) cannot continue from a state")
            keys = torch.einsum("btr,bhtd->bhrd", e, k)  # [b, h, rank, d]
            values = torch.einsum("btr,bhtd->bhrd", f, v)  # [b, h, rank, d]
            out = torch.softmax(q @ keys.transpose(-1, -2) * scale, dim=-1) @ values  # [b, h, t, d]
            return self.o_proj(out.to(x.dtype).transpose(1, 2).reshape(batch, time, -1))
        track = state is not None and state.checkpointing(time)  # keep the sums after each token (rollback)
        real = torch.ones_like(positions) if mask is None else mask.long()  # [b, t]
        tokens = real.cumsum(-1) + (state.tokens[:, None] if state is not None else 0)  # [b, t]: summed so far
        tokens = tokens if counted is None else counted
        # a query before any real token (padding) sees empty sums: dividing them by 1 keeps them empty
        normalizer = tokens.clamp_min(1) if self.prefix_reduction == "mean" else None
        out, (keys, values) = ops.causal_compressed_attention(
            q, k, v, e, f, scale=scale, normalizer=normalizer,
            initial_state=(state.keys, state.values) if state is not None else None, **packed,
        )  # out [b, h, t, d]
        if state is not None:
            if track:  # running sums of the compressed keys and values: [b, t, h, rank, d]
                per_token = {name: torch.einsum("btr,bhtd->bthrd", proj.float(), t.float()).cumsum(1) + held[:, None]
                             for name, proj, t, held in (("keys", e, k, state.keys), ("values", f, v, state.values))}
            state.keys.copy_(keys)
            state.values.copy_(values)
            state.tokens.copy_(tokens[:, -1])
            state.seen += time
            if track:
                state.keep_states(**per_token, tokens=tokens)
        out = self.o_proj(out.to(x.dtype).transpose(1, 2).reshape(batch, time, -1))  # [batch, time, hidden]
        return out if segments is None else segments.rows(out)

    def _check_positions(self, positions: torch.Tensor) -> None:
        """Positions index the columns of E and F: they must lie in ``[0, linformer_max_length)``."""
        if not positions.numel():
            return
        low, high = torch.stack([positions.min(), positions.max()]).tolist()  # one device sync
        if low < 0:
            raise ValueError(f"Linformer: position_ids must be >= 0 (they index the columns of E and F), got {low}")
        if high >= self.max_length:
            raise ValueError(f"Linformer: position {high} >= linformer_max_length={self.max_length}")
