"""Nemotron-H (NVIDIA): a stack of blocks that each hold either one mixer or one MLP. Read and written.

The stack is ``hybrid_override_pattern`` (``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE) or, in newer
configs, the ``layers_block_type`` list. Each block is one hybridlm layer with ``"none"`` for the half it lacks:
``M`` -> (mamba2, none), ``*`` -> (attention, none), ``-`` -> (none, dense), ``E`` -> (none, moe). Attention has
no positional encoding; MLPs are squared-ReLU without a gate; the MoE router is DeepSeek-V3's (sigmoid scores,
a per-expert selection bias, group-limited top-k, renormalised, scaled: ``moe_router="sigmoid"``) and every MoE
block has one always-on shared expert. Mamba-2's dt is clamped to ``time_step_limit`` (default ``[0, inf)``), as in
NVIDIA's own code and transformers 5.25; ``time_step_min`` only bounds dt's initialisation. (transformers 5.24 and
older clamped at ``time_step_min`` instead.)

On export, a hybridlm layer with both a mixer and an MLP becomes two blocks (mixer, then MLP): the same function.
Weights are written in the on-disk layout (``backbone.``, one tensor per expert); the ``model.`` prefix and the
stacked expert layout (``experts.up_proj [E, I, H]``) are read too. Multi-token-prediction weights (``mtp.*``)
are ignored, as transformers ignores them.
"""

from __future__ import annotations

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
    rename_state,
    require_settings,
    same_names,
    split_stacked,
    with_transformers_defaults,
)

#: Nemotron-H block type -> (hybridlm mixer, hybridlm MLP)
BLOCKS = {"linear_attention": ("mamba2", "none"), "full_attention": ("attention", "none"),
          "mlp": ("none", "dense"), "moe": ("none", "moe")}
BLOCK_OF = {kind: block for block, pair in BLOCKS.items() for kind in pair if kind != "none"}

FIELDS = FieldMap({
    **COMMON_FIELDS, **ATTENTION_FIELDS, **same_names("intermediate_size", "head_dim"),
    "layer_norm_epsilon": "rms_norm_eps", "ssm_state_size": "mamba2_d_state",
    "conv_kernel": "mamba2_d_conv", "expand": "mamba2_expand", "mamba_head_dim": "mamba2_head_dim",
    "n_groups": "mamba2_n_groups", "chunk_size": "mamba2_chunk_size", "use_conv_bias": "mamba2_conv_bias",
    "use_bias": "mamba2_proj_bias", "time_step_max": "mamba2_dt_max", "time_step_floor": "mamba2_dt_init_floor",
    "n_routed_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size",
    "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size", "norm_topk_prob": "moe_renormalize",
    "routed_scaling_factor": "moe_routed_scaling", "n_group": "moe_num_groups", "topk_group": "moe_topk_groups",
})
#: MoE weight names that differ (theirs under ``mixer.``, ours under ``mlp.``); experts keep their names.
MOE_NAMES = [("gate.weight", "router.weight"), ("gate.e_score_correction_bias", "expert_bias"),
             ("shared_experts.{rest}", "shared_expert.{rest}")]


def blocks(config: HybridConfig) -> list[tuple[int, str]]:
    """``(hybridlm layer, "mixer" or "mlp")`` for each Nemotron-H block, in order."""
    return [(i, part) for i, (mixer, mlp) in enumerate(zip(config.layer_types, config.mlp_types))
            for part, kind in (("mixer", mixer), ("mlp", mlp)) if kind != "none"]


def block_rules(config: HybridConfig) -> RenameRules:
    pairs = [("lm_head.weight", "lm_head.weight")]
    for prefix in ("backbone", "model"):  # the first is what export writes
        pairs += [(f"{prefix}.embeddings.weight", "model.embed_tokens.weight"),
                  (f"{prefix}.norm_f.weight", "model.norm.weight")]
        for b, (i, part) in enumerate(blocks(config)):
            theirs, ours = f"{prefix}.layers.{b}", f"model.layers.{i}"
            if part == "mixer":
                pairs.append((f"{theirs}.norm.weight", f"{ours}.input_layernorm.weight"))
            else:
                pairs.append((f"{theirs}.norm.weight", f"{ours}.pre_mlp_layernorm.weight"))
                pairs += [(f"{theirs}.mixer.{their_name}", f"{ours}.mlp.{our_name}")
                          for their_name, our_name in MOE_NAMES]
            pairs.append((f"{theirs}.mixer.{{rest}}", f"{ours}.{'mixer' if part == 'mixer' else 'mlp'}.{{rest}}"))
    return RenameRules(pairs)


