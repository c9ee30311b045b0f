"""Qwen3-Next: Gated DeltaNet layers (``gated_deltanet``) and gated attention (query/key-head RMSNorms, partial
RoPE, an output gate), with a softmax top-k MoE whose shared expert is gated by a sigmoid. Read and written.

Layout differences, undone on load and redone on export:

* every RMSNorm except the DeltaNet output norm scales by ``1 + weight`` (ours by ``weight``);
* ``self_attn.q_proj`` holds each head's query rows followed by its gate rows (ours: ``q_proj`` and
  ``gate_proj``);
* ``linear_attn.in_proj_qkvz`` / ``in_proj_ba`` hold, for each key head, its q, k, v, z (b, a) rows in turn
  (ours: all q rows, then all k, v, z).
"""

from __future__ import annotations

import torch

from hybridlm.config import HybridConfig
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.jamba import unfuse_experts
from hybridlm.formats.mapping import (
    ATTENTION_FIELDS,
    COMMON_FIELDS,
    DELTANET_FIELDS,
    FieldMap,
    RenameRules,
    StateDict,
    check_expressible,
    differences,
    layer_rules,
    our_kinds,
    outer_rules,
    positions,
    rename_state,
    require_settings,
    rope_parameters,
    rope_settings,
    same_names,
    their_kinds,
    unsupported_kinds,
    with_transformers_defaults,
)

