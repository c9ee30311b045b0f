"""Falcon-Mamba checkpoints: Mamba-1 with weight-less RMS norms (their own eps) on dt, B and C."""

import torch
import transformers

from .compare import check_all, randomize, save_and_load

VOCAB = 256


def test_falcon_mamba_runs_like_transformers(tmp_path):
    config = transformers.FalconMambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, state_size=8,
                                            layer_norm_epsilon=1e-5, mixer_rms_eps=1e-3)
    torch.manual_seed(0)
    hf = randomize(transformers.FalconMambaForCausalLM(config).eval())
    ours = save_and_load(hf, tmp_path)
    mixer = ours.model.layers[0].mixer
    assert mixer.dt_layernorm.weight is None and mixer.b_layernorm.eps == 1e-3
    check_all(hf, ours, VOCAB)
