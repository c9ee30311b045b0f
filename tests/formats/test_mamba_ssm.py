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
    (dict(ssm_cfg={"layer": "Mamba4"}), "ssm_cfg.layer='Mamba4' is not supported (supported: ['Mamba1', 'Mamba2', "
                                        "'Mamba3'])"),
    (dict(ssm_cfg={"layer": "Mamba3", "rope_fraction": 0.25}), "mamba3_rope_fraction=0.25 is invalid"),
    (dict(ssm_cfg={"layer": "Mamba3", "d_state": 2}), "mamba3_d_state=2 is invalid: is too small for any rotary"),
    (dict(ssm_cfg={"layer": "Mamba3", "is_mimo": True, "mimo_rank": 0}), "mamba3_mimo_rank=0 is invalid"),
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


def mamba3_state(config: dict, seed: int = 0) -> dict:
    """A ``MambaLMHeadModel`` state dict with ``ssm_cfg={"layer": "Mamba3", ...}``, built from mamba-ssm's parameter
    names and shapes (``Mamba3.__init__``: ``in_proj`` rows ``[z, x, B, C, dd_dt, dd_A, trap, angle]``), random."""
    g = torch.Generator().manual_seed(seed)
    ssm, d = config["ssm_cfg"], config["d_model"]
    n, p, groups = ssm.get("d_state", 128), ssm.get("headdim", 64), ssm.get("ngroups", 1)
    inner = ssm.get("expand", 2) * d
    heads, rank = inner // p, ssm.get("mimo_rank", 4) if ssm.get("is_mimo") else 1
    split = int(n * ssm.get("rope_fraction", 0.5))
    angles = (split - split % 2) // 2
    shapes = {"in_proj.weight": (2 * inner + 2 * n * groups * rank + 3 * heads + angles, d), "dt_bias": (heads,),
              "B_bias": (heads, rank, n), "C_bias": (heads, rank, n), "B_norm.weight": (n,), "C_norm.weight": (n,),
              "D": (heads,), "out_proj.weight": (d, inner)}
    if ssm.get("is_mimo"):
        shapes.update({name: (heads, rank, p) for name in ("mimo_x", "mimo_z", "mimo_o")})
    if ssm.get("is_outproj_norm"):
        shapes["norm.weight"] = (inner,)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    multiple = config.get("pad_vocab_size_multiple", 8)
    vocab = -(-config["vocab_size"] // multiple) * multiple
    state = {"backbone.embedding.weight": r(vocab, d), "backbone.norm_f.weight": 1 + r(d)}
    for i in range(config["n_layer"]):
        prefix = f"backbone.layers.{i}."
        state[prefix + "norm.weight"] = 1 + r(d)
        for name, shape in shapes.items():
            state[prefix + "mixer." + name] = r(*shape) + (1 if name.endswith(("norm.weight", "bias")) else 0)
        if config.get("d_intermediate"):
            state[prefix + "norm2.weight"] = 1 + r(d)
            state[prefix + "mlp.fc1.weight"] = r(2 * config["d_intermediate"], d)  # (a multiple of 128 already)
            state[prefix + "mlp.fc2.weight"] = r(d, config["d_intermediate"])
    state["lm_head.weight"] = state["backbone.embedding.weight"]
    return state


MAMBA3_CONFIGS = {
    "siso": {"d_model": 32, "n_layer": 2, "vocab_size": 250, "ssm_cfg": {
        "layer": "Mamba3", "d_state": 16, "headdim": 16, "ngroups": 2, "chunk_size": 8}},
    "mimo-norm-mlp": {"d_model": 32, "n_layer": 2, "vocab_size": 256, "d_intermediate": 128, "ssm_cfg": {
        "layer": "Mamba3", "d_state": 8, "headdim": 16, "rope_fraction": 1.0, "is_mimo": True, "mimo_rank": 2,
        "is_outproj_norm": True, "chunk_size": 16, "fuse_pregate_headwise_norm": False}},
}


@pytest.mark.parametrize("variant", list(MAMBA3_CONFIGS))
def test_mamba3_checkpoint_loads_runs_and_exports(variant, tmp_path):
    """mamba-ssm's names and shapes load into ``mamba3`` layers, each of which computes mamba-ssm's ``Mamba3``
    forward (written out in float64); the export writes back the same tensors under the same names, a config
    ``MambaConfig`` takes, and loads again to the same logits."""
    from tests.mixers.test_mamba3 import written_out

    config = MAMBA3_CONFIGS[variant]
    state = mamba3_state(config)
    write_mamba_ssm(tmp_path / "in", state, config)
    ours = hybridlm.HybridForCausalLM.from_pretrained(tmp_path / "in").eval()
    assert set(ours.config.layer_types) == {"mamba3"} and ours.config.mamba3_mimo == ("mimo" in variant)
    ids = random_ids(256, 2, 11)
    with torch.no_grad():
        hidden = ours.model.embed_tokens(ids)
        mixer = ours.model.layers[0].mixer
        assert torch.equal(mixer.in_proj.weight, state["backbone.layers.0.mixer.in_proj.weight"])
        x = ours.model.layers[0].input_layernorm(hidden)
        got, expected = mixer(x).double(), written_out(mixer, x)
        assert ((got - expected).abs().max() / expected.abs().max()) < 1e-5
    check_continuation(ours, ids)

    ours.save_pretrained(tmp_path / "out", format="mamba_ssm")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert set(written) <= {"d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx",
                            "attn_cfg", "rms_norm", "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple",
                            "tie_embeddings"}  # MambaConfig's fields, nothing else
    exported = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert set(exported) == set(state)
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name
    again = hybridlm.HybridForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ours(ids).logits)


def test_mamba3_mimo_without_its_weights_is_named(tmp_path):
    config = MAMBA3_CONFIGS["mimo-norm-mlp"]
    state = {k: v for k, v in mamba3_state(config).items() if not k.endswith(("mimo_x", "mimo_o"))}
    write_mamba_ssm(tmp_path, state, config)
    with pytest.raises(ValueError, match=r"ssm_cfg.is_mimo=True, but layer 0 has no MIMO weights "
                                         r"\(backbone.layers.0.mixer.mimo_x, backbone.layers.0.mixer.mimo_o\)"):
        hybridlm.HybridForCausalLM.from_pretrained(tmp_path)


def test_export_names_what_mamba_ssm_cannot_hold(tmp_path):
    model = hybridlm.HybridForCausalLM(hybridlm.HybridConfig(
        vocab_size=64, hidden_size=32, layer_types=["mamba3", "mamba2"], mamba3_d_state=8, mamba3_head_dim=16,
        mamba2_head_dim=16, mamba2_d_state=8))
    with pytest.raises(ValueError, match="mamba-ssm stacks one SSM kind"):
        model.save_pretrained(tmp_path, format="mamba_ssm")
    model = hybridlm.HybridForCausalLM(hybridlm.HybridConfig(
        vocab_size=64, hidden_size=32, layer_types=["mamba3"], mamba3_d_state=8, mamba3_head_dim=16,
        rms_norm_eps=1e-6))
    with pytest.raises(ValueError, match=r"rms_norm_eps=1e-06 \(mamba-ssm would give 1e-05\)"):
        model.save_pretrained(tmp_path, format="mamba_ssm")
