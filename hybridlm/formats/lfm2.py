"""LFM2 (Liquid AI): gated short convolutions (``short_conv``) and GQA attention with RMS-normed query and key
heads, each layer followed by a SwiGLU MLP. Read and written. LFM2-MoE (``lfm2_moe``, read only): the same
layers, the MLPs after the first ``num_dense_layers`` replaced by a sigmoid-routed MoE with a selection bias.

Names: ``operator_norm`` / ``ffn_norm`` are the pre-mixer and pre-MLP norms, ``embedding_norm`` the final norm
(despite its name), ``feed_forward.w1 / w3 / w2`` the gate / up / down projections. The MLP width a config
states is adjusted by transformers (``block_auto_adjust_ff_dim``); the width built is what hybridlm reads.
"""

from __future__ import annotations

import warnings

import torch

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
    layer_rules,
    other_positions,
    our_kinds,
    outer_rules,
    positions,
    rename_state,
    renaming,
    rope_parameters,
    rope_settings,
    same_names,
    their_kinds,
    unsupported_kinds,
    with_transformers_defaults,
)

FIELDS = FieldMap({**COMMON_FIELDS, **ATTENTION_FIELDS, **same_names("num_hidden_layers", "tie_word_embeddings"),
                   "norm_eps": "rms_norm_eps", "conv_L_cache": "short_conv_size", "conv_bias": "short_conv_bias"})
LAYER_KINDS = {"full_attention": "attention", "conv": "short_conv"}


def decoder_rules(config: HybridConfig) -> RenameRules:
    """LFM2's names against ours (the first matching rule wins, in both directions)."""
    layer = "model.layers.{i}"
    return RenameRules([
        *outer_rules("model.embedding_norm.weight"),
        (f"{layer}.operator_norm.weight", f"{layer}.input_layernorm.weight"),
        (f"{layer}.ffn_norm.weight", f"{layer}.pre_mlp_layernorm.weight"),
        *[(f"{layer}.feed_forward.{expert}{theirs}.weight", f"{layer}.mlp.{expert}{ours}_proj.weight")
          for theirs, ours in (("w1", "gate"), ("w3", "up"), ("w2", "down")) for expert in ("", "experts.{e}.")],
        (f"{layer}.feed_forward.gate.weight", f"{layer}.mlp.router.weight"),
        (f"{layer}.feed_forward.expert_bias", f"{layer}.mlp.expert_bias"),
        (f"{layer}.self_attn.out_proj.weight", f"{layer}.mixer.o_proj.weight"),
        (f"{layer}.self_attn.q_layernorm.weight", f"{layer}.mixer.q_norm.weight"),
        (f"{layer}.self_attn.k_layernorm.weight", f"{layer}.mixer.k_norm.weight"),
        *layer_rules(config, layer, {"attention": "self_attn", "short_conv": "conv"}),
    ])


