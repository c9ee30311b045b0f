"""Causal Linformer: both prefix reductions against a float64 loop over positions, decode equal to the full
forward for both, an output scale that stays bounded over positions in the (default) mean form, and position
ids that must index a column of E and F."""

import copy

import pytest
import torch

from hybridlm import HybridForCausalLM
from tests.helpers import assert_close_rel, random_ids, tiny_config
from tests.mixers.test_mixers import build, run_in_pieces

REDUCTIONS = ["mean", "sum"]


def linformer_loop(mixer, x, positions, mask, reduction):
    """float64, one query at a time: ``softmax(q_t K~_t^T / sqrt(d)) V~_t`` with ``K~_t = sum_s E[:, pos_s] k_s^T``
    over the real tokens ``s <= t`` (divided by their number for ``"mean"``), and ``V~_t`` likewise with F."""
    m = copy.deepcopy(mixer).double()
    batch, time, _ = x.shape
    q, k, v = (proj(x.double()).view(batch, time, m.num_heads, -1).transpose(1, 2)
               for proj in (m.q_proj, m.k_proj, m.v_proj))
    out = torch.zeros_like(q)
    for b in range(batch):
        for t in range(time):
            seen = [s for s in range(t + 1) if mask[b, s]]
            if not seen:
                continue
            e, f = m.key_projection[:, positions[b, seen]], m.value_projection[:, positions[b, seen]]  # [rank, n]
            keys, values = e @ k[b, :, seen], f @ v[b, :, seen]  # [heads, rank, d]
            if reduction == "mean":
                keys, values = keys / len(seen), values / len(seen)
            weights = torch.softmax(keys @ q[b, :, t, :, None] / m.head_dim**0.5, dim=-2)  # [heads, rank, 1]
            out[b, :, t] = (weights * values).sum(-2)
    return m.o_proj(out.transpose(1, 2).reshape(batch, time, -1))


def left_padded_inputs(config, seed=4):
    x = torch.randn(2, 13, config.hidden_size, generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, :4] = False
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return x, mask, positions


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_both_reductions_match_a_float64_loop(reduction):
    mixer, config = build("linformer", linformer_prefix_reduction=reduction)
    x, mask, positions = left_padded_inputs(config)
    with torch.no_grad():
        out = mixer(x, mask=mask, positions=positions)
    real = mask[:, :, None]
    assert_close_rel(out * real, linformer_loop(mixer, x, positions, mask, reduction) * real, rel=1e-5)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_decode_equals_the_full_forward(reduction):
    """Chunked prefill of a left-padded batch, then decode; the state counts each row's real tokens."""
    mixer, config = build("linformer", linformer_prefix_reduction=reduction)
    x, mask, positions = left_padded_inputs(config, seed=5)
    with torch.no_grad():
        full = mixer(x, mask=mask, positions=positions)
        state = mixer.init_state(2)
        pieces = [mixer(x[:, a:b], state, mask=mask[:, a:b], positions=positions[:, a:b])
                  for a, b in [(0, 3), (3, 8)] + [(t, t + 1) for t in range(8, 13)]]
    real = mask[:, :, None]
    assert_close_rel(torch.cat(pieces, 1) * real, full * real)
    assert state.tokens.tolist() == [13, 9]
    with torch.no_grad():
        stepped, _ = run_in_pieces(mixer, x, [4, 7] + list(range(8, 13)))  # no padding, default positions
        assert_close_rel(stepped, mixer(x))


def test_output_scale_stays_bounded_over_positions_in_the_mean_form():
    """4096 positions at rank 64: the mean form's output RMS does not grow; the sum form's grows many-fold."""
    x = torch.randn(1, 4096, 32, generator=torch.Generator().manual_seed(1)) + 1.0  # a shared component
    growth = {}
    for reduction in REDUCTIONS:
        mixer, _ = build("linformer", linformer_rank=64, linformer_max_length=4096,
                         linformer_prefix_reduction=reduction)
        with torch.no_grad():
            rms = mixer(x).square().mean(-1).sqrt()[0]  # [time]
        growth[reduction] = (rms[-64:].mean() / rms[:64].mean()).item()
    assert growth["mean"] <= 1.5, growth
    assert growth["sum"] >= 10, growth


def test_negative_position_ids_are_an_error():
    mixer, config = build("linformer")
    with pytest.raises(ValueError, match="position_ids must be >= 0"):
        mixer(torch.randn(1, 2, config.hidden_size), positions=torch.tensor([[-1, 0]]))
    model = HybridForCausalLM(tiny_config(layer_pattern="AL")).eval()
    with pytest.raises(ValueError, match="position_ids"):
        model(random_ids(1, 3), position_ids=torch.tensor([[-2, -1, 0]]))


def test_unknown_prefix_reduction_names_the_field():
    """Refused by the config (not only when a model is built), unless no layer is a Linformer."""
    for layer_types in (["linformer"], ["attention+linformer"]):
        with pytest.raises(ValueError, match="HybridConfig.linformer_prefix_reduction='max'"):
            tiny_config(layer_types=layer_types, linformer_prefix_reduction="max")
    tiny_config(layer_types=["attention"], linformer_prefix_reduction="max")
