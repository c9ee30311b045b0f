"""Jamba (AI21): Mamba-1 layers with RMS-normed dt, B and C, attention layers without RoPE placed by period and
offset, and a top-k MoE (softmax then top-k, not renormalised) every ``expert_layer_period`` layers.

Read and written. The decoder layout here (``model.layers.{i}.mamba`` / ``self_attn`` / ``feed_forward``,
``pre_ff_layernorm``, ``final_layernorm``) is shared with Bamba.
"""

from __future__ import annotations

from hybridlm.config import HybridConfig
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.mapping import (
    ATTENTION_FIELDS,
    COMMON_FIELDS,
    FieldMap,
    RenameRules,
    StateDict,
    check_expressible,
    differences,
    head_dim_of,
    layer_rules,
    outer_rules,
    positions,
    rename_state,
    renaming,
    require_settings,
    same_names,
    split_stacked,
    unsupported_kinds,
    with_transformers_defaults,
)

FIELDS = FieldMap({**COMMON_FIELDS, **ATTENTION_FIELDS, **same_names(
    "intermediate_size", "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings", "num_experts",
    "num_experts_per_tok", "router_aux_loss_coef", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_dt_rank",
    "mamba_conv_bias", "mamba_proj_bias",
)})


def decoder_rules(config: HybridConfig) -> RenameRules:
    """Names of the ``model.layers`` decoder layout of Jamba and Bamba."""
    return RenameRules([
        *outer_rules("model.final_layernorm.weight"),
        ("model.layers.{i}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight"),
        ("model.layers.{i}.pre_ff_layernorm.weight", "model.layers.{i}.pre_mlp_layernorm.weight"),
        ("model.layers.{i}.feed_forward.{rest}", "model.layers.{i}.mlp.{rest}"),
        *layer_rules(config, "model.layers.{i}", {"mamba": "mamba", "mamba2": "mamba", "attention": "self_attn"}),
    ])


def periodic(flags: list[bool]) -> tuple[int, int] | None:
    """The smallest ``(period, offset)`` with ``flags[i] == (i % period == offset)`` for every ``i``, or None."""
    for period in range(1, len(flags) + 2):
        for offset in range(period):
            if all(flag == (i % period == offset) for i, flag in enumerate(flags)):
                return period, offset
    return None


def to_config(foreign_config: dict) -> HybridConfig:
    fc = with_transformers_defaults(foreign_config)
    require_settings(fc, {"hidden_act": ("silu",)}, "jamba")
    n = fc["num_hidden_layers"]
    attention = [i % fc["attn_layer_period"] == fc["attn_layer_offset"] for i in range(n)]
    # Jamba builds a dense MLP wherever a layer would have a single expert.
    moe = [fc["num_experts"] > 1 and i % fc["expert_layer_period"] == fc["expert_layer_offset"] for i in range(n)]
    return HybridConfig(
        **FIELDS.to_ours(fc),
        layer_types=["attention" if a else "mamba" for a in attention],
        mlp_types=["moe" if m else "dense" for m in moe],
        head_dim=head_dim_of(fc),
        partial_rotary_factor=0.0,  # Jamba's attention has no positional encoding
        mamba_dt_norm=True,
        moe_intermediate_size=fc["intermediate_size"],
        moe_renormalize=False,
    )


def unfuse_experts(state: StateDict) -> StateDict:
    """Per-expert tensors from the fused layout (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H,
    I]``) that transformers keeps in memory; checkpoints written by ``save_pretrained`` are already per expert."""
    for name in [n for n in state if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        prefix, fused = name.rsplit(".", 1)
        parts = ["gate_proj", "up_proj"] if fused == "gate_up_proj" else ["down_proj"]
        state = split_stacked(state, name, [f"{prefix}.{{e}}.{part}.weight" for part in parts])
    return state


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    return rename_state(unfuse_experts(state), decoder_rules(config))


def from_config(config: HybridConfig) -> dict:
    problems = unsupported_kinds(config, ["mamba", "attention"], "Jamba")
    attention = periodic([kind == "attention" for kind in config.layer_types])
    if attention is None:
        problems.append(f"attention layers at {positions(config.layer_types, 'attention')} are not one every "
                        "attn_layer_period layers")
    if "none" in config.mlp_types:
        problems.append(f"layers {positions(config.mlp_types, 'none')} have no MLP; every Jamba layer has one")
    moe = periodic([kind == "moe" for kind in config.mlp_types])
    if moe is None:
        problems.append(f"MoE layers at {positions(config.mlp_types, 'moe')} are not one every expert_layer_period "
                        "layers")
    problems += differences(config, {
        "mlp_activation": "silu", "sliding_window": None, "attention_bias": False,
        "mamba_dt_norm": True, "mamba_dt_norm_learnable": True, "mamba_dt_norm_eps": config.rms_norm_eps,
    })
    if "attention" in config.layer_types:
        problems += differences(config, {"partial_rotary_factor": 0.0})
    if "moe" in config.mlp_types:
        problems += differences(config, {
            "moe_intermediate_size": config.intermediate_size, "moe_renormalize": False,
            "shared_expert_intermediate_size": 0,
        })
        if config.num_experts < 2:
            problems.append("num_experts=1 (Jamba turns a one-expert layer into a dense MLP)")
    check_expressible("jamba", problems)
    return {
        "model_type": "jamba",
        "architectures": ["JambaForCausalLM"],
        **FIELDS.to_theirs(config),
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "attn_layer_period": attention[0],
        "attn_layer_offset": attention[1],
        "expert_layer_period": moe[0],
        "expert_layer_offset": moe[1],
    }


_, export_weights = renaming(decoder_rules)


FORMAT = register(CheckpointFormat("jamba", to_config, import_weights, from_config, export_weights))

__all__ = ["FORMAT", "decoder_rules", "periodic"]
