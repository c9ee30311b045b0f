"""Blocks, the hybrid stack and the causal LM head, as transformers ``PreTrainedModel`` classes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import ModelOutput

from hybridlm.cache import HybridCache, LayerState, StateGroup
from hybridlm.config import HybridConfig
from hybridlm.layers.linear import Linear
from hybridlm.layers.mlp import MLP, MoE, load_balancing_loss
from hybridlm.layers.norms import RMSNorm
from hybridlm.mixers import Mixer, build_mixer
from hybridlm.mixers.segments import mix
from hybridlm.mixers.shared_blocks import SharedBlocks
from hybridlm.model import checkpoint_io
from hybridlm.model.cache_construction import CacheConstruction
from hybridlm.model.hf_compat import GenerationSupport, forward_kwargs, register_auto_classes
from hybridlm.model.inputs import (
    check_embeddings,
    check_labels,
    check_logits_to_keep,
    check_position_ids,
    check_token_ids,
)
from hybridlm.model.packing import packed_documents
from hybridlm.model.weight_quantization import QUANTIZED_WEIGHTS


@dataclass
class HybridModelOutput(ModelOutput):
    """``last_hidden_state [batch, time, hidden]``; ``cache`` when one was used; ``aux_loss``: the MoE
    load-balancing loss over the real tokens of all MoE layers, as transformers defines it (k for uniform top-k
    routing; see :func:`hybridlm.layers.mlp.load_balancing_loss`), None without MoE layers."""

    last_hidden_state: torch.Tensor | None = None
    cache: HybridCache | None = None
    aux_loss: torch.Tensor | None = None


@dataclass
class HybridCausalLMOutput(ModelOutput):
    """``loss`` (with labels: cross-entropy plus ``router_aux_loss_coef * aux_loss``), ``logits``, ``cache``,
    ``aux_loss``."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: HybridCache | None = None
    aux_loss: torch.Tensor | None = None


class HybridBlock(GradientCheckpointingLayer):
    """Pre-norm residual block: ``h += r * mixer(norm(h + injected))``, then ``h += r * mlp(norm(h))``.

    The mixer is absent for a ``"none"`` layer (MLP-only) and the MLP for ``mlp_type="none"`` (mixer-only);
    ``r`` is ``residual_multiplier``; ``injected`` is what a shared block adds to this layer's mixer input
    (:mod:`hybridlm.mixers.shared_blocks`), None elsewhere. A layer in ``post_norm_layers`` norms the outputs instead
    (OLMo): ``h += r * norm(mixer(h))``, ``h += r * norm(mlp(h))``, with the same two norm weights."""

    def __init__(self, config: HybridConfig, layer_idx: int):
        super().__init__()
        self.mixer_type, self.mlp_type = config.layer_types[layer_idx], config.mlp_types[layer_idx]
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.residual_multiplier = config.residual_multiplier
        self.post_norm = layer_idx in (config.post_norm_layers or ())
        self.mixer = build_mixer(self.mixer_type, config, layer_idx)
        if self.mixer is not None:
            self.input_layernorm = RMSNorm(hidden, eps)
        if self.mlp_type == "dense":
            self.mlp = MLP(hidden, config.intermediate_size, config.mlp_activation)
        elif self.mlp_type == "moe":
            self.mlp = MoE(hidden, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
                           config.mlp_activation, config.moe_renormalize, config.shared_expert_intermediate_size,
                           router=config.moe_router, num_groups=config.moe_num_groups,
                           topk_groups=config.moe_topk_groups, routed_scaling=config.moe_routed_scaling,
                           shared_expert_gate=config.moe_shared_expert_gate)
        if self.mlp_type != "none":
            self.pre_mlp_layernorm = RMSNorm(hidden, eps)

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> LayerState:
        if self.mixer is None:
            return StateGroup()
        return self.mixer.init_state(batch_size, max_length, device, dtype)

    def _residual(self, hidden, out, norm):
        out = norm(out) if self.post_norm else out
        return hidden + (out if self.residual_multiplier == 1.0 else out * self.residual_multiplier)

    def forward(self, hidden, state=None, mask=None, positions=None, injected=None, segments=None):
        if self.mixer is not None:
            mixer_input = hidden if injected is None else hidden + injected
            out = mix(self.mixer, mixer_input if self.post_norm else self.input_layernorm(mixer_input), state,
                      mask=mask, positions=positions, segments=segments)
            hidden = self._residual(hidden, out, self.input_layernorm)
        aux = None
        mlp_input = hidden if self.post_norm or self.mlp_type == "none" else self.pre_mlp_layernorm(hidden)
        if self.mlp_type == "dense":
            hidden = self._residual(hidden, self.mlp(mlp_input), self.pre_mlp_layernorm)
        elif self.mlp_type == "moe":
            out, aux = self.mlp(mlp_input, mask)
            hidden = self._residual(hidden, out, self.pre_mlp_layernorm)
        return hidden, aux


