"""mamba-ssm's own checkpoints (``MambaLMHeadModel``): ``config.json`` with ``d_model``, ``n_layer``, ``ssm_cfg``,
``attn_layer_idx``, ``attn_cfg`` and no ``model_type``; weights in ``pytorch_model.bin``. Read and written.

Layout: ``backbone.embedding``, ``backbone.layers.{i}.norm`` / ``.mixer`` (Mamba-1, Mamba-2, Mamba-3 with its own
parameter names, or attention with a fused ``in_proj`` = q | k | v and ``out_proj``) / ``.norm2`` / ``.mlp.fc1``
(= up | gate) / ``.mlp.fc2``, ``backbone.norm_f``, ``lm_head``. The vocabulary is padded up to
``pad_vocab_size_multiple``. ``ssm_cfg["layer"]`` picks the SSM (``Mamba1`` by default, ``Mamba2``, ``Mamba3``).
Export writes ``pytorch_model.bin`` and a ``config.json`` that ``MambaConfig(**config)`` takes (no other keys).
"""

from __future__ import annotations

import torch

from hybridlm.config import HybridConfig
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.mapping import (
    FieldMap,
    RenameRules,
    StateDict,
    check_expressible,
    outer_rules,
    rename_state,
    require_settings,
)

# MambaConfig's defaults, and those of the mixer classes ssm_cfg and attn_cfg configure.
MODEL_DEFAULTS = {"d_intermediate": 0, "ssm_cfg": {}, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
                  "pad_vocab_size_multiple": 8, "tie_embeddings": True}
SSM_DEFAULTS = {
    "Mamba1": {"d_state": 16, "d_conv": 4, "expand": 2, "dt_rank": "auto", "dt_min": 0.001, "dt_max": 0.1,
               "dt_init": "random", "dt_scale": 1.0, "dt_init_floor": 1e-4, "conv_bias": True, "bias": False,
               "use_fast_path": True},
    "Mamba2": {"d_state": 128, "d_conv": 4, "conv_init": None, "expand": 2, "headdim": 64, "d_ssm": None,
               "ngroups": 1, "A_init_range": [1, 16], "D_has_hdim": False, "rmsnorm": True,
               "norm_before_gate": False, "dt_min": 0.001, "dt_max": 0.1, "dt_init_floor": 1e-4,
               "dt_limit": [0.0, float("inf")], "bias": False, "conv_bias": True, "chunk_size": 256,
               "use_mem_eff_path": True},
    "Mamba3": {"d_state": 128, "expand": 2, "headdim": 64, "ngroups": 1, "rope_fraction": 0.5, "dt_min": 0.001,
               "dt_max": 0.1, "dt_init_floor": 1e-4, "A_floor": 1e-4, "is_outproj_norm": False, "is_mimo": False,
               "mimo_rank": 4, "fuse_pregate_headwise_norm": True, "chunk_size": 64, "dropout": 0.0},
}
ATTN_DEFAULTS = {"num_heads_kv": None, "head_dim": None, "mlp_dim": 0, "qkv_proj_bias": True, "out_proj_bias": True,
                 "softmax_scale": None, "causal": False, "d_conv": 0, "rotary_emb_dim": 0,
                 "rotary_emb_base": 10000.0, "rotary_emb_interleaved": False}
NORM_EPS = 1e-5  # MambaLMHeadModel's block norms and Mamba-2's gated norm

