"""benchmarks/gpu_kernels.py's comparison with flash-linear-attention: its SSD runner computes SSD, and the timed
call hands fla the per-head keys and queries made before timing (fla takes them per head; hybridlm reads the
group through strides), so neither side's timed call copies B or C."""

from __future__ import annotations

import importlib

import torch

from hybridlm.ops.ssd import chunked_decay_scan, ssd_chunk_scan_ref
from tests.helpers import assert_close_rel


def test_the_fla_ssd_runner_computes_ssd_on_per_head_copies_made_before_timing():
    gpu_kernels = importlib.import_module("benchmarks.gpu_kernels")
    calls = []

    def chunk_simple_gla(q, k, v, g, scale):  # fla's layout: q, k [batch, time, heads, dk], g [batch, time, heads]
        calls.append((q.data_ptr(), k.data_ptr(), q.shape, k.shape))
        out, final = chunked_decay_scan(q * scale, k, v, g, 8)
        return out.to(v.dtype), final

    torch.manual_seed(0)
    inputs = gpu_kernels.ssd_inputs("cpu", batch=2, length=19, heads=3, head_dim=4, dstate=5, dtype=torch.float32)
    got = gpu_kernels.fla_ssd(chunk_simple_gla)(**inputs)
    expected, _ = ssd_chunk_scan_ref(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], 8,
                                     D=inputs["D"])
    assert expected.abs().max() > 0.1
    assert_close_rel(got, expected, rel=1e-5)
    per_head = (2, 19, 3, 5)
    assert calls == [(inputs["C_heads"].data_ptr(), inputs["B_heads"].data_ptr(), per_head, per_head)]
