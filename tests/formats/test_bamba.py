"""Bamba checkpoints: Mamba-2 (grouped, chunked) and GQA attention with partial RoPE, each with a SwiGLU MLP;
loaded exactly and exported back to a directory transformers loads as Bamba."""

import re

import torch
import transformers

import hybridlm

from .compare import (
    check_all,
    check_export,
    check_export_round_trip,
    check_logits_and_continuation,
    checkpoint_fixture,
    export_refusal,
    randomize,
    save_and_load,
    tiny_model_maker,
)

VOCAB = 256

tiny_bamba = tiny_model_maker(
    transformers.BambaForCausalLM, transformers.BambaConfig, vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3], mamba_n_heads=8,
    mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=8)
bamba = checkpoint_fixture("bamba", tiny_bamba)


def test_bamba_runs_like_transformers(bamba):
    hf, ours, _ = bamba
    assert ours.config.layer_types == ["mamba2", "attention", "mamba2", "attention"]
    assert ours.config.partial_rotary_factor == 0.5
    check_all(hf, ours, VOCAB)


def test_rope_settings_are_read(tmp_path):
    """A quarter of each head rotated at another base, and a binding dt clamp: full forwards agree."""
    hf = tiny_bamba(rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25},
                    time_step_limit=(0.05, 0.2))
    ours = save_and_load(hf, tmp_path)
    assert (ours.config.partial_rotary_factor, ours.config.rope_theta) == (0.25, 500.0)
    check_logits_and_continuation(hf, ours, VOCAB, 21)


def test_export_round_trip_is_exact(bamba, tmp_path):
    _, ours, directory = bamba
    check_export_round_trip(ours, directory, tmp_path, "bamba", transformers.BambaForCausalLM, VOCAB)


def test_hybridlm_model_exports_to_bamba(tmp_path):
    config = hybridlm.HybridConfig(vocab_size=VOCAB, hidden_size=32, layer_pattern="SAS", intermediate_size=48,
                                   num_attention_heads=4, num_key_value_heads=1, partial_rotary_factor=1.0,
                                   rope_theta=1000.0, mamba2_head_dim=8, mamba2_d_state=4, mamba2_chunk_size=4)
    ours = randomize(hybridlm.HybridForCausalLM(config).eval(), seed=3)
    assert check_export(ours, tmp_path, "bamba").config.attn_layer_indices == [1]
    ours.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", format="bamba")
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto").dtype == torch.bfloat16


def test_export_refuses_mamba1_layers_and_missing_mlps(tmp_path):
    config = hybridlm.HybridConfig(vocab_size=VOCAB, hidden_size=32, layer_pattern="SMA", num_attention_heads=2,
                                   mamba2_head_dim=8, mlp_types=["dense", "dense", "none"])
    message = export_refusal(hybridlm.HybridForCausalLM(config), tmp_path, "bamba")
    assert re.search(r"\['mamba'\].*layers \[2\] do not", message), message
