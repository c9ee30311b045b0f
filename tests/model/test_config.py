"""HybridConfig: the short forms of the layer plan, validation errors, serialisation."""

import json
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedConfig

from hybridlm import HybridConfig, HybridForCausalLM
from hybridlm.config import PATTERN_LETTERS
from hybridlm.mixers import MIXERS
from tests.helpers import tiny_config


def test_pattern_letters():
    config = HybridConfig(layer_pattern="AMSPL")
    assert config.layer_types == ["attention", "mamba", "mamba2", "performer", "linformer"]
    assert config.num_hidden_layers == 5
    assert PATTERN_LETTERS == {cls.pattern_letter: kind for kind, cls in MIXERS.items() if cls.pattern_letter}


def test_jamba_period_offset_form():
    config = HybridConfig(num_hidden_layers=16, attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2,
                          expert_layer_offset=1, ssm_layer_type="mamba2")
    assert [i for i, kind in enumerate(config.layer_types) if kind == "attention"] == [4, 12]
    assert set(config.layer_types) == {"attention", "mamba2"}
    assert config.mlp_types == ["dense", "moe"] * 8


def test_default_is_jamba_like():
    config = HybridConfig()
    assert config.layer_types == ["mamba"] * 4 + ["attention"] + ["mamba"] * 3
    assert config.mlp_types == ["dense"] * 8


def test_forms_must_agree():
    assert HybridConfig(layer_pattern="AM", layer_types=["attention", "mamba"]).num_hidden_layers == 2
    with pytest.raises(ValueError, match="layer_types"):
        HybridConfig(layer_pattern="AM", layer_types=["mamba", "attention"])
    with pytest.raises(ValueError, match="mlp_types"):
        HybridConfig(layer_pattern="AM", mlp_types=["moe", "dense"], expert_layer_period=2, expert_layer_offset=1,
                     num_experts=2, num_experts_per_tok=1)


@pytest.mark.parametrize("kwargs, field", [
    (dict(layer_types=["attention", "transformer"]), "layer_types\\[1\\]"),
    (dict(layer_pattern="AXM"), "layer_pattern"),
    (dict(layer_pattern="AM", num_hidden_layers=3), "num_hidden_layers"),
    (dict(layer_pattern="AM", mlp_types=["dense", "sparse"]), "mlp_types\\[1\\]"),
    (dict(num_attention_heads=8, num_key_value_heads=3), "num_key_value_heads"),
    (dict(num_experts=2, num_experts_per_tok=3), "num_experts_per_tok"),
    (dict(layer_pattern="S", mamba2_head_dim=48), "mamba2_head_dim"),
    (dict(layer_pattern="S", mamba2_n_groups=3), "mamba2_n_groups"),
    (dict(layer_pattern="S", mamba2_dt_limit=[0.5, 0.1]), "mamba2_dt_limit"),
    (dict(partial_rotary_factor=1.5), "partial_rotary_factor"),
    (dict(mlp_activation="tanh"), "mlp_activation"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(attn_layer_period=4, attn_layer_offset=4), "attn_layer_offset"),
])
def test_invalid_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        HybridConfig(**kwargs)


def test_unknown_keys_are_rejected_with_a_suggestion():
    with pytest.raises(ValueError, match="hiden_size.*did you mean 'hidden_size'"):
        HybridConfig(hiden_size=64)


