"""Bad checkpoints give one clear error naming the problem, never a partly random model; sharded checkpoints and
tied embeddings load."""

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import hybridlm

from .compare import check_logits, random_ids, tiny_transformers_model

VOCAB = 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Mamba-2 checkpoint saved by transformers, and the model it came from."""
    config = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4,
                                       num_heads=4, head_dim=16, n_groups=1, chunk_size=4)
    hf = tiny_transformers_model(transformers.Mamba2ForCausalLM, config)
    directory = tmp_path_factory.mktemp("mamba2")
    hf.save_pretrained(directory)
    return directory, hf


def copy_of(checkpoint, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(checkpoint[0], target)
    return target


def load_error(directory) -> str:
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        hybridlm.HybridForCausalLM.from_pretrained(directory)
    return str(error.value)


def test_unsupported_model_type_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    message = load_error(tmp_path)
    assert "model_type='gpt2'" in message
    for model_type in ("bamba", "falcon_mamba", "jamba", "mamba", "mamba2", "mamba_ssm"):
        assert model_type in message


def test_missing_and_unexpected_weights_are_named(checkpoint, tmp_path):
    directory = copy_of(checkpoint, tmp_path)
    state = load_file(directory / "model.safetensors")
    del state["backbone.layers.1.mixer.dt_bias"]
    state["backbone.layers.1.mixer.extra.weight"] = torch.zeros(3)
    save_file(state, directory / "model.safetensors")
    message = load_error(directory)
    assert "missing weights: model.layers.1.mixer.dt_bias" in message
    assert "unexpected weights: model.layers.1.mixer.extra.weight" in message


def test_shape_mismatch_names_the_tensor_and_both_shapes(checkpoint, tmp_path):
    directory = copy_of(checkpoint, tmp_path)
    state = load_file(directory / "model.safetensors")
    state["backbone.layers.0.mixer.conv1d.weight"] = torch.zeros(72, 1, 3)
    save_file(state, directory / "model.safetensors")
    assert "model.layers.0.mixer.conv1d.weight: checkpoint (72, 1, 3) vs model (72, 1, 4)" in load_error(directory)


def test_truncated_safetensors(checkpoint, tmp_path):
    directory = copy_of(checkpoint, tmp_path)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    message = load_error(directory)
    assert "model.safetensors" in message and "truncated" in message


def test_truncated_safetensors_of_hybridlms_own_format_names_the_file(tmp_path):
    from tests.helpers import tiny_model

    tiny_model(layer_pattern="SA").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size - 100])
    for load in (hybridlm.load, hybridlm.HybridForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match="truncated") as error:
            load(tmp_path)
        assert str(weights) in str(error.value)


def test_directory_without_config(checkpoint, tmp_path):
    directory = copy_of(checkpoint, tmp_path)
    (directory / "config.json").unlink()
    assert "no config.json" in load_error(directory)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hybridlm.load(directory)


def test_directory_without_weights(checkpoint, tmp_path):
    directory = copy_of(checkpoint, tmp_path)
    (directory / "model.safetensors").unlink()
    assert "no weights" in load_error(directory)


def test_invalid_or_unsupported_settings(checkpoint, tmp_path):
    directory = copy_of(checkpoint, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    assert "hidden_act='gelu' (supported: 'silu')" in load_error(directory)
    (directory / "config.json").write_text(json.dumps({**config, "state_size": "four"}))
    assert "invalid mamba2 config.json" in load_error(directory)


def test_sharded_checkpoint_with_index(checkpoint, tmp_path):
    directory, hf = checkpoint
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ours = hybridlm.HybridForCausalLM.from_pretrained(tmp_path / "sharded")
    check_logits(hf, ours, random_ids(VOCAB, 2, 9))
    first = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "sharded" / first).unlink()
    assert f"{first} is listed in the index but missing" in load_error(tmp_path / "sharded")


def test_tied_embeddings_share_one_tensor_and_untied_need_a_head(checkpoint, tmp_path):
    directory = copy_of(checkpoint, tmp_path)
    state = load_file(directory / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, directory / "model.safetensors")
    assert "missing weights: lm_head.weight" in load_error(directory)  # untied: the head is required
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tied = hybridlm.HybridForCausalLM.from_pretrained(directory)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert torch.equal(tied.lm_head.weight, state["backbone.embeddings.weight"])


def test_hub_ids_resolve_from_the_local_cache_without_network(tmp_path, monkeypatch):
    """A hub id whose snapshot is in huggingface_hub's cache loads (foreign and own formats), no download."""
    import huggingface_hub.constants

    from hybridlm import HybridForCausalLM
    from tests.helpers import random_ids, tiny_model

    model = tiny_model(layer_pattern="MA")
    snapshot = tmp_path / "models--acme--tiny-hybrid" / "snapshots" / ("0" * 40)
    model.save_pretrained(snapshot)
    (tmp_path / "models--acme--tiny-hybrid" / "refs").mkdir()
    (tmp_path / "models--acme--tiny-hybrid" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    ids = random_ids(1, 5)
    with torch.no_grad():
        for loaded in (hybridlm.load("acme/tiny-hybrid"), HybridForCausalLM.from_pretrained("acme/tiny-hybrid")):
            assert torch.equal(loaded(ids).logits, model(ids).logits)
