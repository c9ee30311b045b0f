"""The flash-linear-attention adapter (fla cannot be installed here), against a stand-in with fla's signature:
it serves what fla computes exactly, with the reference's results, and declines the rest before any work."""

import sys
import types

import pytest
import torch

from hybridlm.ops import backends, external
from hybridlm.ops.declined import Declined
from hybridlm.ops.delta_rule import gated_delta_rule_ref
from tests.helpers import assert_close_rel
from tests.ops.test_delta_rule import random_inputs

calls = []


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None):
    """fla's signature and conventions (as many key as value heads, a log gate per head; q, k and v of one half
    type: fla asserts ``q.dtype == k.dtype == v.dtype`` and refuses fp32), computed by the reference."""
    assert q.shape[2] == k.shape[2] == v.shape[2] and g.shape == beta.shape and output_final_state
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16), "fla's own asserts"
    calls.append(cu_seqlens)
    return gated_delta_rule_ref(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)


@pytest.fixture
def adapter(monkeypatch):
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule",
                        types.SimpleNamespace(chunk_gated_delta_rule=chunk_gated_delta_rule))
    return external.fla_gated_delta_rule()


def mixer_inputs(seed):
    """What a bf16 Gated DeltaNet passes: fp32 L2-normalised q, k, gate, beta and state; bf16 values."""
    q, k, v, log_gate, beta, S0 = (t.float() for t in random_inputs(1, 11, 2, 3, 4, 5, False, seed=seed))
    return q, k, v.bfloat16(), log_gate, beta, S0


def test_serves_grouped_heads_missing_gates_and_packed_sequences(adapter):
    """q, k go to fla in the values' half type (its kernels take one); the result is the reference's on those
    rounded q, k, and within bf16 rounding of the reference on the fp32 ones."""
    q, k, v, log_gate, beta, S0 = mixer_inputs(seed=1)
    q16, k16 = q.bfloat16(), k.bfloat16()
    for gate in (log_gate, None):
        got = adapter(q, k, v, gate, beta, initial_state=S0, scale=0.4)
        assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
        expected = gated_delta_rule_ref(q16, k16, v, gate, beta, initial_state=S0, scale=0.4)
        assert all(torch.equal(g, e) for g, e in zip(got, expected))
        unrounded = gated_delta_rule_ref(q, k, v, gate, beta, initial_state=S0, scale=0.4)
        for g, e in zip(got, unrounded):
            assert_close_rel(g.float(), e.float(), rel=3e-2)
    cu = torch.tensor([0, 4, 11])
    got = adapter(q, k, v, log_gate, beta, initial_state=torch.cat([S0, S0]), cu_seqlens=cu)
    expected = gated_delta_rule_ref(q16, k16, v, log_gate, beta, initial_state=torch.cat([S0, S0]), cu_seqlens=cu)
    assert calls[-1] is cu and all(torch.equal(g, e) for g, e in zip(got, expected))


def test_declines_what_fla_cannot_do_exactly(adapter):
    q, k, v, log_gate, beta, _ = random_inputs(1, 5, 1, 1, 4, 3, True, seed=2)  # channel-wise, float64
    calls.clear()
    with pytest.raises(Declined, match="channel-wise gates"):
        adapter(*(t.float() for t in (q, k, v, log_gate, beta)))
    with pytest.raises(Declined, match="fp16 or bf16 values"):
        adapter(q, k, v, log_gate[..., 0], beta)
    with pytest.raises(Declined, match="fp16 or bf16 values"):  # fla refuses fp32: the Triton kernel serves it
        adapter(*(t.float() for t in (q, k, v, log_gate[..., 0], beta)))
    wide = torch.zeros(1, 5, 1, 512)
    with pytest.raises(Declined, match="dim_k=512"):
        adapter(wide, wide, v.float(), None, beta.float())
    assert calls == []  # declined before calling fla


def test_the_backend_is_listed_and_unavailable_here():
    assert "fla" in backends.PREFERENCE["gated_delta_rule"] and "fla" in backends.LIBRARIES
    assert backends.unavailable_reason("fla", "gated_delta_rule", "cpu") == "fla runs on CUDA tensors only, not cpu"
