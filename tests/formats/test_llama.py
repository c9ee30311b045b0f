"""The plain decoder families (Llama, Mistral, Qwen2, Qwen3) as all-attention stacks: loaded exactly, RoPE
scalings included, and exported back to directories transformers loads as the same family."""

import pytest
import torch
import transformers

import hybridlm

from .compare import (
    check_all,
    check_export,
    check_export_round_trip,
    check_logits,
    check_logits_and_continuation,
    check_settings_refused,
    checkpoint_fixture,
    export_refusal,
    randomize,
    save_and_load,
    tiny_model_maker,
)

VOCAB = 256
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)

tiny_llama = tiny_model_maker(transformers.LlamaForCausalLM, transformers.LlamaConfig, **TINY)
tiny_mistral = tiny_model_maker(transformers.MistralForCausalLM, transformers.MistralConfig, **TINY,
                                sliding_window=5)
tiny_qwen2 = tiny_model_maker(transformers.Qwen2ForCausalLM, transformers.Qwen2Config, **TINY)
tiny_qwen3 = tiny_model_maker(transformers.Qwen3ForCausalLM, transformers.Qwen3Config, **TINY, head_dim=24)
FAMILIES = {
    "llama": (tiny_llama, transformers.LlamaForCausalLM),
    "mistral": (tiny_mistral, transformers.MistralForCausalLM),
    "qwen2": (tiny_qwen2, transformers.Qwen2ForCausalLM),
    "qwen3": (tiny_qwen3, transformers.Qwen3ForCausalLM),
}
llama = checkpoint_fixture("llama", tiny_llama)
mistral = checkpoint_fixture("mistral", tiny_mistral)
qwen2 = checkpoint_fixture("qwen2", tiny_qwen2)
qwen3 = checkpoint_fixture("qwen3", tiny_qwen3)


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param, request.getfixturevalue(request.param)


def test_runs_like_transformers(family):
    """Logits, 16 greedy tokens, left padding and chunked prefill + decode, for each family."""
    name, (hf, ours, _) = family
    assert ours.config.layer_types == ["attention"] * 3
    check_all(hf, ours, VOCAB, length=13)


def test_each_family_keeps_its_options(llama, mistral, qwen2, qwen3):
    assert llama[1].config.sliding_window is None and not llama[1].config.attention_bias
    assert mistral[1].config.sliding_window == 5
    q2 = qwen2[1].model.layers[0].mixer
    assert q2.q_proj.bias is not None and q2.o_proj.bias is None
    assert qwen3[1].config.attention_qk_norm and qwen3[1].config.head_dim == 24


def test_export_round_trip_is_exact(family, tmp_path):
    name, (_, ours, directory) = family
    check_export_round_trip(ours, directory, tmp_path, name, FAMILIES[name][1], VOCAB)


def test_biased_and_tied_llama(tmp_path):
    hf = tiny_llama(attention_bias=True, tie_word_embeddings=True, rms_norm_eps=1e-5)
    ours = save_and_load(hf, tmp_path)
    assert ours.model.layers[1].mixer.o_proj.bias is not None and ours.config.tie_word_embeddings
    check_all(hf, ours, VOCAB)


def test_qwen_sliding_window_layers(tmp_path):
    """Qwen2 with every layer windowed (use_sliding_window, max_window_layers=0) loads with that window."""
    hf = tiny_qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    ours = save_and_load(hf, tmp_path)
    assert ours.config.sliding_window == 4
    check_logits_and_continuation(hf, ours, VOCAB, 17)


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-deepseek": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                      "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
}


@pytest.mark.parametrize("name", sorted(ROPE_SCALINGS))
def test_rope_scalings_match_transformers(name, tmp_path):
    """Each scaling changes the logits (against plain RoPE), and hybridlm follows transformers; a yarn theta
    of 500 puts the ramp inside the rotated dimensions."""
    rope = {**ROPE_SCALINGS[name], "rope_theta": 500.0}
    hf = tiny_llama(rope_parameters=rope)
    ours = save_and_load(hf, tmp_path)
    assert ours.config.rope_scaling["rope_type"] == rope["rope_type"]
    plain = save_and_load(tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 500.0}), tmp_path / "p")
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids).logits - plain(ids).logits).abs().max() > 1e-3, "the scaling changed nothing"
    check_logits_and_continuation(hf, ours, VOCAB, 40)
    check_export(ours, tmp_path / "export", "llama")
    ours.save_pretrained(tmp_path / "own")  # hybridlm's own format keeps the scaling
    check_logits(ours, hybridlm.load(tmp_path / "own"), ids, atol=0.0)


