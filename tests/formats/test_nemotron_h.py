"""Nemotron-H checkpoints: mixer-only and MLP-only blocks, attention without RoPE, relu² MLPs and a grouped sigmoid
MoE router; loaded exactly, in every layout transformers reads, and exported back (hybridlm layers holding a
mixer and an MLP become two Nemotron-H blocks)."""

import json
import shutil

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import hybridlm

from .compare import (
    check_all,
    check_export,
    check_export_round_trip,
    check_logits,
    check_settings_refused,
    checkpoint_fixture,
    export_refusal,
    random_ids,
    randomize,
    tiny_model_maker,
)

VOCAB = 256


@torch.no_grad()
def randomize_with_buffers(model, seed: int = 0):
    """:func:`randomize`, and the routers' selection biases (buffers) too, so that their mapping is tested."""
    randomize(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, buffer in model.named_buffers():
        if name.endswith(("e_score_correction_bias", "expert_bias")):
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
    return model


tiny_nemotron_h = tiny_model_maker(
    transformers.NemotronHForCausalLM, transformers.NemotronHConfig, randomize_with_buffers, vocab_size=VOCAB,
    hidden_size=64, hybrid_override_pattern="MEM*-M", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, chunk_size=8,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
    n_group=2, topk_group=1, routed_scaling_factor=1.5)
nemotron = checkpoint_fixture("nemotron", tiny_nemotron_h)


def test_nemotron_h_runs_like_transformers(nemotron):
    hf, ours, _ = nemotron
    assert ours.config.layer_types == ["mamba2", "none", "mamba2", "attention", "none", "mamba2"]
    assert ours.config.mlp_types == ["none", "moe", "none", "none", "dense", "none"]
    check_all(hf, ours, VOCAB)


def test_legacy_pattern_stacked_experts_and_model_prefix(nemotron, tmp_path):
    """The same checkpoint as ``hybrid_override_pattern`` + ``model.`` names + stacked experts + MTP weights, with
    a dt clamp that binds (``time_step_limit``; transformers before 5.25 clamped at ``time_step_min`` instead, so the
    two say the same here): transformers and hybridlm read it alike."""
    _, unclamped, directory = nemotron
    config = json.loads((directory / "config.json").read_text())
    del config["layers_block_type"]
    config.update(hybrid_override_pattern="MEM*-M", time_step_min=0.02, time_step_limit=[0.02, float("inf")])
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {name.replace("backbone.", "model."): t for name, t in load_file(directory / "model.safetensors").items()}
    for part in ("up_proj", "down_proj"):
        prefix = "model.layers.1.mixer.experts"
        state[f"{prefix}.{part}"] = torch.stack([state.pop(f"{prefix}.{e}.{part}.weight") for e in range(4)])
    state["mtp.layers.0.norm.weight"] = torch.ones(64)
    save_file(state, tmp_path / "model.safetensors")

    ours = hybridlm.HybridForCausalLM.from_pretrained(tmp_path).eval()
    assert ours.config.mamba2_dt_limit == [0.02, float("inf")]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = random_ids(VOCAB, 2, 11)
    check_logits(hf, ours, ids)
    with torch.no_grad():
        assert (ours(ids).logits - unclamped(ids).logits).abs().max() > 1e-3  # the clamp changed something


def test_export_round_trip_is_exact(nemotron, tmp_path):
    _, ours, directory = nemotron
    check_export_round_trip(ours, directory, tmp_path, "nemotron_h", transformers.NemotronHForCausalLM, VOCAB)


LAYER_KINDS = [("mamba2", "none"), ("attention", "none"), ("none", "dense"), ("none", "moe"), ("mamba2", "dense"),
               ("attention", "moe"), ("mamba2", "moe")]


# transformers' Nemotron-H cannot run a stack without attention (its cache then has no sequence length).
PLANS = st.lists(st.sampled_from(LAYER_KINDS), min_size=1, max_size=4).filter(
    lambda plan: any(mixer == "attention" for mixer, _ in plan))


@settings(max_examples=4)
@given(plan=PLANS, tied=st.booleans())
def test_hybridlm_models_export_to_nemotron_h(plan, tied, tmp_path_factory):
    """Any plan of mamba2/attention mixers and relu² dense/MoE MLPs: layers with both halves become two blocks."""
    config = hybridlm.HybridConfig(
        vocab_size=VOCAB, hidden_size=32, layer_types=[m for m, _ in plan], mlp_types=[f for _, f in plan],
        num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.0, mlp_activation="relu2",
        intermediate_size=48, moe_router="sigmoid", num_experts=4, num_experts_per_tok=2, moe_num_groups=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=16, moe_renormalize=True, moe_routed_scaling=2.5,
        mamba2_head_dim=8, mamba2_d_state=8, mamba2_chunk_size=4, tie_word_embeddings=tied)
    ours = randomize_with_buffers(hybridlm.HybridForCausalLM(config).eval(), seed=3)
    directory = tmp_path_factory.mktemp("native")
    back = check_export(ours, directory, "nemotron_h")
    assert len(back.config.layers_block_type) == sum(kind != "none" for pair in plan for kind in pair)
    shutil.rmtree(directory)


def test_export_writes_a_binding_dt_limit_that_transformers_applies(tmp_path):
    """A dt clamp that binds goes out as ``time_step_limit`` (and ``time_step_min`` too, which transformers before
    5.25 clamped at): transformers' logits are ours, and hybridlm reads the same limit back."""
    config = hybridlm.HybridConfig(
        vocab_size=VOCAB, hidden_size=32, layer_types=["mamba2", "attention"], mlp_types=["none", "dense"],
        num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.0, mlp_activation="relu2",
        intermediate_size=48, mamba2_head_dim=8, mamba2_d_state=8, mamba2_chunk_size=4, mamba2_dt_min=0.5,
        mamba2_dt_max=1.0, mamba2_dt_limit=[0.5, float("inf")])
    ours = randomize(hybridlm.HybridForCausalLM(config).eval(), seed=3)
    unclamped = hybridlm.HybridForCausalLM(hybridlm.HybridConfig(**{**config.to_dict(), "mamba2_dt_limit": None}))
    unclamped.load_state_dict(ours.state_dict())
    ids = random_ids(VOCAB, 2, 10)
    with torch.no_grad():
        assert (ours(ids).logits - unclamped.eval()(ids).logits).abs().max() > 1e-3  # the clamp binds
    back = check_export(ours, tmp_path, "nemotron_h")
    assert list(back.config.time_step_limit) == [0.5, float("inf")]
    assert hybridlm.HybridForCausalLM.from_pretrained(tmp_path).config.mamba2_dt_limit == [0.5, float("inf")]


def test_export_names_what_does_not_fit(tmp_path):
    config = hybridlm.HybridConfig(vocab_size=VOCAB, hidden_size=32, layer_types=["attention+mamba2", "mamba",
                                                                                 "attention"],
                                   num_attention_heads=2, mamba2_head_dim=8, moe_router="softmax",
                                   mlp_types=["moe", "dense", "none"])
    message = export_refusal(hybridlm.HybridForCausalLM(config), tmp_path, "nemotron_h")
    for problem in ("'attention+mamba2', 'mamba'", "partial_rotary_factor=1.0", "mlp_activation='silu'",
                    "moe_router='softmax'", "shared_expert_intermediate_size=0"):
        assert problem in message


def test_unsupported_settings_are_named(nemotron, tmp_path):
    _, _, directory = nemotron
    check_settings_refused(directory, tmp_path, r"mlp_hidden_act='silu'.*moe_latent_size=16",
                           moe_latent_size=16, mlp_hidden_act="silu")


@pytest.mark.parametrize("options, field", [
    (dict(moe_num_groups=2), "moe_num_groups"),  # groups need the sigmoid router
    (dict(moe_router="sigmoid", num_experts=4, moe_num_groups=3), "moe_num_groups"),
    (dict(moe_router="sigmoid", num_experts=4, moe_num_groups=2, num_experts_per_tok=3), "num_experts_per_tok"),
    (dict(moe_router="top1"), "moe_router"),
    (dict(layer_types=["none"], mlp_types=["none"]), "mlp_types"),
])
def test_options_are_validated(options, field):
    with pytest.raises(ValueError, match=f"HybridConfig.{field}"):
        hybridlm.HybridConfig(**{"layer_types": ["mamba2"], "mamba2_head_dim": 16, **options})
