"""Every mixer kind under the contract: stateful continuation equals the parallel form, padding leaves the
state untouched, and each state's size follows its formula."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridlm.mixers import MIXERS
from tests.helpers import assert_close_rel, tiny_config

KINDS = sorted(MIXERS)


def build(kind: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(layer_types=[kind], **overrides)
    mixer = MIXERS[kind](config, 0)
    # the model's initialiser sets these; a bare mixer gets them here
    for name, value in getattr(mixer, "initial_values", dict)().items():
        target = dict(mixer.named_parameters()).get(name)
        (target if target is not None else mixer.get_buffer(name)).data.copy_(value)
    return mixer.eval(), config


def run_in_pieces(mixer, x, splits, mask=None):
    state = mixer.init_state(x.shape[0])
    pieces, start = [], 0
    for stop in list(splits) + [x.shape[1]]:
        if stop <= start:
            continue
        piece_mask = mask[:, start:stop] if mask is not None else None
        pieces.append(mixer(x[:, start:stop], state, mask=piece_mask))
        start = stop
    return torch.cat(pieces, 1), state


@pytest.mark.parametrize("kind", KINDS)
@given(batch=st.integers(1, 3), length=st.integers(1, 24), cuts=st.lists(st.integers(1, 23), max_size=4),
       seed=st.integers(0, 1000))
def test_pieces_and_decode_equal_full_forward(kind, batch, length, cuts, seed):
    """Chunked prefill at random split points, then one token at a time, equals the parallel form."""
    mixer, config = build(kind, seed % 3)
    x = torch.randn(batch, length, config.hidden_size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full = mixer(x)
        prefix = sorted(c for c in cuts if c < length)
        decode_from = prefix[-1] if prefix else 0
        stepped, _ = run_in_pieces(mixer, x, prefix + list(range(decode_from + 1, length)))
    assert_close_rel(stepped, full)


@pytest.mark.parametrize("kind", KINDS)
def test_left_padding_leaves_state_untouched(kind):
    """A left-padded row gives, at its real tokens and in every later decode step, what it gives unpadded."""
    mixer, config = build(kind)
    g = torch.Generator().manual_seed(5)
    real, pad, extra = 7, 4, 5
    x = torch.randn(1, real + extra, config.hidden_size, generator=g)
    padded = torch.cat([torch.randn(1, pad, config.hidden_size, generator=g), x[:, :real]], 1)
    mask = torch.tensor([[False] * pad + [True] * real])
    positions = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.arange(real)[None]], 1)
    with torch.no_grad():
        alone_state = mixer.init_state(1)
        alone = mixer(x[:, :real], alone_state, positions=torch.arange(real)[None])
        padded_state = mixer.init_state(1)
        out = mixer(padded, padded_state, mask=mask, positions=positions)
        assert_close_rel(out[:, pad:], alone)
        for t in range(real, real + extra):
            step = x[:, t:t + 1]
            pos = torch.tensor([[t]])
            assert_close_rel(mixer(step, padded_state, positions=pos), mixer(step, alone_state, positions=pos))


@pytest.mark.parametrize("kind", KINDS)
def test_right_padding_in_parallel_form(kind):
    """Without a state, trailing padding does not change the real tokens' outputs."""
    mixer, config = build(kind)
    x = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    with torch.no_grad():
        out = mixer(x, mask=mask)
        assert_close_rel(out[1, :6], mixer(x[1:, :6])[0])
        assert_close_rel(out[0], mixer(x[:1])[0])


def expected_nbytes(kind, config, batch, tokens, element=4):
    """The size formulas of docs/cache.md, per kind."""
    if kind == "attention":
        return batch * (2 * config.num_key_value_heads * tokens * config.head_dim * element + 8)
    if kind == "mamba":
        inner = config.mamba_d_inner
        return batch * (inner * (config.mamba_d_conv - 1) * element + 4 * inner * config.mamba_d_state)
    if kind == "mamba2":
        conv = config.mamba2_d_inner + 2 * config.mamba2_n_groups * config.mamba2_d_state
        return batch * (conv * (config.mamba2_d_conv - 1) * element + 4 * config.mamba2_d_inner * config.mamba2_d_state)
    if kind == "mamba3":  # angles and the state in fp32; the previous token's keys (per rank) and x
        heads, dim, n = config.mamba3_expand * config.hidden_size // config.mamba3_head_dim, \
            config.mamba3_head_dim, config.mamba3_d_state
        angles, rank = int(n * config.mamba3_rope_fraction) // 2, config.mamba3_mimo_rank if config.mamba3_mimo else 1
        return batch * (4 * heads * (angles + dim * n) + (rank * heads * n + heads * dim) * element)
    if kind == "performer":
        return batch * 4 * config.num_attention_heads * ((config.head_dim + 1) * config.performer_num_features + 1)
    if kind == "linformer":
        return batch * (4 * 2 * config.num_attention_heads * config.linformer_rank * config.head_dim + 8)
    if kind in ("gated_deltanet", "kda"):  # the same state layout
        keys, values = config.deltanet_num_key_heads * config.deltanet_key_head_dim, \
            config.deltanet_num_value_heads * config.deltanet_value_head_dim
        return batch * ((2 * keys + values) * (config.deltanet_conv_size - 1) * element
                        + 4 * config.deltanet_num_value_heads * config.deltanet_key_head_dim
                        * config.deltanet_value_head_dim)
    if kind == "mla":  # one latent per token: kv_lora_rank + rope dims
        return batch * (tokens * (config.mla_kv_lora_rank + config.mla_qk_rope_head_dim) * element + 8)
    if kind == "short_conv":
        return batch * config.hidden_size * (config.short_conv_size - 1) * element
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_nbytes_formula(kind, dtype):
    mixer, config = build(kind)
    mixer = mixer.to(dtype)
    state = mixer.init_state(3, dtype=dtype)
    with torch.no_grad():
        mixer(torch.randn(3, 11, config.hidden_size, dtype=dtype), state)
    element = torch.empty(0, dtype=dtype).element_size()
    assert state.nbytes() == expected_nbytes(kind, config, 3, 11, element)


