"""Qwen3-Next checkpoints: Gated DeltaNet and gated attention layers (3:1), a MoE with a gated shared expert;
loaded exactly and exported back to a directory transformers loads as Qwen3-Next."""

import re

import torch
import transformers
from safetensors.torch import load_file

import hybridlm

from .compare import (
    check_all,
    check_export,
    check_logits,
    checkpoint_fixture,
    export_refusal,
    random_ids,
    randomize,
    tiny_model_maker,
)

VOCAB = 256

tiny_qwen3_next = tiny_model_maker(
    transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig, vocab_size=VOCAB, hidden_size=64,
    intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[2],
    pad_token_id=0)
qwen3_next = checkpoint_fixture("qwen3_next", tiny_qwen3_next)


def test_qwen3_next_runs_like_transformers(qwen3_next):
    """Chunked prefill + decode is compared with the full forward to 1e-12 in fp64. (In fp32 the two differ by
    about 1.4e-5 relative on this randomised model: fp32 rounding of ~1e-7 per mixer, amplified by the model,
    whose own fp32 logits are 2e-5 from its fp64 logits in transformers too.)"""
    hf, ours, _ = qwen3_next
    assert ours.config.layer_types == ["gated_deltanet"] * 3 + ["attention"]
    assert ours.config.mlp_types == ["moe", "moe", "dense", "moe"]
    assert ours.config.partial_rotary_factor == 0.25
    check_all(hf, ours, VOCAB, length=21, float64_continuation=True)


def test_export_round_trip(qwen3_next, tmp_path):
    """Every tensor comes back bit for bit, except the norms that Qwen3-Next scales by ``1 + weight``: we hold
    ``1 + weight``, so ``(w + 1) - 1`` returns ``w`` to within half an ulp of ``1 + w`` (fp32 rounding)."""
    _, ours, directory = qwen3_next
    ours.save_pretrained(tmp_path, format="qwen3_next")
    original, exported = (load_file(d / "model.safetensors") for d in (directory, tmp_path))
    assert sorted(original) == sorted(exported)
    offset = [name for name in original if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight"))
              or name == "model.norm.weight"]
    assert len(offset) == 2 * 4 + 2 + 1
    for name in original:
        if name in offset:
            assert (original[name] - exported[name]).abs().max() <= 0.5 * torch.finfo(torch.float32).eps * (
                1 + original[name]).abs().max(), name
        else:
            assert torch.equal(original[name], exported[name]), name
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(back, transformers.Qwen3NextForCausalLM)
    check_logits(back, ours, random_ids(VOCAB, 2, 19))


def test_hybridlm_model_exports_to_qwen3_next(tmp_path):
    config = hybridlm.HybridConfig(
        vocab_size=VOCAB, hidden_size=32, layer_pattern="DDA", intermediate_size=48, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, partial_rotary_factor=0.5, attention_qk_norm=True,
        attention_output_gate=True, deltanet_num_key_heads=1, deltanet_num_value_heads=3, deltanet_key_head_dim=8,
        deltanet_value_head_dim=4, mlp_types=["dense", "moe", "moe"], num_experts=3, moe_intermediate_size=16,
        shared_expert_intermediate_size=8, moe_shared_expert_gate=True, moe_renormalize=True)
    ours = randomize(hybridlm.HybridForCausalLM(config).eval(), seed=3)
    assert check_export(ours, tmp_path, "qwen3_next").config.mlp_only_layers == [0]


def test_export_refuses_what_qwen3_next_cannot_hold(tmp_path):
    config = hybridlm.HybridConfig(vocab_size=VOCAB, hidden_size=32, layer_pattern="DAC", num_attention_heads=2,
                                   deltanet_key_head_dim=8, deltanet_value_head_dim=8)
    message = export_refusal(hybridlm.HybridForCausalLM(config), tmp_path, "qwen3_next")
    assert re.search(r"\['short_conv'\].*attention_qk_norm", message), message
