"""Zamba2 checkpoints: a Mamba-2 stack with shared attention + MLP blocks applied at several depths (used in turn),
fed the hidden state concatenated with the embeddings, with per-application LoRA adapters and output projections;
loaded exactly, each application keeping its own KV state."""

import shutil

import pytest
import transformers
from safetensors.torch import load_file, save_file

import hybridlm

from .compare import (
    check_all,
    check_beam_search,
    check_logits,
    check_logits_and_continuation,
    check_settings_refused,
    checkpoint_fixture,
    random_ids,
    save_and_load,
    tiny_model_maker,
)

VOCAB = 256

tiny_zamba2 = tiny_model_maker(
    transformers.Zamba2ForCausalLM, transformers.Zamba2Config, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=5,
    layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"], num_attention_heads=4, num_key_value_heads=4,
    intermediate_size=96, mamba_d_state=16, n_mamba_heads=8, mamba_ngroups=2, chunk_size=8, num_mem_blocks=2,
    use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True)
zamba2 = checkpoint_fixture("zamba2", tiny_zamba2)


def test_zamba2_runs_like_transformers(zamba2):
    hf, ours, _ = zamba2
    config = ours.config
    assert (config.shared_block_layers, config.num_shared_blocks) == ([1, 3, 4], 2)
    assert len(ours.model.shared.blocks) == 2 and len(ours.model.shared.sites) == 3
    cache = ours.new_cache(1)
    assert len(cache.states) == 5 + 3  # one state per layer, one KV state per shared-block application
    check_all(hf, ours, VOCAB)


def test_untied_gqa_without_attention_adapters_or_rope(tmp_path):
    """transformers shares the blocks only with tied embeddings: untied, each application runs its own copy."""
    hf = tiny_zamba2(num_key_value_heads=2, use_shared_attention_adapter=False, use_mem_rope=False,
                     hidden_act="silu", tie_word_embeddings=False)
    ours = save_and_load(hf, tmp_path)
    assert ours.config.num_shared_blocks == 3
    assert ours.config.partial_rotary_factor == 0.0 and ours.model.shared.sites[0].q_adapter is None
    check_logits_and_continuation(hf, ours, VOCAB, 17)


def _repeat_shared_blocks(directory, target, change=None):
    """The checkpoint with every shared block also stored under its later layers (optionally one copy altered)."""
    shutil.copy(directory / "config.json", target / "config.json")
    state = load_file(directory / "model.safetensors")
    for name in [n for n in state if n.startswith("model.layers.1.shared_transformer.")]:
        state[name.replace("layers.1.", "layers.4.")] = state[name] + (change if change and "norm" in name else 0)
    save_file(state, target / "model.safetensors")


def test_repeated_shared_blocks(zamba2, tmp_path):
    hf, _, directory = zamba2
    (tmp_path / "same").mkdir()
    _repeat_shared_blocks(directory, tmp_path / "same")
    check_logits(hf, hybridlm.HybridForCausalLM.from_pretrained(tmp_path / "same").eval(), random_ids(VOCAB, 1, 9))
    (tmp_path / "differ").mkdir()
    _repeat_shared_blocks(directory, tmp_path / "differ", change=1.0)
    with pytest.raises(ValueError, match=r"model\.layers\.4\.shared_transformer\..*norm.* differs from another copy"):
        hybridlm.HybridForCausalLM.from_pretrained(tmp_path / "differ")


def test_unsupported_settings_are_named(zamba2, tmp_path):
    _, _, directory = zamba2
    check_settings_refused(directory, tmp_path, r"zamba2 checkpoint .*add_bias_linear=True.*rms_norm_eps=1e-06",
                           add_bias_linear=True, rms_norm_eps=1e-6)


def test_beam_search_reorders_zamba2_states(zamba2):
    """Beam search selects cache rows every step, shared blocks' KV states included."""
    hf, ours, _ = zamba2
    check_beam_search(hf, ours, random_ids(VOCAB, 1, 6))


@pytest.mark.parametrize("options, field", [
    (dict(shared_block_layers=[2, 1]), "shared_block_layers"),
    (dict(shared_block_layers=[3]), "shared_block_layers"),
    (dict(shared_block_layers=[0, 1], num_shared_blocks=3), "num_shared_blocks"),
    (dict(shared_block_layers=[1], shared_block_attention_adapters=True), "shared_block_attention_adapters"),
])
def test_shared_block_options_are_validated(options, field):
    with pytest.raises(ValueError, match=f"HybridConfig.{field}"):
        hybridlm.HybridConfig(layer_types=["mamba2"] * 3, mamba2_head_dim=16, **options)
