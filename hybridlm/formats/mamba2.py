"""Mamba-2 (``mamba2``): a stack of Mamba-2 (SSD) mixers with no MLP, in Mamba's ``backbone`` layout. Read and
written."""

from __future__ import annotations

from ..config import HybridConfig
from .base import (
    COMMON_FIELDS,
    CheckpointFormat,
    FieldMap,
    StateDict,
    check_expressible,
    register,
    rename_state,
    require_settings,
    same_names,
    with_transformers_defaults,
)
from .mamba import BACKBONE_RULES

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
    if config.mamba2_num_heads != fc["num_heads"]:
        raise ValueError(f"mamba2 config: num_heads={fc['num_heads']} but expand * hidden_size / head_dim = "
                         f"{config.mamba2_num_heads}")
    return config


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    return rename_state(state, BACKBONE_RULES)


def from_config(config: HybridConfig) -> dict:
    problems = []
    if set(config.layer_types) != {"mamba2"}:
        problems.append(f"every Mamba-2 layer is 'mamba2'; layers {_other(config.layer_types, 'mamba2')} are not")
    if set(config.mlp_types) != {"none"}:
        problems.append(f"Mamba-2 layers have no MLP; layers {_other(config.mlp_types, 'none')} have one")
    check_expressible("mamba2", problems)
    return {
        "model_type": "mamba2",
        "architectures": ["Mamba2ForCausalLM"],
        **FIELDS.to_theirs(config),
        "num_heads": config.mamba2_num_heads,
        "hidden_act": "silu",
    }


def export_weights(state: StateDict, config: HybridConfig) -> StateDict:
    return rename_state(state, BACKBONE_RULES, to_ours=False)


def _other(kinds: list[str], kind: str) -> list[int]:
    return [i for i, k in enumerate(kinds) if k != kind]


FORMAT = register(CheckpointFormat("mamba2", to_config, import_weights, from_config, export_weights))

__all__ = ["FORMAT"]
