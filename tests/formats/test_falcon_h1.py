"""Falcon-H1 checkpoints: attention and Mamba-2 in parallel in every layer, a Mamba-2 width of its own, the three
output-norm variants, and every µP multiplier set to a distinct value; loaded exactly."""

import pytest
import transformers

import hybridlm

from .compare import (
    check_all,
    check_beam_search,
    check_logits_and_continuation,
    check_settings_refused,
    checkpoint_fixture,
    random_ids,
    save_and_load,
    tiny_model_maker,
)

VOCAB = 256
MULTIPLIERS = dict(embedding_multiplier=1.5, lm_head_multiplier=0.7, mlp_multipliers=[0.8, 1.3], key_multiplier=0.6,
                   attention_in_multiplier=1.2, attention_out_multiplier=0.9, ssm_in_multiplier=0.8,
                   ssm_out_multiplier=1.4, ssm_multipliers=[0.5, 1.5, 0.7, 1.1, 2.0])

tiny_falcon_h1 = tiny_model_maker(
    transformers.FalconH1ForCausalLM, transformers.FalconH1Config, vocab_size=VOCAB, hidden_size=64,
    intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=96,
    mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8, mamba_rms_norm=True,
    mamba_norm_before_gate=True, **MULTIPLIERS)
falcon = checkpoint_fixture("falcon", tiny_falcon_h1)


def test_falcon_h1_runs_like_transformers(falcon):
    hf, ours, _ = falcon
    config = ours.config
    assert config.layer_types == ["attention+mamba2"] * 3
    assert (config.mamba2_d_inner, config.mamba2_num_heads, config.mamba2_norm) == (96, 6, "norm_before_gate")
    cache = ours.new_cache(1)
    assert set(cache.nbytes_by_kind()) == {"attention", "mamba2"}
    check_all(hf, ours, VOCAB)


@pytest.mark.parametrize("variant", [
    dict(mamba_norm_before_gate=False, attention_bias=True),
    dict(mamba_rms_norm=False, tie_word_embeddings=True, mamba_proj_bias=True, projectors_bias=True,
         time_step_limit=(0.05, 0.2)),
], ids=["gated-norm", "no-norm"])
def test_norm_variants_biases_and_tied_head(variant, tmp_path):
    """Multipliers folded into biases too, the gated norm, no norm at all, a tied head and a binding dt clamp."""
    hf = tiny_falcon_h1(**variant)
    ours = save_and_load(hf, tmp_path)
    check_logits_and_continuation(hf, ours, VOCAB, 17)


def test_unsupported_settings_are_named(falcon, tmp_path):
    _, _, directory = falcon
    check_settings_refused(directory, tmp_path, r"falcon_h1 checkpoint .*mlp_bias=True.*projectors_bias=True",
                           mlp_bias=True, projectors_bias=True)


def test_beam_search_reorders_falcon_states(falcon):
    """Beam search selects cache rows every step, parallel layers' grouped states included."""
    hf, ours, _ = falcon
    check_beam_search(hf, ours, random_ids(VOCAB, 1, 6))


@pytest.mark.parametrize("options, field", [
    (dict(layer_types=["attention+attention"]), r"layer_types\[0\]"),
    (dict(layer_types=["attention+mamba2"], mamba2_norm="rms"), "mamba2_norm"),
    (dict(layer_types=["mamba2"], mamba2_inner_size=100, mamba2_head_dim=16), "mamba2_head_dim"),
    (dict(embedding_multiplier=0.0), "embedding_multiplier"),
    (dict(logits_multiplier=float("inf")), "logits_multiplier"),
])
def test_options_are_validated(options, field):
    with pytest.raises(ValueError, match=f"HybridConfig.{field}"):
        hybridlm.HybridConfig(**{"mamba2_head_dim": 16, **options})
