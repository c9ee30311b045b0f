"""flash-linear-attention's ``mamba3`` checkpoints (``Mamba3ForCausalLM``; fla needs CUDA and Triton, so it is not
installed): each is written here from fla's parameter names and shapes (``fla/layers/mamba3.py``,
``fla/models/mamba3/modeling_mamba3.py``) with a ``config.json`` in fla's fields, loaded with ``hybridlm.load``,
and its logits compared with fla's model written out in float64 from those tensors alone (A = -softplus(dd_A),
``norm_eps`` in every norm, the token-by-token Mamba-3 recurrence); the export writes the same tensors back."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import hybridlm
from hybridlm.formats import detect
from tests.helpers import assert_close_rel
from tests.ops.test_mamba3 import recurrence

from .compare import check_continuation, random_ids

CONFIGS = {
    "siso": {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 16, "head_dim": 16,
             "chunk_size": 8},
    "norm-full-rope-groups-tied": {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 8,
                                   "head_dim": 16, "n_groups": 2, "rope_fraction": 1.0, "is_outproj_norm": True,
                                   "A_floor": 0.05, "tie_word_embeddings": True},
}
FLA_FIELDS = {"model_type": "mamba3", "architectures": ["Mamba3ForCausalLM"], "fuse_norm": True,
              "fuse_cross_entropy": True, "norm_eps": 1e-5, "expand": 2, "transformers_version": "4.57.1"}


def fla_config(variant: str, **changes) -> dict:
    return {**FLA_FIELDS, **CONFIGS[variant], **changes}


def fla_state(config: dict, seed: int = 0) -> dict:
    """A ``Mamba3ForCausalLM`` state dict by fla's names and shapes (``in_proj`` rows ``[z, x, B, C, dd_dt, dd_A,
    trap, angles]``), every tensor random."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    d, n, p = config["hidden_size"], config["state_size"], config["head_dim"]
    inner, groups = config["expand"] * d, config.get("n_groups", 1)
    heads, split = inner // p, int(n * config.get("rope_fraction", 0.5))
    angles = (split - split % 2) // 2
    shapes = {"in_proj.weight": (2 * inner + 2 * n * groups + 3 * heads + angles, d), "dt_bias": (heads,),
              "B_bias": (heads, 1, n), "C_bias": (heads, 1, n), "B_norm.weight": (n,), "C_norm.weight": (n,),
              "D": (heads,), "out_proj.weight": (d, inner)}
    if config.get("is_outproj_norm"):
        shapes["norm.weight"] = (inner,)
    state = {"backbone.embeddings.weight": r(config["vocab_size"], d), "backbone.norm_f.weight": 1 + r(d)}
    for i in range(config["num_hidden_layers"]):
        state[f"backbone.layers.{i}.norm.weight"] = 1 + r(d)
        for name, shape in shapes.items():
            shift = 1 if name.endswith(("norm.weight", "bias")) else 0
            state[f"backbone.layers.{i}.mixer.{name}"] = r(*shape) + shift
    tied = config.get("tie_word_embeddings")
    state["lm_head.weight"] = state["backbone.embeddings.weight"].clone() if tied else r(config["vocab_size"], d)
    return state


def fla_logits(state: dict, config: dict, ids: torch.Tensor) -> torch.Tensor:
    """fla's ``Mamba3ForCausalLM`` forward in float64, from its tensors and config only."""
    w = {name: t.double() for name, t in state.items()}
    eps, n, p = config["norm_eps"], config["state_size"], config["head_dim"]
    groups, inner = config.get("n_groups", 1), config["expand"] * config["hidden_size"]
    heads, split = inner // p, int(n * config.get("rope_fraction", 0.5))
    a = (split - split % 2) // 2

    def rms(x, weight):
        return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * weight

    h = w["backbone.embeddings.weight"][ids]
    b, t = ids.shape
    for i in range(config["num_hidden_layers"]):
        m = {name.split(".mixer.")[1]: v for name, v in w.items() if name.startswith(f"backbone.layers.{i}.mixer.")}
        u = rms(h, w[f"backbone.layers.{i}.norm.weight"]) @ m["in_proj.weight"].T
        z, x, B, C, dd_dt, dd_a, trap, angles = u.split([inner, inner, n * groups, n * groups, heads, heads, heads,
                                                         a], -1)
        dt = F.softplus(dd_dt + m["dt_bias"])
        inp = dict(q=rms(C.view(b, t, 1, groups, n), m["C_norm.weight"]),
                   k=rms(B.view(b, t, 1, groups, n), m["B_norm.weight"]), v=x.view(b, t, heads, p),
                   log_decay=torch.clamp(-F.softplus(dd_a), max=-config.get("A_floor", 1e-4)) * dt, dt=dt, trap=trap,
                   angles=angles[:, :, None].expand(b, t, heads, a), q_bias=m["C_bias"], k_bias=m["B_bias"],
                   D=m["D"], z=z.view(b, t, heads, p), norm_weight=m.get("norm.weight"))
        zero = tuple(torch.zeros(*shape, dtype=torch.float64)
                     for shape in ((heads, a), (heads, p, n), (1, heads, n), (heads, p)))
        timed = {"q", "k", "v", "log_decay", "dt", "trap", "angles", "z"}
        y = torch.stack([recurrence({key: (v[row] if key in timed else v) for key, v in inp.items()}, zero,
                                    "interleaved", False)[0] for row in range(b)])
        h = h + y.reshape(b, t, inner) @ m["out_proj.weight"].T
    return rms(h, w["backbone.norm_f.weight"]) @ w["lm_head.weight"].T


