"""Kimi Delta Attention: the mixer against a literal float64 token-by-token implementation of its formula, the
chunked op under strong channel-wise decays, and its configuration errors."""

import pytest
import torch
import torch.nn.functional as F

from hybridlm.mixers import MIXERS
from hybridlm.ops.delta_rule import gated_delta_rule_ref
from tests.helpers import assert_close_rel, tiny_config
from tests.mixers.test_mixers import build
from tests.ops.test_delta_rule import naive_delta_rule, random_inputs

SIZES = dict(deltanet_num_key_heads=2, deltanet_key_head_dim=8, deltanet_value_head_dim=6, deltanet_conv_size=3,
             deltanet_chunk_size=4)


def literal_kda(mixer, x):
    """KDA written out per token in float64 from the mixer's weights: S = diag(exp g) S; S += beta k (v - S^T k)^T."""
    p = {name: t.double() for name, t in mixer.state_dict().items()}
    heads, dk, dv = mixer.heads, mixer.dim_k, mixer.dim_v
    x = x.double()
    qkv = torch.cat([x @ p["q_proj.weight"].T, x @ p["k_proj.weight"].T, x @ p["v_proj.weight"].T], -1)
    width = p["conv1d.weight"].shape[-1]
    padded = F.pad(qkv, (0, 0, width - 1, 0))
    conv = sum(padded[:, i:i + x.shape[1]] * p["conv1d.weight"][:, 0, i] for i in range(width))
    q, k, v = F.silu(conv).split([heads * dk, heads * dk, heads * dv], -1)
    S = torch.zeros(x.shape[0], heads, dk, dv, dtype=torch.float64)
    outs = []
    for t in range(x.shape[1]):
        qt, kt = (u[:, t].view(-1, heads, dk) for u in (q, k))
        qt, kt = (u / (u.square().sum(-1, keepdim=True) + 1e-6).sqrt() for u in (qt, kt))  # fla's L2 norm
        vt = v[:, t].view(-1, heads, dv)
        g = -p["A_log"].exp()[:, None] * F.softplus(
            (x[:, t] @ p["f_a_proj.weight"].T @ p["f_b_proj.weight"].T + p["dt_bias"]).view(-1, heads, dk))
        beta = torch.sigmoid(x[:, t] @ p["b_proj.weight"].T)[..., None]  # [b, heads, 1]
        S = S * g.exp()[..., None]
        S = S + kt[..., None] * (beta * (vt - torch.einsum("bhk,bhkv->bhv", kt, S)))[..., None, :]
        o = torch.einsum("bhk,bhkv->bhv", qt * dk**-0.5, S)
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + mixer.o_norm.eps) * p["o_norm.weight"]
        gate = (x[:, t] @ p["g_a_proj.weight"].T @ p["g_b_proj.weight"].T).view(-1, heads, dv)
        outs.append((o * torch.sigmoid(gate)).flatten(1) @ p["o_proj.weight"].T)
    return torch.stack(outs, 1)


def test_mixer_equals_its_literal_formula():
    mixer, config = build("kda", **SIZES)
    with torch.no_grad():
        for name in ("o_norm.weight", "dt_bias"):
            mixer.get_parameter(name).add_(torch.randn(mixer.get_parameter(name).shape) * 0.3)
        x = torch.randn(2, 11, config.hidden_size, generator=torch.Generator().manual_seed(1))
        expected = literal_kda(mixer, x)
        assert expected.abs().max() > 0
        assert_close_rel(mixer.double()(x.double()), expected, rel=1e-12)


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_op_under_strong_channelwise_decay(chunk):
    """Per-channel log decays down to -30 per token (A up to 16, as Kimi initialises): the fp32 chunked form
    stays within 1e-5 of the float64 recurrence and nothing overflows."""
    q, k, v, _, beta, S0 = random_inputs(1, 150, 2, 1, 16, 8, True, seed=4)
    log_gate = -torch.rand(1, 150, 2, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64) ** 3 * 30
    o, S = gated_delta_rule_ref(*(t.float() for t in (q, k, v, log_gate, beta)), initial_state=S0.float(),
                                chunk_size=chunk)
    o_naive, S_naive = naive_delta_rule(q, k, v, log_gate, beta, 16**-0.5, S0)
    assert torch.isfinite(o).all() and o_naive.abs().max() > 0
    assert_close_rel(o, o_naive, rel=1e-5)
    assert_close_rel(S, S_naive, rel=1e-5)


def test_value_heads_must_equal_key_heads():
    with pytest.raises(ValueError, match=r"deltanet_num_value_heads=4 is invalid: kda layers need as many value"):
        tiny_config(layer_types=["kda"], deltanet_num_key_heads=2, deltanet_num_value_heads=4)
    assert MIXERS["kda"].pattern_letter == "K"


def test_a_kda_cache_crops_to_any_token_of_a_block():
    """Rollback (speculative decoding): the per-token states KDA keeps make a crop exact."""
    from tests.cache.test_rollback import check_rollback
    from tests.helpers import random_ids, tiny_model

    model = tiny_model(1, layer_pattern="KA", **SIZES)
    check_rollback(model, random_ids(2, 5, seed=1), random_ids(2, 4, seed=2), random_ids(2, 2, seed=3))
