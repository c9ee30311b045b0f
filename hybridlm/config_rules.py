"""What a valid value of each ``HybridConfig`` field is: its type (read from the field's annotation) and its
range (the table below). :class:`~hybridlm.config.HybridConfig` applies these to the stack's own fields and to
the fields of the mixer kinds its layers use (see ``Mixer.config_fields``); every error names the field."""

from __future__ import annotations

import functools
import math
import types
import typing

import torch

from hybridlm.mixers import invalid_config


def _positive(v) -> bool:
    return v > 0


def _non_negative(v) -> bool:
    return v >= 0


def _open_unit(v) -> bool:
    return 0 < v < 1


def _closed_unit(v) -> bool:
    return 0 <= v <= 1


_RULES = {
    _positive: ("must be > 0", (
        "vocab_size", "hidden_size", "num_hidden_layers", "attn_layer_period", "expert_layer_period",
        "max_position_embeddings", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
        "sliding_window", "attention_scale", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_dt_rank",
        "mamba_dt_min", "mamba_dt_max", "mamba_dt_init_floor", "mamba2_d_state", "mamba2_d_conv", "mamba2_expand",
        "mamba2_head_dim", "mamba2_n_groups", "mamba2_chunk_size", "mamba2_dt_min", "mamba2_dt_max",
        "mamba2_dt_init_floor", "mamba2_inner_size", "mamba3_d_state", "mamba3_expand", "mamba3_head_dim",
        "mamba3_n_groups", "mamba3_dt_min", "mamba3_dt_max", "mamba3_dt_init_floor", "mamba3_a_floor",
        "mamba3_mimo_rank", "mamba3_chunk_size", "performer_num_features", "performer_redraw_interval",
        "linformer_rank", "linformer_max_length", "intermediate_size", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "moe_num_groups", "moe_topk_groups", "moe_routed_scaling", "embedding_multiplier",
        "residual_multiplier", "logits_multiplier", "num_shared_blocks", "deltanet_num_key_heads",
        "deltanet_num_value_heads", "deltanet_key_head_dim", "deltanet_value_head_dim", "deltanet_conv_size",
        "deltanet_chunk_size", "short_conv_size", "deltanet_beta_scale", "mla_kv_lora_rank", "mla_q_lora_rank",
        "mla_v_head_dim",
    )),
    _non_negative: ("must be >= 0", (
        "attn_layer_offset", "expert_layer_offset", "initializer_range", "router_aux_loss_coef",
        "shared_expert_intermediate_size", "shared_block_adapter_rank", "pad_token_id", "bos_token_id",
        "mla_qk_nope_head_dim", "mla_qk_rope_head_dim",
    )),
    _open_unit: ("must be in (0, 1)", ("rms_norm_eps", "mamba_dt_norm_eps", "deltanet_norm_eps")),
    _closed_unit: ("must be in [0, 1]", ("partial_rotary_factor",)),
}
RANGES = {name: (test, text) for test, (text, names) in _RULES.items() for name in names}


def _describe(hint) -> str:
    if hint is type(None):
        return "None"
    if hint is float:
        return "a finite number"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if hint is dict:
        return "a dict"
    if origin is list:
        return f"a list of ({_describe(typing.get_args(hint)[0])})"
    return getattr(hint, "__name__", str(hint))


def _matches(value, hint, *, finite: bool = True) -> bool:
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
                and (math.isfinite(value) or not finite))
    if hint is str:
        return isinstance(value, str)
    if hint is dict:
        return isinstance(value, dict)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg, finite=finite) for arg in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, (list, tuple)) and all(_matches(v, item, finite=finite) for v in value)
    raise TypeError(f"no type check for annotation {hint!r}")


def check_field(name: str, value, hint, *, finite: bool = True) -> None:
    """Raise naming ``name`` unless ``value`` has the annotated type and lies in the field's range. Floats must
    be finite (``finite=False``: infinities allowed, NaN never)."""
    if not _matches(value, hint, finite=finite):
        raise invalid_config(name, value, f"must be {_describe(hint)}")
    if name in RANGES and value is not None:
        test, text = RANGES[name]
        if not test(value):
            raise invalid_config(name, value, text)


@functools.cache
def field_hints(config_class) -> dict[str, typing.Any]:
    """The annotation of each field ``config_class`` itself declares (not those only transformers declares)."""
    own = config_class.__annotations__
    return {name: eval(own[name], {}) for name in own if name in config_class.__dataclass_fields__}


def check_dtype(value) -> None:
    """``dtype`` (transformers' field): None, or a floating-point torch dtype a model computes in (16 bits or more),
    or its name (``"bfloat16"``)."""
    if value is None:
        return
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2):
        raise invalid_config("dtype", value, "must be None, or a floating-point torch.dtype of 16 bits or more or its "
                                             "name ('float32', 'bfloat16', 'float16', 'float64')")


def check_router(config) -> None:
    """The MoE router's expert groups against the experts and the experts chosen per token."""
    groups, chosen = config.moe_num_groups, config.moe_topk_groups
    if config.num_experts % groups:
        raise invalid_config("moe_num_groups", groups, f"must divide num_experts={config.num_experts}")
    if groups > 1 and (config.moe_router != "sigmoid" or config.num_experts // groups < 2):
        raise invalid_config("moe_num_groups", groups, "groups need moe_router='sigmoid' and at least 2 experts per "
                             "group")
    if chosen > groups:
        raise invalid_config("moe_topk_groups", chosen, f"must be in [1, moe_num_groups={groups}]")
    if config.num_experts_per_tok > chosen * (config.num_experts // groups):
        raise invalid_config("num_experts_per_tok", config.num_experts_per_tok,
                             f"exceeds the experts in the {chosen} eligible group(s)")
