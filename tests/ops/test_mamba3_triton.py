"""Mamba-3's Triton scan (forward and every gradient) and fused decode step against the reference, outputs
NaN-poisoned; SISO and MIMO, both rotary pairings, initial states and packed sequences (Triton's interpreter on a
machine without GPU)."""

import pytest
import torch

from hybridlm.ops.mamba3 import Mamba3Carry, mamba3_scan_ref, mamba3_step_ref
from tests.helpers import assert_close_rel
from tests.ops.test_mamba3 import make_inputs
from tests.ops.triton_support import DEVICE, check_against_reference, kernels, poisoned_outputs

TIMED = {"q", "k", "v", "log_decay", "dt", "trap", "angles", "z"}


def device_inputs(batch, time, heads, groups, rank, n, p, fraction, mimo, seed, norm=False):
    inp, state = make_inputs(batch, time, heads, groups, rank, n, p, fraction, mimo, seed)
    inp = {key: t.float().to(DEVICE) for key, t in inp.items()}
    if norm:
        inp["norm_weight"] = torch.rand(heads * p, device=DEVICE) + 0.5
    return inp, Mamba3Carry(*(t.float().to(DEVICE) for t in state))


def flat_scan(op):
    """The scan with its carry as separate tensors (what check_against_reference differentiates)."""
    def run(angle=None, ssm=None, k_state=None, v_state=None, **kwargs):
        initial = None if angle is None else Mamba3Carry(angle, ssm, k_state, v_state)
        y, final = op(**kwargs, initial_state=initial)
        return (y, final.ssm, final.k, final.v, torch.cos(final.angle))
    return run


@pytest.mark.parametrize("case", [
    dict(mimo=False, pairs="interleaved", fraction=0.5, warm=True, chunk=4),
    dict(mimo=True, pairs="halves", fraction=1.0, warm=False, chunk=8),
])
def test_scan_and_its_gradients_match_the_reference(case):
    rank = 2 if case["mimo"] else 1
    inp, state = device_inputs(2, 7, 4, 2, rank, 8, 3, case["fraction"], case["mimo"], seed=1, norm=case["mimo"])
    carry = dict(zip(("angle", "ssm", "k_state", "v_state"), state)) if case["warm"] else {}
    check_against_reference(flat_scan(kernels.mamba3_scan), flat_scan(mamba3_scan_ref), {**inp, **carry},
                            rel=1e-4, rope_pairs=case["pairs"], chunk_size=case["chunk"])


def test_packed_sequences_match_the_reference():
    lengths = [4, 0, 7, 1]
    inp, _ = device_inputs(1, sum(lengths), 2, 1, 1, 8, 4, 0.5, False, seed=2)
    _, state = device_inputs(len(lengths), 1, 2, 1, 1, 8, 4, 0.5, False, seed=3)
    bounds = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    with poisoned_outputs():
        y, final = kernels.mamba3_scan(**inp, initial_state=state, chunk_size=4, cu_seqlens=bounds)
    y_ref, final_ref = mamba3_scan_ref(**inp, initial_state=state, chunk_size=4, cu_seqlens=bounds)
    assert_close_rel(y, y_ref, 1e-5)
    for got, expected in zip(final, final_ref):
        assert_close_rel(got, expected, 1e-5)


@pytest.mark.parametrize("mimo, pairs, norm", [(False, "interleaved", False), (True, "halves", True)])
def test_the_fused_step_is_the_reference_step(mimo, pairs, norm):
    """Several steps in a row, the four state tensors updated in place (d_state 12: the rotary entries do not fill
    a power-of-two tile; head_dim 5 neither)."""
    rank = 3 if mimo else 1
    inp, state = device_inputs(2, 3, 4, 2, rank, 12, 5, 0.5, mimo, seed=4, norm=norm)
    ours, theirs = (Mamba3Carry(*(t.clone() for t in state)) for _ in range(2))
    for t in range(3):
        one = {key: (value[:, t] if key in TIMED else value) for key, value in inp.items()}
        with poisoned_outputs():
            y = kernels.mamba3_step(**one, angle_state=ours.angle, ssm_state=ours.ssm, k_state=ours.k,
                                    v_state=ours.v, rope_pairs=pairs)
        y_ref = mamba3_step_ref(**one, angle_state=theirs.angle, ssm_state=theirs.ssm, k_state=theirs.k,
                                v_state=theirs.v, rope_pairs=pairs)
        assert_close_rel(y, y_ref, 1e-5)
    for name in ("ssm", "k", "v"):
        assert_close_rel(getattr(ours, name), getattr(theirs, name), 1e-5)
    assert_close_rel(torch.cos(ours.angle), torch.cos(theirs.angle), 1e-5)


def test_the_step_declines_what_one_program_cannot_hold():
    from hybridlm.ops.declined import Declined

    inp, state = device_inputs(1, 1, 1, 1, 1, 256, 128, 0.5, False, seed=5)
    one = {key: (value[:, 0] if key in TIMED else value) for key, value in inp.items()}
    with pytest.raises(Declined, match=r"\[128, 256\] state per head"):
        kernels.mamba3_step(**one, angle_state=state.angle, ssm_state=state.ssm, k_state=state.k, v_state=state.v)
