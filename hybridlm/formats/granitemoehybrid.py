"""Granite-4.0-H (IBM, ``granitemoehybrid``): Mamba-2 and attention layers, each followed by a top-k MoE plus an
always-on shared MLP (or by the shared MLP alone when ``num_local_experts`` is 0). Read only.

Quirks as hybridlm options: the router takes a softmax over the top-k logits, i.e. renormalised top-k
(``moe_renormalize``); the shared MLP is the MoE's shared expert; ``embedding_multiplier``,
``residual_multiplier`` (every mixer and MLP output), ``attention_multiplier`` (the softmax scale:
``attention_scale``) and ``logits_scaling`` (logits are divided by it: ``logits_multiplier = 1 / scaling``);
RoPE only with ``position_embedding_type="rope"``. Experts are stored stacked, gate and up fused
(``block_sparse_moe.input_linear [E, 2I, H]``, ``output_linear [E, H, I]``, ``router.layer``), and so is the
shared MLP (``shared_mlp.input_linear [2I, H]``); transformers' in-memory names (``experts.gate_up_proj``,
``experts.down_proj``, ``router.weight``) are read too.
"""

from __future__ import annotations

from hybridlm.config import HybridConfig
from hybridlm.formats.bamba import DECODER_FIELDS, MAMBA2_FIELDS
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.mapping import (
    FieldMap,
    RenameRules,
    StateDict,
    check_mamba2_heads,
    head_dim_of,
    layer_rules,
    outer_rules,
    rename_state,
    require_settings,
    rope_settings,
    same_names,
    split_stacked,
    with_transformers_defaults,
)

FIELDS = FieldMap({
    **{k: v for k, v in DECODER_FIELDS.items() if k != "intermediate_size"}, **MAMBA2_FIELDS,
    **same_names("router_aux_loss_coef", "embedding_multiplier", "residual_multiplier"),
    "attention_multiplier": "attention_scale",
})
MIXERS = {"linear_attention": "mamba2", "full_attention": "attention"}


def to_config(foreign_config: dict) -> HybridConfig:
    fc = with_transformers_defaults(foreign_config)
    # hidden_act is also the activation of the Mamba-2 convolution, which hybridlm fixes to SiLU
    require_settings(fc, {"hidden_act": ("silu",), "position_embedding_type": (None, "rope")}, "granitemoehybrid")
    n, experts = fc["num_hidden_layers"], fc["num_local_experts"]
    if experts:
        mlp = {"mlp_types": ["moe"] * n, "num_experts": experts, "num_experts_per_tok": fc["num_experts_per_tok"],
               "moe_intermediate_size": fc["intermediate_size"], "moe_renormalize": True,
               "shared_expert_intermediate_size": fc["shared_intermediate_size"]}
    else:  # the shared MLP alone
        mlp = {"mlp_types": ["dense"] * n, "intermediate_size": fc["shared_intermediate_size"]}
    rope = {"rope_theta": rope_settings(fc)["rope_theta"], "partial_rotary_factor": 1.0} \
        if fc["position_embedding_type"] == "rope" else {"partial_rotary_factor": 0.0}
    config = HybridConfig(
        **FIELDS.to_ours(fc),
        **mlp,
        **rope,
        layer_types=[MIXERS[kind] for kind in fc["layer_types"]],
        head_dim=head_dim_of(fc),
        logits_multiplier=1.0 / fc["logits_scaling"],
        mamba2_dt_limit=fc.get("time_step_limit"),  # None means no limit
    )
    if "mamba2" in config.layer_types:
        check_mamba2_heads(config, fc, "mamba_n_heads", "mamba_expand * hidden_size / mamba_d_head",
                           "granitemoehybrid")
    return config


def _unfuse(state: StateDict) -> StateDict:
    """Per-expert, unfused tensors (named in Granite's namespace) from the stacked and fused ones."""
    for name in list(state):
        prefix, _, tail = name.rpartition(".block_sparse_moe.")
        experts = f"{prefix}.block_sparse_moe.experts.{{e}}"
        if tail in ("input_linear.weight", "experts.gate_up_proj"):
            state = split_stacked(state, name, [f"{experts}.gate_proj.weight", f"{experts}.up_proj.weight"])
        elif tail in ("output_linear.weight", "experts.down_proj"):
            state = split_stacked(state, name, [f"{experts}.down_proj.weight"])
        elif name.endswith(".shared_mlp.input_linear.weight"):
            gate, up = state.pop(name).chunk(2, dim=0)
            shared = name[: -len("input_linear.weight")]
            state[f"{shared}gate_proj.weight"], state[f"{shared}up_proj.weight"] = gate, up
        elif name.endswith(".shared_mlp.output_linear.weight"):
            state[name.replace("output_linear", "down_proj")] = state.pop(name)
    return state


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    shared = "mlp.shared_expert" if config.mlp_types[0] == "moe" else "mlp"
    rules = RenameRules([
        *outer_rules(),
        ("model.layers.{i}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight"),
        ("model.layers.{i}.post_attention_layernorm.weight", "model.layers.{i}.pre_mlp_layernorm.weight"),
        ("model.layers.{i}.block_sparse_moe.router.layer.weight", "model.layers.{i}.mlp.router.weight"),
        ("model.layers.{i}.block_sparse_moe.router.weight", "model.layers.{i}.mlp.router.weight"),
        ("model.layers.{i}.block_sparse_moe.experts.{rest}", "model.layers.{i}.mlp.experts.{rest}"),
        ("model.layers.{i}.shared_mlp.{rest}", f"model.layers.{{i}}.{shared}.{{rest}}"),
        *layer_rules(config, "model.layers.{i}", {"mamba2": "mamba", "attention": "self_attn"}),
    ])
    return rename_state(_unfuse(dict(state)), rules)


FORMAT = register(CheckpointFormat("granitemoehybrid", to_config, import_weights))

__all__ = ["FORMAT"]
