"""Kimi Linear (Moonshot AI): Kimi Delta Attention layers (``kda``) and multi-head latent attention layers
(``mla``, without RoPE), each followed by a SwiGLU MLP or a DeepSeek-V3 MoE (sigmoid router with a selection
bias and expert groups, renormalised top-k weights times ``routed_scaling_factor``, always-on shared experts).
Read only.

Layout differences, undone on load: ``A_log`` is stored ``[1, 1, heads, 1]`` (ours ``[heads]``); the conv
weights come as ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` (ours one ``conv1d``); MLPs and MoEs live under
``block_sparse_moe`` with experts' ``w1 / w3 / w2`` (gate / up / down). The checkpoint's ``linear_attn_config``
(1-based ``kda_layers`` / ``full_attn_layers``) and ``first_k_dense_replace`` are read through transformers'
config class.
"""

from __future__ import annotations

from hybridlm.config import HybridConfig
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.jamba import unfuse_experts
from hybridlm.formats.mapping import (
    COMMON_FIELDS,
    FieldMap,
    RenameRules,
    StateDict,
    join_weights,
    our_kinds,
    outer_rules,
    positions,
    rename_state,
    require_settings,
    same_names,
    with_transformers_defaults,
)

FIELDS = FieldMap({
    **COMMON_FIELDS,
    **same_names("num_attention_heads", "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings",
                 "intermediate_size", "moe_intermediate_size", "num_experts", "attention_bias", "moe_renormalize"),
    "num_experts_per_token": "num_experts_per_tok", "num_expert_group": "moe_num_groups",
    "topk_group": "moe_topk_groups", "routed_scaling_factor": "moe_routed_scaling",
    "linear_num_heads": "deltanet_num_key_heads", "linear_head_dim": "deltanet_key_head_dim",
    "linear_conv_kernel_dim": "deltanet_conv_size", "kv_lora_rank": "mla_kv_lora_rank",
    "q_lora_rank": "mla_q_lora_rank", "qk_nope_head_dim": "mla_qk_nope_head_dim",
    "qk_rope_head_dim": "mla_qk_rope_head_dim", "v_head_dim": "mla_v_head_dim",
})
LAYER_KINDS = {"linear_attention": "kda", "full_attention": "mla"}
MLP_KINDS = {"dense": "dense", "sparse": "moe"}
CONV_PARTS = ("q_conv1d", "k_conv1d", "v_conv1d")


def to_config(foreign_config: dict) -> HybridConfig:
    fc = with_transformers_defaults(foreign_config)
    require_settings(fc, {"hidden_act": ("silu",)}, "kimi_linear")
    layer_types = our_kinds(fc, LAYER_KINDS, "kimi_linear")
    mlp_types = our_kinds(fc, MLP_KINDS, "kimi_linear", "mlp_layer_types")
    if fc["num_key_value_heads"] not in (None, fc["num_attention_heads"]):
        raise ValueError(f"kimi_linear config: num_key_value_heads={fc['num_key_value_heads']} is not supported (MLA "
                         f"expands its latent to all num_attention_heads={fc['num_attention_heads']} heads)")
    return HybridConfig(
        **FIELDS.to_ours(fc),
        deltanet_num_value_heads=fc["linear_num_heads"],
        deltanet_value_head_dim=fc["linear_head_dim"],
        layer_types=layer_types,
        mlp_types=mlp_types,
        shared_expert_intermediate_size=fc["moe_intermediate_size"] * fc["num_shared_experts"],
        moe_router="sigmoid",
        router_aux_loss_coef=0.0,  # transformers adds no load-balancing loss (the selection bias balances)
        mla_rope=False,
    )


def _rules() -> RenameRules:
    layer, mlp = "model.layers.{i}", "model.layers.{i}.mlp"
    names = [(f"experts.{{e}}.{theirs}.weight", f"experts.{{e}}.{ours}_proj.weight")
             for theirs, ours in (("w1", "gate"), ("w3", "up"), ("w2", "down"))]
    names += [("gate.weight", "router.weight"), ("gate.e_score_correction_bias", "expert_bias"),
              ("shared_experts.{rest}", "shared_expert.{rest}"), ("{rest}", "{rest}")]
    moe = [(f"{layer}.{block}.{theirs}", f"{mlp}.{ours}")
           for block in ("block_sparse_moe", "mlp") for theirs, ours in names]
    return RenameRules([
        *outer_rules(),
        (f"{layer}.input_layernorm.weight", f"{layer}.input_layernorm.weight"),
        (f"{layer}.post_attention_layernorm.weight", f"{layer}.pre_mlp_layernorm.weight"),
        (f"{layer}.self_attn.forget_gate.{{rest}}", f"{layer}.mixer.{{rest}}"),  # transformers' in-memory names
        (f"{layer}.self_attn.{{rest}}", f"{layer}.mixer.{{rest}}"),
        *moe,
    ])


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    state = unfuse_experts(rename_state(state, _rules()))
    for i in positions(config.layer_types, "kda"):
        mixer = f"model.layers.{i}.mixer"
        if f"{mixer}.A_log" in state:
            state[f"{mixer}.A_log"] = state[f"{mixer}.A_log"].flatten()
        join_weights(state, mixer, {"conv1d": CONV_PARTS})
    return state


FORMAT = register(CheckpointFormat("kimi_linear", to_config, import_weights))

__all__ = ["FORMAT"]