def mlp_width(fc: dict) -> int:
    """The SwiGLU width transformers builds from an LFM2 config."""
    width = fc["intermediate_size"]
    if fc["block_auto_adjust_ff_dim"]:
        width = int(2 * width / 3)
        if fc["block_ffn_dim_multiplier"] is not None:
            width = int(fc["block_ffn_dim_multiplier"] * width)
            width = fc["block_multiple_of"] * -(-width // fc["block_multiple_of"])
    return width


def to_config(foreign_config: dict) -> HybridConfig:
    fc = with_transformers_defaults(foreign_config)
    layer_types = our_kinds(fc, LAYER_KINDS, fc["model_type"])
    n = fc["num_hidden_layers"]
    if fc["model_type"] == "lfm2":
        mlp = dict(mlp_types=["dense"] * n, intermediate_size=mlp_width(fc))
    else:  # lfm2_moe: the dense width as stated; sigmoid routing (the selection bias is zero without use_expert_bias)
        mlp = dict(mlp_types=["dense" if i < fc["num_dense_layers"] else "moe" for i in range(n)],
                   intermediate_size=fc["intermediate_size"], moe_intermediate_size=fc["moe_intermediate_size"],
                   num_experts=fc["num_experts"], num_experts_per_tok=fc["num_experts_per_tok"],
                   moe_router="sigmoid", moe_renormalize=fc["norm_topk_prob"],
                   moe_routed_scaling=float(fc["routed_scaling_factor"]),
                   router_aux_loss_coef=0.0)  # transformers adds no load-balancing loss
    return HybridConfig(
        **FIELDS.to_ours(fc),
        **rope_settings(fc),
        **mlp,
        layer_types=layer_types,
        head_dim=fc["hidden_size"] // fc["num_attention_heads"],
        attention_qk_norm=True,
    )


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    state = rename_state(state, decoder_rules(config))
    for i in positions(config.mlp_types, "moe"):  # without use_expert_bias: a zero selection bias
        state.setdefault(f"model.layers.{i}.mlp.expert_bias", torch.zeros(config.num_experts))
    return state


def from_config(config: HybridConfig) -> dict:
    problems = unsupported_kinds(config, list(LAYER_KINDS.values()), "LFM2")
    if set(config.mlp_types) != {"dense"}:
        problems.append(f"every LFM2 layer has a dense MLP; layers {other_positions(config.mlp_types, 'dense')} "
                        "do not")
    problems += differences(config, {"mlp_activation": "silu"})
    if "attention" in config.layer_types:
        problems += differences(config, {
            "attention_qk_norm": True, "attention_output_gate": False, "attention_bias": False,
            "sliding_window": None, "partial_rotary_factor": 1.0,
            "head_dim": config.hidden_size // config.num_attention_heads,
        })
    check_expressible("lfm2", problems)
    if not config.tie_word_embeddings:
        warnings.warn("lfm2 export of an untied LM head (tie_word_embeddings=False): transformers and llama.cpp "
                      "read it as written, but vLLM's LFM2 ties the head to the embeddings and ignores "
                      "lm_head.weight, so the model runs differently there (public LFM2 checkpoints are tied)",
                      UserWarning, stacklevel=2)
    return {
        "model_type": "lfm2",
        "architectures": ["Lfm2ForCausalLM"],
        **FIELDS.to_theirs(config),
        "layer_types": their_kinds(config.layer_types, LAYER_KINDS),
        "full_attn_idxs": positions(config.layer_types, "attention"),
        "intermediate_size": config.intermediate_size,
        "block_auto_adjust_ff_dim": False,
        "rope_parameters": rope_parameters(config, partial=False),
        **public_aliases(config),
    }


def public_aliases(config: HybridConfig) -> dict:
    """The fields LiquidAI's public LFM2 configs carry that transformers folds away or never reads (it builds
    the short conv and the MLP at ``hidden_size``): vLLM's LFM2 model builds its layers from ``conv_dim``,
    ``block_dim`` and ``block_ff_dim``. The public configs' training-time initialisation settings
    (``block_*_init_scale``, ``*_use_xavier_init``) are not written: no reader uses them, and they would not
    describe how this model was initialised."""
    return {
        "block_dim": config.hidden_size, "conv_dim": config.hidden_size, "conv_dim_out": config.hidden_size,
        "block_ff_dim": config.intermediate_size, "block_norm_eps": config.rms_norm_eps, "block_use_swiglu": True,
        "num_heads": config.num_attention_heads, "tie_embedding": config.tie_word_embeddings,
        "use_pos_enc": True,
    }


_, export_weights = renaming(decoder_rules)


FORMAT = register(CheckpointFormat("lfm2", to_config, import_weights, from_config, export_weights,
                                   options=frozenset({"attention_qk_norm"})))
MOE_FORMAT = register(CheckpointFormat("lfm2_moe", to_config, import_weights))

__all__ = ["FORMAT", "MOE_FORMAT"]
