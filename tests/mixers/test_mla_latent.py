"""MLA attending in latent space (``kv_b_proj`` absorbed into queries and outputs) against the expanded form:
the same numbers on warm caches, left padding, rollback and packed sequences; which form a forward takes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hybridlm.mixers.segments import Segments
from tests.helpers import assert_close_rel, relative_error
from tests.mixers.test_mixers import build
from tests.mixers.test_mla import SIZES

KIMI_SHAPE = dict(num_attention_heads=32, mla_kv_lora_rank=512, mla_qk_nope_head_dim=128, mla_qk_rope_head_dim=64,
                  mla_v_head_dim=128)


def two_forms(dtype=torch.float64, **overrides):
    """The same mixer twice, one forced to each form, latent norm weights moved off 1 (so the norm counts)."""
    mixer, config = build("mla", **{**SIZES, **overrides})
    with torch.no_grad():
        for name, t in mixer.named_parameters():
            if name.endswith("layernorm.weight"):
                t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    mixer = mixer.to(dtype)
    latent, expanded = mixer, type(mixer)(config, 0).to(dtype).eval()
    expanded.load_state_dict(latent.state_dict())
    latent.latent_attention, expanded.latent_attention = True, False
    return latent, expanded, config


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), pads=st.lists(st.integers(0, 4), min_size=3, max_size=3),
       pieces=st.lists(st.integers(1, 6), min_size=1, max_size=5), rope=st.booleans(), seed=st.integers(0, 99))
def test_latent_form_equals_expanded_on_a_warm_cache_in_float64(batch, pads, pieces, rope, seed):
    """Left-padded prefill, then pieces of 1..6 tokens: every output of the latent form equals the expanded
    form's to float64 round-off (1e-12: the two sum the same products in another order)."""
    latent, expanded, config = two_forms(mla_rope=rope, mla_q_lora_rank=10 if rope else None)
    g = torch.Generator().manual_seed(seed)
    prompt = 5
    mask = torch.arange(prompt)[None] >= torch.tensor(pads[:batch])[:, None]  # [batch, prompt], left padding
    states = latent.init_state(batch, dtype=torch.float64), expanded.init_state(batch, dtype=torch.float64)
    with torch.no_grad():
        for index, time in enumerate([prompt] + pieces):
            x = torch.randn(batch, time, config.hidden_size, generator=g, dtype=torch.float64)
            piece_mask = mask if index == 0 else None
            got = latent(x, states[0], mask=piece_mask)
            want = expanded(x, states[1], mask=piece_mask)
            assert_close_rel(got, want, rel=1e-12)
    assert torch.equal(states[0].latent[:, :, : states[0].seen], states[1].latent[:, :, : states[1].seen])


