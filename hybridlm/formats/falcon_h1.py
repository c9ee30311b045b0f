"""Falcon-H1 (TII): attention and Mamba-2 side by side in every layer (both read the same normalised input, their
outputs are summed), then a SwiGLU MLP. Read only.

Every layer is ``"attention+mamba2"`` (a :class:`~hybridlm.mixers.ParallelMixer`) with a dense MLP. The Mamba-2
width is ``mamba_d_ssm`` (``mamba2_inner_size``); its output norm is optional and may come before the gate
(``mamba2_norm``). The µP multipliers that scale a linear map's input or output (attention in/out, keys, SSM
in/out, the per-segment multipliers of the Mamba-2 input projection, MLP gate/down) are folded into that map's
weights at import, which computes the same function with no extra work at run time; the embedding and LM-head
multipliers, which tied embeddings would not allow to fold, are the options ``embedding_multiplier`` and
``logits_multiplier``.
"""

from __future__ import annotations

import torch

from hybridlm.config import HybridConfig
from hybridlm.formats.bamba import DECODER_FIELDS, MAMBA2_FIELDS
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.mapping import (
    FieldMap,
    RenameRules,
    StateDict,
    head_dim_of,
    outer_rules,
    rename_state,
    require_settings,
    rope_settings,
    with_transformers_defaults,
)

FIELDS = FieldMap({
    **DECODER_FIELDS, **MAMBA2_FIELDS,
    "embedding_multiplier": "embedding_multiplier", "lm_head_multiplier": "logits_multiplier",
})
RULES = RenameRules([
    *outer_rules("model.final_layernorm.weight"),
    ("model.layers.{i}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("model.layers.{i}.pre_ff_layernorm.weight", "model.layers.{i}.pre_mlp_layernorm.weight"),
    ("model.layers.{i}.feed_forward.{rest}", "model.layers.{i}.mlp.{rest}"),
    ("model.layers.{i}.mamba.{rest}", "model.layers.{i}.mixer.mamba2.{rest}"),
    ("model.layers.{i}.self_attn.{rest}", "model.layers.{i}.mixer.attention.{rest}"),
])


def _mamba2_norm(fc: dict) -> str:
    if not fc["mamba_rms_norm"]:
        return "none"
    return "norm_before_gate" if fc["mamba_norm_before_gate"] else "gated"


def to_config(foreign_config: dict) -> HybridConfig:
    fc = with_transformers_defaults(foreign_config)
    # hidden_act is also the activation of the Mamba-2 convolution, which hybridlm fixes to SiLU; hybridlm has one
    # bias flag for both Mamba-2 projections
    require_settings(fc, {"hidden_act": ("silu",), "mlp_bias": (False,),
                          "projectors_bias": (fc["mamba_proj_bias"],)}, "falcon_h1")
    n = fc["num_hidden_layers"]
    return HybridConfig(
        **FIELDS.to_ours(fc),
        **rope_settings(fc),
        layer_types=["attention+mamba2"] * n,
        mlp_types=["dense"] * n,
        head_dim=head_dim_of(fc),
        mamba2_inner_size=fc["mamba_d_ssm"] if fc["mamba_d_ssm"] != fc["mamba_expand"] * fc["hidden_size"] else None,
        mamba2_norm=_mamba2_norm(fc),
        mamba2_dt_limit=fc.get("time_step_limit"),  # None means no limit
    )


def _scales(fc: dict, config: HybridConfig) -> dict[str, tuple[float, float | torch.Tensor]]:
    """Per projection (by the end of its foreign name): the multiplier of its input and that of its output (a
    number, or one per output row)."""
    inner, group_width = config.mamba2_d_inner, config.mamba2_n_groups * config.mamba2_d_state
    z, x, b, c, dt = fc["ssm_multipliers"]
    segments = [(inner, z), (inner, x), (group_width, b), (group_width, c), (config.mamba2_num_heads, dt)]
    in_proj_rows = torch.cat([torch.full((size,), float(factor)) for size, factor in segments])
    attention_in, (gate, down) = fc["attention_in_multiplier"], fc["mlp_multipliers"]
    return {
        "self_attn.q_proj": (attention_in, 1.0), "self_attn.k_proj": (attention_in, fc["key_multiplier"]),
        "self_attn.v_proj": (attention_in, 1.0), "self_attn.o_proj": (1.0, fc["attention_out_multiplier"]),
        "mamba.in_proj": (fc["ssm_in_multiplier"], in_proj_rows), "mamba.out_proj": (1.0, fc["ssm_out_multiplier"]),
        "feed_forward.gate_proj": (1.0, gate), "feed_forward.down_proj": (1.0, down),
    }


def _fold(state: StateDict, fc: dict, config: HybridConfig) -> StateDict:
    """``out * (W (in * x) + b) = (in * out * W) x + out * b``: each projection with its multipliers folded in."""
    scales = _scales(fc, config)
    folded = dict(state)
    for name, tensor in state.items():
        module, _, kind = name.rpartition(".")
        projection = ".".join(module.split(".")[-2:])  # "self_attn.q_proj", "mamba.in_proj", ...
        if projection not in scales:
            continue
        into, out = scales[projection]
        if isinstance(out, torch.Tensor):
            if out.shape[0] != tensor.shape[0]:
                continue  # a wrongly shaped tensor: left for the loader's shape check to name
            out = out.to(tensor.dtype)[:, None] if kind == "weight" else out.to(tensor.dtype)
        folded[name] = tensor * out * (into if kind == "weight" else 1.0)
    return folded


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    fc = with_transformers_defaults(foreign_config)
    return rename_state(_fold(state, fc, config), RULES)


FORMAT = register(CheckpointFormat("falcon_h1", to_config, import_weights))

__all__ = ["FORMAT"]
