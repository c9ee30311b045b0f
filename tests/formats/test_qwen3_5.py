"""Qwen3.5 checkpoints, text-only and the language model inside a multimodal one: Gated DeltaNet (separate
projections) and gated attention with MRoPE, dense MLPs; loaded exactly."""

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
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=12, pad_token_id=0)


@pytest.fixture(scope="module")
def qwen3_5_text(tmp_path_factory):
    hf = tiny_transformers_model(transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(**TEXT))
    return hf, save_and_load(hf, tmp_path_factory.mktemp("qwen3_5_text"))


def test_qwen3_5_text_runs_like_transformers(qwen3_5_text):
    hf, ours = qwen3_5_text
    assert ours.config.layer_types == ["gated_deltanet"] * 3 + ["attention"]
    assert set(ours.config.mlp_types) == {"dense"}
    ids = random_ids(VOCAB, 2, 21)
    check_logits(hf, ours, ids)
    check_greedy(hf, ours, ids[:1, :7])
    check_left_padding(ours, VOCAB)
    check_continuation(copy.deepcopy(ours).double(), ids, rel=1e-12)  # fp64: see docs/formats.md


def test_language_model_of_a_multimodal_checkpoint(tmp_path):
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=2,
                  temporal_patch_size=1, spatial_merge_size=1)
    config = transformers.Qwen3_5Config(text_config=TEXT, vision_config=vision)
    hf = tiny_transformers_model(transformers.Qwen3_5ForConditionalGeneration, config)
    ours = save_and_load(hf, tmp_path)
    assert ours.config.layer_types == ["gated_deltanet"] * 3 + ["attention"]
    check_logits(hf, ours, random_ids(VOCAB, 2, 13))
