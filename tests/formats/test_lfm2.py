"""LFM2 checkpoints: gated short convolutions and attention with normed query/key heads; loaded exactly and
exported back to a directory transformers loads as LFM2."""

import json
import re

import pytest
import transformers

import hybridlm

from .compare import (
    check_all,
    check_export,
    check_export_round_trip,
    checkpoint_fixture,
    export_refusal,
    randomize,
    save_and_load,
    tiny_model_maker,
    tiny_transformers_model,
)

VOCAB = 256

tiny_lfm2 = tiny_model_maker(
    transformers.Lfm2ForCausalLM, transformers.Lfm2Config, vocab_size=VOCAB, hidden_size=64, intermediate_size=144,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    layer_types=["conv", "full_attention", "conv", "conv"], block_multiple_of=16, block_ffn_dim_multiplier=1.5,
    tie_word_embeddings=False, pad_token_id=0)
lfm2 = checkpoint_fixture("lfm2", tiny_lfm2)


def test_lfm2_runs_like_transformers(lfm2):
    hf, ours, _ = lfm2
    assert ours.config.layer_types == ["short_conv", "attention", "short_conv", "short_conv"]
    assert ours.config.intermediate_size == hf.model.layers[0].feed_forward.w1.out_features == 144
    check_all(hf, ours, VOCAB)


def test_conv_bias_and_tied_embeddings(tmp_path):
    hf = tiny_lfm2(conv_bias=True, tie_word_embeddings=True, conv_L_cache=4, block_auto_adjust_ff_dim=False)
    ours = save_and_load(hf, tmp_path)
    assert ours.config.short_conv_bias and ours.config.tie_word_embeddings and ours.config.short_conv_size == 4
    check_all(hf, ours, VOCAB)


def test_export_round_trip_is_exact(lfm2, tmp_path):
    _, ours, directory = lfm2
    check_export_round_trip(ours, directory, tmp_path, "lfm2", transformers.Lfm2ForCausalLM, VOCAB)


def test_hybridlm_model_exports_to_lfm2(tmp_path):
    config = hybridlm.HybridConfig(vocab_size=VOCAB, hidden_size=32, layer_pattern="CAC", intermediate_size=48,
                                   num_attention_heads=4, num_key_value_heads=1, attention_qk_norm=True,
                                   short_conv_size=4)
    ours = randomize(hybridlm.HybridForCausalLM(config).eval(), seed=3)
    assert check_export(ours, tmp_path, "lfm2").config.layer_types == ["conv", "full_attention", "conv"]


def test_export_writes_the_public_lfm2_fields(tmp_path):
    """vLLM's LFM2 model builds the conv and the MLP from ``conv_dim``, ``block_dim`` and ``block_ff_dim``, which
    transformers does not keep; the export writes them (and the other aliases of LiquidAI's configs) with the
    widths the model has, and transformers still reads it as the same model."""
    config = hybridlm.HybridConfig(vocab_size=VOCAB, hidden_size=32, layer_pattern="CCA", intermediate_size=40,
                                   num_attention_heads=4, num_key_value_heads=2, attention_qk_norm=True,
                                   rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=False,
                                   max_position_embeddings=4096)
    ours = randomize(hybridlm.HybridForCausalLM(config).eval(), seed=4)
    with pytest.warns(UserWarning, match="vLLM's LFM2 ties the head"):  # vLLM would run another model
        check_export(ours, tmp_path, "lfm2")
    written = json.loads((tmp_path / "config.json").read_text())
    assert {name: written[name] for name in PUBLIC_FIELDS} == {
        "block_dim": 32, "conv_dim": 32, "conv_dim_out": 32, "block_ff_dim": 40, "intermediate_size": 40,
        "block_auto_adjust_ff_dim": False, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
        "block_norm_eps": 1e-6, "norm_eps": 1e-6, "block_use_swiglu": True, "num_heads": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "conv_L_cache": 3, "conv_bias": False, "full_attn_idxs": [2],
        "layer_types": ["conv", "conv", "full_attention"], "tie_embedding": False, "tie_word_embeddings": False,
        "use_pos_enc": True, "rope_theta": 5000.0, "max_position_embeddings": 4096,
    }


#: The architecture fields of LiquidAI's public LFM2 configs (LFM2-350M ... 2.6B); their initialisation settings
#: (``block_*_init_scale``, ``*_use_xavier_init``) are left out on purpose (see ``formats/lfm2.py``).
PUBLIC_FIELDS = [
    "block_dim", "conv_dim", "conv_dim_out", "block_ff_dim", "intermediate_size", "block_auto_adjust_ff_dim",
    "block_multiple_of", "block_ffn_dim_multiplier", "block_norm_eps", "norm_eps", "block_use_swiglu", "num_heads",
    "num_attention_heads", "num_key_value_heads", "conv_L_cache", "conv_bias", "full_attn_idxs", "layer_types",
    "tie_embedding", "tie_word_embeddings", "use_pos_enc", "rope_theta", "max_position_embeddings",
]


def test_a_tied_lfm2_export_does_not_warn(tmp_path):
    import warnings

    config = hybridlm.HybridConfig(vocab_size=VOCAB, hidden_size=32, layer_pattern="CA", num_attention_heads=4,
                                   num_key_value_heads=2, attention_qk_norm=True, tie_word_embeddings=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hybridlm.HybridForCausalLM(config).save_pretrained(tmp_path, format="lfm2")
    assert json.loads((tmp_path / "config.json").read_text())["tie_embedding"] is True


def test_export_refuses_what_lfm2_cannot_hold(tmp_path):
    config = hybridlm.HybridConfig(vocab_size=VOCAB, hidden_size=32, layer_pattern="CAS", num_attention_heads=2,
                                   mamba2_head_dim=8)
    message = export_refusal(hybridlm.HybridForCausalLM(config), tmp_path, "lfm2")
    assert re.search(r"\['mamba2'\].*attention_qk_norm=False", message), message


@pytest.mark.parametrize("use_expert_bias", [True, False])
def test_lfm2_moe_runs_like_transformers(tmp_path, use_expert_bias):
    config = transformers.Lfm2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1, num_experts=6, num_experts_per_tok=2,
        layer_types=["conv", "full_attention", "conv", "conv"], routed_scaling_factor=1.5,
        use_expert_bias=use_expert_bias, tie_word_embeddings=False, pad_token_id=0)
    hf = tiny_transformers_model(transformers.Lfm2MoeForCausalLM, config)
    if use_expert_bias:  # a selection bias that changes which experts win
        for layer in hf.model.layers[1:]:
            layer.feed_forward.expert_bias.normal_(0, 0.3)
    ours = save_and_load(hf, tmp_path)
    assert ours.config.mlp_types == ["dense", "moe", "moe", "moe"] and ours.config.moe_router == "sigmoid"
    check_all(hf, ours, VOCAB)
