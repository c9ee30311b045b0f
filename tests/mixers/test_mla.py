"""Multi-head latent attention: against attention written out in float64 from its weights, its options under
the contract (continuation equals the parallel form), and a cache that holds the latent only."""

import pytest
import torch

from tests.helpers import assert_close_rel
from tests.mixers.test_mixers import build, run_in_pieces

SIZES = dict(num_attention_heads=3, mla_kv_lora_rank=12, mla_qk_nope_head_dim=8, mla_qk_rope_head_dim=4,
             mla_v_head_dim=6)


def rotate(x, positions, theta):
    """Rotate-half RoPE on the whole last dim, in float64."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angles = positions[..., None].double() * inv  # [batch, time, half]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def literal_mla(mixer, config, x):
    """Causal softmax attention with each head's key [k_nope | k_rot] and value from the latent, in float64."""
    p = {name: t.double() for name, t in mixer.state_dict().items()}
    heads, nope, rope, rank = mixer.heads, mixer.nope, mixer.rope, mixer.rank
    x = x.double()
    batch, time, _ = x.shape
    positions = torch.arange(time).expand(batch, time)
    if "q_proj.weight" in p:
        q = x @ p["q_proj.weight"].T
    else:
        a = x @ p["q_a_proj.weight"].T
        q = a * torch.rsqrt(a.square().mean(-1, keepdim=True) + 1e-6) * p["q_a_layernorm.weight"]
        q = q @ p["q_b_proj.weight"].T
    q = q.view(batch, time, heads, nope + rope)
    ckv = x @ p["kv_a_proj_with_mqa.weight"].T
    c, k_rot = ckv[..., :rank], ckv[..., rank:]
    c = c * torch.rsqrt(c.square().mean(-1, keepdim=True) + 1e-6) * p["kv_a_layernorm.weight"]
    if config.mla_rope:
        q = torch.cat([q[..., :nope], rotate(q[..., nope:], positions[..., None, :].transpose(1, 2),
                                             config.rope_theta)], -1)
        k_rot = rotate(k_rot, positions, config.rope_theta)
    kv = (c @ p["kv_b_proj.weight"].T).view(batch, time, heads, -1)
    k = torch.cat([kv[..., :nope], k_rot[:, :, None].expand(-1, -1, heads, -1)], -1)
    v = kv[..., nope:]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (nope + rope) ** -0.5
    scores = scores.masked_fill(~torch.ones(time, time, dtype=torch.bool).tril(), -torch.inf)
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(batch, time, -1)
    return out @ p["o_proj.weight"].T


@pytest.mark.parametrize("latent_form", [False, True])
@pytest.mark.parametrize("overrides", [dict(mla_rope=False), dict(mla_rope=True, mla_q_lora_rank=10)])
def test_mla_equals_attention_written_out(overrides, latent_form):
    """Both forms of the attention (expanded keys and values; absorbed, in latent space) against the literal."""
    mixer, config = build("mla", **SIZES, **overrides)
    mixer.latent_attention = latent_form
    with torch.no_grad():
        for name, t in mixer.named_parameters():
            if name.endswith("layernorm.weight"):
                t.add_(torch.randn(t.shape) * 0.3)
        x = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(3))
        expected = literal_mla(mixer, config, x)
        # the RoPE angles are computed in fp32 whatever the dtype (as transformers does): ~1e-9 of rounding
        assert_close_rel(mixer.double()(x.double()), expected, rel=1e-7 if config.mla_rope else 1e-12)


@pytest.mark.parametrize("overrides", [dict(mla_rope=True, mla_q_lora_rank=10, attention_bias=True),
                                       dict(mla_rope=False, mla_qk_nope_head_dim=0)])
def test_options_keep_decode_equal_to_the_parallel_form(overrides):
    mixer, config = build("mla", **{**SIZES, **overrides})
    x = torch.randn(2, 11, config.hidden_size, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        full = mixer(x)
        stepped, state = run_in_pieces(mixer, x, [4, 7] + list(range(8, 11)))
    assert_close_rel(stepped, full)
    width = config.mla_kv_lora_rank + config.mla_qk_rope_head_dim
    assert state.nbytes() == 2 * (11 * width * 4 + 8) == state.predicted_nbytes(11)
    assert state.describe() == (("latent", width, torch.float32),)


def test_the_cache_holds_the_latent_and_can_roll_back():
    mixer, config = build("mla", **SIZES)
    state = mixer.init_state(1, max_length=4)
    x = torch.randn(1, 7, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = mixer(x)
        mixer(x[:, :5], state)
        assert state.reserved_nbytes() > state.nbytes()  # grown past the preallocation, by half
        assert state.rewind_blocker(6) is not None and state.rewind_blocker(2) is None
        state.rewind(2)
        assert_close_rel(mixer(x[:, 3:], state), full[:, 3:])
    with pytest.raises(ValueError, match="values=None"):
        state.update(torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, 16), None, None, None)


def test_bad_config_names_the_field():
    from tests.helpers import tiny_config

    with pytest.raises(ValueError, match="mla_qk_rope_head_dim=3 is invalid: must be even"):
        tiny_config(layer_types=["mla"], mla_qk_rope_head_dim=3)
