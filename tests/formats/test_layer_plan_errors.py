"""Checkpoints of the delta-rule and short-conv formats that hybridlm cannot run: a layer type it does not read,
and Gated DeltaNet value heads that are not a multiple of the key heads, are refused naming the checkpoint's
own field (what the user finds in its config.json)."""

import pytest

from hybridlm.formats.base import to_hybrid_config

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=12, pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: a layer plan with one type transformers accepts for every one of these formats and hybridlm reads in none
PLAN = ["linear_attention", "sliding_attention", "conv", "full_attention"]


def checkpoint_config(model_type: str, **changes) -> dict:
    """A config.json of ``model_type`` (the multimodal ones: their text model changed), with ``changes``."""
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        return dict(model_type=model_type, text_config={**TEXT, **changes})
    return {"model_type": model_type, **TEXT, **changes}


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe",
                                        "olmo_hybrid", "lfm2", "lfm2_moe", "kimi_linear"])
def test_an_unknown_layer_type_is_named(model_type):
    with pytest.raises(ValueError, match=rf"{model_type} config: layer_types \[.*'sliding_attention'.*\] are not "
                                         r"supported \(hybridlm reads"):
        to_hybrid_config(checkpoint_config(model_type, layer_types=PLAN))


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "olmo_hybrid"])
def test_value_heads_not_a_multiple_of_key_heads_are_named(model_type):
    with pytest.raises(ValueError, match=rf"{model_type} config: linear_num_value_heads=5 is not a multiple of "
                                         r"linear_num_key_heads=2"):
        to_hybrid_config(checkpoint_config(model_type, linear_num_value_heads=5))


@pytest.mark.parametrize("layer_types", [None, "missing"])
def test_lfm2_moe_without_a_layer_plan_is_named(layer_types):
    """transformers' Lfm2MoeConfig derives no plan when ``layer_types`` is absent (Lfm2Config does): an error
    naming the field, not a bare TypeError."""
    config = checkpoint_config("lfm2_moe")
    if layer_types is None:
        config["layer_types"] = None
    with pytest.raises(ValueError, match=r"lfm2_moe config: layer_types must be a list of layer kinds"):
        to_hybrid_config(config)