SSM_FIELDS = {
    "Mamba1": FieldMap({"d_state": "mamba_d_state", "d_conv": "mamba_d_conv", "expand": "mamba_expand",
                        "dt_rank": "mamba_dt_rank", "dt_min": "mamba_dt_min", "dt_max": "mamba_dt_max",
                        "dt_init_floor": "mamba_dt_init_floor", "conv_bias": "mamba_conv_bias",
                        "bias": "mamba_proj_bias"}),
    "Mamba2": FieldMap({"d_state": "mamba2_d_state", "d_conv": "mamba2_d_conv", "expand": "mamba2_expand",
                        "headdim": "mamba2_head_dim", "ngroups": "mamba2_n_groups", "chunk_size": "mamba2_chunk_size",
                        "dt_min": "mamba2_dt_min", "dt_max": "mamba2_dt_max", "dt_init_floor": "mamba2_dt_init_floor",
                        "dt_limit": "mamba2_dt_limit", "conv_bias": "mamba2_conv_bias", "bias": "mamba2_proj_bias"}),
    # fuse_pregate_headwise_norm (the same norm, fused or not) and dropout (absorbed) change nothing computed
    "Mamba3": FieldMap({"d_state": "mamba3_d_state", "expand": "mamba3_expand", "headdim": "mamba3_head_dim",
                        "ngroups": "mamba3_n_groups", "rope_fraction": "mamba3_rope_fraction",
                        "dt_min": "mamba3_dt_min", "dt_max": "mamba3_dt_max", "dt_init_floor": "mamba3_dt_init_floor",
                        "A_floor": "mamba3_a_floor", "is_outproj_norm": "mamba3_outproj_norm", "is_mimo": "mamba3_mimo",
                        "mimo_rank": "mamba3_mimo_rank", "chunk_size": "mamba3_chunk_size"}),
}
SSM_KINDS = {"Mamba1": "mamba", "Mamba2": "mamba2", "Mamba3": "mamba3"}
MIMO_WEIGHTS = ("mimo_x", "mimo_z", "mimo_o")

