"""Qwen3.5-MoE checkpoints, text-only and the language model inside a multimodal one: Qwen3.5's Gated DeltaNet
and gated attention with a renormalised top-k MoE and a gated shared expert in every layer; loaded exactly."""

import copy

import pytest
import transformers

from .compare import (
    check_continuation,
    check_greedy,
    check_left_padding,
    check_logits,
    random_ids,
    save_and_load,
    tiny_transformers_model,
)

VOCAB = 256
TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, pad_token_id=0)


@pytest.fixture(scope="module")
def qwen3_5_moe_text(tmp_path_factory):
    hf = tiny_transformers_model(transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig(**TEXT))
    return hf, save_and_load(hf, tmp_path_factory.mktemp("qwen3_5_moe_text"))


def test_qwen3_5_moe_text_runs_like_transformers(qwen3_5_moe_text):
    hf, ours = qwen3_5_moe_text
    assert ours.config.layer_types == ["gated_deltanet"] * 3 + ["attention"]
    assert ours.config.mlp_types == ["moe"] * 4 and ours.config.moe_renormalize
    assert ours.config.moe_shared_expert_gate
    ids = random_ids(VOCAB, 2, 21)
    check_logits(hf, ours, ids)
    check_greedy(hf, ours, ids[:1, :7])
    check_left_padding(ours, VOCAB)
    check_continuation(copy.deepcopy(ours).double(), ids, rel=1e-12)  # fp64: see docs/formats.md


def test_language_model_of_a_multimodal_checkpoint(tmp_path):
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=2,
                  temporal_patch_size=1, spatial_merge_size=1)
    config = transformers.Qwen3_5MoeConfig(text_config=TEXT, vision_config=vision)
    hf = tiny_transformers_model(transformers.Qwen3_5MoeForConditionalGeneration, config)
    ours = save_and_load(hf, tmp_path)
    assert ours.config.layer_types == ["gated_deltanet"] * 3 + ["attention"]
    assert ours.config.mlp_types == ["moe"] * 4
    check_logits(hf, ours, random_ids(VOCAB, 2, 13))
