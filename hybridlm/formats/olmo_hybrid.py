"""OLMo-Hybrid (Ai2): Gated DeltaNet layers with pre-norms and OLMo-3 attention layers with post-norms, each with
a SwiGLU MLP. Read only.

What differs from Qwen3-Next's Gated DeltaNet, and the options that express it:

* ``beta = 2 sigmoid(b)`` with ``linear_allow_neg_eigval`` (``deltanet_beta_scale=2``); the gated output norm's
  eps is fixed at 1e-5 (``deltanet_norm_eps``); q, k, v, the output gate (``g_proj``), b and a are separate
  matrices, joined into our ``in_proj_qkvz`` / ``in_proj_ba``; the conv weights come as ``q_conv1d`` /
  ``k_conv1d`` / ``v_conv1d``, joined in that order into ``conv1d``.
* Attention layers norm their outputs, not their inputs (``post_norm_layers``): ``h += norm(attn(h))``,
  ``h += norm(mlp(h))``; their q/k RMSNorms span all heads together (``attention_qk_norm_whole``). Without
  ``rope_parameters`` (the released checkpoints) attention has no RoPE (``partial_rotary_factor=0``).

Norm names: transformers' conversion renames ``attention_layer_norm`` -> ``input_layernorm`` and
``feedforward_layer_norm`` -> ``post_attention_layernorm``; both spellings are read. In an attention layer
``post_attention_layernorm`` is the norm of the attention output and ``post_feedforward_layernorm`` that of
the MLP output.
"""

from __future__ import annotations

from hybridlm.config import HybridConfig
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.mapping import (
    ATTENTION_FIELDS,
    COMMON_FIELDS,
    DELTANET_FIELDS,
    FieldMap,
    RenameRules,
    StateDict,
    join_weights,
    our_kinds,
    outer_rules,
    positions,
    rename_state,
    require_settings,
    rope_settings,
    same_names,
    with_transformers_defaults,
)
from hybridlm.formats.qwen3_next import check_deltanet_heads

FIELDS = FieldMap({
    **COMMON_FIELDS, **ATTENTION_FIELDS,
    **same_names("num_hidden_layers", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "intermediate_size"),
    **DELTANET_FIELDS,
})
LAYER_KINDS = {"linear_attention": "gated_deltanet", "full_attention": "attention"}
OUTPUT_NORM_EPS = 1e-5  # transformers' OlmoHybridGatedDeltaNet fixes it (FLA's FusedRMSNormGated default)
#: our joined DeltaNet matrices and the OLMo-Hybrid matrices they are made of, in order
JOINED = {"in_proj_qkvz": ("q_proj", "k_proj", "v_proj", "g_proj"), "in_proj_ba": ("b_proj", "a_proj"),
          "conv1d": ("q_conv1d", "k_conv1d", "v_conv1d")}


def to_config(foreign_config: dict) -> HybridConfig:
    fc = with_transformers_defaults(foreign_config)
    require_settings(fc, {"hidden_act": ("silu",)}, "olmo_hybrid")
    layer_types = our_kinds(fc, LAYER_KINDS, "olmo_hybrid")
    check_deltanet_heads(fc, "olmo_hybrid")
    rope = fc.get("rope_parameters")
    no_rope = rope is None or rope.get("rope_theta") is None  # transformers builds no rotary embedding then
    return HybridConfig(
        **FIELDS.to_ours(fc),
        **({"partial_rotary_factor": 0.0} if no_rope else rope_settings(fc)),
        layer_types=layer_types,
        mlp_types=["dense"] * len(layer_types),
        post_norm_layers=positions(layer_types, "attention"),
        attention_qk_norm=True,
        attention_qk_norm_whole=True,
        deltanet_beta_scale=2.0 if fc["linear_allow_neg_eigval"] else 1.0,
        deltanet_norm_eps=OUTPUT_NORM_EPS,
    )


def _rules(config: HybridConfig) -> RenameRules:
    layer = "model.layers.{i}"
    rules = [*outer_rules(), (f"{layer}.mlp.{{rest}}", f"{layer}.mlp.{{rest}}")]
    for i, kind in enumerate(config.layer_types):
        theirs, ours = f"model.layers.{i}", f"model.layers.{i}"
        if kind == "gated_deltanet":
            norms = {"attention_layer_norm": "input_layernorm", "input_layernorm": "input_layernorm",
                     "feedforward_layer_norm": "pre_mlp_layernorm", "post_attention_layernorm": "pre_mlp_layernorm"}
            rules += [(f"{theirs}.linear_attn.o_norm.weight", f"{ours}.mixer.norm.weight"),
                      (f"{theirs}.linear_attn.o_proj.weight", f"{ours}.mixer.out_proj.weight"),
                      (f"{theirs}.linear_attn.{{rest}}", f"{ours}.mixer.{{rest}}")]
        else:  # post-norm attention: our input / pre-MLP norm weights are its output norms
            norms = {"feedforward_layer_norm": "input_layernorm", "post_attention_layernorm": "input_layernorm",
                     "post_feedforward_layernorm": "pre_mlp_layernorm"}
            rules.append((f"{theirs}.self_attn.{{rest}}", f"{ours}.mixer.{{rest}}"))
        rules += [(f"{theirs}.{name}.weight", f"{ours}.{target}.weight") for name, target in norms.items()]
    return RenameRules(rules)


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    state = rename_state(state, _rules(config))
    for i in positions(config.layer_types, "gated_deltanet"):
        join_weights(state, f"model.layers.{i}.mixer", JOINED)
    return state


FORMAT = register(CheckpointFormat("olmo_hybrid", to_config, import_weights))

__all__ = ["FORMAT"]
