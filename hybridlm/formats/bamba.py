"""Bamba (IBM): Mamba-2 layers and attention layers with partial RoPE (half the head by default), each followed
by a SwiGLU MLP, in Jamba's ``model.layers`` layout. Read and written."""

from __future__ import annotations

from ..config import HybridConfig
from .base import (
    ATTENTION_FIELDS,
    COMMON_FIELDS,
    CheckpointFormat,
    FieldMap,
    StateDict,
    check_expressible,
    differences,
    positions,
    register,
    rename_state,
    require_settings,
    rope_settings,
    same_names,
    with_transformers_defaults,
)
from .jamba import decoder_rules

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
        head_dim=fc.get("head_dim") or fc["hidden_size"] // fc["num_attention_heads"],
        mamba2_dt_limit=fc.get("time_step_limit"),  # None means no limit
    )
    if config.mamba2_num_heads != fc["mamba_n_heads"]:
        raise ValueError(f"bamba config: mamba_n_heads={fc['mamba_n_heads']} but mamba_expand * hidden_size / "
                         f"mamba_d_head = {config.mamba2_num_heads}")
    return config


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    return rename_state(state, decoder_rules(config))


def from_config(config: HybridConfig) -> dict:
    problems = []
    other = sorted(set(config.layer_types) - {"mamba2", "attention"})
    if other:
        problems.append(f"Bamba layers are 'mamba2' or 'attention', this model has {other}")
    if set(config.mlp_types) != {"dense"}:
        problems.append(f"every Bamba layer has a dense MLP; layers "
                        f"{[i for i, k in enumerate(config.mlp_types) if k != 'dense']} do not")
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
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta,
                            "partial_rotary_factor": config.partial_rotary_factor},
    }


def export_weights(state: StateDict, config: HybridConfig) -> StateDict:
    return rename_state(state, decoder_rules(config), to_ours=False)


FORMAT = register(CheckpointFormat("bamba", to_config, import_weights, from_config, export_weights))

__all__ = ["FORMAT"]
