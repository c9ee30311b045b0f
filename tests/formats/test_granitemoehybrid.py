"""Granite-4.0-H checkpoints: Mamba-2 and attention layers with a top-2 MoE plus a shared MLP (or the shared MLP
alone), embedding/residual/attention/logits multipliers, optional RoPE; loaded exactly from the on-disk and the
in-memory expert layouts."""

import shutil

import pytest
import transformers
from safetensors.torch import load_file, save_file

import hybridlm

from .compare import (
    check_all,
    check_logits,
    check_logits_and_continuation,
    check_settings_refused,
    checkpoint_fixture,
    export_refusal,
    random_ids,
    save_and_load,
    tiny_model_maker,
)

VOCAB = 256

tiny_granite = tiny_model_maker(
    transformers.GraniteMoeHybridForCausalLM, transformers.GraniteMoeHybridConfig, vocab_size=VOCAB, hidden_size=64,
    intermediate_size=32, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
    num_attention_heads=4, num_key_value_heads=2, shared_intermediate_size=48, num_local_experts=4,
    num_experts_per_tok=2, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8,
    embedding_multiplier=2.0, logits_scaling=3.0, residual_multiplier=0.5, attention_multiplier=0.1,
    position_embedding_type="rope", tie_word_embeddings=True)
granite = checkpoint_fixture("granite", tiny_granite)


def test_granite_runs_like_transformers(granite):
    hf, ours, _ = granite
    config = ours.config
    assert config.layer_types == ["mamba2", "attention", "mamba2", "attention"]
    assert (config.embedding_multiplier, config.residual_multiplier, config.attention_scale) == (2.0, 0.5, 0.1)
    assert config.logits_multiplier == pytest.approx(1 / 3)
    check_all(hf, ours, VOCAB)


def test_dense_granite_without_rope(tmp_path):
    """No experts (the shared MLP alone), no RoPE, an untied head and a binding dt clamp."""
    hf = tiny_granite(num_local_experts=0, position_embedding_type=None, tie_word_embeddings=False,
                      time_step_limit=(0.05, 0.2), layer_types=["attention", "mamba", "mamba"], num_hidden_layers=3)
    ours = save_and_load(hf, tmp_path)
    assert ours.config.mlp_types == ["dense"] * 3
    assert ours.config.partial_rotary_factor == 0.0
    check_logits_and_continuation(hf, ours, VOCAB, 21)


def test_in_memory_expert_names_are_read(granite, tmp_path):
    hf, _, directory = granite
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    renames = {"block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
               "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
               "block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight"}
    state = {}
    for name, tensor in load_file(directory / "model.safetensors").items():
        for old, new in renames.items():
            name = name.replace(old, new)
        state[name] = tensor
    save_file(state, tmp_path / "model.safetensors")
    ours = hybridlm.HybridForCausalLM.from_pretrained(tmp_path).eval()
    check_logits(hf, ours, random_ids(VOCAB, 1, 9))


def test_unsupported_activation_is_named(granite, tmp_path):
    _, _, directory = granite
    check_settings_refused(directory, tmp_path, r"granitemoehybrid checkpoint uses settings .*hidden_act='gelu'",
                           hidden_act="gelu")


@pytest.mark.parametrize("target", ["bamba", "nemotron_h"])
def test_multipliers_block_export_to_formats_without_them(granite, target, tmp_path):
    """A format that cannot hold Granite's multipliers refuses the model instead of writing other logits."""
    _, ours, _ = granite
    message = export_refusal(ours, tmp_path, target)
    for option in ("embedding_multiplier=2.0", "residual_multiplier=0.5", "logits_multiplier=0.33",
                   "attention_scale=0.1"):
        assert option in message
