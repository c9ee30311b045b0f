"""The Mamba-3 mixer: its layer written out token by token in float64 (mamba-ssm's ``Mamba3`` forward), MIMO and the
output norm through the contract (pieces, decode, padding), padding on a warm state, rollback, and its config
errors. The registry-wide tests (tests/mixers/test_mixers.py, test_registry.py) cover the SISO default."""

import pytest
import torch
import torch.nn.functional as F

from hybridlm import HybridConfig
from hybridlm.mixers import MIXERS
from tests.helpers import assert_close_rel, tiny_config
from tests.mixers.test_mixers import build, expected_nbytes, run_in_pieces
from tests.ops.test_mamba3 import recurrence

VARIANTS = {
    "siso": {},
    "siso-norm-full-rope": dict(mamba3_outproj_norm=True, mamba3_rope_fraction=1.0),
    "siso-softplus-a": dict(mamba3_a_activation="softplus"),  # flash-linear-attention's (and older mamba-ssm's) A
    "mimo": dict(mamba3_mimo=True, mamba3_mimo_rank=2),
    "mimo-norm": dict(mamba3_mimo=True, mamba3_mimo_rank=3, mamba3_outproj_norm=True, mamba3_n_groups=1),
}


def randomized(overrides, seed=0):
    """A mixer with every parameter drawn (biases, norms and MIMO weights included), so that nothing is trivial."""
    mixer, config = build("mamba3", seed, **overrides)
    with torch.no_grad():
        for name, param in mixer.named_parameters():
            if name != "dt_bias":
                param.add_(torch.randn_like(param) * 0.3)
    return mixer, config


def written_out(mixer, x):
    """mamba-ssm's ``Mamba3.forward`` in float64, its scan the token-by-token recurrence."""
    m = {name: p.detach().double() for name, p in mixer.named_parameters()}
    c = mixer.config
    b, t, _ = x.shape
    heads, p, n, r, g = mixer.num_heads, mixer.head_dim, c.mamba3_d_state, mixer.rank, c.mamba3_n_groups
    a = int(n * c.mamba3_rope_fraction) // 2
    proj = x.double() @ m["in_proj.weight"].T
    z, xs, B, C, dd_dt, dd_a, trap, angles = proj.split([heads * p, heads * p, r * g * n, r * g * n, heads, heads,
                                                         heads, a], -1)
    dt = F.softplus(dd_dt + m["dt_bias"])
    f = F.softplus(dd_a) if c.mamba3_a_activation == "softplus" else torch.where(dd_a >= 0, 1 + dd_a, 1 / (1 - dd_a))
    A = -f.clamp(min=c.mamba3_a_floor)

    def rms(v, w):
        return v / torch.sqrt((v**2).mean(-1, keepdim=True) + 1e-5) * w

    inp = dict(q=rms(C.view(b, t, r, g, n), m["C_norm.weight"]), k=rms(B.view(b, t, r, g, n), m["B_norm.weight"]),
               v=xs.view(b, t, heads, p), log_decay=A * dt, dt=dt, trap=trap,
               angles=angles[:, :, None].expand(b, t, heads, a), q_bias=m["C_bias"], k_bias=m["B_bias"], D=m["D"],
               z=z.view(b, t, heads, p))
    if mixer.mimo:
        inp.update(mimo_v=m["mimo_x"], mimo_z=m["mimo_z"], mimo_o=m["mimo_o"])
    if mixer.norm is not None:
        inp["norm_weight"] = m["norm.weight"]
    pairs = "halves" if mixer.mimo else "interleaved"
    zero = (torch.zeros(heads, a), torch.zeros(heads, p, n), torch.zeros(r, heads, n), torch.zeros(heads, p))
    timed = {"q", "k", "v", "log_decay", "dt", "trap", "angles", "z"}
    y = torch.stack([recurrence({key: (v[row] if key in timed else v) for key, v in inp.items()},
                                tuple(s.double() for s in zero), pairs, mixer.mimo)[0] for row in range(b)])
    return y.reshape(b, t, heads * p) @ m["out_proj.weight"].T


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_layer_is_mamba_ssms_forward(variant):
    mixer, config = randomized(VARIANTS[variant])
    x = torch.randn(2, 13, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close_rel(mixer(x).double(), written_out(mixer, x), 1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS)[1:])
def test_pieces_decode_and_left_padding(variant):
    """Chunked prefill then decode equals the parallel form; a left-padded row gives what it gives alone."""
    mixer, config = randomized(VARIANTS[variant], seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 19, config.hidden_size, generator=g)
    with torch.no_grad():
        full = mixer(x)
        stepped, state = run_in_pieces(mixer, x, [4, 11] + list(range(12, 19)))
        assert_close_rel(stepped, full, 1e-5)
        assert state.nbytes() == expected_nbytes("mamba3", config, 2, 19)
        padded = torch.cat([torch.randn(2, 3, config.hidden_size, generator=g), x], 1)
        mask = torch.ones(2, 22, dtype=torch.bool)
        mask[1, :3] = False
        pieces, padded_state = run_in_pieces(mixer, padded, [2, 6], mask)  # row 0: other tokens, unpadded
        assert_close_rel(pieces[1, 3:], full[1], 1e-5)
        step = torch.randn(1, 1, config.hidden_size, generator=g)
        alone = run_in_pieces(mixer, x[1:], [])[1]
        assert_close_rel(mixer(step, padded_state.select(torch.tensor([1]))), mixer(step, alone), 1e-5)