class HybridPreTrainedModel(PreTrainedModel):
    config_class = HybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HybridBlock"]
    #: Whether ``from_pretrained`` also reads foreign formats (the causal LM; the bare stack reads its own only).
    reads_foreign_checkpoints: ClassVar[bool] = False

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' loader, except that missing or unexpected weights are an error naming them (transformers
        would initialise missing ones randomly and only log a report); :class:`HybridForCausalLM` also reads any
        format in :mod:`hybridlm.formats` (Jamba, Mamba-2, Bamba, ...). See
        :func:`hybridlm.model.checkpoint_io.load_pretrained`."""
        return checkpoint_io.load_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, Mixer) and hasattr(module, "initial_values"):
            for name, value in module.initial_values().items():
                target = module.get_parameter(name) if name in dict(module.named_parameters()) \
                    else module.get_buffer(name)
                init.copy_(target, value.to(target.device, target.dtype))

    def after_optimizer_step(self) -> None:
        """Call once after each optimizer step (on every data-parallel rank): mixers with step-based schedules
        advance them (a Performer redraws its random features every ``performer_redraw_interval`` steps, from a
        seed and the step count saved with the weights, never from the global RNG)."""
        for module in self.modules():
            if isinstance(module, Mixer) and hasattr(module, "after_optimizer_step"):
                module.after_optimizer_step()


def _check_mask(mask: torch.Tensor, cache: HybridCache | None) -> None:
    """Padding must be a contiguous run at the start or end of each row; with a cache, only at the start
    and only before the row's first real token (what keeps every state exact)."""
    steps = mask[:, 1:].int() - mask[:, :-1].int()
    starts, stops = (steps == 1).sum(-1), (steps == -1).sum(-1)
    if cache is None:
        if bool(((starts + stops > 1) | ((starts == 1) & (stops == 1))).any()):
            raise ValueError("attention_mask: padding must be at the start or the end of each row, not inside it")
        return
    if bool((stops > 0).any()):
        raise ValueError("attention_mask: with a cache only left padding is supported (a padded position "
                         "follows a real token)")
    if bool(((cache.positions > 0) & ~mask.all(-1)).any()):
        raise ValueError("attention_mask: padding after a row's first real token is not supported with a cache")


