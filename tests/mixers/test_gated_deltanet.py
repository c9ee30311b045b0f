"""Gated DeltaNet and LFM2's short convolution beyond the generic contract tests of test_mixers.py: against
transformers' own modules, with value heads grouped over key heads, and their configuration errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Lfm2Config, Qwen3NextConfig
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from hybridlm.mixers import MIXERS
from hybridlm.mixers.segments import Segments
from tests.helpers import assert_close_rel, tiny_config
from tests.mixers.test_mixers import run_in_pieces

GROUPED = dict(deltanet_num_key_heads=2, deltanet_num_value_heads=6, deltanet_key_head_dim=8,
               deltanet_value_head_dim=4, deltanet_chunk_size=4)


def deltanet(seed=0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(layer_types=["gated_deltanet"], **{**GROUPED, **overrides})
    mixer = MIXERS["gated_deltanet"](config, 0)
    for name, value in mixer.initial_values().items():
        getattr(mixer, name).data.copy_(value)
    with torch.no_grad():  # a norm weight of ones would hide a wrong norm layout
        mixer.norm.weight.uniform_(0.5, 1.5)
    return mixer.eval(), config


def interleave_per_key_head(blocks, key_heads):
    """Qwen3-Next's fused layout: for each key head, its rows of every block in turn."""
    return torch.cat([b.unflatten(0, (key_heads, -1)) for b in blocks], dim=1).flatten(0, 1)


def transformers_deltanet(mixer, config):
    hf_config = Qwen3NextConfig(
        hidden_size=config.hidden_size, linear_num_key_heads=config.deltanet_num_key_heads,
        linear_num_value_heads=config.deltanet_num_value_heads, linear_key_head_dim=config.deltanet_key_head_dim,
        linear_value_head_dim=config.deltanet_value_head_dim, linear_conv_kernel_dim=config.deltanet_conv_size,
        rms_norm_eps=config.rms_norm_eps, num_hidden_layers=1, layer_types=["linear_attention"],
    )
    hf = Qwen3NextGatedDeltaNet(hf_config, 0).eval()
    keys, values = mixer.key_dim, mixer.value_dim
    heads = config.deltanet_num_key_heads
    qkvz, ba = mixer.in_proj_qkvz.weight.split([keys, keys, values, values]), mixer.in_proj_ba.weight.chunk(2)
    weights = {**mixer.state_dict(), "in_proj_qkvz.weight": interleave_per_key_head(qkvz, heads),
               "in_proj_ba.weight": interleave_per_key_head(ba, heads)}  # the other names are the same
    hf.load_state_dict({name: w.detach().clone() for name, w in weights.items()})
    return hf


@pytest.mark.parametrize("length", [1, 5, 19])
def test_deltanet_matches_transformers(length):
    mixer, config = deltanet()
    hf = transformers_deltanet(mixer, config)
    x = torch.randn(2, length, config.hidden_size, generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        expected = hf(x)
        assert expected.abs().max() > 0
        assert_close_rel(mixer(x), expected, rel=1e-5)


@settings(max_examples=12)
@given(length=st.integers(1, 17), cuts=st.lists(st.integers(1, 16), max_size=3), seed=st.integers(0, 100))
def test_grouped_heads_pieces_and_decode_equal_full_forward(length, cuts, seed):
    mixer, config = deltanet(seed)
    x = torch.randn(2, length, config.hidden_size, generator=torch.Generator().manual_seed(seed))
    prefix = sorted(c for c in set(cuts) if c < length)
    with torch.no_grad():
        full = mixer(x)
        stepped, state = run_in_pieces(mixer, x, prefix + list(range((prefix or [0])[-1] + 1, length)))
    assert_close_rel(stepped, full)
    assert state.ssm.dtype == torch.float32 and state.ssm.abs().max() > 0


def test_bfloat16_keeps_an_fp32_state():
    mixer, config = deltanet()
    mixer = mixer.to(torch.bfloat16)
    x = torch.randn(1, 9, config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        full = mixer(x)
        state = mixer.init_state(1, dtype=torch.bfloat16)
        stepped, state = run_in_pieces(mixer, x, [4, 5, 6, 7, 8])
    assert state.ssm.dtype == torch.float32 and full.dtype == torch.bfloat16
    assert_close_rel(stepped, full, rel=2e-2)


def test_short_conv_matches_transformers():
    torch.manual_seed(3)
    config = tiny_config(layer_types=["short_conv"], short_conv_bias=True)
    mixer = MIXERS["short_conv"](config, 0).eval()
    hf_config = Lfm2Config(hidden_size=config.hidden_size, conv_L_cache=config.short_conv_size, conv_bias=True,
                           num_hidden_layers=1, layer_types=["conv"])
    hf = Lfm2ShortConv(hf_config, 0).eval()
    hf.load_state_dict(mixer.state_dict())
    x = torch.randn(2, 11, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(x)
        assert expected.abs().max() > 0
        assert_close_rel(mixer(x), expected, rel=1e-5)


@pytest.mark.parametrize("overrides,field", [
    (dict(deltanet_num_key_heads=4, deltanet_num_value_heads=6), "deltanet_num_value_heads"),
    (dict(deltanet_key_head_dim=0), "deltanet_key_head_dim"),
    (dict(deltanet_conv_size=1.5), "deltanet_conv_size"),
])
def test_bad_deltanet_settings_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(layer_types=["gated_deltanet"], **overrides)


def test_unused_deltanet_settings_are_not_checked():
    tiny_config(layer_types=["attention"], deltanet_num_key_heads=4, deltanet_num_value_heads=6)


@pytest.mark.parametrize("kind", ["gated_deltanet", "short_conv"])
def test_packed_documents_equal_each_alone(kind):
    """Two rows of packed documents (segments): each document's output is that of the document run alone."""
    mixer, config = deltanet(1) if kind == "gated_deltanet" else (
        MIXERS["short_conv"](tiny_config(layer_types=["short_conv"], short_conv_bias=True), 0).eval(), tiny_config())
    seq_idx = torch.tensor([[0] * 5 + [1] * 9 + [2] * 2, [0] * 11 + [1] * 5])
    x = torch.randn(2, 16, config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        packed = mixer(x, segments=Segments.from_seq_idx(seq_idx))
        for row in range(2):
            for doc in seq_idx[row].unique():
                where = seq_idx[row] == doc
                alone = mixer(x[row : row + 1, where])
                assert alone.abs().max() > 0
                assert_close_rel(packed[row : row + 1, where], alone)
