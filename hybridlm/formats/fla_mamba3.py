"""flash-linear-attention's Mamba-3 (``model_type="mamba3"``, its ``Mamba3ForCausalLM``): a stack of SISO Mamba-3
mixers with no MLP, in the ``backbone`` layout. Read and written.

Read from fla's source (the fork zhuconv/flash-linear-attention at 85457bd, ``fla/models/mamba3/`` and
``fla/layers/mamba3.py``; fla-org/flash-linear-attention has no ``mamba3`` yet). Layout: ``backbone.embeddings``
(``backbone.embedding`` accepted, as fla's load hook does), ``backbone.layers.{i}.norm``,
``backbone.layers.{i}.mixer.{in_proj, dt_bias, B_bias, C_bias, B_norm, C_norm, D, norm, out_proj}`` (``norm``
with ``is_outproj_norm``; ``B_bias``, ``C_bias`` are ``[heads, 1, state_size]``), ``backbone.norm_f``, ``lm_head``.
The layer is mamba-ssm's SISO ``Mamba3`` as it was before mamba-ssm's #962: its A is ``-softplus(dd_A)``
(``mamba3_a_activation="softplus"``), and ``norm_eps`` is the eps of the block norms and of the B, C and output
norms alike.

Detection: transformers has no ``mamba3``, and another definition may take the name, so a config is read as fla's
only when it holds one of fla's own fields (:data:`FLA_MARKERS`) and no key that fla's ``Mamba3Config`` does not
take (anything else is an error naming the keys); absent fields take ``Mamba3Config``'s defaults. The weights
are then checked by name and shape as for every format.

Refused, each an error naming the field: ``is_mimo=True`` (fla's layer cannot build it: no MIMO layout),
``use_bias=True`` (biased in_proj / out_proj), ``norm_eps`` other than 1e-5 (hybridlm's B/C and output norms use
mamba-ssm's fixed 1e-5), a fractional ``expand``, a ``num_heads`` the widths do not give. Not read by fla's model,
so ignored: ``rmsnorm``, ``hidden_act``, ``mimo_rank`` (SISO), and the training and kernel switches
(``residual_in_fp32``, ``fuse_*``, ``use_l2warp``, ``rescale_prenorm_residual``, ``use_cache``).
"""

from __future__ import annotations

import torch

from hybridlm.config import HybridConfig
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.mamba import BACKBONE_RULES
from hybridlm.formats.mapping import (
    COMMON_FIELDS,
    FieldMap,
    StateDict,
    check_expressible,
    other_positions,
    rename_state,
    require_settings,
    same_names,
)

#: fla's ``Mamba3Config`` arguments and their defaults.
FLA_DEFAULTS = {
    "head_dim": 64, "vocab_size": 32000, "hidden_size": 2048, "state_size": 128, "num_hidden_layers": 48,
    "norm_eps": 1e-5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "expand": 2, "n_groups": 1,
    "rope_fraction": 0.5, "chunk_size": 64, "is_mimo": False, "mimo_rank": 4, "dt_min": 0.001, "dt_max": 0.1,
    "dt_init_floor": 1e-4, "A_floor": 1e-4, "is_outproj_norm": False, "use_bias": False, "hidden_act": "silu",
    "initializer_range": 0.02, "rmsnorm": True, "residual_in_fp32": True, "rescale_prenorm_residual": True,
    "use_cache": True, "fuse_norm": True, "fuse_cross_entropy": True, "fuse_linear_cross_entropy": False,
    "use_l2warp": False, "tie_word_embeddings": False,
}
#: Fields only fla's configs carry: one of them tells its ``mamba3`` from another definition of the name.
FLA_MARKERS = ("fuse_norm", "fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp", "is_outproj_norm")
#: Keys any transformers ``config.json`` may hold besides a model's own (none changes what is computed), and
#: ``num_heads``, which ``Mamba3Config`` derives and writes.
GENERAL_KEYS = {
    "model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "auto_map",
    "_commit_hash", "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "id2label",
    "label2id", "problem_type", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "chunk_size_feed_forward", "sep_token_id", "decoder_start_token_id", "tokenizer_class", "num_heads",
}
NORM_EPS = 1e-5  # hybridlm's (mamba-ssm's) fixed eps of the Mamba-3 B/C and output norms

FIELDS = FieldMap({
    **COMMON_FIELDS, **same_names("num_hidden_layers", "tie_word_embeddings"), "norm_eps": "rms_norm_eps",
    "state_size": "mamba3_d_state", "expand": "mamba3_expand", "head_dim": "mamba3_head_dim",
    "n_groups": "mamba3_n_groups", "rope_fraction": "mamba3_rope_fraction", "dt_min": "mamba3_dt_min",
    "dt_max": "mamba3_dt_max", "dt_init_floor": "mamba3_dt_init_floor", "A_floor": "mamba3_a_floor",
    "is_outproj_norm": "mamba3_outproj_norm", "chunk_size": "mamba3_chunk_size",
})