class HybridModel(CacheConstruction, HybridPreTrainedModel):
    """Embedding (scaled by ``embedding_multiplier``), the stack of :class:`HybridBlock` s, the shared blocks
    applied inside it when ``shared_block_layers`` is set, and the final norm. Its cache (``new_cache``) is
    built and checked by :class:`~hybridlm.model.cache_construction.CacheConstruction`."""

    def __init__(self, config: HybridConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridBlock(config, i) for i in range(config.num_hidden_layers))
        self.shared = SharedBlocks(config) if config.shared_block_layers else None
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self._signatures: dict[torch.dtype, tuple] = {}
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    # --- forward --------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridCache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache_policy=None,
        **kwargs,
    ) -> HybridModelOutput:
        forward_kwargs(type(self).__name__, kwargs)
        hidden = self._embed(input_ids, inputs_embeds)
        batch, time = hidden.shape[:2]
        if cache is None and use_cache:
            cache = self.new_cache(batch, policy=cache_policy)
        elif cache is None and cache_policy is not None:  # it would shape no cache: a silent no-op
            raise ValueError("cache_policy is given but no cache is used: pass use_cache=True or a cache")
        elif cache is not None and cache_policy is not None and cache_policy != cache.policy:
            raise ValueError(f"cache_policy={cache_policy} differs from the policy this cache was made with "
                             f"({cache.policy}); a policy cannot change during generation")
        if cache is not None:
            self._check_cache(cache, batch, hidden.dtype)
            cache.check_room(time)
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                raise ValueError("HybridModel: a cache cannot be used while training with gradient checkpointing")
        mask = self._current_mask(attention_mask, cache, batch, time)
        segments = packed_documents(kwargs, position_ids, mask, cache, batch, time)  # None: one document per row
        if segments is not None and position_ids is None:
            position_ids = segments.positions()
        positions = self._positions(position_ids, mask, cache, batch, time, hidden.device)
        hidden, aux_losses = self.run_blocks(hidden, cache, mask, positions, segments)
        if cache is not None:
            cache.advance(mask, time)
        aux_loss = load_balancing_loss(torch.stack(aux_losses)) if aux_losses else None
        return HybridModelOutput(last_hidden_state=self.norm(hidden), cache=cache, aux_loss=aux_loss)

    def run_blocks(self, hidden, cache, mask, positions, segments) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The stack (and shared blocks) over ``hidden [batch, time, hidden]``, before the final norm; returns
        it with the MoE routing statistics. Leaves the cache's counters to the caller (``cache.advance``)."""
        aux_losses, embeddings = [], hidden
        sites = {layer: k for k, layer in enumerate(self.shared.layers)} if self.shared is not None else {}
        for i, block in enumerate(self.layers):
            state = cache.states[i] if cache is not None else None
            injected = None
            if i in sites:
                k = sites[i]
                site_state = cache.states[len(self.layers) + k] if cache is not None else None
                injected = self.shared(k, hidden, embeddings, site_state, mask, positions, segments)
            hidden, aux = block(hidden, state, mask, positions, injected, segments)
            if aux is not None:
                aux_losses.append(aux)
        return hidden, aux_losses

    def _embed(self, input_ids, inputs_embeds) -> torch.Tensor:
        """``[batch, time, hidden]`` from exactly one of the two; each is checked first, so that bad input is an
        error naming the argument rather than a failure deep inside a mixer."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("HybridModel: pass exactly one of input_ids and inputs_embeds")
        weight = self.embed_tokens.weight
        if inputs_embeds is not None:
            check_embeddings(inputs_embeds, self.config.hidden_size, weight.dtype, weight.device)
            return inputs_embeds
        check_token_ids(input_ids, self.config.vocab_size, weight.device)
        return self.embed_ids(input_ids)

    def embed_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled embeddings of ids already checked (or produced by the model itself)."""
        embeddings = self.embed_tokens(input_ids)
        multiplier = self.config.embedding_multiplier
        return embeddings if multiplier == 1.0 else embeddings * multiplier

    def _current_mask(self, attention_mask, cache, batch: int, time: int) -> torch.Tensor | None:
        """The padding mask of the new tokens, or None when none is padded. transformers' generate() passes the
        mask of the whole sequence so far; its last ``time`` columns are the new tokens."""
        if attention_mask is None:
            return None
        seen = cache.seen if cache is not None else 0
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or \
                attention_mask.shape[1] not in (time, seen + time):
            raise ValueError(f"attention_mask must be [batch={batch}, {time}] or [batch, {seen + time}] "
                             f"(cached + new tokens), got {tuple(attention_mask.shape)}")
        mask = attention_mask[:, -time:].bool()
        if bool(mask.all()):
            return None
        _check_mask(mask, cache)
        return mask

    def _positions(self, position_ids, mask, cache, batch, time, device) -> torch.Tensor:
        if position_ids is not None:
            check_position_ids(position_ids, batch, time)
            positions = position_ids.expand(batch, time)
        else:
            start = cache.positions[:, None] if cache is not None else torch.zeros(batch, 1, dtype=torch.long,
                                                                                    device=device)
            if mask is None:
                positions = start + torch.arange(time, device=device)
            else:
                positions = start + (mask.long().cumsum(-1) - 1).clamp(min=0)
        limit = self.config.max_length_limit
        if limit is not None and time and int(positions.max()) >= limit:
            raise ValueError(f"sequence too long: position {int(positions.max())} is beyond this model's limit of "
                             f"{limit} positions ({self.config.length_limits})")
        return positions


