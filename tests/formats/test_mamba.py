"""Mamba-1 checkpoints (transformers' ``mamba``): loaded exactly, with tied and untied embeddings."""

import pytest
import transformers

from .compare import check_all, save_and_load, tiny_transformers_model

VOCAB = 256


@pytest.mark.parametrize("tie", [True, False])
def test_mamba_runs_like_transformers(tie, tmp_path):
    config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, state_size=8,
                                      time_step_rank=6, use_bias=not tie, tie_word_embeddings=tie)
    hf = tiny_transformers_model(transformers.MambaForCausalLM, config)
    ours = save_and_load(hf, tmp_path)
    assert ours.config.layer_types == ["mamba"] * 3 and ours.config.mlp_types == ["none"] * 3
    assert ours.config.tie_word_embeddings == tie
    assert (ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()) == tie
    check_all(hf, ours, VOCAB)