def _fla_config(foreign_config: dict) -> dict:
    """``foreign_config`` over fla's defaults, after checking that it is fla's ``Mamba3Config``."""
    if not any(marker in foreign_config for marker in FLA_MARKERS):
        raise ValueError(f"model_type='mamba3' config without any of flash-linear-attention's own fields "
                         f"({', '.join(FLA_MARKERS)}): hybridlm reads fla's mamba3 only")
    unknown = sorted(set(foreign_config) - set(FLA_DEFAULTS) - GENERAL_KEYS)
    if unknown:
        raise ValueError(f"mamba3 (flash-linear-attention) config has keys fla's Mamba3Config does not take: "
                         f"{unknown}; another model's mamba3? (known: {sorted(FLA_DEFAULTS)})")
    return {**FLA_DEFAULTS, **foreign_config}


def to_config(foreign_config: dict) -> HybridConfig:
    fc = _fla_config(foreign_config)
    require_settings(fc, {"is_mimo": (False,), "use_bias": (False,), "norm_eps": (NORM_EPS,)},
                     "mamba3 (flash-linear-attention)")
    expand, hidden, head_dim = fc["expand"], fc["hidden_size"], fc["head_dim"]
    if int(expand) != expand:
        raise ValueError(f"mamba3 (flash-linear-attention) config: expand={expand!r} is not a whole number "
                         "(hybridlm's mamba3_expand is)")
    heads = int(expand) * hidden // head_dim
    if "num_heads" in fc and fc["num_heads"] != heads:
        raise ValueError(f"mamba3 (flash-linear-attention) config: num_heads={fc['num_heads']} but expand * "
                         f"hidden_size / head_dim = {heads}")
    n = fc["num_hidden_layers"]
    return HybridConfig(**{**FIELDS.to_ours(fc), "mamba3_expand": int(expand)}, layer_types=["mamba3"] * n,
                        mlp_types=["none"] * n, mamba3_a_activation="softplus")


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    state = rename_state(state, BACKBONE_RULES)
    head, embeddings = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if config.tie_word_embeddings and head is not None and embeddings is not None and not torch.equal(head,
                                                                                                     embeddings):
        raise ValueError("mamba3 (flash-linear-attention) config says tie_word_embeddings=True, but lm_head.weight "
                         "differs from backbone.embeddings.weight (fla's Mamba3ForCausalLM may not tie them): "
                         "set tie_word_embeddings=false to read its own head")
    return state


def from_config(config: HybridConfig) -> dict:
    """fla's ``Mamba3Config`` for a stack of SISO Mamba-3 layers with fla's A (softplus) and no MLP."""
    problems = []
    if set(config.layer_types) != {"mamba3"}:
        problems.append(f"every layer is 'mamba3'; layers {other_positions(config.layer_types, 'mamba3')} are not")
    if set(config.mlp_types) != {"none"}:
        problems.append(f"its layers have no MLP; layers {other_positions(config.mlp_types, 'none')} have one")
    if config.mamba3_mimo:
        problems.append("mamba3_mimo=True (fla's Mamba3 layer is SISO only)")
    if config.mamba3_a_activation != "softplus":
        problems.append(f"mamba3_a_activation={config.mamba3_a_activation!r} (fla's A is -softplus(dd_A))")
    if config.rms_norm_eps != NORM_EPS:
        problems.append(f"rms_norm_eps={config.rms_norm_eps!r} (fla's norm_eps is also the B/C norms' eps, "
                        f"{NORM_EPS} here)")
    check_expressible("mamba3", problems)
    return {
        **FLA_DEFAULTS,
        "model_type": "mamba3",
        "architectures": ["Mamba3ForCausalLM"],
        **FIELDS.to_theirs(config),
        "num_heads": config.mamba3_expand * config.hidden_size // config.mamba3_head_dim,
    }


def export_weights(state: StateDict, config: HybridConfig) -> StateDict:
    state = rename_state(state, BACKBONE_RULES, to_ours=False)
    if config.tie_word_embeddings:  # fla's Mamba3ForCausalLM declares no tied weights: its head is read from the file
        state["lm_head.weight"] = state["backbone.embeddings.weight"].clone()
    return state


FORMAT = register(CheckpointFormat("mamba3", to_config, import_weights, from_config, export_weights))

__all__ = ["FORMAT"]
