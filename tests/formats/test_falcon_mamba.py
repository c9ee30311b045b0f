"""Falcon-Mamba checkpoints: Mamba-1 with weight-less RMS norms (their own eps) on dt, B and C."""

import transformers

from .compare import check_all, save_and_load, tiny_transformers_model

VOCAB = 256


def test_falcon_mamba_runs_like_transformers(tmp_path):
    config = transformers.FalconMambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, state_size=8,
                                            layer_norm_epsilon=1e-5, mixer_rms_eps=1e-3)
    hf = tiny_transformers_model(transformers.FalconMambaForCausalLM, config)
    ours = save_and_load(hf, tmp_path)
    mixer = ours.model.layers[0].mixer
    assert mixer.dt_layernorm.weight is None and mixer.b_layernorm.eps == 1e-3
    check_all(hf, ours, VOCAB)
