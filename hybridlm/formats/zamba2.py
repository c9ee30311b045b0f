"""Zamba2 (Zyphra): a Mamba-2 stack in which some layers first run a shared transformer block. Read only.

Every layer is a Mamba-2 mixer without MLP. Before the mixer of each ``"hybrid"`` layer, one of
``num_mem_blocks`` shared attention + MLP blocks (used in turn) reads the hidden state concatenated with the
token embeddings; the layer's own ``linear`` maps its output into the mixer's input. That is hybridlm's shared
blocks (:mod:`hybridlm.mixers.shared_blocks`): ``shared_block_layers`` are the hybrid layers, each application owns its
``linear`` (``out_proj``) and its LoRA adapters (MLP gate/up always, q/k/v with ``use_shared_attention_adapter``).
The attention is ``2 * hidden`` wide, with a softmax scale of ``(head_dim / 2) ** -0.5`` and RoPE only with
``use_mem_rope``; Mamba-2's dt is clamped from below at ``time_step_min``.

transformers stores each shared block once, under the first layer that applies it, with the adapters of every
application of that block; a checkpoint that repeats a block under later layers is read when the copies agree.
transformers (5.x) ties the blocks only when ``tie_word_embeddings`` is true; otherwise every hybrid layer runs
its own copy, stored under it, and so does hybridlm (one shared block per application).
"""

from __future__ import annotations

import re

import torch

from hybridlm.config import HybridConfig
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.mapping import (
    ATTENTION_FIELDS,
    COMMON_FIELDS,
    FieldMap,
    RenameRules,
    StateDict,
    check_mamba2_heads,
    outer_rules,
    rename_state,
    require_settings,
    rope_settings,
    same_names,
    with_transformers_defaults,
)

FIELDS = FieldMap({
    **COMMON_FIELDS, **ATTENTION_FIELDS,
    **same_names("intermediate_size", "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings"),
    "attention_head_dim": "head_dim", "hidden_act": "mlp_activation", "mamba_d_state": "mamba2_d_state",
    "mamba_d_conv": "mamba2_d_conv", "mamba_expand": "mamba2_expand", "mamba_headdim": "mamba2_head_dim",
    "mamba_ngroups": "mamba2_n_groups", "chunk_size": "mamba2_chunk_size", "add_bias_linear": "mamba2_proj_bias",
    "time_step_min": "mamba2_dt_min", "time_step_max": "mamba2_dt_max", "time_step_floor": "mamba2_dt_init_floor",
    "adapter_rank": "shared_block_adapter_rank", "use_shared_attention_adapter": "shared_block_attention_adapters",
})
SHARED = re.compile(r"^model\.layers\.(\d+)\.shared_transformer\.(.+)$")
ADAPTER_INDEX = re.compile(r"adapter_list\.(\d+)\.")
ADAPTERS = [(f"self_attn.linear_{p}_adapter_list.{{k}}.{i}.weight", f"{p}_adapter.{part}.weight")
            for p in "qkv" for i, part in enumerate(("down", "up"))] + \
           [(f"feed_forward.gate_up_proj_adapter_list.{{k}}.{i}.weight", f"mlp_adapter.{part}.weight")
            for i, part in enumerate(("down", "up"))]


def to_config(foreign_config: dict) -> HybridConfig:
    fc = with_transformers_defaults(foreign_config)
    # add_bias_linear also puts biases on the shared MLP; the Mamba-2 output norm's eps is fixed at 1e-5
    require_settings(fc, {"add_bias_linear": (False,), "rms_norm_eps": (1e-5,), "hidden_act": ("gelu", "silu")},
                     "zamba2")
    hybrid = [i for i, kind in enumerate(fc["layers_block_type"]) if kind == "hybrid"]
    rope = rope_settings(fc) if fc["use_mem_rope"] else {"partial_rotary_factor": 0.0}
    blocks = fc["num_mem_blocks"] if fc["tie_word_embeddings"] else len(hybrid)  # untied: one per application
    config = HybridConfig(
        **FIELDS.to_ours(fc),
        **rope,
        layer_types=["mamba2"] * fc["num_hidden_layers"],
        mlp_types=["none"] * fc["num_hidden_layers"],
        shared_block_layers=hybrid or None,
        num_shared_blocks=max(min(blocks, len(hybrid)), 1),
        attention_scale=(fc["attention_head_dim"] / 2) ** -0.5,
        mamba2_conv_bias=True,  # Zamba2's convolution always has a bias
        mamba2_dt_limit=[fc["time_step_min"], float("inf")],
    )
    check_mamba2_heads(config, fc, "n_mamba_heads", "mamba_expand * hidden_size / mamba_headdim", "zamba2")
    return config


def _gather_shared(state: StateDict, config: HybridConfig) -> StateDict:
    """Shared-block tensors renamed ``shared.{block}.{name}`` (from under whichever layer holds them), with the
    fused MLP gate/up split; copies of a block under several layers must agree. A block's adapter slots for
    applications that run another block are unused (transformers keeps them when it does not tie): dropped."""
    applications = {layer: k for k, layer in enumerate(config.shared_block_layers or [])}
    gathered: StateDict = {}
    for name, tensor in state.items():
        match = SHARED.match(name)
        if match is None or int(match[1]) not in applications:
            gathered[name] = tensor  # anything else, a stray shared block included, is renamed or reported as is
            continue
        block = applications[int(match[1])] % config.num_shared_blocks
        adapter = ADAPTER_INDEX.search(match[2])
        if adapter is not None and int(adapter[1]) % config.num_shared_blocks != block:
            continue
        key = f"shared.{block}.{match[2]}"
        if key in gathered and not torch.equal(gathered[key], tensor):
            raise ValueError(f"zamba2 checkpoint: {name} differs from another copy of the same shared block")
        gathered[key] = tensor
    for name in [n for n in gathered if n.endswith(".feed_forward.gate_up_proj.weight")]:
        gate, up = gathered.pop(name).chunk(2, dim=0)
        prefix = name[: -len("gate_up_proj.weight")]
        gathered[f"{prefix}gate_proj.weight"], gathered[f"{prefix}up_proj.weight"] = gate, up
    return gathered


def rules(config: HybridConfig) -> RenameRules:
    pairs = [*outer_rules("model.final_layernorm.weight"),
             ("model.layers.{i}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight"),
             ("model.layers.{i}.mamba.{rest}", "model.layers.{i}.mixer.{rest}"),
             ("model.layers.{i}.mamba_decoder.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight"),
             ("model.layers.{i}.mamba_decoder.mamba.{rest}", "model.layers.{i}.mixer.{rest}")]
    pairs += [(f"model.layers.{layer}.linear.weight", f"model.shared.sites.{k}.out_proj.weight")
              for k, layer in enumerate(config.shared_block_layers or [])]
    pairs += [(f"shared.{{j}}.{theirs}", f"model.shared.sites.{{k}}.{ours}") for theirs, ours in ADAPTERS]
    pairs += [("shared.{j}.input_layernorm.weight", "model.shared.blocks.{j}.input_layernorm.weight"),
              ("shared.{j}.pre_ff_layernorm.weight", "model.shared.blocks.{j}.pre_mlp_layernorm.weight"),
              ("shared.{j}.self_attn.{rest}", "model.shared.blocks.{j}.attention.{rest}"),
              ("shared.{j}.feed_forward.{rest}", "model.shared.blocks.{j}.mlp.{rest}")]
    return RenameRules(pairs)


def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
    return rename_state(_gather_shared(state, config), rules(config))


FORMAT = register(CheckpointFormat("zamba2", to_config, import_weights))

__all__ = ["FORMAT"]
