"""Qwen3.5-MoE checkpoints, text-only and the language model inside a multimodal one: Qwen3.5's Gated DeltaNet
and gated attention with a renormalised top-k MoE and a gated shared expert in every layer; loaded exactly."""

import transformers

from .compare import check_all, check_logits, checkpoint_fixture, multimodal_checkpoint, random_ids, tiny_model_maker

VOCAB = 256
TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, pad_token_id=0)

qwen3_5_moe_text = checkpoint_fixture(
    "qwen3_5_moe_text", tiny_model_maker(transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig, **TEXT))


def test_qwen3_5_moe_text_runs_like_transformers(qwen3_5_moe_text):
    hf, ours, _ = qwen3_5_moe_text
    assert ours.config.layer_types == ["gated_deltanet"] * 3 + ["attention"]
    assert ours.config.mlp_types == ["moe"] * 4 and ours.config.moe_renormalize
    assert ours.config.moe_shared_expert_gate
    check_all(hf, ours, VOCAB, length=21, float64_continuation=True)


def test_language_model_of_a_multimodal_checkpoint(tmp_path):
    hf, ours = multimodal_checkpoint(transformers.Qwen3_5MoeForConditionalGeneration, transformers.Qwen3_5MoeConfig,
                                     TEXT, tmp_path)
    assert ours.config.layer_types == ["gated_deltanet"] * 3 + ["attention"]
    assert ours.config.mlp_types == ["moe"] * 4
    check_logits(hf, ours, random_ids(VOCAB, 2, 13))
