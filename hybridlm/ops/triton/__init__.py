"""Triton kernels for the ops of :mod:`hybridlm.ops`, with the same signatures and results as the references.

Importing this package imports Triton; the backend selection imports it only when it is asked for. The kernels
are compiled for CUDA tensors, or run by Triton's CPU interpreter when ``TRITON_INTERPRET=1`` is set before
this package is first imported (slow: for tests).
"""

from hybridlm.ops.triton.causal_conv1d import causal_conv1d, causal_conv1d_update
from hybridlm.ops.triton.delta_rule import gated_delta_rule
from hybridlm.ops.triton.linear_attention import causal_linear_attention
from hybridlm.ops.triton.mamba3 import mamba3_scan, mamba3_step
from hybridlm.ops.triton.paged_attention import paged_attention
from hybridlm.ops.triton.selective_scan import selective_scan
from hybridlm.ops.triton.ssd import ssd_chunk_scan
from hybridlm.ops.triton.state_update import selective_state_update

__all__ = [
    "causal_conv1d",
    "causal_conv1d_update",
    "causal_linear_attention",
    "gated_delta_rule",
    "mamba3_scan",
    "mamba3_step",
    "paged_attention",
    "selective_scan",
    "selective_state_update",
    "ssd_chunk_scan",
]