def test_wrong_model_type_is_rejected():
    with pytest.raises(ValueError, match="model_type='jamba'"):
        HybridConfig.from_dict({"model_type": "jamba", "hidden_size": 64})


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kwargs, field", [
    (dict(hidden_size="512"), "hidden_size"),
    (dict(hidden_size=512.0), "hidden_size"),
    (dict(num_hidden_layers="8"), "num_hidden_layers"),
    (dict(layer_types="attention"), "layer_types"),
    (dict(layer_types=[]), "layer_types"),
    (dict(num_attention_heads=8.0), "num_attention_heads"),
    (dict(mamba_dt_rank="big"), "mamba_dt_rank"),
    (dict(rope_theta=0), "rope_theta"),
    (dict(rope_theta=-1.0), "rope_theta"),
    (dict(rope_theta=INF), "rope_theta"),
    (dict(mamba_dt_min=0.5), "mamba_dt_min"),
    (dict(layer_pattern="S", mamba2_dt_min=0.2, mamba2_dt_max=0.1), "mamba2_dt_min"),
    (dict(layer_pattern="S", mamba2_dt_limit=[0.1]), "mamba2_dt_limit"),
    (dict(layer_pattern="S", mamba2_dt_limit=[0.0, 1.0, 2.0]), "mamba2_dt_limit"),
    (dict(layer_pattern="S", mamba2_dt_limit=[0.0, NAN]), "mamba2_dt_limit"),
    (dict(dtype="float33"), "dtype"),
    (dict(torch_dtype="float33"), "dtype"),
    (dict(dtype="int64"), "dtype"),
    (dict(dtype=torch.int8), "dtype"),
    (dict(dtype=torch.float8_e4m3fn), "dtype"),
    (dict(dtype="Tensor"), "dtype"),
    (dict(sliding_window=True), "sliding_window"),
    (dict(attention_bias="yes"), "attention_bias"),
    (dict(tie_word_embeddings=1), "tie_word_embeddings"),
    (dict(layer_pattern="L", linformer_causal=0), "linformer_causal"),
    (dict(residual_multiplier=NAN), "residual_multiplier"),
    (dict(router_aux_loss_coef=NAN), "router_aux_loss_coef"),
    (dict(initializer_range=NAN), "initializer_range"),
    (dict(partial_rotary_factor=NAN), "partial_rotary_factor"),
])
def test_wrong_types_and_ranges_name_the_field(kwargs, field):
    """Each of these used to be accepted silently or to crash with an error naming no field."""
    with pytest.raises(ValueError, match=f"HybridConfig.{field}="):
        HybridConfig(**kwargs)


@pytest.mark.parametrize("dtype", [None, "float32", "bfloat16", torch.float16, torch.float64])
def test_floating_point_dtypes_are_accepted(dtype):
    assert HybridConfig(dtype=dtype).dtype == (getattr(torch, dtype) if isinstance(dtype, str) else dtype)


def test_heads_that_do_not_divide_hidden_size():
    """hidden 100 / 3 heads used to blame partial_rotary_factor; 128 / 3 silently made a 126-wide attention."""
    for hidden in (100, 128):
        with pytest.raises(ValueError, match=f"num_attention_heads=3 .*hidden_size={hidden}.*head_dim"):
            HybridConfig(hidden_size=hidden, num_attention_heads=3, num_key_value_heads=1)
    config = tiny_config(hidden_size=128, num_attention_heads=3, num_key_value_heads=1, head_dim=42,
                         layer_types=["attention"])  # explicit: 126 wide, as asked
    assert HybridForCausalLM(config).model.layers[0].mixer.q_proj.out_features == 126


def test_settings_of_unused_mixer_kinds_are_not_checked():
    """A stack without attention is not refused for its head arithmetic or RoPE settings, nor one without
    Mamba-2 for its dt limits; a shared attention block counts as attention."""
    plain = dict(hidden_size=100, num_attention_heads=3, rope_theta=0, partial_rotary_factor=0.7)
    config = tiny_config(layer_pattern="M", **plain)
    assert config.head_dim is None
    model = HybridForCausalLM(config)
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, config.vocab_size)
    assert HybridConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    HybridConfig(layer_pattern="A", mamba2_dt_limit=[0.5, 0.1], mamba2_head_dim=7)
    with pytest.raises(ValueError, match="num_attention_heads=3"):
        HybridConfig(layer_pattern="MM", shared_block_layers=[1], hidden_size=100, num_attention_heads=3)


@pytest.mark.parametrize("dt_limit", [None, [0.001, 10.0]])
def test_round_trip(tmp_path, dt_limit):
    """What save_pretrained writes reads back through from_pretrained (a directory or the file),
    from_json_file and from_dict of the parsed JSON (infinities are stored as {"__float__": "Infinity"})."""
    config = tiny_config(layer_pattern="MAS", expert_layer_period=3, expert_layer_offset=1, mamba2_dt_limit=dt_limit)
    config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    readers = [HybridConfig.from_pretrained(tmp_path), HybridConfig.from_pretrained(path),
               HybridConfig.from_json_file(path), HybridConfig.from_dict(json.loads(path.read_text()))]
    for loaded in readers:
        assert loaded.layer_types == config.layer_types and loaded.mlp_types == config.mlp_types
        assert loaded.mamba2_dt_limit == (dt_limit or [0.0, INF])
        assert loaded.to_dict() == config.to_dict()


def test_every_field_is_documented():
    """docs/config.md lists every HybridConfig field (those inherited from transformers are documented there)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    missing = [name for name in HybridConfig.__dataclass_fields__
               if name not in PreTrainedConfig.__dataclass_fields__ and f"`{name}`" not in text]
    assert not missing, f"fields missing from docs/config.md: {missing}"