def test_dynamic_rope_past_the_original_context(tmp_path):
    """Dynamic NTK scaling is plain RoPE up to max_position_embeddings and rescales past it; hybridlm drops the
    length limit (the scaling exists to pass it) and matches transformers on a full forward of 40 > 16
    positions. The export states the original context again."""
    hf = tiny_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0},
                    max_position_embeddings=16)
    ours = save_and_load(hf, tmp_path)
    assert ours.config.max_position_embeddings is None
    assert ours.config.rope_scaling["original_max_position_embeddings"] == 16
    from .compare import random_ids

    check_logits(hf, ours, random_ids(VOCAB, 2, 40))
    check_logits(hf, ours, random_ids(VOCAB, 2, 12))  # within the context: the base is unchanged
    back = check_export(ours, tmp_path / "export", "llama")
    assert back.config.max_position_embeddings == 16


def test_hybridlm_model_exports_to_each_family(tmp_path):
    base = dict(vocab_size=VOCAB, hidden_size=32, layer_pattern="AA", intermediate_size=48, num_attention_heads=4,
                num_key_value_heads=2)
    configs = {"llama": {}, "mistral": {"sliding_window": 3}, "qwen2": {"attention_bias": True,
                                                                        "attention_output_bias": False},
               "qwen3": {"attention_qk_norm": True}}
    for name, settings in configs.items():
        ours = randomize(hybridlm.HybridForCausalLM(hybridlm.HybridConfig(**base, **settings)).eval(), seed=3)
        assert isinstance(check_export(ours, tmp_path / name, name), FAMILIES[name][1])


def test_export_refuses_what_a_family_cannot_hold(tmp_path):
    hybrid = hybridlm.HybridForCausalLM(hybridlm.HybridConfig(vocab_size=VOCAB, hidden_size=32, layer_pattern="AS",
                                                              num_attention_heads=2, mamba2_head_dim=8))
    assert "['mamba2']" in export_refusal(hybrid, tmp_path, "llama")
    windowed = hybridlm.HybridForCausalLM(hybridlm.HybridConfig(vocab_size=VOCAB, hidden_size=32, layer_pattern="A",
                                                                num_attention_heads=2, sliding_window=4))
    assert "sliding_window=4" in export_refusal(windowed, tmp_path, "llama")
    plain = hybridlm.HybridForCausalLM(hybridlm.HybridConfig(vocab_size=VOCAB, hidden_size=32, layer_pattern="A",
                                                             num_attention_heads=2))
    assert "attention_qk_norm=False" in export_refusal(plain, tmp_path, "qwen3")
    assert "attention_bias=False" in export_refusal(plain, tmp_path, "qwen2")


def test_bad_settings_are_refused(llama, qwen2, tmp_path):
    _, _, directory = llama
    check_settings_refused(directory, tmp_path / "a", r"rope_type 'longrope' is not supported",
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                            "long_factor": [1.0] * 8, "original_max_position_embeddings": 16})
    check_settings_refused(directory, tmp_path / "b", r"hidden_act='gelu'", hidden_act="gelu")
    check_settings_refused(directory, tmp_path / "c", r"mlp_bias=True", mlp_bias=True)
    check_settings_refused(qwen2[2], tmp_path / "d", r"mixes sliding_attention and full_attention",
                           use_sliding_window=True, sliding_window=4, max_window_layers=1,
                           layer_types=["full_attention", "sliding_attention", "sliding_attention"])


def test_rope_scaling_config_errors():
    """A bad rope_scaling names the field and the problem; rope_scaling without RoPE is refused."""
    base = dict(vocab_size=VOCAB, hidden_size=32, layer_pattern="A", num_attention_heads=2)
    cases = [({"rope_type": "su", "factor": 2.0}, "'su' is not supported"),
             ({"rope_type": "linear"}, r"needs \['factor'\]"),
             ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3}, r"does not read \['beta_fast'\]"),
             ({"rope_type": "linear", "factor": 0.5}, "must be >= 1"),
             ({"rope_type": "linear", "factor": "2"}, "must be positive numbers")]
    for scaling, message in cases:
        with pytest.raises(ValueError, match=rf"rope_scaling.*{message}"):
            hybridlm.HybridConfig(**base, rope_scaling=scaling)
    with pytest.raises(ValueError, match="rope_scaling.*no RoPE"):
        hybridlm.HybridConfig(**base, partial_rotary_factor=0.0, rope_scaling={"rope_type": "linear", "factor": 2.0})


@pytest.mark.parametrize("model_type,config_class", [("gemma2", transformers.Gemma2Config),
                                                     ("gemma3_text", transformers.Gemma3TextConfig)])
def test_gemma_is_refused_naming_what_is_missing(model_type, config_class, tmp_path):
    """Gemma 2 / 3 need options hybridlm lacks: the error names them (soft-capping for Gemma 2)."""
    config_class(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"{model_type} checkpoints are not supported: hybridlm lacks sandwich "
                                         rf"norms.*per-layer sliding windows") as error:
        hybridlm.load(tmp_path)
    assert ("soft-capping" in str(error.value)) == (model_type == "gemma2")