def test_sliding_window_attention():
    """Window W: each query sees its last W tokens; decode keeps W - 1 slots and matches the parallel form."""
    mixer, config = build("attention", sliding_window=4)
    x = torch.randn(2, 13, config.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = mixer(x)
        stepped, state = run_in_pieces(mixer, x, [5] + list(range(6, 13)))
        assert_close_rel(stepped, full)
        assert state.length == 3 and state.start == 10
        assert state.nbytes() == expected_nbytes("attention", config, 2, 3)
        unwindowed, _ = build("attention")
        for t in range(4):  # the first window tokens see everything before them
            assert_close_rel(full[:, t], unwindowed(x[:, : t + 1])[:, t])


def test_preallocated_kv_reports_used_and_reserved():
    mixer, config = build("attention")
    state = mixer.init_state(2, max_length=20)
    with torch.no_grad():
        mixer(torch.randn(2, 5, config.hidden_size), state)
    assert state.nbytes() == expected_nbytes("attention", config, 2, 5)
    assert state.reserved_nbytes() == expected_nbytes("attention", config, 2, 20)


@pytest.mark.parametrize("kind", KINDS)
def test_state_select_and_clone(kind):
    mixer, config = build(kind)
    x = torch.randn(3, 6, config.hidden_size, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        state = mixer.init_state(3)
        mixer(x, state)
        picked = state.select(torch.tensor([2, 0, 2]))
        copy = state.clone()
        step = torch.randn(3, 1, config.hidden_size)
        out = mixer(step, state, positions=torch.full((3, 1), 6))
        assert_close_rel(mixer(step[[2, 0, 2]], picked, positions=torch.full((3, 1), 6)), out[[2, 0, 2]])
        assert_close_rel(mixer(step, copy, positions=torch.full((3, 1), 6)), out)


def test_bidirectional_linformer_is_the_papers_form():
    mixer, config = build("linformer", linformer_causal=False)
    x = torch.randn(2, 7, config.hidden_size, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        out = mixer(x)
        q, k, v = (p(x).view(2, 7, config.num_attention_heads, -1).transpose(1, 2)
                   for p in (mixer.q_proj, mixer.k_proj, mixer.v_proj))
        keys = mixer.key_projection[:, :7] @ k  # E K
        values = mixer.value_projection[:, :7] @ v  # F V
        attn = torch.softmax(q @ keys.transpose(-1, -2) / config.head_dim**0.5, -1) @ values
        assert_close_rel(out, mixer.o_proj(attn.transpose(1, 2).reshape(2, 7, -1)))
        assert not torch.allclose(mixer(x[:, :3]), out[:, :3])  # every query sees the whole sequence
    with pytest.raises(ValueError, match="cannot decode|no state"):
        mixer.init_state(1)


def test_linformer_rejects_positions_past_its_projection():
    mixer, config = build("linformer")
    with pytest.raises(ValueError, match="linformer_max_length"):
        mixer(torch.randn(1, 2, config.hidden_size), positions=torch.tensor([[255, 256]]))


@pytest.mark.parametrize("kind, overrides", [
    ("attention", dict(num_key_value_heads=4)),  # MHA
    ("attention", dict(num_key_value_heads=1)),  # MQA
    ("attention", dict(partial_rotary_factor=0.5, rope_theta=500.0)),
    ("attention", dict(partial_rotary_factor=0.0, attention_bias=True)),
    ("attention", dict(sliding_window=3, num_key_value_heads=1)),
    ("mamba", dict(mamba_dt_norm=True)),
    ("mamba", dict(mamba_dt_norm=True, mamba_dt_norm_learnable=False, mamba_conv_bias=False, mamba_proj_bias=True)),
    ("mamba2", dict(mamba2_dt_limit=[0.01, 0.05], mamba2_n_groups=1)),
    ("mamba2", dict(mamba2_norm="norm_before_gate")),
    ("performer", dict(performer_num_features=5)),
    ("linformer", dict(linformer_rank=1)),
])
def test_options_keep_decode_equal_to_the_parallel_form(kind, overrides):
    mixer, config = build(kind, **overrides)
    x = torch.randn(2, 11, config.hidden_size, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        full = mixer(x)
        stepped, _ = run_in_pieces(mixer, x, [4, 7] + list(range(8, 11)))
    assert_close_rel(stepped, full)


def test_kv_capacity_grows_past_a_preallocation_and_geometrically():
    mixer, config = build("attention")
    x = torch.randn(1, 40, config.hidden_size, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        full = mixer(x)
        state = mixer.init_state(1, max_length=8)
        pieces = [mixer(x[:, :5], state), mixer(x[:, 5:20], state)]  # 5 used of 8, then 15 more
        assert state.keys.shape[2] == 20
        pieces += [mixer(x[:, t:t + 1], state) for t in range(20, 40)]
    assert_close_rel(torch.cat(pieces, 1), full)
    assert state.nbytes() == expected_nbytes("attention", config, 1, 40)
    assert state.keys.shape[2] == 45  # 20 -> 30 -> 45: two copies for twenty single-token steps
    assert state.reserved_nbytes() > state.nbytes()
