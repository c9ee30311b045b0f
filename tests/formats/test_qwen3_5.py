"""Qwen3.5 checkpoints, text-only and the language model inside a multimodal one: Gated DeltaNet (separate
projections) and gated attention with MRoPE, dense MLPs; loaded exactly."""

import transformers

from .compare import check_all, check_logits, checkpoint_fixture, multimodal_checkpoint, random_ids, tiny_model_maker

VOCAB = 256
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=12, pad_token_id=0)

qwen3_5_text = checkpoint_fixture(
    "qwen3_5_text", tiny_model_maker(transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig, **TEXT))


def test_qwen3_5_text_runs_like_transformers(qwen3_5_text):
    hf, ours, _ = qwen3_5_text
    assert ours.config.layer_types == ["gated_deltanet"] * 3 + ["attention"]
    assert set(ours.config.mlp_types) == {"dense"}
    check_all(hf, ours, VOCAB, length=21, float64_continuation=True)


def test_language_model_of_a_multimodal_checkpoint(tmp_path):
    hf, ours = multimodal_checkpoint(transformers.Qwen3_5ForConditionalGeneration, transformers.Qwen3_5Config,
                                     TEXT, tmp_path)
    assert ours.config.layer_types == ["gated_deltanet"] * 3 + ["attention"]
    check_logits(hf, ours, random_ids(VOCAB, 2, 13))
