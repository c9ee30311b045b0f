"""Shared transformer blocks (Zamba2): one set of attention + MLP weights applied at several depths.

Before the mixer of each layer in ``config.shared_block_layers``, application ``k`` runs shared block
``k % num_shared_blocks`` on the hidden state concatenated with the token embeddings (width ``2 * hidden``):

    x = norm(cat(h, embeddings));  a = attention(x);  m = mlp(norm(a));  t = out_proj(m)

and the layer computes ``h + mixer(norm(h + t))`` (``t`` enters the mixer's input, not the residual). The
weights of a block are shared; each application owns its output projection ``out_proj`` and, optionally, LoRA
adapters added to the shared projections (the MLP's gate/up with ``shared_block_adapter_rank > 0``, also the
attention's q/k/v with ``shared_block_attention_adapters``). Each application attends over its own keys and
values, so it keeps its own KV state in the cache.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.cache import KVState
from hybridlm.layers.linear import Linear
from hybridlm.layers.mlp import MLP
from hybridlm.layers.norms import RMSNorm
from hybridlm.mixers.attention import Attention


class LoRA(nn.Module):
    """The low-rank term ``up(down(x))`` added to a shared projection's output."""

    def __init__(self, in_features: int, rank: int, out_features: int):
        super().__init__()
        self.down = Linear(in_features, rank, bias=False)
        self.up = Linear(rank, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class SharedBlockSite(nn.Module):
    """What one application of a shared block owns: its output projection and its adapters."""

    def __init__(self, config):
        super().__init__()
        hidden, rank = config.hidden_size, config.shared_block_adapter_rank
        self.out_proj = Linear(hidden, hidden, bias=False)
        self.mlp_adapter = LoRA(hidden, rank, 2 * config.intermediate_size) if rank else None
        if config.shared_block_attention_adapters:
            q_width = config.num_attention_heads * config.head_dim
            kv_width = config.num_key_value_heads * config.head_dim
            self.q_adapter = LoRA(2 * hidden, rank, q_width)
            self.k_adapter = LoRA(2 * hidden, rank, kv_width)
            self.v_adapter = LoRA(2 * hidden, rank, kv_width)
        else:
            self.q_adapter = self.k_adapter = self.v_adapter = None


class SharedBlock(nn.Module):
    """Attention over ``cat(h, embeddings)`` then an MLP, with no residual inside (see the module docstring)."""

    mixer_class = Attention  # its settings are validated and its state is signed as that kind's

    def __init__(self, config):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(2 * hidden, eps)
        self.attention = self.mixer_class(config, input_size=2 * hidden)
        self.pre_mlp_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, config.intermediate_size, config.mlp_activation)

    def forward(self, hidden, embeddings, site: SharedBlockSite, state: KVState | None, mask, positions,
                segments=None):
        x = self.input_layernorm(torch.cat([hidden, embeddings], dim=-1))
        q, k, v = self.attention.project(x)
        if site.q_adapter is not None:
            q, k, v = q + site.q_adapter(x), k + site.k_adapter(x), v + site.v_adapter(x)
        attended = self.attention.attend(q, k, v, state, mask=mask, positions=positions, segments=segments)
        y = self.pre_mlp_layernorm(attended)
        return site.out_proj(self.mlp(y, site.mlp_adapter(y) if site.mlp_adapter is not None else None))


class SharedBlocks(nn.Module):
    """The shared blocks of a model and their applications (one :class:`SharedBlockSite` per layer listed in
    ``shared_block_layers``)."""

    def __init__(self, config):
        super().__init__()
        self.layers = list(config.shared_block_layers)
        self.blocks = nn.ModuleList(SharedBlock(config) for _ in range(config.num_shared_blocks))
        self.sites = nn.ModuleList(SharedBlockSite(config) for _ in self.layers)

    def block_of(self, application: int) -> SharedBlock:
        return self.blocks[application % len(self.blocks)]

    def init_states(self, batch_size, max_length=None, device=None, dtype=None) -> list[KVState]:
        """One KV state per application."""
        return [self.block_of(k).attention.init_state(batch_size, max_length, device, dtype)
                for k in range(len(self.layers))]

    def forward(self, application: int, hidden, embeddings, state=None, mask=None, positions=None, segments=None):
        """What application ``application`` adds to its layer's mixer input (``segments``: packed documents)."""
        return self.block_of(application)(hidden, embeddings, self.sites[application], state, mask, positions,
                                          segments)