RULES = RenameRules([
    *outer_rules("backbone.norm_f.weight", embeddings="backbone.embedding.weight"),
    ("backbone.layers.{i}.norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("backbone.layers.{i}.norm2.weight", "model.layers.{i}.pre_mlp_layernorm.weight"),
    ("backbone.layers.{i}.mlp.fc1.weight", "model.layers.{i}.mlp.fc1.weight"),  # split in import_weights
    ("backbone.layers.{i}.mlp.fc2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("backbone.layers.{i}.mixer.{rest}", "model.layers.{i}.mixer.{rest}"),
])


def matches(foreign_config: dict) -> bool:
    return "model_type" not in foreign_config and {"d_model", "n_layer"} <= set(foreign_config)


def _settings(given: dict, defaults: dict, what: str) -> dict:
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"mamba-ssm {what} has unknown keys {unknown}; known: {sorted(defaults)}")
    return {**defaults, **given}


def to_config(foreign_config: dict) -> HybridConfig:
    fc = {**MODEL_DEFAULTS, **foreign_config}
    require_settings(fc, {"rms_norm": (True,)}, "mamba-ssm")
    ssm_cfg = dict(fc["ssm_cfg"])
    layer = ssm_cfg.pop("layer", "Mamba1")
    if layer not in SSM_DEFAULTS:
        raise ValueError(f"mamba-ssm ssm_cfg.layer={layer!r} is not supported (supported: {sorted(SSM_DEFAULTS)})")
    ssm = _settings(ssm_cfg, SSM_DEFAULTS[layer], "ssm_cfg")
    if layer == "Mamba2":
        require_settings(ssm, {"D_has_hdim": (False,), "rmsnorm": (True,), "norm_before_gate": (False,),
                               "d_ssm": (None,)}, f"mamba-ssm {layer}")
    n, hidden = fc["n_layer"], fc["d_model"]
    attention_layers = set(fc["attn_layer_idx"])
    if not attention_layers <= set(range(n)):
        raise ValueError(f"mamba-ssm attn_layer_idx={sorted(attention_layers)} has layers outside 0..{n - 1}")
    vocab, multiple = fc["vocab_size"], fc["pad_vocab_size_multiple"]
    kwargs = {
        **SSM_FIELDS[layer].to_ours(ssm),
        "vocab_size": -(-vocab // multiple) * multiple,
        "hidden_size": hidden,
        "layer_types": ["attention" if i in attention_layers else SSM_KINDS[layer] for i in range(n)],
        "mlp_types": ["dense" if fc["d_intermediate"] else "none"] * n,
        "intermediate_size": -(-fc["d_intermediate"] // 128) * 128 if fc["d_intermediate"] else None,
        "rms_norm_eps": NORM_EPS,
        "tie_word_embeddings": fc["tie_embeddings"],
    }
    if attention_layers:
        kwargs.update(_attention_settings(fc["attn_cfg"], hidden))
    return HybridConfig(**kwargs)


def _attention_settings(attn_cfg: dict, hidden: int) -> dict:
    attn = _settings(attn_cfg, {"num_heads": None, **ATTN_DEFAULTS}, "attn_cfg")
    require_settings(attn, {"causal": (True,), "mlp_dim": (0,), "d_conv": (0,), "rotary_emb_interleaved": (False,),
                            "out_proj_bias": (attn["qkv_proj_bias"],)}, "mamba-ssm attention")
    heads = attn["num_heads"]
    head_dim = attn["head_dim"] or hidden // heads
    factor = attn["rotary_emb_dim"] / head_dim
    if int(head_dim * factor) != attn["rotary_emb_dim"]:
        raise ValueError(f"mamba-ssm attn_cfg.rotary_emb_dim={attn['rotary_emb_dim']} is not expressible as a "
                         f"fraction of head_dim={head_dim}")
    return {"num_attention_heads": heads, "num_key_value_heads": attn["num_heads_kv"] or heads, "head_dim": head_dim,
            "attention_bias": attn["qkv_proj_bias"], "partial_rotary_factor": factor,
            "rope_theta": float(attn["rotary_emb_base"]), "attention_scale": attn["softmax_scale"]}


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    state = rename_state(state, RULES)
    for i, kind in enumerate(config.layer_types):
        prefix = f"model.layers.{i}."
        if f"{prefix}mlp.fc1.weight" in state:  # fc1 = up | gate
            up, gate = state.pop(f"{prefix}mlp.fc1.weight").chunk(2, dim=0)
            state[f"{prefix}mlp.up_proj.weight"], state[f"{prefix}mlp.gate_proj.weight"] = up, gate
        if kind == "attention":
            _split_attention(state, prefix + "mixer.", config)
        if kind == "mamba3" and config.mamba3_mimo:
            missing = [name for name in MIMO_WEIGHTS if f"{prefix}mixer.{name}" not in state]
            if missing:
                raise ValueError(f"mamba-ssm ssm_cfg.is_mimo=True, but layer {i} has no MIMO weights "
                                 f"({', '.join(f'backbone.layers.{i}.mixer.{name}' for name in missing)}): a SISO "
                                 "checkpoint? (is_mimo=false)")
    return state


def _split_attention(state: StateDict, prefix: str, config: HybridConfig) -> None:
    """``in_proj`` (q | k | v) -> ``q_proj``, ``k_proj``, ``v_proj``; ``out_proj`` -> ``o_proj``."""
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    for suffix in ("weight", "bias"):
        fused = state.pop(f"{prefix}in_proj.{suffix}", None)
        if fused is not None:
            if fused.shape[0] != q_size + 2 * kv_size:
                raise ValueError(f"{prefix}in_proj.{suffix}: shape {tuple(fused.shape)}, expected "
                                 f"{q_size + 2 * kv_size} rows (q {q_size} + k {kv_size} + v {kv_size})")
            q, k, v = torch.split(fused, [q_size, kv_size, kv_size], dim=0)
            state[f"{prefix}q_proj.{suffix}"], state[f"{prefix}k_proj.{suffix}"] = q, k
            state[f"{prefix}v_proj.{suffix}"] = v
        out = state.pop(f"{prefix}out_proj.{suffix}", None)
        if out is not None:
            state[f"{prefix}o_proj.{suffix}"] = out


def from_config(config: HybridConfig) -> dict:
    """mamba-ssm's ``MambaConfig`` for a stack of one SSM kind, optionally attention layers and dense MLPs in every
    layer or none; anything else it cannot hold is named (read back, the config must be this model's)."""
    layers = {SSM_KINDS[name]: name for name in SSM_KINDS}
    kinds = set(config.layer_types) - {"attention"}
    problems = []
    if len(kinds) != 1 or not kinds <= set(layers):
        problems.append(f"mamba-ssm stacks one SSM kind ({', '.join(layers)}) with attention layers; this model has "
                        f"{sorted(set(config.layer_types))}")
    if set(config.mlp_types) not in ({"dense"}, {"none"}):
        problems.append(f"mamba-ssm has a dense MLP in every layer or in none; this model has {config.mlp_types}")
    check_expressible("mamba_ssm", problems)
    layer = layers[kinds.pop()]
    ssm = {key: value for key, value in SSM_FIELDS[layer].to_theirs(config).items()}
    if layer == "Mamba3" and not config.mamba3_mimo:
        ssm.pop("mimo_rank")
    attention = [i for i, kind in enumerate(config.layer_types) if kind == "attention"]
    dense = config.mlp_types[0] == "dense"
    foreign = {"d_model": config.hidden_size, "d_intermediate": config.intermediate_size if dense else 0,
               "n_layer": config.num_hidden_layers, "vocab_size": config.vocab_size,
               "ssm_cfg": {"layer": layer, **ssm}, "attn_layer_idx": attention, "attn_cfg": {}, "rms_norm": True,
               "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 1,
               "tie_embeddings": config.tie_word_embeddings}
    if attention:
        head_dim = config.head_dim
        foreign["attn_cfg"] = {
            "num_heads": config.num_attention_heads, "num_heads_kv": config.num_key_value_heads, "head_dim": head_dim,
            "qkv_proj_bias": config.attention_bias, "out_proj_bias": config.attention_bias, "causal": True,
            "rotary_emb_dim": int(head_dim * config.partial_rotary_factor), "rotary_emb_base": config.rope_theta,
            "softmax_scale": config.attention_scale}
    _check_round_trip(config, to_config(foreign))
    return foreign


def _check_round_trip(config: HybridConfig, back: HybridConfig) -> None:
    """Refuse what the written config would not say: every field the stack and its kinds read must come back."""
    from hybridlm.mixers import mixer_class

    fields = {"vocab_size", "hidden_size", "layer_types", "mlp_types", "rms_norm_eps", "tie_word_embeddings",
              "mlp_activation", *(f for kind in set(config.layer_types) for f in mixer_class(kind).config_fields)}
    if "dense" in config.mlp_types:
        fields.add("intermediate_size")
    problems = [f"{name}={getattr(config, name)!r} (mamba-ssm would give {getattr(back, name)!r})"
                for name in sorted(fields) if getattr(config, name) != getattr(back, name)]
    check_expressible("mamba_ssm", problems)


def export_weights(state: StateDict, config: HybridConfig) -> StateDict:
    state = dict(state)
    for i, kind in enumerate(config.layer_types):
        prefix = f"model.layers.{i}."
        if f"{prefix}mlp.up_proj.weight" in state:
            state[f"{prefix}mlp.fc1.weight"] = torch.cat([state.pop(f"{prefix}mlp.up_proj.weight"),
                                                          state.pop(f"{prefix}mlp.gate_proj.weight")])
        if kind == "attention":
            for part in ("weight", "bias"):
                names = [f"{prefix}mixer.{proj}.{part}" for proj in ("q_proj", "k_proj", "v_proj")]
                if names[0] in state:
                    state[f"{prefix}mixer.in_proj.{part}"] = torch.cat([state.pop(name) for name in names])
                if f"{prefix}mixer.o_proj.{part}" in state:
                    state[f"{prefix}mixer.out_proj.{part}"] = state.pop(f"{prefix}mixer.o_proj.{part}")
    state = rename_state(state, RULES, to_ours=False)
    if config.tie_word_embeddings:  # MambaLMHeadModel's state dict holds the tied head too (strict loading)
        state["lm_head.weight"] = state["backbone.embedding.weight"]
    return state


FORMAT = register(CheckpointFormat("mamba_ssm", to_config, import_weights, from_config, export_weights,
                                   matches=matches, options=frozenset({"attention_scale"}),
                                   weights_name="pytorch_model.bin"))

__all__ = ["FORMAT"]
