"""Qwen3.5-MoE: Qwen3.5's text model (see :mod:`.qwen3_5`) with a Qwen3-Next MoE (softmax top-k, weights
renormalised, a sigmoid-gated shared expert) in every layer; read from a text-only checkpoint
(``qwen3_5_moe_text``) or from the language model inside a multimodal one (``qwen3_5_moe``, whose vision tower
is ignored). Read only.

Its config has no ``norm_topk_prob``, ``mlp_only_layers`` or ``decoder_sparse_step``: transformers' router always
renormalises the top-k weights and every layer is sparse.
"""

from __future__ import annotations

from hybridlm.config import HybridConfig
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.mapping import StateDict, with_transformers_defaults
from hybridlm.formats.qwen3_5 import import_weights as qwen3_5_weights
from hybridlm.formats.qwen3_next import config_from

MULTIMODAL = "qwen3_5_moe"


def _text_config(foreign_config: dict) -> dict:
    fc = with_transformers_defaults(foreign_config)
    if fc["model_type"] == MULTIMODAL:  # the language model's config, tying decided at the top
        fc = {**fc["text_config"], "tie_word_embeddings": fc.get("tie_word_embeddings", False)}
    return {**fc, "norm_topk_prob": True}


def to_config(foreign_config: dict) -> HybridConfig:
    fc = _text_config(foreign_config)
    if fc["num_experts"] < 1:
        raise ValueError(f"{foreign_config['model_type']} config: num_experts={fc['num_experts']} (every layer of "
                         "Qwen3.5-MoE is a MoE; need at least one expert)")
    return config_from(fc, ["moe"] * fc["num_hidden_layers"], foreign_config["model_type"])


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    if foreign_config["model_type"] == MULTIMODAL:  # keep the language model, under the text model's names
        state = {name.replace("model.language_model.", "model.", 1): t for name, t in state.items()
                 if not name.startswith(("model.visual.", "mtp."))}
    return qwen3_5_weights(state, config, {"model_type": "qwen3_5_moe_text"})


TEXT_FORMAT = register(CheckpointFormat("qwen3_5_moe_text", to_config, import_weights))
FORMAT = register(CheckpointFormat(MULTIMODAL, to_config, import_weights))

__all__ = ["FORMAT", "TEXT_FORMAT"]