def _inner_size(fc: dict) -> int | None:
    """Nemotron-H's Mamba-2 width, when ``expand * hidden_size`` does not say it already."""
    inner = fc["mamba_num_heads"] * fc["mamba_head_dim"]
    return None if inner == fc["expand"] * fc["hidden_size"] else inner


def to_config(foreign_config: dict) -> HybridConfig:
    fc = with_transformers_defaults(foreign_config)
    require_settings(fc, {"mlp_hidden_act": ("relu2",), "mamba_hidden_act": ("silu",), "moe_latent_size": (None,),
                          "mlp_bias": (False,)}, "nemotron_h")
    pairs = [BLOCKS[block] for block in fc["layers_block_type"]]
    return HybridConfig(
        **FIELDS.to_ours(fc),
        layer_types=[mixer for mixer, _ in pairs],
        mlp_types=[mlp for _, mlp in pairs],
        tie_word_embeddings=False,  # NemotronHForCausalLM never ties its head
        partial_rotary_factor=0.0,  # no positional encoding in attention
        mlp_activation="relu2",
        moe_router="sigmoid",
        router_aux_loss_coef=0.0,  # transformers adds no load-balancing loss (expert_bias balances instead)
        mamba2_inner_size=_inner_size(fc),
        mamba2_dt_min=fc["time_step_min"],
        mamba2_dt_limit=list(fc["time_step_limit"]),
    )


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    state = {name: tensor for name, tensor in state.items() if not name.startswith("mtp.")}
    for name in [n for n in state if n.endswith((".experts.up_proj", ".experts.down_proj"))]:
        state = split_stacked(state, name, [f"{name.rsplit('.', 1)[0]}.{{e}}.{name.rsplit('.', 1)[1]}.weight"])
    return rename_state(state, block_rules(config))


def from_config(config: HybridConfig) -> dict:
    problems = []
    mixers = {kind for kind in config.layer_types if kind != "none"}
    mlps = {kind for kind in config.mlp_types if kind != "none"}
    if mixers - {"mamba2", "attention"}:
        problems.append(f"Nemotron-H mixers are 'mamba2' or 'attention', this model has "
                        f"{sorted(mixers - {'mamba2', 'attention'})}")
    if "attention" in mixers:
        problems += differences(config, {"partial_rotary_factor": 0.0, "attention_bias": False,
                                         "attention_scale": None, "sliding_window": None})
    if "mamba2" in mixers:
        problems += differences(config, {"mamba2_norm": "gated"})
    if mlps:
        problems += differences(config, {"mlp_activation": "relu2"})
    if "moe" in mlps:
        problems += differences(config, {"moe_router": "sigmoid"})
        if config.shared_expert_intermediate_size == 0:
            problems.append("shared_expert_intermediate_size=0 (every Nemotron-H MoE has a shared expert)")
    check_expressible("nemotron_h", problems)
    foreign = {
        "model_type": "nemotron_h",
        "architectures": ["NemotronHForCausalLM"],
        **FIELDS.to_theirs(config),
        "layers_block_type": [BLOCK_OF[(config.layer_types if part == "mixer" else config.mlp_types)[i]]
                              for i, part in blocks(config)],
        "mamba_num_heads": config.mamba2_num_heads,
        "time_step_min": config.mamba2_dt_min,
        "time_step_limit": list(config.mamba2_dt_limit),
        "tie_word_embeddings": False,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
    }
    return {key: value for key, value in foreign.items() if value is not None or key.endswith("token_id")}


def export_weights(state: StateDict, config: HybridConfig) -> StateDict:
    state = dict(state)
    if config.tie_word_embeddings:  # Nemotron-H does not tie: write the head explicitly
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    return rename_state(state, block_rules(config), to_ours=False)


FORMAT = register(CheckpointFormat("nemotron_h", to_config, import_weights, from_config, export_weights,
                                   options=frozenset({"moe_router", "moe_routed_scaling", "mamba2_inner_size"})))

__all__ = ["FORMAT", "blocks"]
