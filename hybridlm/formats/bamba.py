"""Bamba (IBM): Mamba-2 layers and attention layers with partial RoPE (half the head by default), each followed
by a SwiGLU MLP, in Jamba's ``model.layers`` layout. Read and written."""

from __future__ import annotations

from hybridlm.config import HybridConfig
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.jamba import decoder_rules
from hybridlm.formats.mapping import (
    ATTENTION_FIELDS,
    COMMON_FIELDS,
    FieldMap,
    check_expressible,
    check_mamba2_heads,
    differences,
    head_dim_of,
    other_positions,
    positions,
    renaming,
    require_settings,
    rope_parameters,
    rope_settings,
    same_names,
    unsupported_kinds,
    with_transformers_defaults,
)

#: Mamba-2 settings as Bamba names them (Falcon-H1 and Granite-4.0-H inherit the names).
MAMBA2_FIELDS = {
    "mamba_d_state": "mamba2_d_state", "mamba_d_conv": "mamba2_d_conv", "mamba_expand": "mamba2_expand",
    "mamba_d_head": "mamba2_head_dim", "mamba_n_groups": "mamba2_n_groups", "mamba_chunk_size": "mamba2_chunk_size",
    "mamba_conv_bias": "mamba2_conv_bias", "mamba_proj_bias": "mamba2_proj_bias",
}
#: Bamba's decoder settings (Falcon-H1 shares them).
DECODER_FIELDS = {
    **COMMON_FIELDS, **ATTENTION_FIELDS,
    **same_names("intermediate_size", "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings", "attention_bias"),
}
FIELDS = FieldMap({**DECODER_FIELDS, **MAMBA2_FIELDS})
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # what transformers assumes when a Bamba config does not say


def to_config(foreign_config: dict) -> HybridConfig:
    fc = with_transformers_defaults(foreign_config)
    require_settings(fc, {"hidden_act": ("silu",), "mlp_bias": (False,)}, "bamba")
    n = fc["num_hidden_layers"]
    attention = set(fc.get("attn_layer_indices") or [])
    config = HybridConfig(
        **FIELDS.to_ours(fc),
        **rope_settings(fc, DEFAULT_PARTIAL_ROTARY_FACTOR),
        layer_types=["attention" if i in attention else "mamba2" for i in range(n)],
        mlp_types=["dense"] * n,
        head_dim=head_dim_of(fc),
        mamba2_dt_limit=fc.get("time_step_limit"),  # None means no limit
    )
    check_mamba2_heads(config, fc, "mamba_n_heads", "mamba_expand * hidden_size / mamba_d_head", "bamba")
    return config


import_weights, export_weights = renaming(decoder_rules)


def from_config(config: HybridConfig) -> dict:
    problems = unsupported_kinds(config, ["mamba2", "attention"], "Bamba")
    if set(config.mlp_types) != {"dense"}:
        problems.append(f"every Bamba layer has a dense MLP; layers {other_positions(config.mlp_types, 'dense')} "
                        "do not")
    problems += differences(config, {"mlp_activation": "silu", "sliding_window": None})
    check_expressible("bamba", problems)
    return {
        "model_type": "bamba",
        "architectures": ["BambaForCausalLM"],
        **FIELDS.to_theirs(config),
        "attn_layer_indices": positions(config.layer_types, "attention"),
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "mamba_n_heads": config.mamba2_num_heads,
        "time_step_limit": config.mamba2_dt_limit,
        "rope_parameters": rope_parameters(config),
    }


FORMAT = register(CheckpointFormat("bamba", to_config, import_weights, from_config, export_weights))

__all__ = ["FORMAT"]
