"""HybridConfig: the short forms of the layer plan, validation errors, serialisation."""

from pathlib import Path

import pytest
from transformers import PreTrainedConfig

from hybridlm import HybridConfig
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


def test_round_trip(tmp_path):
    config = tiny_config(layer_pattern="MAS", expert_layer_period=3, expert_layer_offset=1)
    config.save_pretrained(tmp_path)
    loaded = HybridConfig.from_pretrained(tmp_path)
    assert loaded.layer_types == config.layer_types and loaded.mlp_types == config.mlp_types
    assert loaded.mamba2_dt_limit == [0.0, float("inf")]
    assert loaded.to_dict() == config.to_dict()



def test_every_field_is_documented():
    """docs/config.md lists every HybridConfig field (those inherited from transformers are documented there)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    missing = [name for name in HybridConfig.__dataclass_fields__
               if name not in PreTrainedConfig.__dataclass_fields__ and f"`{name}`" not in text]
    assert not missing, f"fields missing from docs/config.md: {missing}"