@pytest.mark.parametrize("variant", ["siso", "mimo"])
def test_padding_on_a_warm_state_changes_nothing(variant):
    """Padding before a row's next real tokens, on a state that has seen tokens: the carried previous key and x
    enter at the first real token, as if the padding were not there; an all-padding call leaves every tensor of
    the state bit for bit as it was (decode and prefill paths)."""
    mixer, config = randomized(VARIANTS[variant], seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 12, config.hidden_size, generator=g)
    with torch.no_grad():
        full = mixer(x)
        state = mixer.init_state(1)
        mixer(x[:, :7], state)
        padded = torch.cat([torch.randn(1, 4, config.hidden_size, generator=g), x[:, 7:]], 1)
        mask = torch.tensor([[False] * 4 + [True] * 5])
        assert_close_rel(mixer(padded, state, mask=mask)[:, 4:], full[:, 7:], 1e-5)
        for time in (1, 3):
            before = state.clone()
            mixer(torch.randn(1, time, config.hidden_size, generator=g), state, mask=torch.zeros(1, time, dtype=bool))
            for name in ("angle", "ssm", "k", "v"):
                assert torch.equal(getattr(state, name), getattr(before, name)), (time, name)


@pytest.mark.parametrize("variant", ["siso", "mimo-norm"])
def test_crop_returns_to_the_state_after_each_token(variant):
    """A warm forward of a few tokens keeps the four tensors after each; cropping back to any of them equals the
    state that forward over fewer tokens leaves (speculative decoding's rollback)."""
    mixer, config = randomized(VARIANTS[variant], seed=6)
    x = torch.randn(2, 14, config.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        state = mixer.init_state(2)
        mixer(x[:, :8], state)
        reference = state.clone()
        mixer(x[:, 8:], state)
        assert state.rewind_blocker(7) is not None and state.rewind_blocker(6) is None
        state.rewind(3)
        after_8 = reference.clone()
        mixer(x[:, 8:11], reference)
        for name in ("angle", "ssm", "k", "v"):
            assert_close_rel(getattr(state, name).double(), getattr(reference, name).double(), 1e-6)
        state.rewind(3)  # back to the start of the forward: exactly the state it started from
        for name in ("angle", "ssm", "k", "v"):
            assert torch.equal(getattr(state, name), getattr(after_8, name))


def test_bf16_runs_and_keeps_the_state_fp32():
    mixer, config = randomized(VARIANTS["mimo"], seed=8)
    mixer = mixer.to(torch.bfloat16)
    state = mixer.init_state(2, dtype=torch.bfloat16)
    x = torch.randn(2, 9, config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        out = mixer(x, state)
        out_step = mixer(x[:, :1], state)
    assert out.dtype == out_step.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
    assert state.ssm.dtype == state.angle.dtype == torch.float32 and state.k.dtype == torch.bfloat16
    assert state.nbytes() == expected_nbytes("mamba3", config, 2, 9, element=2)


@pytest.mark.parametrize(("overrides", "field", "message"), [
    (dict(mamba3_rope_fraction=0.25), "mamba3_rope_fraction", "must be one of"),
    (dict(mamba3_d_state=3), "mamba3_d_state", "too small for any rotary angle"),
    (dict(mamba3_d_state=1, mamba3_rope_fraction=1.0), "mamba3_d_state", "too small for any rotary angle"),
    (dict(mamba3_mimo=True, mamba3_mimo_rank=0), "mamba3_mimo_rank", "must be > 0"),
    (dict(mamba3_mimo=True, mamba3_d_state=9), "mamba3_d_state", "must be even"),
    (dict(mamba3_head_dim=24), "mamba3_head_dim", "must divide"),
    (dict(mamba3_n_groups=3), "mamba3_n_groups", "must divide"),
    (dict(mamba3_dt_min=0.5), "mamba3_dt_min", "must be <="),
    (dict(mamba3_a_activation="exp"), "mamba3_a_activation", "must be one of"),
])
def test_bad_settings_name_the_field(overrides, field, message):
    with pytest.raises(ValueError, match=f"HybridConfig.{field}=.*{message}"):
        tiny_config(layer_types=["mamba3"], **overrides)
    assert isinstance(HybridConfig(layer_types=["attention"], **overrides), HybridConfig)  # unused: not checked
    assert "mamba3" in MIXERS