FIELDS = FieldMap({
    **COMMON_FIELDS, **ATTENTION_FIELDS,
    **same_names("num_hidden_layers", "rms_norm_eps", "tie_word_embeddings", "head_dim", "attention_bias",
                 "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                 "num_experts_per_tok", "router_aux_loss_coef"),
    "norm_topk_prob": "moe_renormalize",
    **DELTANET_FIELDS,
})
LAYER_KINDS = {"linear_attention": "gated_deltanet", "full_attention": "attention"}
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
#: the options this format's config fixes (checked on export, set on import)
FIXED = {"attention_qk_norm": True, "attention_output_gate": True, "moe_shared_expert_gate": True}


def decoder_rules(config: HybridConfig) -> RenameRules:
    layer = "model.layers.{i}"
    return RenameRules([
        *outer_rules(),
        (f"{layer}.input_layernorm.weight", f"{layer}.input_layernorm.weight"),
        (f"{layer}.post_attention_layernorm.weight", f"{layer}.pre_mlp_layernorm.weight"),
        (f"{layer}.mlp.gate.weight", f"{layer}.mlp.router.weight"),
        (f"{layer}.mlp.{{rest}}", f"{layer}.mlp.{{rest}}"),
        *layer_rules(config, layer, {"gated_deltanet": "linear_attn", "attention": "self_attn"}),
    ])


def _offset_norms(state: StateDict, config: HybridConfig, offset: float) -> StateDict:
    """Add ``offset`` to the weights of the norms that scale by ``1 + weight`` (our names)."""
    names = ["model.norm.weight"]
    for i, kind in enumerate(config.layer_types):
        names += [f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.pre_mlp_layernorm.weight"]
        if kind == "attention":
            names += [f"model.layers.{i}.mixer.q_norm.weight", f"model.layers.{i}.mixer.k_norm.weight"]
    return {name: t + offset if name in names else t for name, t in state.items()}


def _regroup(t: torch.Tensor, groups: int, sizes: list[int], per_group: bool) -> torch.Tensor:
    """Rows ``[block 0 | block 1 | ...]`` per group (``per_group``) to all rows of each block in turn, or back.
    ``sizes`` are the blocks' rows per group."""
    if per_group:
        blocks = t.unflatten(0, (groups, -1)).split(sizes, dim=1)  # each [groups, size, ...]
        return torch.cat([b.flatten(0, 1) for b in blocks])
    blocks = t.split([groups * size for size in sizes])
    return torch.cat([b.unflatten(0, (groups, -1)) for b in blocks], dim=1).flatten(0, 1)


def _relayout(state: StateDict, config: HybridConfig, to_ours: bool, interleaved: bool = True) -> StateDict:
    """Split (or join) the fused attention projection and (``interleaved``) reorder the DeltaNet projections;
    names are ours except the fused q_proj."""
    state = dict(state)
    group = config.deltanet_num_value_heads // config.deltanet_num_key_heads
    dk, dv = config.deltanet_key_head_dim, config.deltanet_value_head_dim
    for i, kind in enumerate(config.layer_types):
        mixer = f"model.layers.{i}.mixer"
        if kind == "gated_deltanet" and interleaved:
            for name, sizes in (("in_proj_qkvz", [dk, dk, group * dv, group * dv]), ("in_proj_ba", [group, group])):
                key = f"{mixer}.{name}.weight"
                if key in state:
                    state[key] = _regroup(state[key], config.deltanet_num_key_heads, sizes, per_group=to_ours)
        elif kind == "attention":
            for suffix in ("weight", "bias"):
                fused, query, gate = (f"{mixer}.{name}.{suffix}" for name in ("q_proj_and_gate", "q_proj", "gate_proj"))
                if to_ours and fused in state:
                    state[query], state[gate] = _regroup(state.pop(fused), config.num_attention_heads,
                                                         [config.head_dim] * 2, per_group=True).chunk(2)
                elif not to_ours and query in state:
                    joined = torch.cat([state.pop(query), state.pop(gate)])
                    state[fused] = _regroup(joined, config.num_attention_heads, [config.head_dim] * 2, False)
    return state


def _fused_q_rules(config: HybridConfig) -> RenameRules:
    """Qwen3-Next's fused ``q_proj`` (query and gate rows) under a name of its own while it is split or joined."""
    return RenameRules([(f"model.layers.{i}.self_attn.q_proj.{{rest}}",
                         f"model.layers.{i}.mixer.q_proj_and_gate.{{rest}}")
                        for i in positions(config.layer_types, "attention")])


def check_deltanet_heads(fc: dict, model_type: str) -> None:
    """A Gated DeltaNet key head serves a group of consecutive value heads: refuse a checkpoint whose value heads
    do not split into such groups, naming its own fields (HybridConfig would name ours)."""
    keys, values = fc["linear_num_key_heads"], fc["linear_num_value_heads"]
    if keys > 0 and values % keys:
        raise ValueError(f"{model_type} config: linear_num_value_heads={values} is not a multiple of "
                         f"linear_num_key_heads={keys} (each key head serves a group of consecutive value heads)")


def config_from(fc: dict, mlp_types: list[str], model_type: str) -> HybridConfig:
    """The HybridConfig of a Qwen3-Next-style text config (Qwen3.5's too) whose MLP plan is ``mlp_types``."""
    require_settings(fc, {"hidden_act": ("silu",)}, model_type)
    layer_types = our_kinds(fc, LAYER_KINDS, model_type)
    check_deltanet_heads(fc, model_type)
    if "moe" in mlp_types and not fc["shared_expert_intermediate_size"]:
        raise ValueError(f"{model_type} config: shared_expert_intermediate_size=0 is not supported (its gated "
                         "shared expert would be empty)")
    return HybridConfig(
        **FIELDS.to_ours(fc),
        **rope_settings(fc, DEFAULT_PARTIAL_ROTARY_FACTOR),
        layer_types=layer_types,
        mlp_types=mlp_types,
        **FIXED,
    )


def to_config(foreign_config: dict) -> HybridConfig:
    fc = with_transformers_defaults(foreign_config)
    moe = [i not in fc["mlp_only_layers"] and fc["num_experts"] > 0 and (i + 1) % fc["decoder_sparse_step"] == 0
           for i in range(fc["num_hidden_layers"])]
    return config_from(fc, ["moe" if m else "dense" for m in moe], "qwen3_next")


def weights_to_ours(state: StateDict, config: HybridConfig, interleaved: bool = True) -> StateDict:
    """Qwen3-Next-style weights (``model.layers...`` names) as ours; ``interleaved``: the DeltaNet projections
    hold their blocks per key head (Qwen3-Next), not one after another (Qwen3.5, joined by its reader)."""
    state = {name: t for name, t in state.items() if not name.startswith("mtp.")}  # multi-token prediction head
    state = rename_state(rename_state(unfuse_experts(state), _fused_q_rules(config)), decoder_rules(config))
    return _offset_norms(_relayout(state, config, to_ours=True, interleaved=interleaved), config, 1.0)


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    return weights_to_ours(state, config)


def from_config(config: HybridConfig) -> dict:
    problems = unsupported_kinds(config, list(LAYER_KINDS.values()), "Qwen3-Next")
    if "none" in config.mlp_types:
        problems.append(f"every Qwen3-Next layer has an MLP; layers {positions(config.mlp_types, 'none')} do not")
    problems += differences(config, {"mlp_activation": "silu", "sliding_window": None, "deltanet_chunk_size": 64})
    if "attention" in config.layer_types:
        problems += differences(config, {"attention_qk_norm": True, "attention_output_gate": True})
    if "moe" in config.mlp_types:
        problems += differences(config, {"moe_shared_expert_gate": True, "moe_router": "softmax"})
    check_expressible("qwen3_next", problems)
    return {
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        **FIELDS.to_theirs(config),
        "layer_types": their_kinds(config.layer_types, LAYER_KINDS),
        "mlp_only_layers": positions(config.mlp_types, "dense"),
        "decoder_sparse_step": 1,
        "num_experts": config.num_experts,  # dense layers are listed in mlp_only_layers
        "hidden_act": "silu",
        "rope_parameters": rope_parameters(config),
    }


def export_weights(state: StateDict, config: HybridConfig) -> StateDict:
    state = _relayout(_offset_norms(state, config, -1.0), config, to_ours=False)
    return rename_state(rename_state(state, _fused_q_rules(config), to_ours=False), decoder_rules(config),
                        to_ours=False)


FORMAT = register(CheckpointFormat("qwen3_next", to_config, import_weights, from_config, export_weights,
                                   options=frozenset(FIXED)))

__all__ = ["FORMAT"]