def write_fla(directory, state: dict, config: dict) -> None:
    directory.mkdir(exist_ok=True)
    save_file({name: t.contiguous() for name, t in state.items()}, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_fla_checkpoint_loads_runs_and_exports(variant, tmp_path):
    """fla's names and shapes load into ``mamba3`` layers with fla's A, and the model gives fla's logits; the export
    writes back the same tensors under the same names and a config of fla's fields that loads to the same logits."""
    config = fla_config(variant)
    state = fla_state(config)
    write_fla(tmp_path / "in", state, config)
    ours = hybridlm.load(tmp_path / "in").eval()
    c = ours.config
    assert set(c.layer_types) == {"mamba3"} and set(c.mlp_types) == {"none"}
    assert (c.mamba3_a_activation, c.mamba3_mimo, c.mamba3_outproj_norm) == ("softplus", False, "norm" in variant)
    ids = random_ids(config["vocab_size"], 2, 11)
    with torch.no_grad():
        got = ours(ids).logits
    assert_close_rel(got.double(), fla_logits(state, config, ids), rel=1e-4)
    check_continuation(ours, ids, rel=1e-4)  # fp32 rounding of the chunked scan against the decode step

    ours.save_pretrained(tmp_path / "out", format="mamba3")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {key: written[key] for key in config if key != "transformers_version"} == \
        {key: value for key, value in config.items() if key != "transformers_version"}
    assert written["num_heads"] == config["expand"] * config["hidden_size"] // config["head_dim"]
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert set(exported) == set(state)
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name
    again = hybridlm.load(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, got)


def test_mamba_ssms_embedding_name_is_accepted(tmp_path):
    config = fla_config("siso")
    state = fla_state(config)
    state["backbone.embedding.weight"] = state.pop("backbone.embeddings.weight")  # fla's load hook renames it
    write_fla(tmp_path, state, config)
    ours = hybridlm.load(tmp_path)
    assert torch.equal(ours.model.embed_tokens.weight, state["backbone.embedding.weight"])


@pytest.mark.parametrize(("change", "complaint"), [
    ({"is_mimo": True, "mimo_rank": 2}, "is_mimo=True"),
    ({"use_bias": True}, "use_bias=True"),
    ({"norm_eps": 1e-6}, "norm_eps=1e-06"),
    ({"expand": 1.5}, "expand=1.5 is not a whole number"),
    ({"num_heads": 3}, "num_heads=3 but expand * hidden_size / head_dim = 4"),
    ({"rope_fraction": 0.25}, "mamba3_rope_fraction=0.25"),
    ({"ssm_cfg": {"layer": "Mamba3"}}, "keys fla's Mamba3Config does not take: ['ssm_cfg']"),
])
def test_settings_hybridlm_cannot_run_are_named(change, complaint):
    config = fla_config("siso", **change)
    with pytest.raises(ValueError) as error:
        detect(config).to_config(config)
    assert complaint in str(error.value)


def test_another_mamba3_is_not_read_as_fla():
    """Detection is by model_type and fla's own fields: a ``mamba3`` config without any of them is refused."""
    config = {"model_type": "mamba3", **CONFIGS["siso"]}
    with pytest.raises(ValueError, match="without any of flash-linear-attention's own fields"):
        detect(config).to_config(config)


def test_bad_weights_are_named(tmp_path):
    config = fla_config("norm-full-rope-groups-tied")
    state = fla_state(config)
    state["lm_head.weight"] = state["lm_head.weight"] + 1  # tied by the config, but not in the file
    write_fla(tmp_path / "tied", state, config)
    with pytest.raises(ValueError, match="tie_word_embeddings=True, but lm_head.weight differs"):
        hybridlm.load(tmp_path / "tied")
    state = fla_state(config)
    state["backbone.layers.1.mixer.B_bias"] = state["backbone.layers.1.mixer.B_bias"][:, 0]
    write_fla(tmp_path / "shape", state, config)
    with pytest.raises(ValueError, match=r"model.layers.1.mixer.B_bias: checkpoint \(4, 8\) vs model \(4, 1, 8\)"):
        hybridlm.load(tmp_path / "shape")


def test_export_names_what_fla_cannot_hold(tmp_path):
    def model(**settings):
        return hybridlm.HybridForCausalLM(hybridlm.HybridConfig(
            vocab_size=64, hidden_size=32, mamba3_d_state=8, mamba3_head_dim=16, **settings))

    with pytest.raises(ValueError, match=r"mamba3_a_activation='heavy_tail' \(fla's A is -softplus"):
        model(layer_types=["mamba3"]).save_pretrained(tmp_path, format="mamba3")
    with pytest.raises(ValueError, match=r"layers \[1\] are not.*mamba3_mimo=True"):
        model(layer_types=["mamba3", "attention"], mamba3_a_activation="softplus", mamba3_mimo=True,
              mamba3_mimo_rank=2).save_pretrained(tmp_path, format="mamba3")
