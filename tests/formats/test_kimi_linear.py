"""Kimi Linear checkpoints: Kimi Delta Attention and MLA layers (3:1), a dense first MLP then DeepSeek-V3 MoEs
with shared experts; loaded exactly."""

import pytest
import transformers

from .compare import check_all, check_logits_and_greedy, checkpoint_fixture, save_and_load, tiny_model_maker

VOCAB = 256

tiny_kimi_linear = tiny_model_maker(
    transformers.KimiLinearForCausalLM, transformers.KimiLinearConfig, vocab_size=VOCAB, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=None, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, linear_head_dim=8, linear_num_heads=2,
    layer_types=["linear_attention"] * 3 + ["full_attention"], routed_scaling_factor=1.7, pad_token_id=0,
    bos_token_id=1, eos_token_id=2)
kimi_linear = checkpoint_fixture("kimi_linear", tiny_kimi_linear)


def test_kimi_linear_runs_like_transformers(kimi_linear):
    hf, ours, _ = kimi_linear
    assert ours.config.layer_types == ["kda"] * 3 + ["mla"]
    assert ours.config.mlp_types == ["dense", "moe", "moe", "moe"] and ours.config.moe_router == "sigmoid"
    check_all(hf, ours, VOCAB, length=21, float64_continuation=True)


def test_low_rank_queries_and_the_checkpoints_layer_lists(tmp_path):
    """``q_lora_rank`` set, and the layer plan given as the checkpoint's 1-based ``linear_attn_config``."""
    linear = {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "head_dim": 8, "num_heads": 2,
              "short_conv_kernel_size": 3}
    hf = tiny_kimi_linear(q_lora_rank=12, layer_types=None, linear_attn_config=linear)
    ours = save_and_load(hf, tmp_path)
    assert ours.config.layer_types == ["kda", "mla", "kda", "mla"] and ours.config.deltanet_conv_size == 3
    check_logits_and_greedy(hf, ours, VOCAB, 13)


def test_memory_report_and_info_count_the_latent_per_token():
    """``hybridlm memory`` rows put MLA's latent growth under ``mla`` (``kv_lora_rank + rope`` elements per token
    per layer, bf16) and KDA's fixed state under ``kda``; ``hybridlm info``'s per-token figure agrees."""
    import torch

    import hybridlm
    from hybridlm.decoding.bench import cache_bytes
    from hybridlm.model.memory import memory_rows, read_any_config

    config = read_any_config(tiny_kimi_linear().config.to_dict())
    (row,) = memory_rows(config, [1000])
    latent, kda_state = 16 + 4, 2 * 8 * 8 * 4 + 3 * 16 * 3 * 2  # per token; per layer (fp32 matrix + bf16 window)
    assert row["bytes_per_token"] == latent * 2
    assert row["by_kind"]["mla"] == 1000 * latent * 2 + 8 and row["by_kind"]["kda"] == 3 * kda_state
    with torch.device("cpu"):
        model = hybridlm.HybridForCausalLM(config)
    assert cache_bytes(model, 64)[1] == latent * 4  # fp32 model


@pytest.mark.parametrize("config, message", [
    (dict(layer_types=["linear_attention", "sliding_attention"], mlp_layer_types=["dense"] * 2),
     r"layer_types \['sliding_attention'\] are not supported"),
    (dict(num_key_value_heads=8, num_attention_heads=32), "num_key_value_heads=8 is not supported"),
])
def test_what_hybridlm_cannot_read_is_named(config, message):
    from hybridlm.formats.base import to_hybrid_config

    with pytest.raises(ValueError, match=message):
        to_hybrid_config(dict(model_type="kimi_linear", num_hidden_layers=2, **config))
