"""Mamba-3's chunked scan and its one-token step against the paper's recurrence, one token at a time, in float64.

The oracle below is written from the equations (arXiv 2603.15569, sections 3-4): a complex-valued state turned by
``exp(i theta)`` (the rotary form), the trapezoidal rule mixing each token's input with the previous one's, MIMO as
a rank-R sum of outer products. It shares no code with :mod:`hybridlm.ops.mamba3`.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.ops.mamba3 import Mamba3Carry, mamba3_scan_ref, mamba3_scan_states, mamba3_step_ref, rotary_angles
from tests.helpers import assert_close_rel


def turn(x, theta, pairs):
    """``x [..., n]`` with entries paired as complex numbers (re, im) and multiplied by ``exp(i theta)``."""
    a, n = theta.shape[-1], x.shape[-1]
    re = torch.arange(0, 2 * a, 2) if pairs == "interleaved" else torch.arange(a)
    im = re + 1 if pairs == "interleaved" else re + n // 2
    c = torch.complex(x[..., re], x[..., im]) * torch.exp(1j * theta)
    out = x.clone()
    out[..., re], out[..., im] = c.real, c.imag
    return out


def recurrence(inp, state, pairs, mimo):
    """One sequence, token by token. ``inp``: the op's arguments for one row (float64, no batch axis); ``state``:
    ``(theta [h, A], S [h, p, n], k_prev [R, h, n], x_prev [h, p])``. Returns ``(y [t, h, p], final state)``."""
    theta, S, k_prev, x_prev = (t.clone() for t in state)
    heads = inp["v"].shape[1]
    per_group = heads // inp["q"].shape[2]
    up = (lambda x: x[None] * inp["mimo_v"].transpose(0, 1)) if mimo else (lambda x: x[None])
    ys = []
    for t in range(inp["v"].shape[0]):
        dt, lam = inp["dt"][t], torch.sigmoid(inp["trap"][t])  # [h]
        alpha = torch.exp(inp["log_decay"][t])
        theta = theta + math.pi * torch.tanh(inp["angles"][t]) * dt[:, None]
        q = inp["q"][t].repeat_interleave(per_group, 1) + inp["q_bias"].transpose(0, 1)  # [R, h, n]
        k = inp["k"][t].repeat_interleave(per_group, 1) + inp["k_bias"].transpose(0, 1)
        q, k = turn(q, theta, pairs), turn(k, theta, pairs)
        v, v_prev = up(inp["v"][t]), up(x_prev)  # [R, h, p]
        previous = sum(v_prev[r, :, :, None] * k_prev[r, :, None, :] for r in range(v.shape[0]))
        current = sum(v[r, :, :, None] * k[r, :, None, :] for r in range(v.shape[0]))
        S = alpha[:, None, None] * S + ((1 - lam) * dt * alpha)[:, None, None] * previous \
            + (lam * dt)[:, None, None] * current
        o = (S[None] * q[:, :, None, :]).sum(-1)  # [R, h, p]
        if inp.get("D") is not None:
            o = o + inp["D"][:, None] * v
        if inp.get("norm_weight") is not None:
            o = o / torch.sqrt((o**2).mean(-1, keepdim=True) + 1e-5) * inp["norm_weight"].view(heads, -1)
        if inp.get("z") is not None:
            gate = inp["z"][t][None] * (inp["mimo_z"].transpose(0, 1) if mimo else 1.0)
            o = o * gate * torch.sigmoid(gate)
        ys.append((o * inp["mimo_o"].transpose(0, 1)).sum(0) if mimo else o[0])
        k_prev, x_prev = k, inp["v"][t]
    y = torch.stack(ys) if ys else inp["v"].new_zeros(0, *inp["v"].shape[1:])
    return y, (theta, S, k_prev, x_prev)


def make_inputs(batch, time, heads, groups, rank, n, p, fraction, mimo, seed, extras=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    a = rotary_angles(n, fraction)
    dt = F.softplus(r(batch, time, heads) - 1.5)
    inp = dict(
        q=r(batch, time, rank, groups, n), k=r(batch, time, rank, groups, n), v=r(batch, time, heads, p),
        log_decay=-dt * (0.05 + torch.rand(batch, time, heads, generator=g, dtype=torch.float64)),
        dt=dt, trap=r(batch, time, heads), angles=r(batch, time, heads, a) * 2,
        q_bias=r(heads, rank, n), k_bias=r(heads, rank, n),
    )
    if extras:
        inp.update(D=r(heads), z=r(batch, time, heads, p))
    if mimo:
        inp.update(mimo_v=r(heads, rank, p) / rank, mimo_o=r(heads, rank, p) / rank)
        if extras:
            inp["mimo_z"] = r(heads, rank, p)
    state = Mamba3Carry(torch.rand(batch, heads, a, generator=g, dtype=torch.float64) * 6, r(batch, heads, p, n),
                        r(batch, rank, heads, n), r(batch, heads, p))
    return inp, state


def row(inp, b, start=0, stop=None):
    return {key: (t[b, start:stop] if key in {"q", "k", "v", "log_decay", "dt", "trap", "angles", "z"} else t)
            for key, t in inp.items()}


def as_f32(inp):
    return {key: t.float() for key, t in inp.items()}


def same_angles(got, expected):
    """Angles compared on the circle (the op reduces them mod 2 pi)."""
    assert_close_rel(torch.cos(got.double()), torch.cos(expected), 1e-5)
    assert_close_rel(torch.sin(got.double()), torch.sin(expected), 1e-5)


def check_carry(got, expected):
    same_angles(got.angle, expected[0])
    for name, value in zip(("ssm", "k", "v"), expected[1:]):
        assert_close_rel(getattr(got, name).double(), value, 1e-5)


shapes = dict(batch=st.integers(1, 2), time=st.integers(1, 37), groups=st.sampled_from([1, 2]),
              per_group=st.sampled_from([1, 2]), rank=st.integers(1, 3), n=st.sampled_from([4, 6, 8, 12]),
              p=st.integers(1, 5), fraction=st.sampled_from([0.5, 1.0]), pairs=st.sampled_from(["interleaved",
              "halves"]), chunk=st.integers(1, 16), warm=st.booleans(), extras=st.booleans(), seed=st.integers(0, 99))


@settings(max_examples=40)
@given(**shapes)
def test_chunked_scan_is_the_recurrence(batch, time, groups, per_group, rank, n, p, fraction, pairs, chunk, warm,
                                        extras, seed):
    """SISO (rank 1 without the MIMO weights) and MIMO, both rotary fractions and pairings, odd lengths and chunk
    sizes, from zero or from a carried state: outputs and the four final state tensors."""
    mimo = rank > 1 or seed % 2 == 1
    heads = groups * per_group
    inp, state = make_inputs(batch, time, heads, groups, rank, n, p, fraction, mimo, seed, extras)
    if extras and seed % 3 == 0:
        inp["norm_weight"] = torch.rand(heads * p, dtype=torch.float64) + 0.5
    initial = Mamba3Carry(*(t.float() for t in state)) if warm else None
    y, final = mamba3_scan_ref(**as_f32(inp), rope_pairs=pairs, initial_state=initial, chunk_size=chunk)
    for b in range(batch):
        start = tuple(t[b] for t in state) if warm else tuple(torch.zeros_like(t[b]) for t in state)
        y_b, final_b = recurrence(row(inp, b), start, pairs, mimo)
        assert_close_rel(y[b].double(), y_b, 1e-5)
        check_carry(Mamba3Carry(*(t[b] for t in final)), final_b)


@pytest.mark.parametrize("mimo, pairs", [(False, "interleaved"), (True, "halves")])
def test_step_and_per_token_states_are_the_recurrence(mimo, pairs):
    """The one-token step (state updated in place) and the per-token states kept for rollback."""
    rank = 2 if mimo else 1
    inp, state = make_inputs(2, 9, 4, 2, rank, 8, 3, 0.5, mimo, seed=3)
    f32 = as_f32(inp)
    carry = Mamba3Carry(*(t.float().clone() for t in state))
    per_token = {key: t for key, t in f32.items() if key in {"q", "k", "v", "log_decay", "dt", "trap", "angles", "z"}}
    named = dict(zip(("angle_state", "ssm_state", "k_state", "v_state"), carry))
    steps = [mamba3_step_ref(**{key: (per_token[key][:, t] if key in per_token else value)
                                for key, value in f32.items()}, **named, rope_pairs=pairs) for t in range(9)]
    y_states, states = mamba3_scan_states(**f32, initial_state=Mamba3Carry(*(t.float() for t in state)),
                                          rope_pairs=pairs, chunk_size=4)
    for b in range(2):
        y_b, final_b = recurrence(row(inp, b), tuple(t[b] for t in state), pairs, mimo)
        assert_close_rel(torch.stack(steps, 1)[b].double(), y_b, 1e-5)
        check_carry(Mamba3Carry(*(t[b] for t in carry)), final_b)
        assert_close_rel(y_states[b].double(), y_b, 1e-5)
        for t in (0, 4, 8):  # the state after token t is the recurrence's over the first t + 1 tokens
            _, upto = recurrence(row(inp, b, 0, t + 1), tuple(s[b] for s in state), pairs, mimo)
            check_carry(Mamba3Carry(*(s[b, t] for s in states)), upto)


def test_pieces_continue_the_scan():
    """Prefill in pieces through the carried state equals one pass (what chunked prefill relies on)."""
    inp, _ = make_inputs(2, 23, 4, 1, 2, 8, 4, 1.0, True, seed=5)
    f32 = as_f32(inp)
    full, final = mamba3_scan_ref(**f32, chunk_size=8)
    timed = {"q", "k", "v", "log_decay", "dt", "trap", "angles", "z"}
    carry, pieces = None, []
    for start, stop in ((0, 5), (5, 6), (6, 23)):
        y, carry = mamba3_scan_ref(**{key: (t[:, start:stop] if key in timed else t) for key, t in f32.items()},
                                   initial_state=carry, chunk_size=8)
        pieces.append(y)
    assert_close_rel(torch.cat(pieces, 1), full, 1e-5)
    for got, expected in zip(carry[1:], final[1:]):
        assert_close_rel(got, expected, 1e-5)


@pytest.mark.parametrize("mimo", [False, True])
def test_packed_sequences_run_alone(mimo):
    """``cu_seqlens``: each sequence from its own initial state to its own final state (an empty one keeps its
    initial state), and ``seq_idx`` describes the same packing."""
    lengths = [5, 0, 11, 1, 7]
    rank = 2 if mimo else 1
    inp, _ = make_inputs(1, sum(lengths), 2, 1, rank, 8, 3, 0.5, mimo, seed=7)
    _, state = make_inputs(len(lengths), 1, 2, 1, rank, 8, 3, 0.5, mimo, seed=8)
    bounds = torch.tensor([0, *lengths]).cumsum(0)
    initial = Mamba3Carry(*(t.float() for t in state))
    y, final = mamba3_scan_ref(**as_f32(inp), initial_state=initial, chunk_size=4, cu_seqlens=bounds)
    nonempty = [i for i, length in enumerate(lengths) if length]  # seq_idx cannot describe an empty sequence
    seq_idx = torch.repeat_interleave(torch.arange(len(nonempty)), torch.tensor(lengths)[nonempty])[None]
    some = Mamba3Carry(*(t[nonempty] for t in initial))
    by_idx = mamba3_scan_ref(**as_f32(inp), initial_state=some, chunk_size=4, seq_idx=seq_idx)
    by_bounds = mamba3_scan_ref(**as_f32(inp), initial_state=some, chunk_size=4,
                                cu_seqlens=torch.tensor([0, *lengths[:1], *lengths[2:]]).cumsum(0))
    for a, b in zip((by_idx[0], *by_idx[1]), (by_bounds[0], *by_bounds[1])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for i, (start, stop) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        y_i, final_i = recurrence(row(inp, 0, start, stop), tuple(t[i] for t in state), "interleaved", mimo)
        if stop > start:
            assert_close_rel(y[0, start:stop].double(), y_i, 1e-5)
        check_carry(Mamba3Carry(*(t[i] for t in final)), final_i)
    for got, kept in zip(final, initial):
        torch.testing.assert_close(got[1], kept[1], rtol=0, atol=0)


@pytest.mark.parametrize("mimo, fraction", [(False, 0.5), (True, 1.0)])
def test_gradients_are_the_recurrences(mimo, fraction):
    """Every input's gradient (biases, angles, trapezoid, decay, MIMO weights, the initial state) through the
    chunked scan in fp32 equals autograd through the float64 recurrence."""
    rank = 2 if mimo else 1
    inp, state = make_inputs(1, 13, 2, 1, rank, 8, 3, fraction, mimo, seed=11)
    inp["norm_weight"] = torch.rand(6, dtype=torch.float64) + 0.5
    leaves64 = {key: t.clone().requires_grad_() for key, t in inp.items()}
    state64 = tuple(t.clone().requires_grad_() for t in state)
    leaves32 = {key: t.float().requires_grad_() for key, t in inp.items()}
    state32 = Mamba3Carry(*(t.float().requires_grad_() for t in state))
    y, final = mamba3_scan_ref(**leaves32, initial_state=state32, chunk_size=4)
    y64, final64 = recurrence(row(leaves64, 0), tuple(t[0] for t in state64), "interleaved", mimo)
    g = torch.Generator().manual_seed(12)
    weights = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (y64, *final64[1:])]
    loss64 = sum((w * t).sum() for w, t in zip(weights, (y64, *final64[1:]))) + torch.sin(final64[0]).sum()
    loss32 = sum((w.float() * t[0]).sum() for w, t in zip(weights, (y, *final[1:]))) + torch.sin(final.angle).sum()
    loss64.backward()
    loss32.backward()
    for key in inp:
        assert_close_rel(leaves32[key].grad.double(), leaves64[key].grad, 1e-4)
    for got, expected in zip(state32, state64):
        assert_close_rel(got.grad.double(), expected.grad, 1e-4)


def test_bad_arguments_name_what_is_wrong():
    inp, _ = make_inputs(1, 4, 2, 1, 2, 8, 3, 0.5, True, seed=0)
    f32 = as_f32(inp)
    with pytest.raises(ValueError, match="rope_pairs"):
        mamba3_scan_ref(**f32, rope_pairs="rotate_half")
    with pytest.raises(ValueError, match="mimo_v and mimo_o"):
        mamba3_scan_ref(**{**f32, "mimo_o": None})
    with pytest.raises(ValueError, match="angles"):
        mamba3_scan_ref(**{**f32, "angles": torch.zeros(1, 4, 2, 5)})
    with pytest.raises(ValueError, match="k_bias"):
        mamba3_scan_ref(**{**f32, "k_bias": torch.zeros(2, 1, 8)})
    assert rotary_angles(8, 0.5) == 2 and rotary_angles(6, 0.5) == 1 and rotary_angles(3, 0.5) == 0