class HybridForCausalLM(GenerationSupport, HybridPreTrainedModel, GenerationMixin):
    """:class:`HybridModel` plus the LM head; works with ``generate()`` (greedy, sampling, beam search)."""

    reads_foreign_checkpoints: ClassVar[bool] = True

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridConfig):
        super().__init__(config)
        bidirectional = [kind for kind, cls in config.used_mixers.items() if not cls.is_causal(config)]
        if bidirectional:
            fields = [f"{cls.causal_field}=False" for cls in map(config.used_mixers.get, bidirectional)
                      if cls.causal_field is not None]
            raise ValueError(f"HybridForCausalLM needs causal mixers, but {bidirectional} see later tokens under this "
                             f"config ({', '.join(fields) or 'not causal'}); use HybridModel as an encoder instead")
        self.model = HybridModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def save_pretrained(self, save_directory, *args, format: str = "hybridlm", **kwargs):
        """``format="hybridlm"`` (default) writes hybridlm's own checkpoint; another ``model_type`` (e.g.
        ``"jamba"``) writes a checkpoint that transformers loads as that architecture."""
        if bits := getattr(self, QUANTIZED_WEIGHTS, None):
            raise ValueError(f"save_pretrained: this model's linear weights are quantized to int{bits} for inference "
                             "(quantize_weights); save the float model and quantize it after loading")
        if format == "hybridlm":
            from hybridlm.remote_code import write_remote_code

            super().save_pretrained(save_directory, *args, **kwargs)
            write_remote_code(save_directory)  # what config.json's auto_map names
            return None
        return checkpoint_io.export(self, save_directory, format)

    def get_output_embeddings(self):
        return self.lm_head

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head (and ``logits_multiplier``) over final hidden states ``[..., hidden]``."""
        logits = self.lm_head(hidden)
        return logits if self.config.logits_multiplier == 1.0 else logits * self.config.logits_multiplier

    def set_output_embeddings(self, value):
        self.lm_head = value

    def new_cache(self, batch_size: int, max_length: int | None = None, device=None, dtype=None,
                  policy=None, static: bool = False) -> HybridCache:
        return self.model.new_cache(batch_size, max_length, device, dtype, policy, static)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridCache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        cache_policy=None,
        **kwargs,
    ) -> HybridCausalLMOutput:
        """``use_cache=True`` starts a new cache (returned as ``.cache``); ``cache=...`` continues one. With
        ``labels``, ``num_items_in_batch`` (what transformers' ``Trainer`` passes under gradient accumulation)
        makes the cross-entropy a sum over this batch's targets divided by that count, as transformers' models do."""
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        kwargs = forward_kwargs(type(self).__name__, kwargs)
        check_logits_to_keep(logits_to_keep)
        out = self.model(input_ids, attention_mask, position_ids, cache, use_cache, inputs_embeds,
                         cache_policy=cache_policy, **kwargs)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.logits_of(hidden)
        if logits.dtype == torch.float16 and not torch.compiler.is_compiling():
            check_float16_range(logits)
        loss = None
        if labels is not None:
            check_labels(labels, logits.shape)
            targets = labels[:, 1:].flatten().to(logits.device, torch.long)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets, ignore_index=-100,
                                   reduction="mean" if num_items_in_batch is None else "sum")
            if num_items_in_batch is not None:
                loss = loss / torch.as_tensor(num_items_in_batch, device=loss.device)
            if out.aux_loss is not None:
                loss = loss + self.config.router_aux_loss_coef * out.aux_loss
        return HybridCausalLMOutput(loss=loss, logits=logits, cache=out.cache, aux_loss=out.aux_loss)


def check_float16_range(logits: torch.Tensor) -> None:
    """float16 runs on the CPU as on a GPU, but its range ends at 65504: a model whose activations go past it
    gives inf, then NaN. Say so, rather than return them (one check per forward, float16 only)."""
    if not bool(torch.isfinite(logits).all()):
        raise FloatingPointError("the float16 model overflowed (float16 holds magnitudes up to 65504; inf or NaN "
                                 "in the logits): load it with dtype=torch.bfloat16 (the range of float32) or "
                                 "torch.float32")


register_auto_classes(HybridConfig, HybridModel, HybridForCausalLM)
