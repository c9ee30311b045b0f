"""Feed-forward layers: the gated MLP (SwiGLU / GeGLU) or the squared-ReLU MLP, and top-k mixture of experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GATED = {"silu": F.silu, "gelu": F.gelu}


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` for silu/gelu; ``down(relu(up(x))^2)`` for relu2 (Nemotron-H)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False):
        super().__init__()
        self.activation = activation
        if activation in GATED:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        elif activation != "relu2":
            raise ValueError(f"MLP activation={activation!r}; allowed: {sorted(GATED) + ['relu2']}")
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "relu2":
            return self.down_proj(F.relu(self.up_proj(x)).square())
        return self.down_proj(GATED[self.activation](self.gate_proj(x)) * self.up_proj(x))


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss ``E * sum_e f_e * p_e`` (``f``: share of routed slots, ``p``: mean
    router probability); 1.0 when routing is uniform. ``probs [tokens, E]``, ``chosen [tokens, k]``."""
    routed = F.one_hot(chosen, num_experts).float().sum(1).mean(0) / chosen.shape[1]
    return num_experts * (routed * probs.mean(0)).sum()


class MoE(nn.Module):
    """Top-k routing over ``num_experts`` MLPs (softmax, then top-k, optionally renormalised), plus an optional
    always-on shared expert. ``forward`` returns ``(output, aux_loss)``."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        activation: str = "silu",
        renormalize: bool = False,
        shared_intermediate_size: int = 0,
    ):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(hidden_size, intermediate_size, activation) for _ in range(num_experts))
        self.shared_expert = (
            MLP(hidden_size, shared_intermediate_size, activation) if shared_intermediate_size else None
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        real = mask.reshape(-1) if mask is not None else slice(None)
        aux = load_balancing_loss(probs[real], chosen[real], len(self.experts))
        return out.view_as(x), aux
