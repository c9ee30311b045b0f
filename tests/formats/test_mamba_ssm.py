"""mamba-ssm's own checkpoints (config.json with d_model/n_layer/ssm_cfg/attn_cfg, pytorch_model.bin).

mamba-ssm has no transformers class, so each checkpoint is written here in mamba-ssm's layout from a source model
(transformers' Mamba / Mamba-2, or a hybridlm hybrid with attention and MLPs), and the loaded model must give the
source's logits.
"""

import json

import pytest
import torch
import transformers

import hybridlm

from .compare import check_continuation, check_greedy, check_logits, random_ids, randomize

VOCAB = 256


def write_mamba_ssm(directory, state: dict, config: dict) -> None:
    directory.mkdir(exist_ok=True)
    torch.save(state, directory / "pytorch_model.bin")
    (directory / "config.json").write_text(json.dumps(config))


def from_transformers(hf) -> dict:
    """transformers' Mamba and Mamba-2 names are mamba-ssm's, except the embedding."""
    return {name.replace("backbone.embeddings.", "backbone.embedding."): tensor
            for name, tensor in hf.state_dict().items()}


def from_hybridlm(model) -> dict:
    """mamba-ssm's names and fused layouts for a hybridlm model of Mamba-2, attention and dense-MLP layers."""
    state = {"backbone.embedding.weight": model.model.embed_tokens.weight, "lm_head.weight": model.lm_head.weight,
             "backbone.norm_f.weight": model.model.norm.weight}
    for i, block in enumerate(model.model.layers):
        prefix = f"backbone.layers.{i}."
        state[prefix + "norm.weight"] = block.input_layernorm.weight
        state[prefix + "norm2.weight"] = block.pre_mlp_layernorm.weight
        state[prefix + "mlp.fc1.weight"] = torch.cat([block.mlp.up_proj.weight, block.mlp.gate_proj.weight])
        state[prefix + "mlp.fc2.weight"] = block.mlp.down_proj.weight
        mixer = block.mixer
        if block.mixer_type == "attention":
            for part in ("weight", "bias"):
                qkv = [getattr(getattr(mixer, proj), part) for proj in ("q_proj", "k_proj", "v_proj")]
                state[prefix + f"mixer.in_proj.{part}"] = torch.cat(qkv)
                state[prefix + f"mixer.out_proj.{part}"] = getattr(mixer.o_proj, part)
        else:
            state.update({prefix + "mixer." + name: tensor for name, tensor in mixer.state_dict().items()})
    return {name: tensor.detach().clone() for name, tensor in state.items()}


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_pure_ssm_checkpoint_runs_like_transformers(layer, tmp_path):
    torch.manual_seed(0)
    if layer == "Mamba1":
        hf_config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=8,
                                             time_step_rank=6)
        hf = transformers.MambaForCausalLM(hf_config)
        ssm_cfg = {"d_state": 8, "dt_rank": 6}
    else:
        hf_config = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=8,
                                              num_heads=8, head_dim=16, n_groups=2, chunk_size=8)
        hf = transformers.Mamba2ForCausalLM(hf_config)
        ssm_cfg = {"layer": "Mamba2", "d_state": 8, "headdim": 16, "ngroups": 2, "chunk_size": 8}
    hf = randomize(hf.eval())
    # vocab_size 250 is padded to a multiple of 8: the 256 rows the weights have.
    write_mamba_ssm(tmp_path, from_transformers(hf), {
        "d_model": 64, "n_layer": 2, "vocab_size": 250, "ssm_cfg": ssm_cfg, "rms_norm": True,
        "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8,
        "tie_embeddings": hf_config.tie_word_embeddings,
    })
    ours = hybridlm.HybridForCausalLM.from_pretrained(tmp_path)
    assert ours.config.vocab_size == VOCAB
    ids = random_ids(VOCAB, 2, 13)
    check_logits(hf, ours, ids)
    check_greedy(hf, ours, ids[:1, :7])
    check_continuation(ours, ids)


def test_hybrid_checkpoint_with_attention_and_mlps(tmp_path):
    """Mamba-2 + GQA attention (fused qkv with biases, half-head RoPE, its own softmax scale) + gated MLPs
    (d_intermediate 100, rounded up to 128 as mamba-ssm does)."""
    config = hybridlm.HybridConfig(
        vocab_size=VOCAB, hidden_size=64, layer_types=["mamba2", "attention", "mamba2"], intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True, partial_rotary_factor=0.5,
        attention_scale=0.3, rms_norm_eps=1e-5, mamba2_head_dim=16, mamba2_n_groups=2, mamba2_d_state=8,
        mamba2_chunk_size=8, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    source = randomize(hybridlm.HybridForCausalLM(config).eval())
    write_mamba_ssm(tmp_path, from_hybridlm(source), {
        "d_model": 64, "d_intermediate": 100, "n_layer": 3, "vocab_size": VOCAB,
        "ssm_cfg": {"layer": "Mamba2", "d_state": 8, "headdim": 16, "ngroups": 2, "chunk_size": 8},
        "attn_layer_idx": [1], "attn_cfg": {"causal": True, "num_heads": 4, "num_heads_kv": 2, "rotary_emb_dim": 8,
                                                    "softmax_scale": 0.3},
        "rms_norm": True, "pad_vocab_size_multiple": 8, "tie_embeddings": True,
    })
    ours = hybridlm.HybridForCausalLM.from_pretrained(tmp_path)
    assert ours.config.layer_types == config.layer_types and ours.config.intermediate_size == 128
    ids = random_ids(VOCAB, 2, 13)
    check_logits(source, ours, ids)
    check_greedy(source, ours, ids[:1, :7])
    check_continuation(ours, ids)


@pytest.mark.parametrize("change, complaint", [
    (dict(ssm_cfg={"layer": "Mamba3"}), "ssm_cfg.layer='Mamba3' is not supported"),
    (dict(ssm_cfg={"d_stat": 8}), "unknown keys ['d_stat']"),
    (dict(rms_norm=False), "rms_norm=False"),
    (dict(attn_layer_idx=[0], attn_cfg={"num_heads": 2}), "causal=False"),
    (dict(attn_layer_idx=[0], attn_cfg={"num_heads": 2, "causal": True, "rotary_emb_interleaved": True}),
     "rotary_emb_interleaved=True"),
])
def test_settings_hybridlm_cannot_run_are_named(change, complaint, tmp_path):
    write_mamba_ssm(tmp_path, {}, {"d_model": 32, "n_layer": 2, "vocab_size": 64, **change})
    with pytest.raises(ValueError) as error:
        hybridlm.HybridForCausalLM.from_pretrained(tmp_path)
    assert complaint in str(error.value)
