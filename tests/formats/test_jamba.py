"""Jamba checkpoints: loaded exactly (logits, greedy decoding, padding, cache continuation), both expert layouts,
and export back to a directory transformers loads as Jamba."""

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import hybridlm

from .compare import (
    check_all,
    check_export,
    check_export_round_trip,
    checkpoint_fixture,
    export_refusal,
    random_ids,
    randomize,
    tiny_transformers_model,
)

VOCAB = 256



def tiny_jamba_config(**overrides) -> transformers.JambaConfig:
    """5 layers: attention at 1 and 4 (GQA, no RoPE), top-2 MoE over 4 experts at odd layers. (Also used by
    tests/cli/test_cli.py, tests/model/test_moe_loss.py and tests/training/test_finetune.py.)"""
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8,
    )
    return transformers.JambaConfig(**{**settings, **overrides})


jamba = checkpoint_fixture("jamba", lambda: tiny_transformers_model(transformers.JambaForCausalLM, tiny_jamba_config()))


def test_jamba_runs_like_transformers(jamba):
    hf, ours, _ = jamba
    assert ours.config.layer_types == ["mamba", "attention", "mamba", "mamba", "attention"]
    assert ours.config.mlp_types == ["dense", "moe", "dense", "moe", "dense"]
    check_all(hf, ours, VOCAB)


def test_fused_expert_layout_loads_the_same(jamba, tmp_path):
    """Experts stacked as transformers holds them in memory (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    hf, ours, directory = jamba
    state = load_file(directory / "model.safetensors")
    for layer in (1, 3):
        prefix = f"model.layers.{layer}.feed_forward.experts."
        experts = range(4)
        gate_up = [torch.cat([state.pop(f"{prefix}{e}.gate_proj.weight"), state.pop(f"{prefix}{e}.up_proj.weight")])
                   for e in experts]
        state[f"{prefix}gate_up_proj"] = torch.stack(gate_up)
        state[f"{prefix}down_proj"] = torch.stack([state.pop(f"{prefix}{e}.down_proj.weight") for e in experts])
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    fused = hybridlm.HybridForCausalLM.from_pretrained(tmp_path)
    ids = random_ids(VOCAB, 2, 9)
    assert torch.equal(fused(ids).logits, ours(ids).logits)


def test_export_round_trip_is_exact(jamba, tmp_path):
    """hybridlm -> jamba -> transformers: the same tensors under the same names, and the same logits."""
    _, ours, directory = jamba
    check_export_round_trip(ours, directory, tmp_path, "jamba", transformers.JambaForCausalLM, VOCAB, length=11)


def test_hybridlm_model_exports_to_jamba(tmp_path):
    """A model built in hybridlm (tied embeddings, a dense-only stack) is served by transformers' Jamba."""
    config = hybridlm.HybridConfig(
        vocab_size=VOCAB, hidden_size=32, layer_pattern="MMAM", intermediate_size=48, num_attention_heads=2,
        partial_rotary_factor=0.0, mamba_dt_norm=True, mamba_d_state=4, tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    ours = randomize(hybridlm.HybridForCausalLM(config).eval(), seed=1)
    back = check_export(ours, tmp_path, "jamba")
    assert back.config.layers_block_type == ["mamba", "mamba", "attention", "mamba"]
    assert back.config.tie_word_embeddings


@pytest.mark.parametrize("settings, complaint", [
    (dict(layer_pattern="MPMA"), "['performer']"),
    (dict(layer_pattern="AAMA"), "attention layers at [0, 1, 3]"),
    (dict(layer_pattern="MAMM", partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(layer_pattern="MAMM", partial_rotary_factor=0.0, mamba_dt_norm=False), "mamba_dt_norm=False"),
    (dict(layer_pattern="MAMM", partial_rotary_factor=0.0, mlp_types=["dense", "none", "dense", "dense"]),
     "layers [1] have no MLP"),
    (dict(layer_pattern="MAMM", partial_rotary_factor=0.0, residual_multiplier=0.5), "residual_multiplier=0.5"),
])
def test_export_refuses_what_jamba_cannot_hold(settings, complaint, tmp_path):
    base = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, mamba_dt_norm=True)
    model = hybridlm.HybridForCausalLM(hybridlm.HybridConfig(**{**base, **settings}))
    assert complaint in export_refusal(model, tmp_path, "jamba")
