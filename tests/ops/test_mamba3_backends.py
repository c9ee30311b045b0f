"""The mamba-ssm adapters of Mamba-3 against stand-ins that enforce the layouts its kernels document
(``mamba3_siso_combined``, ``mamba3_siso_step``), and what they decline."""

import sys
import types

import pytest
import torch

from hybridlm.ops import external
from hybridlm.ops.declined import Declined
from hybridlm.ops.mamba3 import Mamba3Carry, mamba3_scan_ref, mamba3_step_ref
from tests.ops.test_mamba3 import make_inputs

TIMED = {"q", "k", "v", "log_decay", "dt", "trap", "angles", "z"}


def install(monkeypatch, name, **functions):
    parts = name.split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**functions))


def ours(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z):
    """Their arguments back in our layout (the inverse of the map in hybridlm.ops.mamba3's docstring)."""
    return dict(q=Q.unsqueeze(-3), k=K.unsqueeze(-3), v=V, log_decay=ADT.transpose(1, 2) if ADT.dim() == 3 else ADT,
                dt=DT.transpose(1, 2) if DT.dim() == 3 else DT, trap=Trap.transpose(1, 2) if Trap.dim() == 3 else Trap,
                angles=Angles, q_bias=Q_bias.unsqueeze(1), k_bias=K_bias.unsqueeze(1), D=D, z=Z)


def mamba3_siso_combined(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, Input_States=None,
                         chunk_size=64, return_final_states=False, cu_seqlens=None):
    batch, time, groups, n = Q.shape
    heads, p = V.shape[2:]
    assert K.shape == Q.shape and ADT.shape == DT.shape == Trap.shape == (batch, heads, time)
    assert Q_bias.shape == K_bias.shape == (heads, n) and Angles.shape[:3] == (batch, time, heads)
    assert ADT.dtype == DT.dtype == Q_bias.dtype == torch.float32 and return_final_states
    assert cu_seqlens is None or cu_seqlens.dtype == torch.int32
    initial = None
    if Input_States is not None:
        angle, ssm, k_state, v_state = Input_States
        assert k_state.shape == (angle.shape[0], heads, n) and v_state.shape == (angle.shape[0], heads, p)
        initial = Mamba3Carry(angle, ssm, k_state.unsqueeze(1), v_state)
    y, final = mamba3_scan_ref(**ours(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z), initial_state=initial,
                               chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    return y, final.angle, final.ssm, final.k[:, 0], final.v


def mamba3_siso_step(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, Input_States=None):
    angle, ssm, k_state, v_state = (t.clone() for t in Input_States)  # it writes new state tensors
    assert Q.dim() == 3 and ADT.shape == (V.shape[0], V.shape[1]) and k_state.shape == Q.shape[:1] + V.shape[1:2] \
        + Q.shape[2:]
    k_state = k_state.unsqueeze(1)
    y = mamba3_step_ref(**ours(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z), angle_state=angle,
                        ssm_state=ssm, k_state=k_state, v_state=v_state)
    return y, [angle, ssm, k_state[:, 0], v_state]


def bf16_inputs(batch=2, time=9, mimo=False, seed=0):
    inp, state = make_inputs(batch, time, 4, 2, 2 if mimo else 1, 8, 4, 0.5, mimo, seed)
    for key in ("q", "k", "v", "z", "trap", "angles"):
        inp[key] = inp[key].bfloat16()
    inp = {key: (t if t.dtype == torch.bfloat16 else t.float()) for key, t in inp.items()}
    return inp, Mamba3Carry(state.angle.float(), state.ssm.float(), state.k.bfloat16(), state.v.bfloat16())


def test_the_scan_adapter_passes_mamba_ssms_layouts(monkeypatch):
    install(monkeypatch, "mamba_ssm.ops.triton.mamba3.mamba3_siso_combined", mamba3_siso_combined=mamba3_siso_combined)
    scan = external.mamba3_siso_scan()
    inp, state = bf16_inputs()
    y, final = scan(**inp, initial_state=state, chunk_size=4)
    y_ref, final_ref = mamba3_scan_ref(**inp, initial_state=state, chunk_size=4)
    assert torch.equal(y, y_ref) and all(torch.equal(a, b) for a, b in zip(final, final_ref))
    one, _ = bf16_inputs(batch=1, time=9, seed=1)
    packed = dict(initial_state=Mamba3Carry(*(t[:1].repeat(2, *[1] * (t.dim() - 1)) for t in state)),
                  cu_seqlens=torch.tensor([0, 4, 9]))
    assert torch.equal(scan(**one, **packed)[0], mamba3_scan_ref(**one, **packed)[0])
    for change, why in [(dict(v=inp["v"].float()), "float32 inputs"), (dict(rope_pairs="halves"), "rope_pairs"),
                        (dict(norm_weight=torch.ones(16)), "the output norm"),
                        (dict(seq_idx=torch.zeros(2, 9, dtype=torch.long)), "seq_idx")]:
        with pytest.raises(Declined, match=why):
            scan(**{**inp, **change})
    mimo, _ = bf16_inputs(mimo=True)
    with pytest.raises(Declined, match="MIMO"):
        scan(**mimo)


def test_the_step_adapter_updates_the_state_in_place(monkeypatch):
    install(monkeypatch, "mamba_ssm.ops.triton.mamba3.mamba3_siso_step", mamba3_siso_step=mamba3_siso_step)
    step = external.mamba3_siso_step()
    inp, state = bf16_inputs(time=1)
    one = {key: (t[:, 0] if key in TIMED else t) for key, t in inp.items()}
    mine, theirs = (Mamba3Carry(*(t.clone() for t in state)) for _ in range(2))
    y = step(**one, angle_state=mine.angle, ssm_state=mine.ssm, k_state=mine.k, v_state=mine.v)
    y_ref = mamba3_step_ref(**one, angle_state=theirs.angle, ssm_state=theirs.ssm, k_state=theirs.k,
                            v_state=theirs.v)
    assert torch.equal(y, y_ref) and all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert not torch.equal(mine.ssm, state.ssm)
