"""Mamba-2 (``mamba2``): a stack of Mamba-2 (SSD) mixers with no MLP, in Mamba's ``backbone`` layout. Read and
written."""

from __future__ import annotations

from hybridlm.config import HybridConfig
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.mamba import BACKBONE_RULES
from hybridlm.formats.mapping import (
    COMMON_FIELDS,
    FieldMap,
    check_expressible,
    check_mamba2_heads,
    other_positions,
    renaming,
    require_settings,
    same_names,
    with_transformers_defaults,
)

FIELDS = FieldMap({
    **COMMON_FIELDS, **same_names("num_hidden_layers", "tie_word_embeddings"), "layer_norm_epsilon": "rms_norm_eps",
    "state_size": "mamba2_d_state", "conv_kernel": "mamba2_d_conv",
    "expand": "mamba2_expand", "head_dim": "mamba2_head_dim", "n_groups": "mamba2_n_groups",
    "chunk_size": "mamba2_chunk_size", "use_conv_bias": "mamba2_conv_bias", "use_bias": "mamba2_proj_bias",
    "time_step_min": "mamba2_dt_min", "time_step_max": "mamba2_dt_max", "time_step_floor": "mamba2_dt_init_floor",
    "time_step_limit": "mamba2_dt_limit",
})


def to_config(foreign_config: dict) -> HybridConfig:
    fc = with_transformers_defaults(foreign_config)
    require_settings(fc, {"hidden_act": ("silu",)}, "mamba2")
    n = fc["num_hidden_layers"]
    config = HybridConfig(**FIELDS.to_ours(fc), layer_types=["mamba2"] * n, mlp_types=["none"] * n)
    check_mamba2_heads(config, fc, "num_heads", "expand * hidden_size / head_dim", "mamba2")
    return config


import_weights, export_weights = renaming(lambda config: BACKBONE_RULES)


def from_config(config: HybridConfig) -> dict:
    problems = []
    if set(config.layer_types) != {"mamba2"}:
        problems.append(f"every Mamba-2 layer is 'mamba2'; layers {other_positions(config.layer_types, 'mamba2')} "
                        "are not")
    if set(config.mlp_types) != {"none"}:
        problems.append(f"Mamba-2 layers have no MLP; layers {other_positions(config.mlp_types, 'none')} have one")
    check_expressible("mamba2", problems)
    return {
        "model_type": "mamba2",
        "architectures": ["Mamba2ForCausalLM"],
        **FIELDS.to_theirs(config),
        "num_heads": config.mamba2_num_heads,
        "hidden_act": "silu",
    }


FORMAT = register(CheckpointFormat("mamba2", to_config, import_weights, from_config, export_weights))

__all__ = ["FORMAT"]
