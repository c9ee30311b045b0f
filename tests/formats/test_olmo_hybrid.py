"""OLMo-Hybrid checkpoints: Gated DeltaNet layers (beta up to 2, separate projections and convs) with pre-norms,
OLMo-3 attention layers with post-norms and q/k norms over all heads, with and without RoPE; loaded exactly."""

import pytest
import transformers

from .compare import check_all, check_logits_and_greedy, checkpoint_fixture, save_and_load, tiny_model_maker

VOCAB = 256

tiny_olmo_hybrid = tiny_model_maker(
    transformers.OlmoHybridForCausalLM, transformers.OlmoHybridConfig, vocab_size=VOCAB, hidden_size=64,
    intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, pad_token_id=0, eos_token_id=1)
olmo_hybrid = checkpoint_fixture("olmo_hybrid", tiny_olmo_hybrid)


def test_olmo_hybrid_runs_like_transformers(olmo_hybrid):
    hf, ours, _ = olmo_hybrid
    assert ours.config.layer_types == ["gated_deltanet"] * 3 + ["attention"]
    assert ours.config.post_norm_layers == [3] and ours.config.deltanet_beta_scale == 2.0
    check_all(hf, ours, VOCAB, length=21, float64_continuation=True)


def test_without_rope_and_with_beta_below_one(tmp_path):
    """The released checkpoints' settings: ``rope_theta`` None (no RoPE in attention); and beta in [0, 1]."""
    hf = tiny_olmo_hybrid(rope_parameters={"rope_type": "default", "rope_theta": None}, linear_allow_neg_eigval=False,
                          layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    assert hf.model.rotary_emb is None
    ours = save_and_load(hf, tmp_path)
    assert ours.config.partial_rotary_factor == 0.0 and ours.config.deltanet_beta_scale == 1.0
    assert ours.config.post_norm_layers == [1, 3]
    check_logits_and_greedy(hf, ours, VOCAB, 13)


def test_convs_split_at_the_query_key_value_widths(olmo_hybrid, tmp_path):
    """transformers saves the joined conv in three equal parts (27 / 27 / 26 rows here); the released checkpoints
    split it at the q / k / v widths (16 / 16 / 48). hybridlm reads both alike."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    import hybridlm

    from .compare import check_logits, random_ids

    hf, _, directory = olmo_hybrid
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    state = load_file(directory / "model.safetensors")
    for i in (0, 1, 2):
        parts = [f"model.layers.{i}.linear_attn.{name}_conv1d.weight" for name in ("q", "k", "v")]
        assert [state[name].shape[0] for name in parts] == [27, 27, 26]
        joined = torch.cat([state.pop(name) for name in parts])
        state.update(zip(parts, joined.split([16, 16, 48])))
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    check_logits(hf, hybridlm.HybridForCausalLM.from_pretrained(tmp_path).eval(), random_ids(VOCAB, 2, 13))


def test_bad_olmo_options_name_the_field():
    import hybridlm

    with pytest.raises(ValueError, match=r"HybridConfig.post_norm_layers=\[4\] is invalid"):
        hybridlm.HybridConfig(layer_pattern="DDDA", hidden_size=32, post_norm_layers=[4])
    with pytest.raises(ValueError, match="attention_qk_norm_whole=True is invalid: needs attention_qk_norm=True"):
        hybridlm.HybridConfig(layer_pattern="DA", hidden_size=32, attention_qk_norm_whole=True)


def test_an_unknown_layer_type_is_named():
    from hybridlm.formats.base import to_hybrid_config

    with pytest.raises(ValueError, match=r"olmo_hybrid config: layer_types \['conv'\] are not supported"):
        to_hybrid_config(dict(model_type="olmo_hybrid", layer_types=["linear_attention", "conv"], num_hidden_layers=2,
                              vocab_size=300, pad_token_id=0, eos_token_id=1))
