"""Every preset builds; each writable foreign format has a preset that exports to it and reloads."""

import json

import pytest
import torch

from hybridlm import HybridForCausalLM, load
from hybridlm.formats import FORMATS
from hybridlm.presets import FORMAT_PRESETS, PRESETS, preset

SMALLER = dict(vocab_size=128, hidden_size=64, intermediate_size=96)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds(name):
    assert preset(name).num_hidden_layers >= 1


@pytest.mark.parametrize("model_type", sorted(FORMAT_PRESETS))
def test_format_preset_exports_and_reloads(model_type, tmp_path):
    from transformers import CONFIG_MAPPING, AutoConfig

    assert FORMATS[model_type].from_config is not None, f"{model_type} is not writable"
    torch.manual_seed(0)
    smaller = {**SMALLER, "intermediate_size": 128} if model_type == "mamba_ssm" else SMALLER  # (its MLP: x128)
    model = HybridForCausalLM(preset(FORMAT_PRESETS[model_type], **smaller)).eval()
    model.save_pretrained(tmp_path, format=model_type)
    written = json.loads((tmp_path / "config.json").read_text())
    if FORMATS[model_type].matches is None:
        assert written["model_type"] == model_type
        if model_type in CONFIG_MAPPING:  # (transformers has no flash-linear-attention mamba3)
            assert AutoConfig.from_pretrained(tmp_path).model_type == model_type  # transformers reads it as that format
    else:  # mamba-ssm's own config: no model_type, recognised by its fields
        assert "model_type" not in written and FORMATS[model_type].matches(written)
    assert (tmp_path / "generation_config.json").is_file()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = model(ids).logits
    got = load(tmp_path).eval()(ids).logits
    assert expected.abs().max() > 0
    assert (got - expected).abs().max() / expected.abs().max() < 1e-5


def test_every_writable_format_has_a_preset():
    writable = {name for name, fmt in FORMATS.items() if fmt.from_config is not None}
    missing = writable - set(FORMAT_PRESETS)
    assert not missing, f"writable formats without a preset: {sorted(missing)}"
