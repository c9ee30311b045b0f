"""Mamba-1 (``mamba``) and Falcon-Mamba (``falcon_mamba``): stacks of Mamba-1 mixers with no MLP; Falcon-Mamba
adds weight-less RMS norms on dt, B and C. Read only.

The ``backbone`` layout here (``backbone.embeddings``, ``backbone.layers.{i}.norm`` / ``.mixer``,
``backbone.norm_f``) is shared with Mamba-2.
"""

from __future__ import annotations

from hybridlm.config import HybridConfig
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.mapping import (
    COMMON_FIELDS,
    FieldMap,
    RenameRules,
    outer_rules,
    renaming,
    require_settings,
    same_names,
    with_transformers_defaults,
)

FIELDS = FieldMap({
    **COMMON_FIELDS, **same_names("num_hidden_layers", "tie_word_embeddings"), "layer_norm_epsilon": "rms_norm_eps",
    "state_size": "mamba_d_state", "conv_kernel": "mamba_d_conv",
    "expand": "mamba_expand", "time_step_rank": "mamba_dt_rank", "use_conv_bias": "mamba_conv_bias",
    "use_bias": "mamba_proj_bias", "time_step_min": "mamba_dt_min", "time_step_max": "mamba_dt_max",
    "time_step_floor": "mamba_dt_init_floor",
})

BACKBONE_RULES = RenameRules([
    *outer_rules("backbone.norm_f.weight", embeddings="backbone.embeddings.weight"),
    ("backbone.embedding.weight", "model.embed_tokens.weight"),  # mamba-ssm's name, accepted by transformers
    ("backbone.layers.{i}.norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("backbone.layers.{i}.mixer.{rest}", "model.layers.{i}.mixer.{rest}"),
])


def _to_config(foreign_config: dict) -> HybridConfig:
    fc = with_transformers_defaults(foreign_config)
    require_settings(fc, {"hidden_act": ("silu",)}, fc["model_type"])
    n = fc["num_hidden_layers"]
    falcon = fc["model_type"] == "falcon_mamba"
    return HybridConfig(
        **FIELDS.to_ours(fc),
        layer_types=["mamba"] * n,
        mlp_types=["none"] * n,
        mamba_dt_norm=falcon,
        mamba_dt_norm_learnable=not falcon,
        mamba_dt_norm_eps=fc.get("mixer_rms_eps"),
    )


import_weights, _ = renaming(lambda config: BACKBONE_RULES)


MAMBA = register(CheckpointFormat("mamba", _to_config, import_weights))
FALCON_MAMBA = register(CheckpointFormat("falcon_mamba", _to_config, import_weights))

__all__ = ["BACKBONE_RULES", "FALCON_MAMBA", "MAMBA"]
