"""Qwen3.5: the text model of Qwen3-Next's design with dense MLPs, read from a text-only checkpoint
(``qwen3_5_text``) or from the language model inside a multimodal one (``qwen3_5``, whose vision tower is
ignored). Read only.

Besides Qwen3-Next's layout (``1 + weight`` norms, a query-and-gate ``q_proj``; see :mod:`.qwen3_next`), the
DeltaNet projections are four separate matrices (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``)
whose blocks are already in our order: they are joined, not reordered. Its multimodal RoPE (MRoPE) gives every
section the same position for text, which is ordinary RoPE; text given explicit 3-D positions is not
supported.
"""

from __future__ import annotations

from hybridlm.config import HybridConfig
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.mapping import StateDict, join_weights, positions, with_transformers_defaults
from hybridlm.formats.qwen3_next import config_from, weights_to_ours

#: our fused DeltaNet projections and the Qwen3.5 matrices they join, in order
JOINED = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}


def _text_config(foreign_config: dict) -> dict:
    fc = with_transformers_defaults(foreign_config)
    if fc["model_type"] == "qwen3_5":  # multimodal: the language model's config, tying decided at the top
        fc = {**fc["text_config"], "tie_word_embeddings": fc.get("tie_word_embeddings", False)}
    return fc


def to_config(foreign_config: dict) -> HybridConfig:
    fc = _text_config(foreign_config)
    return config_from(fc, ["dense"] * fc["num_hidden_layers"], foreign_config["model_type"])


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    if foreign_config["model_type"] == "qwen3_5":  # keep the language model, under the text model's names
        state = {name.replace("model.language_model.", "model.", 1): t for name, t in state.items()
                 if not name.startswith(("model.visual.", "mtp."))}
    state = dict(state)
    for i in positions(config.layer_types, "gated_deltanet"):
        join_weights(state, f"model.layers.{i}.linear_attn", JOINED)
    return weights_to_ours(state, config, interleaved=False)


TEXT_FORMAT = register(CheckpointFormat("qwen3_5_text", to_config, import_weights))
FORMAT = register(CheckpointFormat("qwen3_5", to_config, import_weights))

__all__ = ["FORMAT", "TEXT_FORMAT"]
