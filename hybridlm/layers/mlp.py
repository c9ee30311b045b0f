"""Feed-forward layers: the gated MLP (SwiGLU / GeGLU) or the squared-ReLU MLP, and top-k mixture of experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.layers.linear import Linear
from hybridlm.layers.norms import at_least_fp32

GATED = {"silu": F.silu, "gelu": F.gelu}


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` for silu/gelu; ``down(relu(up(x))^2)`` for relu2 (Nemotron-H)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False):
        super().__init__()
        self.activation = activation
        if activation in GATED:
            self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        elif activation != "relu2":
            raise ValueError(f"MLP activation={activation!r}; allowed: {sorted(GATED) + ['relu2']}")
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, gate_up_delta: torch.Tensor | None = None) -> torch.Tensor:
        """``gate_up_delta [..., 2 * intermediate]`` (gated MLPs only) is added to the concatenated gate and up
        pre-activations: what a per-site LoRA adapter contributes (Zamba2's shared blocks)."""
        if self.activation == "relu2":
            if gate_up_delta is not None:
                raise ValueError("MLP: gate_up_delta needs a gated activation (silu or gelu)")
            return self.down_proj(F.relu(self.up_proj(x)).square())
        gate, up = self.gate_proj(x), self.up_proj(x)
        if gate_up_delta is not None:
            gate_delta, up_delta = gate_up_delta.chunk(2, dim=-1)
            gate, up = gate + gate_delta, up + up_delta
        return self.down_proj(GATED[self.activation](gate) * up)


def routing_statistics(probs: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[2, E]``: per expert, the top-k selections per token (``f``, summing to k) and the mean router
    probability (``p``), over the ``tokens`` given. ``probs [tokens, E]``, ``chosen [tokens, k]``."""
    selections = F.one_hot(chosen, num_experts).float().sum(1).mean(0)  # [E]
    return torch.stack([selections, probs.float().mean(0)])


def load_balancing_loss(statistics: torch.Tensor) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss as transformers defines it for Mixtral, Jamba and Granite-MoE
    (``load_balancing_loss_func``): ``E * sum_e f_e * p_e`` with ``f`` and ``p`` (see :func:`routing_statistics`)
    averaged over the MoE layers first (transformers pools all layers' tokens; every layer sees the same ones).
    ``statistics [layers, 2, E]``. Uniform routing gives k (not 1: ``f`` counts each token's k selections)."""
    selections, probability = statistics.mean(0)  # [E] each
    return statistics.shape[-1] * (selections * probability).sum()


#: Up to this many tokens (decode steps), MoE may run every expert on every token (weight 0 where not chosen):
#: fixed shapes and no host sync, where the sparse path's ``nonzero`` reads the routing back. See
#: :meth:`MoE.routes_densely` for when.
DENSE_ROUTING_TOKENS = 64


class MoE(nn.Module):
    """Top-k routing over ``num_experts`` MLPs plus an optional always-on shared expert. ``forward`` returns
    ``(output, routing statistics [2, E])``; the model turns those of all layers into the auxiliary loss
    (:func:`load_balancing_loss`).

    ``router="softmax"``: softmax probabilities, then top-k. ``router="sigmoid"`` (DeepSeek-V3, Nemotron-H):
    sigmoid scores; the top-k are chosen by score plus ``expert_bias`` (a buffer, for balancing without an
    auxiliary loss), among the experts of the ``topk_groups`` best of ``num_groups`` groups (a group ranks by
    the sum of its two best biased scores); the weights are the unbiased scores. Either way the weights are
    optionally renormalised to sum to one, then multiplied by ``routed_scaling``. With ``shared_expert_gate``
    the shared expert's output is scaled per token by ``sigmoid(shared_expert_gate(x))`` (Qwen3-Next).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        activation: str = "silu",
        renormalize: bool = False,
        shared_intermediate_size: int = 0,
        router: str = "softmax",
        num_groups: int = 1,
        topk_groups: int = 1,
        routed_scaling: float = 1.0,
        shared_expert_gate: bool = False,
    ):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.router_kind, self.num_groups, self.topk_groups = router, num_groups, topk_groups
        self.routed_scaling = routed_scaling
        self.router = Linear(hidden_size, num_experts, bias=False)
        if router == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        elif router != "softmax" or num_groups != 1:
            raise ValueError(f"MoE: router={router!r} with num_groups={num_groups}; allowed: 'softmax' (one group) "
                             "or 'sigmoid'")
        self.experts = nn.ModuleList(MLP(hidden_size, intermediate_size, activation) for _ in range(num_experts))
        self.shared_expert = (
            MLP(hidden_size, shared_intermediate_size, activation) if shared_intermediate_size else None
        )
        if shared_expert_gate and not shared_intermediate_size:
            raise ValueError("MoE: shared_expert_gate needs a shared expert (shared_intermediate_size > 0)")
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if shared_expert_gate else None

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probs [tokens, E], weights [tokens, k], chosen [tokens, k])``; ``probs`` sum to one per token (the
        sigmoid scores normalised) and feed the load-balancing loss."""
        logits = at_least_fp32(self.router(flat))  # fp32, or fp64 in an fp64 model
        if self.router_kind == "softmax":
            probs = torch.softmax(logits, dim=-1)
            weights, chosen = probs.topk(self.top_k, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            chosen = self._eligible(scores + self.expert_bias.to(scores.dtype)).topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, chosen)
            probs = scores / scores.sum(-1, keepdim=True)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return probs, weights * self.routed_scaling, chosen

    def _eligible(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with the experts outside the ``topk_groups`` best groups set to -inf."""
        if self.num_groups == 1:
            return choice
        grouped = choice.unflatten(-1, (self.num_groups, -1))
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_groups, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(-1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2)

    def _chosen_experts(self, flat, weights, chosen) -> torch.Tensor:
        """``[tokens, hidden]``: each expert on the tokens that chose it (``weights, chosen [tokens, k]``)."""
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out

    def _weights_by_expert(self, flat, weights, chosen) -> torch.Tensor:
        """``[tokens, E]``: each token's routing weight per expert, 0 where not chosen."""
        dense = torch.zeros(flat.shape[0], len(self.experts), dtype=flat.dtype, device=flat.device)
        return dense.scatter_(1, chosen, weights)

    def _every_expert(self, flat, weights, chosen) -> torch.Tensor:
        """The same sum with every expert on every token, weighted 0 where not chosen (see
        :data:`DENSE_ROUTING_TOKENS`)."""
        dense = self._weights_by_expert(flat, weights, chosen)  # [tokens, E]
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            out = out + expert(flat) * dense[:, e, None]
        return out

    def _used_experts(self, flat, weights, chosen) -> torch.Tensor:
        """The same sum, compiled, with fixed shapes: each expert runs inside a ``torch.cond`` branch taken only
        when some token chose it, so a batch-1 step reads ``top_k`` experts' weights rather than all of them.
        CPU only: on a GPU the branch would read its predicate back to the host (and rule out CUDA graphs)."""
        dense = self._weights_by_expert(flat, weights, chosen)  # [tokens, E]
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            weight = dense[:, e, None]  # [tokens, 1]
            out = out + torch.cond(
                (weight != 0).any(),
                lambda x, w, expert=expert: expert(x) * w,
                lambda x, w: torch.zeros_like(x),
                (flat, weight),
            )
        return out

    def _route_for(self, flat: torch.Tensor):
        """The expert sum for ``flat [tokens, hidden]``: sparse (eager, few tokens), branching (compiled on CPU,
        fewer choices than experts) or dense (see :meth:`routes_densely`)."""
        if not self.routes_densely(flat.shape[0]):
            return self._chosen_experts
        branching = torch.compiler.is_compiling() and flat.device.type == "cpu"
        if branching and flat.shape[0] * self.top_k < len(self.experts):
            return self._used_experts
        return self._every_expert

    def routes_densely(self, tokens: int) -> bool:
        """Every expert on every token for a short forward that is being compiled (no graph break), or whose
        ``tokens * top_k`` choices would reach every expert anyway (a batch of decode steps): then it costs
        little more than the sparse path. A batch-1 eager decode step of a many-expert model stays sparse
        (reading all experts' weights would cost ``num_experts / top_k`` times as much)."""
        if tokens > DENSE_ROUTING_TOKENS:
            return False
        return torch.compiler.is_compiling() or tokens * self.top_k >= len(self.experts)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        probs, weights, chosen = self.route(flat)
        weights = weights.to(x.dtype)
        out = self._route_for(flat)(flat, weights, chosen)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        real = mask.reshape(-1) if mask is not None else slice(None)  # padding takes no part in balancing
        return out.view_as(x), routing_statistics(probs[real], chosen[real], len(self.experts))
