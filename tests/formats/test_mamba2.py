"""Mamba-2 checkpoints: loaded exactly (grouped B/C, sequences longer than and not a multiple of the chunk size),
and exported back to a directory transformers loads as Mamba-2."""

import re

import pytest
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

tiny_mamba2 = tiny_model_maker(transformers.Mamba2ForCausalLM, transformers.Mamba2Config, vocab_size=VOCAB,
                               hidden_size=64, num_hidden_layers=3, state_size=8, num_heads=8, head_dim=16,
                               n_groups=2, chunk_size=8)
mamba2 = checkpoint_fixture("mamba2", tiny_mamba2)


def test_mamba2_runs_like_transformers(mamba2):
    hf, ours, _ = mamba2
    assert ours.config.mamba2_n_groups == 2 and ours.config.mamba2_chunk_size == 8
    check_all(hf, ours, VOCAB)


def test_time_step_limit_is_applied(tmp_path):
    """A dt clamp that binds: full forwards agree. (transformers' single-token decode skips the clamp, so greedy
    decoding is not compared here; the cache continuation is checked against hybridlm's own full forward.)"""
    hf = tiny_mamba2(time_step_limit=(0.05, 0.2))
    ours = save_and_load(hf, tmp_path)
    assert ours.config.mamba2_dt_limit == [0.05, 0.2]
    check_logits_and_continuation(hf, ours, VOCAB, 21)


def test_export_round_trip_is_exact(mamba2, tmp_path):
    _, ours, directory = mamba2
    check_export_round_trip(ours, directory, tmp_path, "mamba2", transformers.Mamba2ForCausalLM, VOCAB)


def test_hybridlm_model_exports_to_mamba2(tmp_path):
    config = hybridlm.HybridConfig(vocab_size=VOCAB, hidden_size=32, layer_pattern="SS", mlp_types=["none"] * 2,
                                   mamba2_head_dim=8, mamba2_d_state=4, mamba2_n_groups=4, mamba2_chunk_size=4,
                                   mamba2_dt_limit=[0.0, 0.5], tie_word_embeddings=True)
    ours = randomize(hybridlm.HybridForCausalLM(config).eval(), seed=2)
    back = check_export(ours, tmp_path, "mamba2")
    assert tuple(back.config.time_step_limit) == (0.0, 0.5) and back.config.num_heads == 8


@pytest.mark.parametrize("settings, complaint", [
    (dict(layer_pattern="SA", num_attention_heads=2), r"layers \[1\] are not.*layers \[0, 1\] have one"),
    (dict(layer_pattern="SS", mlp_types=["none"] * 2, mamba2_norm="norm_before_gate"), "mamba2_norm='norm_before"),
])
def test_export_refuses_what_mamba2_cannot_hold(settings, complaint, tmp_path):
    config = hybridlm.HybridConfig(vocab_size=VOCAB, hidden_size=32, mamba2_head_dim=8, **settings)
    message = export_refusal(hybridlm.HybridForCausalLM(config), tmp_path, "mamba2")
    assert re.search(complaint, message), message
