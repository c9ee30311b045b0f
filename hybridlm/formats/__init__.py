"""Foreign checkpoint formats as data: one small module per architecture, each registering itself in
:data:`~hybridlm.formats.base.FORMATS` by ``model_type`` with how its config maps to a
:class:`~hybridlm.HybridConfig` and its weights to hybridlm's names (and back, for export).

Formats know configs and tensors, not the model classes: reading and writing whole checkpoints is
:mod:`hybridlm.model.checkpoint_io`, above both. This package imports the config, the mixer registry and
:mod:`hybridlm.paths` only.
"""

from __future__ import annotations

# Each format module registers its format on import.
from hybridlm.formats import (  # noqa: F401
    bamba,
    falcon_h1,
    fla_mamba3,
    gemma,
    granitemoehybrid,
    jamba,
    kimi_linear,
    lfm2,
    llama,
    mamba,
    mamba2,
    mamba_ssm,
    mistral,
    nemotron_h,
    olmo_hybrid,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
    zamba2,
)
from hybridlm.formats.base import (
    FORMATS,
    CheckpointFormat,
    check_state,
    detect,
    is_own,
    read_config,
    read_weights,
    register,
    resolve_directory,
    safetensors_files,
    supported,
    undeclared_options,
)
from hybridlm.formats.mapping import check_expressible, public_fields

__all__ = ["FORMATS", "CheckpointFormat", "check_expressible", "check_state", "detect", "is_own", "public_fields",
           "read_config", "read_weights", "register", "resolve_directory", "safetensors_files", "supported",
           "undeclared_options"]