def test_latent_form_in_float32_and_after_a_rollback():
    """fp32 within its round-off (1e-5 relative: eps 1.2e-7 times sums over ~20 products and a softmax), and a
    cache cropped by 3 continues in latent space as the expanded form does."""
    latent, expanded, config = two_forms(torch.float32)
    x = torch.randn(2, 16, config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = expanded(x)
        states = latent.init_state(2), expanded.init_state(2)
        for state, mixer in zip(states, (latent, expanded)):
            mixer(x[:, :12], state)
            state.rewind(3)
        for t in range(9, 16):
            got = latent(x[:, t:t + 1], states[0])
            assert_close_rel(got, expanded(x[:, t:t + 1], states[1]), rel=1e-5)
            assert_close_rel(got, full[:, t:t + 1], rel=1e-5)


def test_latent_form_in_bfloat16_is_as_accurate_as_expanded():
    """bf16 decode steps against the float64 forward: the latent form rounds other intermediates (the absorbed
    query, the weighted latent), no larger an error than the expanded form's (bf16 eps 7.8e-3: a few eps)."""
    latent, expanded, config = two_forms(torch.float64)
    x = torch.randn(2, 24, config.hidden_size, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    errors = []
    with torch.no_grad():
        want = expanded(x)[:, 16:]
        for mixer in (latent.bfloat16(), expanded.bfloat16()):
            state = _warm(mixer, x[:, :16].bfloat16())
            steps = torch.cat([mixer(x[:, t:t + 1].bfloat16(), state) for t in range(16, 24)], 1)
            errors.append(relative_error(steps, want))
    assert errors[0] < 3e-2 and errors[0] <= 2 * errors[1], errors


def test_packed_sequences_in_latent_space():
    """Two documents packed in a row: the latent form keeps each to its own keys, as the expanded form does."""
    latent, expanded, config = two_forms()
    x = torch.randn(2, 10, config.hidden_size, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    seq_idx = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
    positions = torch.tensor([list(range(4)) + list(range(6)), list(range(7)) + list(range(3))])  # restart per doc
    packing = dict(segments=Segments.from_seq_idx(seq_idx), positions=positions)
    with torch.no_grad():
        packed = latent(x, **packing)
        assert_close_rel(packed, expanded(x, **packing), rel=1e-12)
        assert_close_rel(packed[:1, 4:], expanded(x[:1, 4:]), rel=1e-12)  # the second document run alone
        assert_close_rel(packed[1:, :7], expanded(x[1:, :7]), rel=1e-12)


def test_latent_form_gradients_equal_the_expanded_forms():
    """Training through the latent form (chosen when ``kv_lora_rank`` is small against nope + v): every weight's
    gradient equals the expanded form's in float64."""
    latent, expanded, config = two_forms(mla_q_lora_rank=10)
    x = torch.randn(2, 7, config.hidden_size, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    weights = torch.randn(2, 7, config.hidden_size, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    for mixer in (latent, expanded):
        (mixer(x) * weights).sum().backward()
    for (name, got), want in zip(latent.named_parameters(), expanded.parameters()):
        assert got.grad is not None, f"{name} got no gradient"
        assert_close_rel(got.grad, want.grad, rel=1e-10)


def test_decode_attends_in_latent_space_and_long_forwards_expand(monkeypatch):
    """The multiply-add count picks the form: a decode step or a short piece over a long cache in latent space
    (no expansion at all), prefill expanded; at Kimi Linear's shape the crossover is ~150 new tokens over a 1K
    cache, ~170 over a long one."""
    mixer, config = build("mla", **SIZES)
    assert mixer.latent_attention is None
    x = torch.randn(1, 24, config.hidden_size, generator=torch.Generator().manual_seed(2))
    state = mixer.init_state(1)
    with torch.no_grad():
        mixer(x[:, :23], state)  # prefill: expanded, the only form that expands
        monkeypatch.setattr(mixer, "_expand", lambda latent: pytest.fail("a decode step expanded the latents"))
        mixer(x[:, 23:], state)
    kimi, _ = build("mla", **KIMI_SHAPE, hidden_size=64)
    for context in (1024, 16384):
        assert kimi.attends_in_latent(1, context + 1) and kimi.attends_in_latent(140, context + 140)
        assert not kimi.attends_in_latent(180, context + 180) and not kimi.attends_in_latent(context, context)
    kimi.latent_attention = False
    assert not kimi.attends_in_latent(1, 4096)


class LowRankAdapted(nn.Module):
    """A LoRA-like wrapper: the base projection plus a low-rank update the base weight does not hold."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base, self.down = base, nn.Linear(base.in_features, 2, bias=False, dtype=base.weight.dtype)
        self.up = nn.Linear(2, base.out_features, bias=False, dtype=base.weight.dtype)

    @property
    def weight(self):
        return self.base.weight

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def test_an_adapted_kv_b_proj_is_never_absorbed():
    """Absorbing reads ``kv_b_proj.weight``; with an adapter around it the mixer expands (even when forced), so
    the adapter takes part in every decode step."""
    latent, expanded, config = two_forms()
    x = torch.randn(1, 6, config.hidden_size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        plain = latent(x[:, 5:], _warm(latent, x[:, :5]))
        for mixer in (latent, expanded):
            mixer.kv_b_proj = LowRankAdapted(mixer.kv_b_proj)
        expanded.kv_b_proj.load_state_dict(latent.kv_b_proj.state_dict())
        assert not latent.attends_in_latent(1, 100)
        adapted = latent(x[:, 5:], _warm(latent, x[:, :5]))
        assert_close_rel(adapted, expanded(x[:, 5:], _warm(expanded, x[:, :5])), rel=1e-12)
    assert (adapted - plain).abs().max() > 1e-3 * plain.abs().max()  # the adapter changed the step


def _warm(mixer, prompt):
    state = mixer.init_state(prompt.shape[0], dtype=prompt.dtype)
    mixer(prompt, state)
    return state
